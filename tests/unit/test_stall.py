"""A rank that stalls while the others save a checkpoint ends the job within the job's timeout
(distributed.nccl.timeout_s), not torch's 30-minute default of a new gloo group: a task: callable on 2
CPU ranks through the local executor, rank 1 asleep at step 2 while rank 0 calls ctx.save(2)."""
from __future__ import annotations

import subprocess
import time
from pathlib import Path

from conftest import job_env, kill_leftovers, only_run_dir, rank_processes, submit_cmd, write_spec_file
from hpcgpu.contract import first_failure

STALLING = '''
import time

import torch


def main(ctx):
    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = ctx.prepare(model, optimizer)
    ctx.save(1)  # both ranks: the checkpoint group exists
    if ctx.rank == 1:
        time.sleep(3600)  # stalled: rank 0 waits for it inside the next save
    ctx.save(2)
    return 0
'''
TIMEOUT_S = 10


def test_a_rank_stalled_in_a_checkpoint_save_ends_the_job_within_its_timeout(tmp_path: Path) -> None:
    (tmp_path / "stalling.py").write_text(STALLING)
    spec = write_spec_file(tmp_path, {
        "name": "stall", "task": "callable", "entry": "stalling:main",
        "resources": {"gpus": 2, "cpus_per_gpu": 1},
        "distributed": {"nccl": {"timeout_s": TIMEOUT_S}},
    })
    t0 = time.monotonic()
    proc = subprocess.Popen(submit_cmd(spec), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=job_env(), cwd=tmp_path, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=TIMEOUT_S + 110)  # start-up and imports included
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
            kill_leftovers(str(tmp_path))
    took = time.monotonic() - t0
    assert proc.returncode not in (0, 75), out[-3000:]  # a failure, not a finish or a preemption
    assert took < TIMEOUT_S + 100, took
    assert not rank_processes(str(tmp_path))  # the stalled rank did not outlive the job
    # the rank that stalled is the failure, with where it was; rank 0, which timed out waiting, is not
    failure = first_failure(only_run_dir(tmp_path / "runs", "stall"))
    assert failure is not None and failure.rank == 1, (failure, out[-2000:])
    assert "made no progress" in failure.message and "main at stalling.py:" in failure.message, failure
    assert "rank 0 timed out waiting" in failure.message, failure


KILLED = '''
import os
import signal

import torch


def main(ctx):
    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = ctx.prepare(model, optimizer)
    ctx.save(1)
    if ctx.rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)  # as the kernel's OOM killer does
    ctx.save(2)  # rank 0 meets its dead peer in this save's collectives
    return 0
'''


def test_a_rank_killed_by_sigkill_is_the_failure_and_the_likely_cause_is_named(tmp_path: Path) -> None:
    import json
    import sys

    (tmp_path / "killed.py").write_text(KILLED)
    spec = write_spec_file(tmp_path, {"name": "killed", "task": "callable", "entry": "killed:main",
                                      "resources": {"gpus": 2, "cpus_per_gpu": 1},
                                      "distributed": {"nccl": {"timeout_s": TIMEOUT_S}}})
    out = subprocess.run(submit_cmd(spec), capture_output=True, text=True, timeout=180, env=job_env(), cwd=tmp_path)
    assert out.returncode == 137, out.stdout[-2000:] + out.stderr[-2000:]
    failure = first_failure(only_run_dir(tmp_path / "runs", "killed"))
    assert failure is not None and failure.rank == 1 and failure.exit_code == 137, failure
    assert "SIGKILL" in failure.describe() and "out-of-memory" in failure.message, failure
    listed = json.loads(subprocess.run([sys.executable, "-m", "hpcgpu", "list", "--json"], capture_output=True,
                                       text=True, timeout=60, env=job_env(), check=True).stdout)
    job = next(j for j in listed if j["name"] == "killed")
    assert job["state"] == "FAILED" and job["failure"]["rank"] == 1 and "out-of-memory" in job["failure"]["message"]


HUNG = '''
import time


def main(ctx):
    ctx.heartbeat()
    time.sleep(3600)  # no progress from here on
    return 0
'''


def test_a_rank_without_progress_prints_its_stacks_and_fails_naming_where_it_was(tmp_path: Path) -> None:
    """distributed.hang_timeout_s: the watchdog of a rank that stopped making progress (no peer to time
    out on it) ends the job FAILED: the reason names the rank and the function and line it sits in, and
    its log holds every thread's stack."""
    (tmp_path / "hung.py").write_text(HUNG)
    spec = write_spec_file(tmp_path, {"name": "hung", "task": "callable", "entry": "hung:main",
                                      "resources": {"gpus": 1, "cpus_per_gpu": 1},
                                      "distributed": {"hang_timeout_s": 6}})
    out = subprocess.run(submit_cmd(spec), capture_output=True, text=True, timeout=150, env=job_env(), cwd=tmp_path)
    assert out.returncode == 1, out.stdout[-2000:] + out.stderr[-2000:]
    run_dir = only_run_dir(tmp_path / "runs", "hung")
    failure = first_failure(run_dir)
    assert failure is not None and failure.rank == 0, failure
    assert "made no progress for" in failure.message and "main at hung.py:7" in failure.message, failure
    log = (run_dir / "logs" / "rank-0.log").read_text()
    assert "the stacks of its threads" in log and "most recent call first" in log, log[-2000:]
    assert not rank_processes(str(tmp_path))


LOADER = '''
import time

import torch


class Rows(torch.utils.data.Dataset):
    def __init__(self, rank):
        self.rank = rank

    def __len__(self):
        return 64

    def __getitem__(self, i):
        if self.rank == 1 and i >= 8:
            time.sleep(3600)  # a read that never returns (a hung filesystem)
        return torch.ones(4)


def main(ctx):
    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = ctx.prepare(model, optimizer)
    for batch in ctx.data_loader(Rows(ctx.rank), batch_size=2, num_workers=0):
        ctx.backward(model(batch).sum())
        ctx.step()
    return 0
'''


def test_a_rank_stalled_in_its_data_loader_is_named_with_the_function(tmp_path: Path) -> None:
    (tmp_path / "loader.py").write_text(LOADER)
    spec = write_spec_file(tmp_path, {"name": "loader", "task": "callable", "entry": "loader:main",
                                      "resources": {"gpus": 2, "cpus_per_gpu": 1},
                                      "distributed": {"nccl": {"timeout_s": TIMEOUT_S}}})
    out = subprocess.run(submit_cmd(spec), capture_output=True, text=True, timeout=TIMEOUT_S + 110, env=job_env(),
                         cwd=tmp_path)
    assert out.returncode not in (0, 75), out.stdout[-2000:]
    failure = first_failure(only_run_dir(tmp_path / "runs", "loader"))
    assert failure is not None and failure.rank == 1, (failure, out.stderr[-2000:])
    assert "made no progress" in failure.message and "__getitem__ at loader.py:" in failure.message, failure
    assert not rank_processes(str(tmp_path))
