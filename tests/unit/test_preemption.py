"""Preemption on CPU, 2 ranks, through the local executor: agreed stop, checkpoint, exact resume."""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from resumes import assert_resumed

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
TEXT = REPO / "configs" / "data" / "pydocs-eval.txt"
MAX_STEPS = 12


def spec_doc(runs: Path, **ckpt) -> dict:
    return {
        "name": "pre",
        "task": "train",
        "resources": {"gpus": 2, "cpus_per_gpu": 1},
        "model": {"config": {"model_type": "gpt2", "n_layer": 1, "n_head": 2, "n_embd": 32, "n_positions": 64,
                             "vocab_size": 256, "bos_token_id": 0, "eos_token_id": 0,
                             # dropout on: resume must restore every rank's RNG to be exact
                             "resid_pdrop": 0.1, "embd_pdrop": 0.1, "attn_pdrop": 0.0}},
        "data": {"train": str(TEXT), "seq_len": 64},
        "train": {"global_batch_size": 8, "micro_batch_size": 2, "max_steps": MAX_STEPS, "lr": 1e-3,
                  "warmup_steps": 2, "log_every": 1},
        "checkpoint": {"every_steps": 4, "keep": 3, **ckpt},
        "runs_dir": str(runs),
    }


def write(tmp: Path, doc: dict) -> Path:
    path = tmp / "spec.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def submit(spec: Path, *args: str, env: dict | None = None, timeout: int = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hpcgpu", "submit", str(spec), "--executor", "local", *args],
                          capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})})


def run_dir_of(proc: subprocess.CompletedProcess) -> Path:
    for marker in ("run dir ", "unfinished run "):
        if marker in proc.stderr:
            return Path(proc.stderr.split(marker)[1].split()[0].rstrip(","))
    raise AssertionError(proc.stderr)


def records(run_dir: Path, kind: str) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == kind]


def losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in records(run_dir, "train")}


def weights(run_dir: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(run_dir / "model" / "model.safetensors"))


def assert_same_result(run_dir: Path, baseline: Path) -> None:
    assert losses(run_dir) == losses(baseline)  # every logged loss, bit for bit
    a, b = weights(run_dir), weights(baseline)
    assert a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a)


