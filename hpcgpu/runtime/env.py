"""Where a rank runs: one DistEnv from SLURM, torchrun, the local executor or a plain process.

No torch here: the environment is checked before any process group starts, so an inconsistent
allocation is one clear error instead of a hang.
"""
from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass, field
from typing import Callable, Mapping

from hpcgpu.contract import ENV_LAUNCHER, ENV_LOCAL_JOB, ENV_NODE_GPUS
from hpcgpu.errors import EnvironmentError_
from hpcgpu.gpu import nvml
from hpcgpu.hostlist import expand_hostlist, port_for_job

@dataclass(frozen=True)
class Launcher:
    """What started the ranks, as what it allows a stopping job to do (asked by runtime/requeue.py and
    the command task, never its name)."""

    name: str
    # SLURM's controller knows the job: it can be asked the job's state (scancel, `scontrol requeue`),
    # requeues it, and signals hpcgpu's batch script too when the job is preempted or timed out
    controller: bool = False
    # every stop is the user's (Ctrl-C, SIGTERM, hpcgpu cancel): no time limit, no preemption
    stops_are_interrupts: bool = False
    # a stop signal reaches the user's program from the launcher itself (SLURM the whole step, the
    # local executor each rank's process group), so the command task does not relay it
    signals_the_program: bool = False


SLURM = Launcher("slurm", controller=True, signals_the_program=True)
LOCAL = Launcher("local", stops_are_interrupts=True, signals_the_program=True)
TORCHRUN = Launcher("torchrun")
SINGLE = Launcher("single")
LAUNCHERS = {launcher.name: launcher for launcher in (SLURM, LOCAL, TORCHRUN, SINGLE)}


def launcher_named(name: str) -> Launcher | None:
    """HPCGPU_LAUNCHER's value -> its launcher; None when unset (found from the environment)."""
    if not name:
        return None
    if name not in LAUNCHERS:
        raise EnvironmentError_(f"HPCGPU_LAUNCHER={name!r}: expected one of {', '.join(LAUNCHERS)}")
    return LAUNCHERS[name]


