"""A rank that stalls while the others save a checkpoint ends the job within the job's timeout
(distributed.nccl.timeout_s), not torch's 30-minute default of a new gloo group: a task: callable on 2
CPU ranks through the local executor, rank 1 asleep at step 2 while rank 0 calls ctx.save(2)."""
from __future__ import annotations

import subprocess
import time
from pathlib import Path

from conftest import job_env, kill_leftovers, rank_processes, submit_cmd, write_spec_file

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
