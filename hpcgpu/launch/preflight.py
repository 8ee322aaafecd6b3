"""Check a request against the cluster before submitting: a job that can never start is one clear
line and exit 2 now, not a job that pends forever with `Resources` or `ReqNodeNotAvail`."""
from __future__ import annotations

from hpcgpu.errors import HpcgpuError
from hpcgpu.launch.scheduler import Cluster, Node
from hpcgpu.spec.derive import mem_per_node, time_limit_s
from hpcgpu.spec.schema import Spec


class RequestError(HpcgpuError):
    """The cluster has no place for the request (exit 2: the spec or a flag must change)."""


def size_mb(text: str) -> int:
    """An sbatch size (`128G`, `1536M`, `2T`, `512` = MB) in megabytes."""
    unit = text[-1].upper() if text[-1].isalpha() else "M"
    number = float(text[:-1] if text[-1].isalpha() else text)
    return int(number * {"K": 1 / 1024, "M": 1, "G": 1024, "T": 1024 * 1024}[unit])


def check_request(spec: Spec, cluster: Cluster) -> str:
    """Raise RequestError unless some partition named by the spec can run it; return that partition."""
    wanted = spec.slurm.partition.split(",") if spec.slurm.partition else []
    if not wanted:
        if not cluster.default_partition:
            raise RequestError("slurm.partition: the cluster has no default partition; name one "
                               f"({', '.join(cluster.partitions) or 'sinfo lists none'})")
        wanted = [cluster.default_partition]
    unknown = [p for p in wanted if p not in cluster.partitions]
    if len(unknown) == len(wanted):
        raise RequestError(f"slurm.partition: no partition {', '.join(repr(p) for p in unknown)} on this "
                           f"cluster (partitions: {', '.join(sorted(cluster.partitions)) or 'none'})")
    problems = []
    for partition in wanted:
        if partition in unknown:
            continue
        problem = partition_problem(spec, partition, cluster.in_partition(partition))
        if problem is None:
            return partition
        problems.append(problem)
    raise RequestError(problems[0])  # SLURM takes the first partition that fits: its reason is the one


def partition_problem(spec: Spec, partition: str, nodes: list[Node]) -> str | None:
    """Why no set of nodes in `partition` fits the request, or None when it fits."""
    r = spec.resources
    cpus = r.gpus * r.cpus_per_gpu
    mem = mem_per_node(spec)
    mem_mb = size_mb(mem) if mem else 0
    gpu_kind = r.gpu_type or ""
    limit = nodes[0].time_limit_s if nodes else None
    if limit is not None and time_limit_s(spec) > limit:
        return (f"resources.time: {r.time} is over the time limit of partition '{partition}' "
                f"({_hms(limit)})")

    def gpus_of(n: Node) -> int:
        return n.gpus.get(gpu_kind, 0) if gpu_kind else sum(n.gpus.values())

    with_gpus = [n for n in nodes if gpus_of(n) >= r.gpus or spec.slurm.gpu_request == "none"]
    if not with_gpus:
        most = max(nodes, key=gpus_of, default=None)
        what = f"{r.gpus} GPU(s) of type {gpu_kind}" if gpu_kind else f"{r.gpus} GPU(s)"
        have = f"the most is {gpus_of(most)}, on {most.name}" if most else "it has no nodes"
        types = sorted({k for n in nodes for k in n.gpus if k})
        hint = f"; GPU types there: {', '.join(types)}" if gpu_kind and types else ""
        return f"--gpus/resources.gpus: no node in partition '{partition}' has {what} ({have}{hint})"
    with_cpus = [n for n in with_gpus if n.cpus >= cpus]
    if not with_cpus:
        most_cpus = max(n.cpus for n in with_gpus)
        return (f"resources.cpus_per_gpu: {r.gpus} GPU(s) x {r.cpus_per_gpu} CPUs = {cpus} CPUs per node, but "
                f"the nodes of partition '{partition}' with {r.gpus} GPU(s) have at most {most_cpus}")
    fitting = [n for n in with_cpus if n.mem_mb >= mem_mb]
    if not fitting:
        most_mb = max(n.mem_mb for n in with_cpus)
        return (f"resources.mem_per_gpu: {r.gpus} GPU(s) x {r.mem_per_gpu} = {mem} per node, but the nodes "
                f"of partition '{partition}' with enough GPUs and CPUs have at most {most_mb}M")
    if len(fitting) < r.nodes:
        return (f"--nodes/resources.nodes: {r.nodes} nodes asked for, but partition '{partition}' has only "
                f"{len(fitting)} with {r.gpus} GPU(s), {cpus} CPUs" + (f" and {mem}" if mem else "")
                + f" ({', '.join(n.name for n in fitting)})")
    return None


def _hms(seconds: int) -> str:
    days, rest = divmod(seconds, 86400)
    text = f"{rest // 3600:02d}:{rest % 3600 // 60:02d}:{rest % 60:02d}"
    return f"{days}-{text}" if days else text
