"""Values derived from a spec that both the launchers and the job need (no imports but the schema)."""
from __future__ import annotations

from hpcgpu.spec.schema import Spec


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
