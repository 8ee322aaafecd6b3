"""Lightning scripts under the local executor: an unchanged `Trainer()` forms one job of the spec's ranks,
and ranks that train apart are reported instead of passing for one job."""
from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import job_env, submit_all, write_spec_file

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "frameworks" / "lightning"


def lightning_spec(name: str, script: str, out: Path, **env: str) -> dict:
    return {"name": name, "task": "command", "resources": {"gpus": 2, "cpus_per_gpu": 1},
            "command": [sys.executable, str(FIXTURES / script)],
            "env": {"OUT": str(out), "PYTHONPATH": str(FIXTURES), **env}}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[str, Path]]:
    specs = {
        # Lightning's bug-report model as fetched: its Trainer() names no devices
        "unchanged": ("bug_report_model.py", {}),
        # the same script whose Trainer says devices=1 (as PL_TRAINER_DEVICES=1 gives it): two lone runs
        "lone": ("bug_report_model.py", {"PL_TRAINER_DEVICES": "1"}),
        "recorded": ("preemptible.py", {"EPOCHS": "1", "STEP_S": "0"}),
    }
    folders = {key: tmp_path_factory.mktemp(key) for key in specs}
    paths = {key: (write_spec_file(folders[key], lightning_spec(key, script, folders[key], **env)), ())
             for key, (script, env) in specs.items()}
    results = submit_all(paths, timeout=150)
    return {key: (results[key].stdout + results[key].stderr, folders[key]) for key in specs}


def rank_log(folder: Path, rank: int) -> str:
    (log,) = folder.glob(f"runs/*/*/logs/rank-{rank}.log")
    return log.read_text()


def test_an_unchanged_trainer_forms_one_job_of_the_spec_ranks(runs: dict) -> None:
    out, folder = runs["unchanged"]
    assert "completed" in out and "Initializing distributed: GLOBAL_RANK: 0, MEMBER: 1/2" in out, out
    assert "Starting with 2 processes" in out and "did not form one job" not in out, out
    assert "MEMBER: 2/2" in rank_log(folder, 1)


def test_ranks_that_train_apart_are_reported(runs: dict) -> None:
    out, _ = runs["lone"]
    assert "completed" in out and "MEMBER" not in out, out
    warnings = [line for line in out.splitlines() if "did not form one job" in line]
    assert len(warnings) == 1 and "hpcgpu: warning: the 2 ranks" in warnings[0], out
    # and `hpcgpu status` of the completed job says it too
    job = out.split("job ", 1)[1].split()[0]
    status = subprocess.run([sys.executable, "-m", "hpcgpu", "status", job], capture_output=True, text=True,
                            timeout=60, env=job_env())
    shown = [line for line in status.stdout.splitlines() if line.startswith("warning")]
    assert "COMPLETED" in status.stdout and len(shown) == 1 and "the 2 ranks did not form one job" in shown[0], \
        status.stdout + status.stderr


def test_lightning_writes_into_the_run_dir_and_sees_the_world_size(runs: dict) -> None:
    out, folder = runs["recorded"]
    seen = [json.loads(p.read_text()) for p in sorted(folder.glob("rank*-run0.json"))]
    assert [(r["global_rank"], r["world_size"]) for r in seen] == [(0, 2), (1, 2)], out
    (run_dir,) = folder.glob("runs/*/*")
    # default_root_dir: this run's folder, not the submit folder every run of the spec shares
    assert all(r["root"] == str(run_dir) for r in seen) and (run_dir / "lightning_logs").is_dir()
    assert not (folder / "lightning_logs").exists()


def test_port_listening_sees_a_listening_socket() -> None:
    from hpcgpu.runtime.tasks.command import port_listening

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        assert port_listening(port) is False  # bound, not listening: no rendezvous yet
        sock.listen()
        assert port_listening(port) is True


def test_a_stop_signal_the_program_does_not_handle_is_named(tmp_path: Path, capsys) -> None:
    """USR2 (hpcgpu's default) would end a Lightning program at once, without its checkpoint: said once,
    with the signal it does listen to."""
    import signal
    import subprocess

    from hpcgpu.runtime.env import DistEnv
    from hpcgpu.runtime.tasks.command import warn_unhandled
    from hpcgpu.spec import spec_from_raw

    code = "import signal, time; signal.signal(signal.SIGUSR1, lambda *a: None); print(1, flush=True); time.sleep(30)"
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        proc.stdout.readline()  # its handler is set
        spec = spec_from_raw(lightning_spec("sig", "x.py", tmp_path), need_data=False)
        warn_unhandled(proc.pid, signal.SIGUSR2, spec, DistEnv(rank=0))
        err = capsys.readouterr().err
        assert "no handler for SIGUSR2" in err and "set slurm.signal: USR1" in err, err
        warn_unhandled(proc.pid, signal.SIGUSR1, spec, DistEnv(rank=0))  # not the spec's signal: nothing
        warn_unhandled(proc.pid, signal.SIGUSR2, spec, DistEnv(rank=1))  # rank 0 says it for the job
        assert capsys.readouterr().err == ""
    finally:
        proc.kill()
        proc.wait()