@dataclass(frozen=True)
class DistEnv:
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    node_rank: int = 0
    num_nodes: int = 1
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    launcher: Launcher = SINGLE
    job_id: str | None = None
    restart_count: int = 0
    array_job_id: str | None = None
    array_task_id: str | None = None
    hosts: tuple[str, ...] = field(default_factory=tuple)
    visible_devices: tuple[str, ...] | None = None  # CUDA_VISIBLE_DEVICES as given, None if unset
    gpus_per_task: int = 1  # a model copy over several GPUs (task: infer): its group, once bound
    own_group: bool = False  # the task sees only its own GPUs, even one (task: infer; bind_gpu_group)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def requeue_target(self) -> str | None:
        """The id `scontrol requeue` takes: `<array job>_<task>` for array tasks."""
        if self.array_job_id and self.array_task_id:
            return f"{self.array_job_id}_{self.array_task_id}"
        return self.job_id

    def torchrun_vars(self) -> dict[str, str]:
        """The variables a torchrun-style program reads."""
        return {
            "RANK": str(self.rank),
            "LOCAL_RANK": str(self.local_rank),
            "WORLD_SIZE": str(self.world_size),
            "LOCAL_WORLD_SIZE": str(self.local_world_size),
            "GROUP_RANK": str(self.node_rank),
            "MASTER_ADDR": self.master_addr,
            "MASTER_PORT": str(self.master_port),
        }

    def device_index(self, gpu_count: int) -> int | None:
        """The GPU this rank uses among the `gpu_count` it can see, or None for CPU.

        SLURM may give each task only its own GPU (one visible) or all of the node's; either way the
        N-th local rank takes the N-th visible GPU.
        """
        if gpu_count <= 0:
            return None
        if gpu_count == 1 or self.own_group:  # a bound group: its first GPU leads
            return 0
        if self.local_rank >= gpu_count:
            raise EnvironmentError_(
                f"local rank {self.local_rank} has no GPU: {self.local_world_size} tasks on this node "
                f"but {gpu_count} GPUs visible (CUDA_VISIBLE_DEVICES={','.join(self.visible_devices or ())}); "
                "ask for one task per GPU")
        return self.local_rank

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None, gpus_per_task: int = 1,
                     own_group: bool = False) -> "DistEnv":
        """gpus_per_task: GPUs one task spans (infer.gpus_per_replica); own_group: the task is to see
        only those (Spec.own_gpu_group); the group is bound later."""
        env = os.environ if environ is None else environ
        launcher = launcher_named(env.get(ENV_LAUNCHER, "")) or _found_launcher(env)
        if launcher in (SLURM, LOCAL):
            out = _from_slurm(env, launcher)
        elif launcher is TORCHRUN:
            out = _from_torchrun(env)
        elif env.get(ENV_LAUNCHER):  # named single: a plain process whatever MASTER_ADDR says
            out = cls(launcher=SINGLE, master_port=_port(env, None), visible_devices=_visible(env))
        else:
            out = cls(launcher=SINGLE, master_port=_port(env, None), visible_devices=_visible(env),
                      master_addr=env.get("MASTER_ADDR", "127.0.0.1"))
        if own_group or gpus_per_task > 1:
            out = dataclasses.replace(out, gpus_per_task=gpus_per_task, own_group=True)
        out.check()
        return out

    def check(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise EnvironmentError_(f"rank {self.rank} is outside the world of {self.world_size} ranks")
        if not 0 <= self.local_rank < self.local_world_size:
            raise EnvironmentError_(
                f"local rank {self.local_rank} is outside the {self.local_world_size} tasks of this node")
        if self.local_world_size > self.world_size:
            raise EnvironmentError_(
                f"{self.local_world_size} tasks on this node but only {self.world_size} in the job")
        if not 1 <= self.master_port <= 65535:
            raise EnvironmentError_(f"MASTER_PORT={self.master_port} is not a port (1-65535)")
        if self.own_group:
            return  # bind_gpu_group checks the GPUs a group needs
        if self.visible_devices and self.local_world_size > len(self.visible_devices) > 1:
            raise EnvironmentError_(
                f"{self.local_world_size} tasks on this node but only {len(self.visible_devices)} GPUs visible "
                f"(CUDA_VISIBLE_DEVICES={','.join(self.visible_devices)}); ask for one task per GPU")


def bind_gpu_group(env: DistEnv, environ: dict[str, str] | None = None,
                   node_gpus: Callable[[], int] = nvml.gpu_count) -> DistEnv:
    """A task with a GPU group of its own (an infer replica: a model copy over gpus_per_task GPUs, one
    included) keeps only that group visible: GPUs [g * local rank, g * local rank + g) of those the
    node's tasks all see (SLURM's --gres, the local executor), or all it sees where SLURM bound the
    task to its g GPUs already. Before CUDA starts (torch reads CUDA_VISIBLE_DEVICES once). The
    node's list stays in HPCGPU_NODE_GPUS for the GPU monitor.

    Why one GPU too: a replica that saw the node's GPUs asked each of them for its free memory, which
    made a CUDA context of it on every GPU and summed every GPU's memory into its batch budget.
    Training ranks keep the node's list (own_group False)."""
    g = env.gpus_per_task
    if not env.own_group or env.visible_devices == ():  # CUDA_VISIBLE_DEVICES="": CPU ranks, on purpose
        return env
    target = os.environ if environ is None else environ
    visible = env.visible_devices
    if visible is None:  # nothing set: the node's GPUs in order, as many as its tasks need
        if node_gpus() == 0:
            return env  # no GPU here (CPU ranks): nothing to narrow, and no CUDA_VISIBLE_DEVICES=0 to mislead
        visible = tuple(str(i) for i in range(env.local_world_size * g))
    if len(visible) == g:
        group = visible
    elif len(visible) >= env.local_world_size * g:
        group = visible[env.local_rank * g: (env.local_rank + 1) * g]
    else:
        raise EnvironmentError_(
            f"{env.local_world_size} model copies of {g} GPUs on this node need {env.local_world_size * g} GPUs, but "
            f"{len(visible)} are visible (CUDA_VISIBLE_DEVICES={','.join(visible)}); ask for resources.gpus = "
            "infer.gpus_per_replica x copies per node")
    target.setdefault(ENV_NODE_GPUS, ",".join(visible))
    target["CUDA_VISIBLE_DEVICES"] = ",".join(group)
    return dataclasses.replace(env, visible_devices=group)


def _found_launcher(env: Mapping[str, str]) -> Launcher:
    """The launcher of a rank HPCGPU_LAUNCHER does not name: srun, torchrun, or a plain process."""
    if _in_slurm_step(env) and "RANK" not in env:
        return SLURM
    if "RANK" in env and "WORLD_SIZE" in env:
        return TORCHRUN
    return SINGLE


def _in_slurm_step(env: Mapping[str, str]) -> bool:
    # SLURM_STEP_ID is set under srun; the batch script alone has SLURM_PROCID=0 of a bigger job
    return "SLURM_PROCID" in env and ("SLURM_STEP_ID" in env or "SLURM_STEPID" in env)


def _int(env: Mapping[str, str], name: str, default: int | None = None) -> int:
    value = env.get(name)
    if value is None or value == "":
        if default is None:
            raise EnvironmentError_(f"{name} is not set")
        return default
    try:
        return int(value)
    except ValueError:
        raise EnvironmentError_(f"{name}={value!r} is not a number") from None


def _visible(env: Mapping[str, str]) -> tuple[str, ...] | None:
    value = env.get("CUDA_VISIBLE_DEVICES")
    if value is None:
        return None
    return tuple(v for v in (s.strip() for s in value.split(",")) if v)


def _port(env: Mapping[str, str], job_id: str | None, step_id: str | None = None) -> int:
    if env.get("MASTER_PORT"):
        return _int(env, "MASTER_PORT")
    return port_for_job(job_id, step_id) if job_id else 29500


def tasks_per_node(expr: str) -> list[int]:
    """SLURM_TASKS_PER_NODE / SLURM_NTASKS_PER_NODE: `2(x3),1` -> [2, 2, 2, 1]."""
    out: list[int] = []
    for part in expr.split(","):
        m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if not m:
            raise EnvironmentError_(f"cannot read tasks per node {expr!r}")
        out += [int(m.group(1))] * int(m.group(2) or 1)
    return out


def _pick(env: Mapping[str, str], *names: str) -> tuple[str, str | None]:
    """The first of `names` that is set, with its value (or the first name and None)."""
    name = next((n for n in names if env.get(n)), names[0])
    return name, env.get(name) or None


def _first(env: Mapping[str, str], *names: str) -> str | None:
    return _pick(env, *names)[1]


def _from_slurm(env: Mapping[str, str], launcher: Launcher) -> DistEnv:
    # Inside an srun step the SLURM_STEP_* variables describe the step, which may use only part of
    # the allocation; the job-wide ones come second (the local executor sets only those).
    world_var = _pick(env, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_NPROCS")[0]
    world = _int(env, world_var)
    nnodes = int(_first(env, "SLURM_STEP_NUM_NODES", "SLURM_NNODES", "SLURM_JOB_NUM_NODES") or 1)
    node_rank = _int(env, "SLURM_NODEID", 0)
    per_node = _slurm_tasks_per_node(env, world_var, world, nnodes)
    if node_rank >= len(per_node):
        raise EnvironmentError_(f"SLURM_NODEID={node_rank} but the job has {len(per_node)} node(s)")
    nodelist_var, nodelist = _pick(env, "SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
    try:
        hosts = tuple(expand_hostlist(nodelist)) if nodelist else ()
    except ValueError as exc:
        raise EnvironmentError_(f"{nodelist_var}: {exc}") from None
    job_id = env.get(ENV_LOCAL_JOB) or env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID")
    step_id = _first(env, "SLURM_STEP_ID", "SLURM_STEPID")
    return DistEnv(
        rank=_int(env, "SLURM_PROCID"),
        local_rank=_int(env, "SLURM_LOCALID", 0),
        world_size=world,
        local_world_size=per_node[node_rank],
        node_rank=node_rank,
        num_nodes=len(per_node),
        master_addr=env.get("MASTER_ADDR") or (hosts[0] if hosts else "127.0.0.1"),
        master_port=_port(env, job_id, step_id),
        launcher=launcher,
        job_id=job_id,
        restart_count=_int(env, "SLURM_RESTART_COUNT", 0),
        array_job_id=env.get("SLURM_ARRAY_JOB_ID") or None,
        array_task_id=env.get("SLURM_ARRAY_TASK_ID") or None,
        hosts=hosts,
        visible_devices=_visible(env),
    )


def _slurm_tasks_per_node(env: Mapping[str, str], world_var: str, world: int, nnodes: int) -> list[int]:
    """Each node's task count, which must add up to the world size."""
    per_node_var, per_node_expr = _pick(env, "SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE",
                                        "SLURM_NTASKS_PER_NODE")
    per_node_expr = per_node_expr or str(world // max(nnodes, 1))
    per_node = tasks_per_node(per_node_expr)
    if len(per_node) == 1 and nnodes > 1:
        per_node = per_node * nnodes
    if sum(per_node) != world:
        raise EnvironmentError_(
            f"tasks do not add up: {world_var}={world} but tasks per node {per_node_expr!r} "
            f"({per_node_var}) over {nnodes} node(s) make {sum(per_node)}")
    return per_node


def _from_torchrun(env: Mapping[str, str]) -> DistEnv:
    world = _int(env, "WORLD_SIZE")
    local_world = _int(env, "LOCAL_WORLD_SIZE", world)
    return DistEnv(
        rank=_int(env, "RANK"),
        local_rank=_int(env, "LOCAL_RANK", 0),
        world_size=world,
        local_world_size=local_world,
        node_rank=_int(env, "GROUP_RANK", 0),
        num_nodes=max(1, world // max(local_world, 1)),
        master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
        master_port=_port(env, None),
        launcher=TORCHRUN,
        job_id=env.get("SLURM_JOB_ID") or env.get("TORCHELASTIC_RUN_ID"),
        restart_count=_int(env, "TORCHELASTIC_RESTART_COUNT", _int(env, "SLURM_RESTART_COUNT", 0)),
        visible_devices=_visible(env),
    )
