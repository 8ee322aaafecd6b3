"""Scheduler queries: what the cluster has (sinfo), where jobs are (squeue), cancelling (scancel).

Each function makes at most one scheduler call, whatever the number of jobs: many users polling
one job at a time is what overloads a shared slurmctld.
"""
from __future__ import annotations

import re
import subprocess
import time
from dataclasses import dataclass, field, replace

from hpcgpu.errors import SchedulerError

QUERY_TIMEOUT_S = 30
FINAL_STATES = frozenset({"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "OUT_OF_MEMORY", "NODE_FAIL",
                          "BOOT_FAIL", "DEADLINE", "PREEMPTED", "REVOKED", "SPECIAL_EXIT"})


def run_scheduler(argv: list[str]) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=QUERY_TIMEOUT_S)
    except FileNotFoundError:
        raise SchedulerError(f"{argv[0]} not found: is this a SLURM login node? "
                             "(--executor local runs jobs here)") from None
    except subprocess.TimeoutExpired:
        raise SchedulerError(f"`{' '.join(argv[:2])}` did not answer in {QUERY_TIMEOUT_S} s: "
                             "is slurmctld up?") from None


def one_line(text: str) -> str:
    return "; ".join(line.strip() for line in text.splitlines() if line.strip())


# --- what the cluster has -------------------------------------------------------------------------

@dataclass(frozen=True)
class Node:
    name: str
    partition: str
    cpus: int
    mem_mb: int
    gpus: dict[str, int]  # GPU type ("" when untyped) -> count
    state: str
    time_limit_s: int | None  # the partition's MaxTime; None when unlimited


@dataclass
class Cluster:
    nodes: list[Node] = field(default_factory=list)
    default_partition: str | None = None

    @property
    def partitions(self) -> list[str]:
        return list(dict.fromkeys(n.partition for n in self.nodes))

    def in_partition(self, partition: str) -> list[Node]:
        return [n for n in self.nodes if n.partition == partition]


SINFO_FORMAT = "%N|%P|%c|%m|%G|%T|%l"


def read_cluster() -> Cluster:
    """One `sinfo` call: every node of every partition, with CPUs, memory, GPUs and time limits."""
    done = run_scheduler(["sinfo", "-h", "-N", "-o", SINFO_FORMAT])
    if done.returncode != 0:
        raise SchedulerError(f"sinfo failed: {one_line(done.stderr) or done.returncode}")
    return parse_sinfo(done.stdout)


def parse_sinfo(text: str) -> Cluster:
    cluster = Cluster()
    for line in text.splitlines():
        parts = line.strip().split("|")
        if len(parts) != 7:
            continue
        name, partition, cpus, mem, gres, state, limit = parts
        if partition.endswith("*"):
            partition = partition[:-1]
            cluster.default_partition = partition
        cluster.nodes.append(Node(name, partition, _int(cpus), _int(mem), parse_gres(gres), state,
                                  parse_duration(limit)))
    return cluster


def _int(text: str) -> int:
    m = re.match(r"\d+", text.strip())
    return int(m.group(0)) if m else 0


def parse_gres(text: str) -> dict[str, int]:
    """`gpu:a100:4(S:0-1),gpu:2,shard:8` -> {"a100": 4, "": 2}; `(null)` -> {}."""
    out: dict[str, int] = {}
    for item in re.split(r",(?![^()]*\))", text):
        item = re.sub(r"\(.*?\)", "", item).strip()
        parts = item.split(":")
        if parts[0] != "gpu" or len(parts) < 2:
            continue
        kind = parts[1] if len(parts) > 2 else ""
        count = _int(parts[-1])
        out[kind] = out.get(kind, 0) + count
    return out


def parse_duration(text: str) -> int | None:
    """SLURM times (`infinite`, `1-00:00:00`, `30:00`, `5`) -> seconds; None for unlimited."""
    text = text.strip()
    if not text or text.lower() in ("infinite", "unlimited", "n/a"):
        return None
    days, _, rest = text.rpartition("-")
    parts = [int(p) for p in rest.split(":") if p.isdigit()]
    if len(parts) == 1:
        seconds = parts[0] * 60  # a bare number is minutes
    elif len(parts) == 2:
        seconds = (parts[0] * 3600 + parts[1] * 60) if days else (parts[0] * 60 + parts[1])
    else:
        seconds = parts[0] * 3600 + parts[1] * 60 + parts[2]
    return (int(days) if days.isdigit() else 0) * 86400 + seconds


def max_array_size() -> int:
    """MaxArraySize of the cluster (array indices run from 0 to this minus one)."""
    done = run_scheduler(["scontrol", "show", "config"])
    m = re.search(r"^MaxArraySize\s*=\s*(\d+)", done.stdout, re.M)
    return int(m.group(1)) if m else 1001  # SLURM's default


