"""Process group set-up: rendezvous variables, NCCL settings, device binding, clean teardown."""
from __future__ import annotations

import datetime
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from hpcgpu.runtime.env import DistEnv
from hpcgpu.spec import Spec
from hpcgpu.spec.derive import nccl_env

log = logging.getLogger("hpcgpu")


FLIGHT_RECORDER_DUMP_WAIT_MS = 5_000  # TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC: see flight_recorder_env
DEFAULT_PG_TIMEOUT_S = 600  # the schema default of distributed.nccl.timeout_s, for hpcgpu.init() without a spec

def export_rendezvous(env: DistEnv, spec: Spec | None) -> None:
    """Export what `init_process_group(init_method='env://')` and NCCL read, before init."""
    if spec is not None:
        for key, value in nccl_env(spec).items():
            os.environ.setdefault(key, value)
    os.environ.update({k: v for k, v in env.torchrun_vars().items()})


def select_device(env: DistEnv) -> torch.device:
    if not torch.cuda.is_available():
        return torch.device("cpu")
    index = env.device_index(torch.cuda.device_count())
    if index is None:
        return torch.device("cpu")
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def flight_recorder_env(trace_dir: Path) -> dict[str, str]:
    """torch's NCCL flight recorder: the last collectives of every rank, dumped to trace_dir/rank_<N>
    when one times out (what a mismatched or stalled collective was); a user's own settings win."""
    return {"TORCH_NCCL_TRACE_BUFFER_SIZE": "2000", "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
            "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": str(trace_dir / "rank_"),
            # NCCL's watchdog sleeps 4x this between a timed-out collective and taking the process down
            # (torch's default 15 s: a minute of nothing after the timeout, seen on torch 2.11); 20 s
            # still leaves every rank (told through the store, polled each second) time to dump
            "TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC": str(FLIGHT_RECORDER_DUMP_WAIT_MS)}


def init_process_group(env: DistEnv, spec: Spec | None, device: torch.device, alone: bool = False,
                       trace_dir: Path | None = None) -> None:
    """Start the process group (nccl on GPU, gloo on CPU) of a job of several ranks. A job of one rank
    gets none unless `alone` (DeepSpeed's engine and fsdp need a group even alone): then a one-rank group on an
    in-memory store. The train task calls this once for a distributed job (in init) and, for one rank,
    once more only after its run plan chose DeepSpeed or fsdp: the group never starts twice."""
    export_rendezvous(env, spec)
    alone_in_deepspeed = alone and not env.distributed
    if not (env.distributed or alone_in_deepspeed) or dist.is_initialized():
        return
    timeout_s = spec.distributed.nccl.timeout_s if spec else DEFAULT_PG_TIMEOUT_S
    backend = "nccl" if device.type == "cuda" else "gloo"
    if backend == "nccl" and trace_dir is not None:
        trace_dir.mkdir(parents=True, exist_ok=True)
        for key, value in flight_recorder_env(trace_dir).items():
            os.environ.setdefault(key, value)
    kwargs: dict[str, Any] = {}
    if device.type == "cuda":
        kwargs["device_id"] = device  # binds NCCL to our GPU up front: no guessing, no extra context
    if alone_in_deepspeed:
        kwargs["store"] = dist.HashStore()  # no rendezvous, no port to collide with another job
    else:
        kwargs["init_method"] = "env://"
    global _TIMEOUT
    _TIMEOUT = datetime.timedelta(seconds=timeout_s)
    dist.init_process_group(backend=backend, rank=env.rank, world_size=env.world_size, timeout=_TIMEOUT, **kwargs)
    log.debug("process group %s: rank %d/%d via %s:%s", backend, env.rank, env.world_size,
              env.master_addr, env.master_port)


def destroy_process_group() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


_COORDINATION: Any = None
_TIMEOUT = datetime.timedelta(seconds=DEFAULT_PG_TIMEOUT_S)  # the job's, set with its process group


def new_gloo_group() -> Any:
    """A gloo group of all ranks (collective) under the job's timeout (distributed.nccl.timeout_s):
    torch's own default for a new gloo group is 30 minutes, which held a job whose rank stalled in a
    checkpoint save for that long."""
    return dist.new_group(backend="gloo", timeout=_TIMEOUT)


def coordination_group(device: torch.device) -> Any:
    """The group ranks agree in at step boundaries (stop flag, checkpoint timing, progress): gloo on
    host tensors, so agreeing never waits for a GPU stream and the CPU keeps queueing kernels. On GPUs
    a gloo group of its own, created collectively on first use; on CPU ranks the default (gloo)
    group; None without a process group."""
    global _COORDINATION
    if not (dist.is_available() and dist.is_initialized()):
        return None
    if device.type != "cuda":
        return dist.group.WORLD
    if _COORDINATION is None:
        _COORDINATION = new_gloo_group()
    return _COORDINATION