@pytest.fixture(scope="module")
def baseline(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("baseline")
    proc = submit(write(tmp, spec_doc(tmp / "runs")), "--new")
    assert proc.returncode == 0, proc.stderr[-2000:]
    return run_dir_of(proc)


# the step at which a rank gets the signal; the ranks agree one step later (they stop at the next one)
STOP_POINTS = sorted({3, 6, random.Random(os.environ.get("HPCGPU_TEST_SEED", time.time_ns())).randint(1, MAX_STEPS - 2)})


@pytest.mark.parametrize("stop_at", STOP_POINTS)
def test_interrupt_and_resume_reproduces_the_uninterrupted_run(tmp_path, baseline, stop_at):
    spec = write(tmp_path, spec_doc(tmp_path / "runs"))
    # the signal reaches rank 1 only: the ranks must still agree and stop at the same step
    first = submit(spec, "--new", env={"HPCGPU_SIGNAL_AT": f"{stop_at}:1"})
    assert first.returncode == 75, first.stderr[-2000:]
    run_dir = run_dir_of(first)
    (stop,) = records(run_dir, "stop")
    stopped = stop_at + 1  # the flags posted after step N are acted on after step N+1, by every rank
    assert stop["step"] == stopped and stop["reason"] == "interrupted"
    assert (run_dir / "checkpoints" / f"step-{stopped:08d}" / "COMPLETE").exists()
    assert not (run_dir / "model").exists()
    for rank in (0, 1):
        assert "Traceback" not in (run_dir / "logs" / f"rank-{rank}.log").read_text()

    second = submit(spec)  # the same command again resumes the unfinished run
    assert second.returncode == 0, second.stderr[-2000:]
    assert run_dir_of(second) == run_dir
    (resume,) = records(run_dir, "resume")
    assert resume["step"] == stopped
    assert_resumed(run_dir)
    assert_same_result(run_dir, baseline)


def test_kill_during_checkpoint_write_resumes_from_the_previous_one(tmp_path, baseline):
    spec = write(tmp_path, spec_doc(tmp_path / "runs"))
    first = submit(spec, "--new", env={"HPCGPU_KILL_IN_CHECKPOINT": "8"})
    assert first.returncode != 0
    run_dir = run_dir_of(first)
    ckpts = run_dir / "checkpoints"
    assert (ckpts / "step-00000004" / "COMPLETE").exists()
    assert (ckpts / ".step-00000008.tmp").is_dir() and not (ckpts / "step-00000008").exists()

    second = submit(spec)
    assert second.returncode == 0, second.stderr[-2000:]
    (resume,) = records(run_dir, "resume")
    assert resume["checkpoint"] == "step-00000004"
    assert_resumed(run_dir, at=[4])
    assert not (ckpts / ".step-00000008.tmp").exists()  # the partial write is cleaned up once superseded
    assert_same_result(run_dir, baseline)


def test_corrupt_newest_checkpoint_falls_back_to_the_previous(tmp_path, baseline):
    spec = write(tmp_path, spec_doc(tmp_path / "runs"))
    first = submit(spec, "--new", env={"HPCGPU_SIGNAL_AT": "9"})  # stops after step 10
    assert first.returncode == 75
    run_dir = run_dir_of(first)
    newest = run_dir / "checkpoints" / "step-00000010"
    for shard in newest.glob("*.distcp"):
        shard.write_bytes(shard.read_bytes()[:100])  # truncated, as by a full disk
    second = submit(spec)
    assert second.returncode == 0, second.stderr[-2000:]
    log = (run_dir / "logs" / "rank-0.log").read_text()
    assert "step-00000010 could not be loaded" in log
    (resume,) = records(run_dir, "resume")
    assert resume["checkpoint"] == "step-00000008"
    assert_resumed(run_dir, at=[8])
    assert_same_result(run_dir, baseline)


def test_keep_last_k_never_deletes_the_newest(tmp_path):
    spec = write(tmp_path, spec_doc(tmp_path / "runs", every_steps=2, keep=2))
    proc = submit(spec, "--new")
    assert proc.returncode == 0, proc.stderr[-2000:]
    kept = sorted(p.name for p in (run_dir_of(proc) / "checkpoints").iterdir())
    assert kept == ["step-00000008", "step-00000010"]  # no save at the final step: the model is saved


def test_a_time_based_checkpoint_is_written_once_when_due_not_again_at_the_next_step(tmp_path):
    """every_minutes is agreed a step late: the flags posted before a save must not ask for another
    one right after it (due at every step here, so one save every other step, none at the last)."""
    spec = write(tmp_path, spec_doc(tmp_path / "runs", every_steps=None, every_minutes=1e-6, keep=20))
    proc = submit(spec, "--new")
    assert proc.returncode == 0, proc.stderr[-2000:]
    saved = sorted(p.name for p in (run_dir_of(proc) / "checkpoints").iterdir())
    assert saved == [f"step-{s:08d}" for s in (2, 4, 6, 8, 10)]


def test_ctrl_c_checkpoints_and_the_same_command_resumes(tmp_path):
    doc = spec_doc(tmp_path / "runs")
    doc["train"]["max_steps"] = 400
    spec = write(tmp_path, doc)
    proc = subprocess.Popen([sys.executable, "-m", "hpcgpu", "submit", str(spec), "--executor", "local", "--new"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for line in proc.stdout:  # type: ignore[union-attr]
        if "step      5/" in line:
            break
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 75, err[-2000:]
    run_dir = run_dir_of(subprocess.CompletedProcess([], 0, "", err))
    (stop,) = records(run_dir, "stop")
    assert f"stopped at step {stop['step']}, at its checkpoint; run the same command without --new to go on" in err
    assert (run_dir / "checkpoints" / f"step-{stop['step']:08d}" / "COMPLETE").exists()

    again = submit(spec, "--set", "train.max_steps=400")
    assert again.returncode == 0, again.stderr[-2000:]
    assert records(run_dir, "resume")[0]["step"] == stop["step"]
    assert_resumed(run_dir)
    assert max(losses(run_dir)) == 400


def test_a_finished_run_never_trains_again(tmp_path, baseline):
    before = (baseline / "metrics.jsonl").read_text()
    proc = subprocess.run([sys.executable, "-m", "hpcgpu", "run", str(baseline / "spec.yaml")],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "HPCGPU_RUN_DIR": str(baseline)})
    assert proc.returncode == 0, proc.stderr
    assert "finished earlier" in proc.stdout
    assert (baseline / "metrics.jsonl").read_text() == before


def test_command_task_gets_the_signal_and_a_checkpoint_dir(tmp_path):
    prog = tmp_path / "prog.py"
    prog.write_text(
        "import os, signal, sys, time, pathlib\n"
        "d = pathlib.Path(os.environ['HPCGPU_CHECKPOINT_DIR']); d.mkdir(parents=True, exist_ok=True)\n"
        "def stop(sig, frame):\n"
        "    (d / f\"rank{os.environ['RANK']}.txt\").write_text(str(sig)); sys.exit(0)\n"
        "signal.signal(signal.SIGUSR2, stop)\n"
        "(d / f\"ready{os.environ['RANK']}\").write_text('')\n"
        "time.sleep(60)\n")
    doc = {"name": "cmd", "task": "command", "command": [sys.executable, str(prog)],
           "resources": {"gpus": 2, "cpus_per_gpu": 1}, "runs_dir": str(tmp_path / "runs")}
    spec = write(tmp_path, doc)
    proc = subprocess.Popen([sys.executable, "-m", "hpcgpu", "submit", str(spec), "--executor", "local", "--new"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and len(list((tmp_path / "runs").rglob("ready*"))) < 2:
        time.sleep(0.1)
    proc.send_signal(signal.SIGINT)  # the executor sends the spec's signal (USR2) to every rank
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 75, err
    got = sorted(p.read_text() for p in (tmp_path / "runs").rglob("rank*.txt"))
    assert got == [str(int(signal.SIGUSR2))] * 2


def test_async_checkpoints_resume_exactly(tmp_path, baseline):
    """checkpoint.async: the write runs in the background and is marked complete only once every
    rank's write ended; a stop waits for it, and the resumed run is still the uninterrupted one."""
    spec = write(tmp_path, spec_doc(tmp_path / "runs", **{"async": True}))
    # the signal after step 8, while step 8's write runs: the stop after step 9 waits for it
    first = submit(spec, "--new", env={"HPCGPU_SIGNAL_AT": "8"})
    assert first.returncode == 75, first.stderr[-2000:]
    run_dir = run_dir_of(first)
    done = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert done == ["step-00000004", "step-00000008", "step-00000009"]
    assert all((run_dir / "checkpoints" / d / "COMPLETE").exists() for d in done)
    second = submit(spec)
    assert second.returncode == 0, second.stderr[-2000:]
    assert_resumed(run_dir)
    assert_same_result(run_dir, baseline)


def test_staging_buffers_survive_torch_closing_the_stager(tmp_path):
    """torch 2.11's DefaultStager closes its inner copier after every stage (and some releases close a
    caller's stager after the upload); the next save must still stage, into the same host buffers,
    and write a checkpoint that loads back."""
    import torch
    import torch.distributed.checkpoint as dcp

    from hpcgpu.runtime.checkpoint import reusable_pinned_stager

    stager = reusable_pinned_stager(pinned=False)
    state = {"w": torch.arange(6.0), "opt": {"param_groups": [{"lr": 0.1, "params": [0]}]}}
    buffers = []
    for step in (1, 2):
        state["w"] += 1
        stager._state_dict_stager.close()  # what torch 2.11 does at the end of each stage()
        stager.close()  # what others do once the previous upload completes
        fut = dcp.async_save(state, checkpoint_id=str(tmp_path / f"s{step}"), async_stager=stager)
        getattr(fut, "upload_completion", fut).result()
        buffers.append(stager.stage(state)["w"].data_ptr())
    assert buffers[0] == buffers[1]  # staged into the buffer allocated by the first save
    loaded = {"w": torch.zeros(6), "opt": {"param_groups": [{"lr": 0.0, "params": [0]}]}}
    dcp.load(loaded, checkpoint_id=str(tmp_path / "s2"))
    assert torch.equal(loaded["w"], torch.arange(6.0) + 2)
    stager.release()
