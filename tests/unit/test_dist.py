"""runtime/dist.py: the training loop's per-step agreement (LaggedFlags), over a real gloo group."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

AGREE = """
import json, os, sys
import torch.distributed as dist
from hpcgpu.runtime.dist import LaggedFlags
rank = int(os.environ["RANK"])
if os.environ["WORLD_SIZE"] != "1":
    dist.init_process_group("gloo", rank=rank, world_size=int(os.environ["WORLD_SIZE"]))
flags = LaggedFlags(2, dist.group.WORLD if dist.is_initialized() else None)
seen = []
for step in range(1, 6):
    # rank 1 (or the only rank) raises flag 0 from step 3 on; flag 1 is never raised
    agreed = flags.exchange([rank == int(os.environ["RAISER"]) and step >= 3, False], step)
    seen.append([agreed.flags, agreed.step])
flags.drain()
del flags  # it holds the group: a group still referenced when the interpreter exits may abort it
print(json.dumps(seen), flush=True)
if dist.is_initialized():
    dist.destroy_process_group()
os._exit(0)  # the agreement is what is tested here, not the interpreter's teardown of torch's statics
"""

# what every rank sees at steps 1-5: nothing agreed at the first step, then each step the flags
# the ranks posted the step before; the flag raised at step 3 arrives at step 4
EXPECTED = [[[False, False], None], [[False, False], 1], [[False, False], 2], [[True, False], 3], [[True, False], 4]]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(script: str, world: int, **env: str) -> list:
    """`script` as ranks 0..world-1 of a gloo group on a free port; each rank's last line, as JSON."""
    base = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": str(world),
            **env}
    procs = [subprocess.Popen([sys.executable, "-c", script], env={**base, "RANK": str(r)}, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in range(world)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0] * world, [e[-2000:] for _, e in outs]
    return [json.loads(o.splitlines()[-1]) for o, _ in outs]


def agree(world: int, raiser: int) -> list[list]:
    return run_ranks(AGREE, world, RAISER=str(raiser))


def test_every_rank_sees_a_flag_raised_on_one_rank_at_the_same_later_step() -> None:
    assert agree(2, raiser=1) == [EXPECTED, EXPECTED]


def test_one_rank_lags_the_same_so_a_run_stops_at_the_same_step_at_every_width() -> None:
    assert agree(1, raiser=0) == [EXPECTED]


THREADS = """
import json, os
import torch, torch.distributed as dist
from hpcgpu.runtime.dist import set_cpu_threads
os.environ.pop("OMP_NUM_THREADS", None)  # it would decide instead
dist.init_process_group("gloo", rank=int(os.environ["RANK"]), world_size=2)
set_cpu_threads(torch.device("cuda", 0))  # only the device's type matters here: no GPU is touched
print(json.dumps(torch.get_num_threads()), flush=True)
dist.destroy_process_group()
os._exit(0)
"""


def test_gpu_ranks_sharing_a_machine_take_at_most_their_share_of_its_cores() -> None:
    # the local executor gives each rank cpus_per_gpu cores; asked for every core, two ranks would
    # run twice as many threads as the machine has
    cores = os.cpu_count() or 1
    assert run_ranks(THREADS, 2, SLURM_CPUS_PER_TASK=str(cores)) == [max(1, cores // 2)] * 2