def coordination_barrier(device: torch.device) -> None:
    """Every rank got here (on the coordination group: no GPU stream is waited for)."""
    group = coordination_group(device)
    if group is not None:
        dist.barrier(group=group)


def reset_coordination_group() -> None:
    global _COORDINATION
    _COORDINATION = None


def any_rank(flags: list[bool], group: Any) -> list[bool]:
    """Each flag, True if it is True on any rank (collective over `group`; host memory only)."""
    if group is None:
        return list(flags)
    t = _flags_tensor(flags)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return _flags_of(t)


def _flags_tensor(flags: list[bool]) -> torch.Tensor:
    return torch.tensor([1 if f else 0 for f in flags], dtype=torch.int32)


def _flags_of(t: torch.Tensor) -> list[bool]:
    return [v > 0 for v in t.tolist()]


@dataclass(frozen=True)
class Agreed:
    """Flags agreed across ranks, and the step at which the ranks posted them (None: nothing agreed
    yet). What happened after that step (a save, a signal) is not in them."""
    flags: list[bool]
    step: int | None


class LaggedFlags:
    """The training loop's per-step agreement, one step late. Each step posts this rank's flags (an
    asynchronous MAX all-reduce on the gloo coordination group) and returns what the ranks posted the
    step before, which has had a whole step to arrive. A blocking all-reduce every step would hold
    each rank's CPU until the slowest rank reached it, the time in which it would otherwise queue the
    next step's kernels. Every rank sees the same agreement at the same step, so they still act
    together; one rank (no group) lags alike, so a run behaves the same at every width."""

    def __init__(self, count: int, group: Any):
        self.count, self.group = count, group
        self._posted: tuple[torch.Tensor, Any, int] | None = None

    def exchange(self, flags: list[bool], step: int) -> Agreed:
        """Post `flags` (as of `step`); return the agreement posted at the previous call."""
        agreed = self._collect()
        t = _flags_tensor(flags)
        work = None
        if self.group is not None:
            work = dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group, async_op=True)
        self._posted = (t, work, step)
        return agreed

    def _collect(self) -> Agreed:
        if self._posted is None:
            return Agreed([False] * self.count, None)
        t, work, step = self._posted
        self._posted = None
        if work is not None:
            work.wait()
        return Agreed(_flags_of(t), step)

    def drain(self) -> None:
        """Wait for the last post (every rank posted it): the group is idle for what follows."""
        self._collect()

    def abandon(self) -> None:
        """Forget the last post without waiting (a rank failed: its peers may never answer)."""
        self._posted = None


def agreed_min(value: int, device: torch.device) -> int:
    """The smallest of every rank's value (e.g. GPU memory on a node of mixed cards), so that
    choices made from it are the same on every rank."""
    if not (dist.is_available() and dist.is_initialized()):
        return value
    t = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())


def host_id() -> str:
    """The machine whose cores this process runs on: the kernel's boot id (the same in every
    container and every emulated SLURM "node" of one host), else the host name."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as fh:
            return fh.read().strip()
    except OSError:
        import socket

        return socket.gethostname()


def set_cpu_threads(device: torch.device) -> None:
    """A rank's torch threads: the SLURM_CPUS_PER_TASK cores srun and the local executor give it (torch
    would take every core), and no more than their share of the machine's cores when ranks of the job
    share one machine (the local executor's ranks, or SLURM "nodes" that are one host), on CPUs and
    GPUs alike: oversubscribed OpenMP threads wait for each other (2 CPU ranks of 2 threads on a 2-core
    host generated 20x slower than 1 thread each), and a GPU rank's host must keep queueing kernels.
    OMP_NUM_THREADS, where set, decides. Collective where there is a process group."""
    if "OMP_NUM_THREADS" in os.environ:
        return
    if os.environ.get("SLURM_CPUS_PER_TASK", "").isdigit():
        torch.set_num_threads(int(os.environ["SLURM_CPUS_PER_TASK"]))
    if not (dist.is_available() and dist.is_initialized()):
        return
    me = host_id()
    hosts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(hosts, me, group=coordination_group(device))
    sharing = hosts.count(me)
    share = max(1, (os.cpu_count() or 1) // sharing)
    if torch.get_num_threads() > share:
        log.info(f"{sharing} ranks share this machine's {os.cpu_count()} cores: {share} torch thread(s) per rank "
                 f"(not {torch.get_num_threads()}; set OMP_NUM_THREADS to choose)")
        torch.set_num_threads(share)


def barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