# --- where jobs are -------------------------------------------------------------------------------

@dataclass(frozen=True)
class JobInfo:
    """One job or array task as the scheduler reports it."""

    id: str  # "123" or "123_4"
    state: str
    reason: str = ""
    elapsed: str = ""  # the current run only (SLURM restarts the clock at every requeue)
    nodes: str = ""
    restarts: int = 0
    exit_code: int | None = None
    start: float | None = None  # the current run's start (epoch), while it runs
    submit: float | None = None  # SLURM resets it to the moment of every requeue
    gpus: int | None = None  # GPUs allocated (or asked for) per run, all nodes together
    total_s: int | None = None  # every run together, where accounting (sacct) lists each run


SQUEUE_FIELDS = ("JobArrayID:|,State:|,Reason:|,TimeUsed:|,NodeList:|,RestartCnt:|,exit_code:|,"
                 "StartTime:|,SubmitTime:|,NumNodes:|,tres-per-node:|,tres-per-job:|")
# A state sacct gives the earlier runs of a requeued job (each run is a row of its own there).
REQUEUED_RUN_STATES = frozenset({"REQUEUED", "PREEMPTED", "NODE_FAIL"})


def query_jobs(job_ids: list[str]) -> dict[str, JobInfo]:
    """State of the given jobs (array jobs by their id: every task comes back), in one squeue call.

    `squeue -t all` reads the controller's whole job table, finished jobs included until MinJobAge
    passes, so it already holds what `scontrol show job` would say (state, reason, restarts, exit code).
    Jobs it no longer knows, and the run times of requeued ones (squeue counts the current run
    only), are asked of sacct, once for all, where accounting exists.
    """
    ids = sorted({j.split("_")[0] for j in job_ids})
    if not ids:
        return {}
    done = run_scheduler(["squeue", "-h", "-r", "-t", "all", "-j", ",".join(ids), "-O", SQUEUE_FIELDS])
    if done.returncode != 0 and "Invalid job id" not in done.stderr:
        raise SchedulerError(f"squeue failed: {one_line(done.stderr) or done.returncode}")
    found = parse_squeue(done.stdout if done.returncode == 0 else "")
    missing = [i for i in ids if not knows_job(found, i)]
    requeued = sorted({k.split("_")[0] for k, info in found.items() if info.restarts > 0})
    if missing or requeued:
        accounted = query_sacct(missing + requeued)
        for key, info in accounted.items():
            if key in found:
                found[key] = replace(found[key], total_s=info.total_s)
            elif key.split("_")[0] in missing:
                found[key] = info
    return found


def knows_job(infos: dict[str, JobInfo], job_id: str) -> bool:
    """Whether the answer holds the job or any task of it (keys are `123` or `123_4`)."""
    return any(k.split("_")[0] == job_id for k in infos)


def parse_squeue(text: str) -> dict[str, JobInfo]:
    out = {}
    for line in text.splitlines():
        parts = [p.strip() for p in line.split("|")]
        if len(parts) < 7:
            continue
        job_id, state, reason, elapsed, nodes, restarts, exit_code = parts[:7]
        start, submit, num_nodes, per_node, per_job = (parts[7:12] + [""] * 5)[:5]
        state = state.split()[0] if state else "UNKNOWN"
        out[job_id] = JobInfo(job_id, state, "" if reason in ("None", "(null)") else reason, elapsed,
                              "" if nodes in ("(null)", "") else nodes, _int(restarts),
                              _wait_status(exit_code, state),
                              start=parse_time(start) if state not in ("PENDING", "REQUEUED") else None,
                              submit=parse_time(submit), gpus=gpu_count(per_node, per_job, num_nodes))
    return out


def parse_time(text: str) -> float | None:
    """A SLURM timestamp (`2026-11-26T11:04:03`, the client's local time) -> epoch; None for N/A."""
    try:
        return time.mktime(time.strptime(text.strip(), "%Y-%m-%dT%H:%M:%S"))
    except ValueError:
        return None


def gpu_count(per_node: str, per_job: str, nodes: str) -> int | None:
    """GPUs of a job from squeue's tres-per-node (`gres:gpu:2`, `gres/gpu:a100:2`) x nodes plus
    tres-per-job; None when neither field is there to read (an older squeue)."""
    if not per_node and not per_job:
        return None

    def gpus(text: str) -> int:
        items = [re.sub(r"^gres[:/]", "", item.strip()).replace("=", ":") for item in text.split(",")]
        return sum(parse_gres(",".join(items)).values())

    return gpus(per_node) * max(1, _int(nodes)) + gpus(per_job)


