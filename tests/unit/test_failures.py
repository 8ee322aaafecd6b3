"""Failures told as what they were: a signal during start-up is remembered, a rank stopped because
another failed is that crash (never a preemption), an input error is one line per job."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import job_env, submit, train_spec, write_spec_file
from hpcgpu.contract import Failure, attempt_id, first_failure, record_failure

EARLY_ENTRY = '''
import os, signal
from pathlib import Path

# a preemption signal while the job is still importing (torch, the model code, ...)
os.kill(os.getpid(), signal.SIGUSR2)


def main(ctx):
    stopped = ctx.should_stop()
    Path(os.environ["OUT"], "stopped").write_text(str(stopped))
    return 75 if stopped else 0
'''


def run_entrypoint(spec: Path, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hpcgpu", "run", str(spec)], capture_output=True, text=True,
                          timeout=120, env=job_env(**env), cwd=spec.parent)


def test_a_signal_during_imports_is_remembered_not_fatal(tmp_path: Path) -> None:
    (tmp_path / "early_entry.py").write_text(EARLY_ENTRY)
    spec = write_spec_file(tmp_path, {"name": "early", "task": "callable", "entry": "early_entry:main",
                                      "resources": {"gpus": 1}})
    proc = run_entrypoint(spec, PYTHONPATH=str(tmp_path), OUT=str(tmp_path))
    # without the early handler SIGUSR2 kills the rank: returncode -12, no file
    assert proc.returncode == 75, proc.stderr[-2000:]
    assert (tmp_path / "stopped").read_text() == "True"


def test_a_command_job_stopped_before_its_program_starts_requeues_without_running_it(tmp_path: Path) -> None:
    spec = write_spec_file(tmp_path, {"name": "pending", "task": "command", "resources": {"gpus": 1},
                                      "command": [sys.executable, "-c", f"open({str(tmp_path / 'ran')!r}, 'w')"]})
    # the batch script got USR2 before srun started the ranks
    proc = run_entrypoint(spec, HPCGPU_PENDING_SIGNAL="USR2")
    assert proc.returncode == 75, proc.stdout + proc.stderr
    assert "before the program started" in proc.stdout
    assert not (tmp_path / "ran").exists()


DIES_FIRST = ("import os, signal, subprocess\n"
              "subprocess.Popen(['sh', '-c', 'sleep 0.3; kill -TERM %d' % os.getppid()])\n"
              "os.kill(os.getpid(), signal.SIGTERM)\n")


def test_a_program_that_dies_of_the_stop_signal_before_its_wrapper_sees_it_is_a_stop(tmp_path: Path) -> None:
    """SLURM signals every process of the step; the program may die of its copy before the wrapper's
    copy arrives. That is a stop (exit 75), not the program crashing with 143."""
    spec = write_spec_file(tmp_path, {"name": "race", "task": "command", "resources": {"gpus": 1},
                                      "command": [sys.executable, "-c", DIES_FIRST]})
    proc = run_entrypoint(spec, HPCGPU_RUN_DIR=str(tmp_path))
    assert proc.returncode == 75, proc.stdout + proc.stderr
    assert "the program exited with code 143 after the stop signal" in proc.stdout
    assert first_failure(tmp_path) is None  # nothing recorded as a crash


def test_an_input_error_in_the_job_is_one_line_for_all_ranks(tmp_path: Path) -> None:
    not_a_model = tmp_path / "not-a-model"
    not_a_model.mkdir()
    (not_a_model / "README").write_text("weights went elsewhere\n")
    doc = train_spec("bad-model")
    doc["model"] = {"name_or_path": str(not_a_model)}
    proc = submit(write_spec_file(tmp_path, doc))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    logs = "".join(p.read_text() for p in (tmp_path / "runs" / "bad-model").glob("*/logs/rank-*.log"))
    errors = [line for line in logs.splitlines() if line.startswith("hpcgpu: error:")]
    assert len(errors) == 1, logs
    assert "model.name_or_path" in errors[0] and len(errors[0]) < 500
    assert "Traceback" not in logs


def rank_env(rank: int, launcher: str, **more: str) -> dict[str, str]:
    return {"SLURM_JOB_ID": "4242", "SLURM_PROCID": str(rank), "SLURM_LOCALID": str(rank), "SLURM_NTASKS": "2",
            "SLURM_NTASKS_PER_NODE": "2", "SLURM_NNODES": "1", "SLURM_NODEID": "0", "SLURM_STEP_ID": "0",
            "SLURM_JOB_NODELIST": "n1", "HPCGPU_LAUNCHER": launcher, **more}


@pytest.fixture
def in_rank(monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    def enter(rank: int, launcher: str = "slurm", **more: str):  # type: ignore[no-untyped-def]
        from hpcgpu.runtime.env import DistEnv

        for key in list(os.environ):
            if key.startswith(("SLURM_", "HPCGPU_")):
                monkeypatch.delenv(key)
        for key, value in rank_env(rank, launcher, **more).items():
            monkeypatch.setenv(key, value)
        return DistEnv.from_environ()

    return enter


def tiny_command_spec(tmp_path: Path):  # type: ignore[no-untyped-def]
    from hpcgpu.spec import load_spec

    return load_spec(write_spec_file(tmp_path, {"name": "c", "task": "command", "command": ["true"],
                                                "resources": {"gpus": 2}}))


def test_sigterm_after_another_rank_recorded_a_failure_is_that_failure(tmp_path: Path, in_rank) -> None:
    import signal

    from hpcgpu.runtime.requeue import torn_down_by

    spec = tiny_command_spec(tmp_path)
    env = in_rank(0)
    assert torn_down_by(spec, env, signal.SIGUSR2, tmp_path, wait_s=0) is None  # the spec's signal: a stop
    record_failure(tmp_path, Failure(attempt_id(), 1, "n2", 3, "ValueError: boom", time.time()))
    why = torn_down_by(spec, env, signal.SIGTERM, tmp_path, wait_s=0)
    assert why == "rank 1 on n2 failed with exit code 3: ValueError: boom"
    assert first_failure(tmp_path).rank == 1  # type: ignore[union-attr]


def test_sigterm_under_the_batch_script_is_a_stop_only_if_the_script_got_it_too(tmp_path: Path, in_rank) -> None:
    import signal

    from hpcgpu.runtime.requeue import torn_down_by

    spec = tiny_command_spec(tmp_path)
    env = in_rank(0, HPCGPU_JOB_START=str(int(time.time())))
    # srun tore the step down (the rank that failed left no record: killed by the OOM killer, say)
    assert "another task of the step failed" in torn_down_by(spec, env, signal.SIGTERM, tmp_path, wait_s=0.3)
    # a preemption or time limit: SLURM signalled the batch script as well
    (tmp_path / ".batch-signal.4242.0").write_text(f"TERM {int(time.time())}\n")
    assert torn_down_by(spec, env, signal.SIGTERM, tmp_path, wait_s=0) is None
    # the local executor: SIGTERM is Ctrl-C or hpcgpu cancel unless a rank recorded a failure
    assert torn_down_by(spec, in_rank(0, "local"), signal.SIGTERM, tmp_path / "elsewhere", wait_s=0) is None


def test_an_accelerate_script_runs_distributed_on_cpu_ranks(tmp_path: Path) -> None:
    """Without ACCELERATE_USE_CPU each CPU rank of an accelerate/HF-Trainer script trains alone."""
    program = ("from accelerate import Accelerator\n"  # what the HF Trainer and run_clm_no_trainer use
               "s = Accelerator()\n"
               "print('accelerate', s.num_processes, s.process_index, s.device, flush=True)\n")
    spec = write_spec_file(tmp_path, {"name": "acc", "task": "command", "resources": {"gpus": 2, "cpus_per_gpu": 1},
                                      "command": [sys.executable, "-c", program]})
    proc = submit(spec)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    logs = "".join(p.read_text() for p in sorted((tmp_path / "runs" / "acc").glob("*/logs/rank-*.log")))
    assert "accelerate 2 0 cpu" in logs and "accelerate 2 1 cpu" in logs, logs


KILLED_ENTRY = '''
import os, signal, time
import torch.distributed as dist


def main(ctx):
    if ctx.rank == 1:
        time.sleep(1)
        os.kill(os.getpid(), signal.SIGKILL)  # the OOM killer, say: no word from the rank itself
    dist.barrier()  # rank 0 waits here until gloo notices its peer is gone
    return 0
'''


def test_a_rank_killed_outright_is_the_recorded_failure_not_its_peer(tmp_path: Path) -> None:
    (tmp_path / "killed_entry.py").write_text(KILLED_ENTRY)
    spec = write_spec_file(tmp_path, {"name": "killed", "task": "callable", "entry": "killed_entry:main",
                                      "resources": {"gpus": 2, "cpus_per_gpu": 1},
                                      "env": {"PYTHONPATH": str(tmp_path)}})
    proc = submit(spec)
    assert proc.returncode == 137, proc.stdout + proc.stderr
    run_dir = next((tmp_path / "runs" / "killed").iterdir())
    failure = first_failure(run_dir)
    assert failure is not None and failure.rank == 1 and failure.exit_code == 137, failure
    assert failure.signal_name == "SIGKILL"
    assert "after rank 1" in (run_dir / "logs" / "rank-0.log").read_text()
    assert "rank 1 on" in proc.stderr and "exit code 137" in proc.stderr  # submit says who failed
    listed = json.loads(subprocess.run([sys.executable, "-m", "hpcgpu", "list", "--json"], capture_output=True,
                                       text=True, timeout=60, env=job_env(), check=True).stdout)
    job = next(j for j in listed if j["name"] == "killed")
    assert job["state"] == "FAILED" and job["failure"]["rank"] == 1 and job["failure"]["exit_code"] == 137
