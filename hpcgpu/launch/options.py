"""The one mapping from a spec to SLURM job options, used by `hpcgpu sbatch` and `hpcgpu submit`."""
from __future__ import annotations

from pathlib import Path

from hpcgpu.spec.derive import mem_per_node
from hpcgpu.spec.schema import Spec


def asks_gpus(spec: Spec) -> bool:
    return spec.slurm.gpu_request != "none"


def per_node_text(spec: Spec) -> str:
    """What one node runs, for the script's first comment: "4 GPU(s)" or "1 CPU task(s), no GPU"."""
    n = spec.resources.gpus
    return f"{n} GPU(s)" if asks_gpus(spec) else f"{n} CPU task(s), no GPU"


def gpu_request(spec: Spec) -> tuple[str, str]:
    r = spec.resources
    if spec.slurm.gpu_request == "gpus-per-node":
        return "gpus-per-node", f"{r.gpu_type}:{r.gpus}" if r.gpu_type else str(r.gpus)
    return "gres", f"gpu:{r.gpu_type}:{r.gpus}" if r.gpu_type else f"gpu:{r.gpus}"


def sbatch_options(spec: Spec, run_dir: Path, array: str | None = None) -> list[tuple[str, str | None]]:
    """(option, value) pairs in the order they are rendered; value None means a bare flag.

    array: a job array's index range (`0-9%4`); its tasks share one script, so SLURM's own log goes to
    run_dir/slurm-<array job>_<task>.* until the script moves each task's output into its run dir.
    """
    s = spec.slurm
    log = "slurm-%A_%a" if array else "slurm-%j"
    opts = request_options(spec)
    opts += [
        ("output", str(run_dir / f"{log}.out")),
        ("error", str(run_dir / f"{log}.err")),
        ("signal", s.signal),
    ]
    if array:
        opts.append(("array", array))
    opts.append(("requeue", None) if s.requeue else ("no-requeue", None))
    opts.append(("open-mode", "append"))
    for key, value in s.extra.items():
        if value is True:
            opts.append((key, None))
        elif value is not False:
            opts.append((key, str(value)))
    return opts


def request_options(spec: Spec) -> list[tuple[str, str | None]]:
    """What the job asks of the cluster: its name, nodes, tasks, GPUs, CPUs, memory, time and where."""
    r, s = spec.resources, spec.slurm
    opts: list[tuple[str, str | None]] = [
        ("job-name", spec.name),
        ("nodes", str(r.nodes)),
        ("ntasks-per-node", str(spec.tasks_per_node)),
        *([gpu_request(spec)] if asks_gpus(spec) else []),
        ("cpus-per-task", str(r.cpus_per_gpu * spec.gpus_per_task)),
    ]
    mem = mem_per_node(spec)
    if mem:
        opts.append(("mem", mem))
    opts.append(("time", r.time))
    for key in ("partition", "account", "qos", "constraint"):
        value = getattr(s, key)
        if value:
            opts.append((key, value))
    return opts