def format_duration(seconds: float) -> str:
    """Seconds -> SLURM's way of writing elapsed time: `4:05`, `1:02:03`, `2-01:02:03`."""
    seconds = max(0, int(seconds))
    days, rest = divmod(seconds, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    if days:
        return f"{days}-{hours:02d}:{minutes:02d}:{secs:02d}"
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


def _wait_status(text: str, state: str) -> int | None:
    """squeue's exit_code is the raw wait status (exit code << 8 | signal)."""
    if not text.strip().isdigit() or state not in FINAL_STATES:
        return None
    status = int(text)
    return status >> 8 if status & 0x7F == 0 else 128 + (status & 0x7F)


SACCT_FIELDS = "JobID,State,Elapsed,NodeList,ExitCode,ElapsedRaw,Submit"


def query_sacct(job_ids: list[str]) -> dict[str, JobInfo]:
    """Jobs as accounting saw them, every run of a requeued job summed into total_s; {} where
    accounting is off (sacct fails then). One call for all."""
    try:
        done = run_scheduler(["sacct", "-n", "-X", "-P", "-D", "-o", SACCT_FIELDS, "-j", ",".join(job_ids)])
    except SchedulerError:
        return {}
    return parse_sacct(done.stdout) if done.returncode == 0 else {}


def parse_sacct(text: str) -> dict[str, JobInfo]:
    """`sacct -X -P -D` rows -> the latest run of each job, with the time of all its runs.

    -D lists each run of a requeued job as a row (the earlier ones REQUEUED); the same id may also
    be an older job from before a controller reset, so only the latest row and the requeued runs
    right before it count."""
    rows: dict[str, list[list[str]]] = {}
    for line in text.splitlines():
        parts = line.split("|")
        if len(parts) >= 7 and "." not in parts[0]:
            rows.setdefault(parts[0], []).append(parts)
    out = {}
    for job_id, runs in rows.items():
        runs.sort(key=lambda r: r[6])  # by Submit, which SLURM resets at each requeue
        _, state, elapsed, nodes, exit_code = runs[-1][:5]
        state = state.split()[0] if state else "UNKNOWN"
        earlier = 0
        while earlier < len(runs) - 1 and (runs[-2 - earlier][1].split() or [""])[0] in REQUEUED_RUN_STATES:
            earlier += 1
        total = sum(_int(r[5]) for r in runs[len(runs) - 1 - earlier:])
        out[job_id] = JobInfo(job_id, state, "", elapsed, nodes, earlier, _sacct_exit(exit_code), total_s=total)
    return out


def _sacct_exit(text: str) -> int | None:
    """sacct's ExitCode is `code:signal`; a signal N reads as 128+N, as a shell says it."""
    code, _, sig = text.partition(":")
    if sig.isdigit() and int(sig):
        return 128 + int(sig)
    return int(code) if code.isdigit() else None


def cancel_jobs(job_ids: list[str], now: bool = False) -> None:
    """Cancel for good: `123_4` one array task, `123` a whole array.

    scancel sends SIGTERM, which the job takes as a preemption: it checkpoints and rank 0 runs
    `scontrol requeue`, which SLURM accepts even for a cancelled job. Turning the job's Requeue flag
    off first makes that requeue fail ("presently disabled"), so a cancelled job stays cancelled.
    `now`: no checkpoint first (kill_steps).
    """
    run_scheduler(["scontrol", "update", f"JobId={','.join(job_ids)}", "Requeue=0"])  # a finished job refuses: fine
    if now:
        kill_steps(job_ids)
    done = run_scheduler(["scancel", *job_ids])
    if done.returncode != 0:
        raise SchedulerError(f"scancel failed: {one_line(done.stderr) or done.returncode}")


def kill_steps(job_ids: list[str]) -> None:
    """SIGKILL every step of the jobs (their ranks), none of them given the SIGTERM that means "checkpoint":
    a plain scancel, even `--signal=KILL`, ends a job through SIGTERM and KillWait. The batch script is
    paused first (SIGSTOP): left running, it would end the job FAILED the moment its srun died, before the
    scancel that marks it CANCELLED (which resumes and ends it)."""
    run_scheduler(["scancel", "--batch", "--signal=STOP", *job_ids])  # a job not started yet refuses: fine
    listed = run_scheduler(["squeue", "-h", "-s", "-j", ",".join(job_ids), "-o", "%i"])
    steps = [s for s in listed.stdout.split() if s.rpartition(".")[2].isdigit()]  # not .batch or .extern
    if steps:
        run_scheduler(["scancel", "--signal=KILL", *steps])
