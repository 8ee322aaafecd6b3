"""Values derived from a spec that both the launchers and the job need (no imports but the schema)."""
from __future__ import annotations

from hpcgpu.errors import SpecError
from hpcgpu.spec.schema import Spec


DEFAULT_MAX_STEPS = 100  # neither train.max_steps nor train.epochs given


def fixed_max_steps(spec: Spec) -> int | None:
    """The step count the spec fixes: train.max_steps, else the default; None with train.epochs (the
    job's run plan derives it from the data)."""
    t = spec.train
    return None if t.epochs else (t.max_steps or DEFAULT_MAX_STEPS)


def batch_split(global_batch: int, world: int, micro: int | None = None, *,
                ranks: str = "nodes x gpus") -> tuple[int, int | None]:
    """(sequences per rank, accumulation steps) of `global_batch` over `world` ranks at micro batch
    `micro` (accumulation None while the micro batch is still to be chosen).

    The one place a global batch is divided: the spec check (host side, the spec's own numbers) and the
    job's run plan (the real world size) both call it. A batch that does not divide is a SpecError
    naming the key, never a silent round-down. `ranks` says where the world size comes from."""
    if global_batch % world:
        raise SpecError("train.global_batch_size", f"{global_batch} is not divisible by the {world} ranks ({ranks})")
    per_rank = global_batch // world
    if micro is None:
        return per_rank, None
    if per_rank % micro:
        raise SpecError("train.micro_batch_size", f"{micro} does not divide the {per_rank} sequences per rank "
                        f"(global_batch_size {global_batch} / {world} ranks)")
    return per_rank, per_rank // micro


def nccl_env(spec: Spec) -> dict[str, str]:
    """NCCL/torch variables the job exports before the process group starts."""
    n = spec.distributed.nccl
    env = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}  # a dead peer aborts the job, not a 10-minute hang
    if n.debug:
        env["NCCL_DEBUG"] = n.debug
    if n.socket_ifname:
        env["NCCL_SOCKET_IFNAME"] = n.socket_ifname
    if n.ib_disable is not None:
        env["NCCL_IB_DISABLE"] = "1" if n.ib_disable else "0"
    return env


def signal_name(spec: Spec) -> str:
    """`B:USR2@120` -> `USR2`."""
    sig = spec.slurm.signal.split("@")[0].removeprefix("B:")
    return sig.removeprefix("SIG")


def signal_lead_s(spec: Spec) -> int:
    return int(spec.slurm.signal.split("@")[1])


def time_limit_s(spec: Spec) -> int:
    text = spec.resources.time
    days, _, hms = text.rpartition("-")
    h, m, s = (int(x) for x in hms.split(":"))
    return (int(days) if days else 0) * 86400 + h * 3600 + m * 60 + s


def mem_per_node(spec: Spec) -> str | None:
    """`mem_per_gpu` x gpus as an sbatch size, in the unit given (32G x 4 -> 128G)."""
    mem = spec.resources.mem_per_gpu
    if not mem:
        return None
    unit = mem[-1] if mem[-1].isalpha() else "M"  # SLURM's default unit is megabytes
    number = float(mem[:-1] if mem[-1].isalpha() else mem)
    total = number * spec.resources.gpus
    return f"{int(total) if total == int(total) else int(total * 1024)}{unit if total == int(total) else _smaller(unit)}"


def _smaller(unit: str) -> str:
    return {"T": "G", "G": "M", "M": "K", "K": "K"}[unit]
