"""The registry before the scheduler: a damaged jobs.db stops `submit` before any job exists (one line
naming the file, the damage and the way out), a lock held by another hpcgpu is announced after a
moment, and `hpcgpu registry rebuild` recovers rows from the run dirs."""
from __future__ import annotations

import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from conftest import job_env, submit_cmd, write_spec_file
from hpcgpu.launch.registry import JobRecord, Registry


def tiny_spec(folder: Path) -> Path:
    (folder / "text.txt").write_text("some words to train on\n" * 50)
    return write_spec_file(folder, {"name": "t", "task": "train", "resources": {"gpus": 1, "cpus_per_gpu": 1},
                                    "model": {"config": {"model_type": "gpt2", "n_layer": 1, "n_head": 2,
                                                         "n_embd": 16, "n_positions": 32, "vocab_size": 256}},
                                    "data": {"train": str(folder / "text.txt")}, "train": {"max_steps": 1}})


def test_a_damaged_registry_stops_submit_before_anything_is_started(tmp_path: Path) -> None:
    db = tmp_path / "jobs.db"
    reg = Registry(db)
    reg.add(JobRecord(job_id="7", name="old", spec="s.yaml", run_dir="/r", executor="slurm"))
    reg.close()
    data = db.read_bytes()
    db.write_bytes(data[:len(data) // 2])  # cut short, as a full disk or a crash leaves it
    for side in ("-wal", "-shm"):
        Path(f"{db}{side}").unlink(missing_ok=True)
    spec = tiny_spec(tmp_path)
    out = subprocess.run(submit_cmd(spec), capture_output=True, text=True, timeout=120, cwd=tmp_path,
                         env=job_env(HPCGPU_REGISTRY=str(db)))
    assert out.returncode == 2, out.stderr[-2000:]
    lines = [x for x in out.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and f"job registry {db} is damaged" in lines[0], out.stderr
    assert "hpcgpu registry rebuild" in lines[0] and "writable" not in lines[0]
    assert not (tmp_path / "runs").exists()  # no run dir, no job


def test_a_locked_registry_says_it_waits(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    db = tmp_path / "jobs.db"
    Registry(db).count()  # created
    holder = sqlite3.connect(str(db), isolation_level=None, check_same_thread=False)
    holder.execute("BEGIN IMMEDIATE")
    release = threading.Timer(4.0, lambda: holder.execute("ROLLBACK"))
    release.start()
    t0 = time.monotonic()
    job = Registry(db).add(JobRecord(job_id="", name="n", spec="s.yaml", run_dir="/r", executor="local"))
    release.join()
    assert job.job_id.startswith("local-") and time.monotonic() - t0 >= 3.5
    assert f"waiting for the job registry {db}: another hpcgpu holds its lock" in capsys.readouterr().err


def test_rebuild_recovers_run_dirs_the_registry_lacks(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    done = runs / "alpha" / "20261128-101500-ab12"
    stopped = runs / "beta" / "20261128-111500-cd34"
    for run in (done, stopped):
        run.mkdir(parents=True)
        (run / "spec.yaml").write_text("name: x\n")
    (done / "FINISHED").write_text("2026-11-28T10:20:00\n")
    (stopped / "slurm-4242.out").write_text("")
    db = tmp_path / "jobs.db"
    env = job_env(HPCGPU_REGISTRY=str(db))
    for _ in range(2):  # the second time there is nothing to add
        out = subprocess.run([sys.executable, "-m", "hpcgpu", "registry", "rebuild", str(runs)], capture_output=True,
                             text=True, timeout=60, env=env)
        assert out.returncode == 0, out.stderr
    jobs = Registry(db).all()
    assert sorted(Path(j.run_dir).parent.name for j in jobs) == ["alpha", "beta"]  # one row each, not two
    rows = {Path(j.run_dir).parent.name: j for j in jobs}
    assert (rows["alpha"].state, rows["alpha"].executor) == ("COMPLETED", "local")
    assert (rows["beta"].state, rows["beta"].executor, rows["beta"].job_id) == ("PREEMPTED", "slurm", "4242")
    assert time.strftime("%Y%m%d-%H%M", time.localtime(rows["alpha"].submitted)) == "20261128-1015"
