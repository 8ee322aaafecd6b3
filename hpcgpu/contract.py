"""The run contract, shared by the launchers (launch/) and the job (runtime/); imports nothing of ours.

What a run leaves and reads: its folder's layout (RunPaths), the markers (FINISHED, COMPLETE), the
exit codes, the HPCGPU_* variables a launcher sets for a rank, the failure records a rank writes for
`hpcgpu status`, and the batch script's record of the signals it got.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import socket
import shutil
import signal
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Iterator, Mapping

FAILURES_DIR = "failures"  # <run dir>/failures/<attempt>.rank-<N>.json, one per rank that failed

# --- exit codes ------------------------------------------------------------------------------------
EXIT_FINISHED = 0
EXIT_USAGE = 2  # a spec, flag or file to fix (HpcgpuError)
EXIT_SCHEDULER = 3  # the scheduler refused or failed (SchedulerError)
EXIT_STOPPED = 75  # EX_TEMPFAIL: stopped at a checkpoint after a preemption/timeout signal or Ctrl-C
EXIT_KILLED = 130  # 128 + SIGINT: the local executor killed the ranks at a second Ctrl-C (or cancel)

# --- markers ---------------------------------------------------------------------------------------
FINISHED_MARKER = "FINISHED"  # in a run dir: the run is done and never trains (or requeues) again
COMPLETE_MARKER = "COMPLETE"  # in checkpoints/step-N/: the checkpoint was written whole
PLAN_FILE = "plan.json"  # the run plan, in the run dir and in every checkpoints/step-N/

# --- variables a launcher sets for each rank (and the job's own code may read) ----------------------
ENV_LAUNCHER = "HPCGPU_LAUNCHER"  # slurm | local | torchrun | single
ENV_RUN_DIR = "HPCGPU_RUN_DIR"
ENV_SPEC = "HPCGPU_SPEC"
ENV_CHECKPOINT_DIR = "HPCGPU_CHECKPOINT_DIR"  # for a task: command program's own checkpoints
ENV_JOB_START = "HPCGPU_JOB_START"  # epoch seconds the batch script started: timeout vs preemption
ENV_PENDING_SIGNAL = "HPCGPU_PENDING_SIGNAL"  # a stop signal the batch script got before srun ran
ENV_PARENT_PID = "HPCGPU_PARENT_PID"  # the local executor: a rank dies with this process
ENV_SIGNAL_AT = "HPCGPU_SIGNAL_AT"  # drill: STEP[:RANK] sends that rank the stop signal at STEP
ENV_KILL_IN_CHECKPOINT = "HPCGPU_KILL_IN_CHECKPOINT"  # drill: SIGKILL in the middle of that step's checkpoint
# ... and the host side's
ENV_REGISTRY = "HPCGPU_REGISTRY"  # the job registry's file
ENV_NVML_RECORDED = "HPCGPU_NVML_RECORDED"  # recorded GPU readings in place of the driver's
ENV_DEBUG = "HPCGPU_DEBUG"  # tracebacks for errors
ENV_NODE_GPUS = "HPCGPU_NODE_GPUS"  # the node's visible GPUs, where a task narrowed CUDA_VISIBLE_DEVICES to its group
ENV_GPU_MEMORY = "HPCGPU_GPU_MEMORY"
ENV_LOCAL_JOB = "HPCGPU_LOCAL_JOB"  # the local executor's job name (local-3); SLURM_JOB_ID holds its number  # a size (80G) that replaces each rank's GPU memory reading for the plan
# what the launchers (srun, the local executor, hpcgpu run) set for every rank: a spec's env: must not.
# MASTER_PORT is the exception: `env: {MASTER_PORT: N}` picks the rendezvous port (a site's firewall)
LAUNCHER_OWNED_ENV = frozenset({
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
    "CUDA_VISIBLE_DEVICES", ENV_LAUNCHER, ENV_RUN_DIR, ENV_SPEC, ENV_JOB_START, ENV_PENDING_SIGNAL, ENV_PARENT_PID,
    ENV_NODE_GPUS, ENV_LOCAL_JOB})


def launcher_owned(name: str) -> bool:
    return name in LAUNCHER_OWNED_ENV or name.startswith("SLURM_")


@contextlib.contextmanager
def folder_written_whole(out: Path) -> Iterator[Path]:
    """Write a folder (a model) under `<out>.tmp`, renamed to `out` (the old one replaced) once complete:
    a folder under its final name is whole, even where the job was stopped while writing it."""
    tmp = out.with_name(out.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    yield tmp
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)


def compile_cache(runs_dir: str | Path) -> Path:
    """The compiled kernels of every run under runs_dir: torch.compile's inductor and Triton caches
    (TORCHINDUCTOR_CACHE_DIR, where the user has not set it). One folder for the runs folder, not one a
    run: a second run on the machine (or on the cluster's shared filesystem) and a requeued job both find
    what the first start compiled (inductor keys its entries by torch version, GPU and code, so runs can
    share them; on an H100 a second 384-row infer run started in 27 s, the first ~50 s)."""
    return Path(runs_dir).expanduser() / ".compile-cache"


@dataclass(frozen=True)
class RunPaths:
    """Every path of one run dir, derived in one place."""

    run_dir: Path

    @property
    def spec(self) -> Path:
        """The fully resolved spec the ranks run (written by the host before the job starts)."""
        return self.run_dir / "spec.yaml"

    @property
    def plan(self) -> Path:
        return self.run_dir / PLAN_FILE

    @property
    def checkpoints(self) -> Path:
        return self.run_dir / "checkpoints"

    @property
    def logs(self) -> Path:
        return self.run_dir / "logs"

    def gpu_logs(self) -> list[Path]:
        """The GPU monitor's samples: gpu.jsonl (node 0), gpu-node{N}.jsonl (the other nodes)."""
        return sorted(self.run_dir.glob("gpu*.jsonl"))

    def rank_log(self, rank: int) -> Path:
        """The local executor: what one rank printed (SLURM jobs log to slurm-<id>.out/.err); under every
        executor, the Python warnings the rank met (runtime/logsetup.py)."""
        return self.logs / f"rank-{rank}.log"

    @property
    def metrics(self) -> Path:
        return self.run_dir / "metrics.jsonl"

    @property
    def nccl_traces(self) -> Path:
        """NCCL's flight recorder dumps (rank_<N>), written by every rank when a collective times out."""
        return self.run_dir / "nccl-trace"

    @property
    def code(self) -> Path:
        """The code snapshot taken at submit (command, callable): every rank, requeue and resume runs it."""
        return self.run_dir / "code"

    @property
    def provenance(self) -> Path:
        """provenance.json: the commit, dirty or not, the snapshot's source, Python and package versions."""
        return self.run_dir / "provenance.json"

    @property
    def code_diff(self) -> Path:
        """code.diff: `git diff HEAD` of a dirty tree at submit."""
        return self.run_dir / "code.diff"

    @property
    def outputs(self) -> Path:
        """task: infer: one row per input row, in input order (merged at the end)."""
        return self.run_dir / "outputs.jsonl"

    def replica_outputs(self, replica: int) -> Path:
        """task: infer: what one replica wrote, appended batch by batch (resume reads it back)."""
        return self.run_dir / "outputs" / f"replica-{replica}.jsonl"

    def replica_output_files(self) -> list[Path]:
        """task: infer: every replica's outputs (replica_outputs), in replica order."""
        return sorted(self.replica_outputs(0).parent.glob("replica-*.jsonl"))

    @property
    def profile(self) -> Path:
        """train.profile: rank{R}.trace.json and rank{R}.txt of every rank."""
        return self.run_dir / "profile"

    @property
    def failures(self) -> Path:
        return self.run_dir / FAILURES_DIR

    @classmethod
    def in_job(cls, spec_path: Path | None, environ: Mapping[str, str] | None = None) -> "RunPaths":
        """Inside a job: the launcher's HPCGPU_RUN_DIR, else the spec's folder, else here."""
        env = os.environ if environ is None else environ
        given = env.get(ENV_RUN_DIR)
        if given:
            return cls(Path(given))
        return cls(Path(spec_path).resolve().parent if spec_path else Path.cwd())


STEP_RE = re.compile(r"^step-(\d+)$")  # checkpoints/step-N (N zero-padded)


def complete_checkpoints(root: Path) -> list[Path]:
    """The complete step folders under `root` (a run dir's checkpoints/: COMPLETE inside), oldest first;
    a resume takes the newest. Read by the job and, without torch, by the host (status, submit)."""
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        m = STEP_RE.match(p.name)
        if m and (p / COMPLETE_MARKER).is_file():
            found.append((int(m.group(1)), p))
    return [p for _, p in sorted(found)]


def checkpoint_step(path: Path) -> int:
    """checkpoints/step-00000040 -> 40."""
    return int(STEP_RE.match(path.name).group(1))  # type: ignore[union-attr]


def is_finished(run_dir: Path) -> bool:
    return (run_dir / FINISHED_MARKER).exists()


def write_finished(run_dir: Path) -> None:
    (run_dir / FINISHED_MARKER).write_text(time.strftime("%Y-%m-%dT%H:%M:%S") + "\n")


# --- why a rank failed: written by the rank (or the local executor), read by `hpcgpu status` -------


@dataclass(frozen=True)
class Failure:
    """One rank's failure in one attempt (a SLURM job run, counted by SLURM_RESTART_COUNT)."""

    attempt: str  # "<job id>.<restart count>", array tasks "<array job>_<task>.<restart count>"
    rank: int
    node: str
    exit_code: int | None  # the shell's view: killed by signal N -> 128+N
    message: str  # the last error line (an exception's last line), "" when unknown
    time: float

    @property
    def signal_name(self) -> str | None:
        if self.exit_code is None or self.exit_code <= 128:
            return None
        try:
            return signal.Signals(self.exit_code - 128).name
        except ValueError:
            return None

    def describe(self) -> str:
        """One line: 'rank 1 on n2 exited with code 1 (SIGKILL): ValueError: boom'."""
        how = f"exit code {self.exit_code}" if self.exit_code is not None else "an unknown exit"
        if self.signal_name:
            how += f" ({self.signal_name})"
        text = f"rank {self.rank} on {self.node or '?'} failed with {how}"
        return f"{text}: {self.message}" if self.message else text


# what a rank killed by a signal did not say itself (it cannot), keyed by the shell's exit code 128+N
SIGNAL_HINTS = {
    128 + signal.SIGKILL: ("killed by SIGKILL without a word of its own; the kernel's out-of-memory killer is the "
                           "usual cause (dmesg on the node; sacct -j JOB -o MaxRSS where accounting works)"),
    128 + signal.SIGSEGV: "a segmentation fault in native code (a CUDA/NCCL library, a C extension)",
    128 + signal.SIGBUS: "a bus error: often /dev/shm full (DataLoader workers) or a file mapped and truncated",
    128 + signal.SIGABRT: ("aborted (SIGABRT): often torch's NCCL watchdog after a collective timed out "
                           "(distributed.nccl.timeout_s; the rank's log says which)"),
}


def signal_hint(exit_code: int | None) -> str:
    """The likely cause of a death by signal (exit code 128+N), '' for any other end."""
    return SIGNAL_HINTS.get(exit_code or 0, "")


def node_name() -> str:
    """This node as SLURM names it (SLURMD_NODENAME), else the host name: for failure records and lines."""
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname()


def attempt_id(environ: Mapping[str, str] | None = None) -> str:
    """This run of the job: the same in every rank of one start, new after every requeue.

    Without a SLURM (or local executor) job id, one start is one launch: under torchrun (or ranks
    started by hand with WORLD_SIZE) the ranks' parent and rendezvous, a lone `hpcgpu run` its own
    process. A fixed id there would make a second launch in the same folder take the first one's
    failure markers for its own (and say nothing of its error)."""
    env = os.environ if environ is None else environ
    job = env.get(ENV_LOCAL_JOB) or env.get("SLURM_JOB_ID", "")
    if env.get("SLURM_ARRAY_JOB_ID") and env.get("SLURM_ARRAY_TASK_ID"):
        job = f"{env['SLURM_ARRAY_JOB_ID']}_{env['SLURM_ARRAY_TASK_ID']}"
    if job:
        return f"{job}.{env.get('SLURM_RESTART_COUNT') or '0'}"
    if env.get("WORLD_SIZE"):
        launch = "|".join([env.get("TORCHELASTIC_RUN_ID", ""), env.get("MASTER_ADDR", ""),
                           env.get("MASTER_PORT", ""), str(os.getppid())])
        digest = hashlib.sha1(launch.encode()).hexdigest()[:10]
        return f"launch-{digest}.{env.get('TORCHELASTIC_RESTART_COUNT') or '0'}"
    return f"nojob-{os.getpid()}.0"


RESERVE_BYTES = 4096  # a failure record's room, taken when a rank starts: the record fits a full disk


def reserve_path(run_dir: Path, attempt: str, rank: int) -> Path:
    return run_dir / FAILURES_DIR / f".{attempt}.reserve-{rank}"


def reserve_failure_record(run_dir: Path, attempt: str, rank: int) -> None:
    """Room for this rank's failure record, written now: on a disk that fills up later, record_failure
    writes into these blocks instead of new ones (no space is no reason to lose the reason)."""
    path = reserve_path(run_dir, attempt, rank)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b" " * RESERVE_BYTES)
    except OSError:
        pass


def record_failure(run_dir: Path, failure: Failure, overwrite: bool = False) -> None:
    """Write one rank's failure (atomically; a record the rank wrote itself is kept unless overwrite).
    On a full disk the rank's reserved room (reserve_failure_record) takes it."""
    folder = run_dir / FAILURES_DIR
    path = folder / f"{failure.attempt}.rank-{failure.rank}.json"
    if path.exists() and not overwrite:
        return
    body = (json.dumps(asdict(failure)) + "\n").encode()
    tmp = folder / f".{path.name}.tmp{os.getpid()}"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        tmp.write_bytes(body)
        os.replace(tmp, path)
        return
    except OSError:
        tmp.unlink(missing_ok=True)
    reserve = reserve_path(run_dir, failure.attempt, failure.rank)
    try:  # overwritten in place: blocks it already has
        with open(reserve, "r+b") as fh:
            fh.write(body[:RESERVE_BYTES])
            fh.truncate(min(len(body), RESERVE_BYTES))
        os.replace(reserve, path)
    except OSError:
        pass  # reporting must never turn one failure into another


def read_failures(run_dir: Path, attempt: str | None = None) -> list[Failure]:
    """The recorded failures, oldest first; only those of `attempt` when given."""
    out = []
    for path in (run_dir / FAILURES_DIR).glob("*.rank-*.json"):
        try:
            failure = Failure(**json.loads(path.read_text()))
        except (OSError, ValueError, TypeError):
            continue
        if attempt is None or failure.attempt == attempt:
            out.append(failure)
    return sorted(out, key=lambda f: (f.time, f.rank))


def first_failure(run_dir: Path) -> Failure | None:
    """The rank that failed first in the latest attempt that had a failure."""
    failures = read_failures(run_dir)
    if not failures:
        return None
    last_attempt = failures[-1].attempt
    return next(f for f in failures if f.attempt == last_attempt)


# --- a stalled peer: read from the ranks' progress files (runtime/watchdog.py writes them) ---------
PROGRESS_ALIVE_S = 20.0  # a progress file older than this: its rank is gone, not stalled (4 x the check)
EXIT_HUNG = 1  # a rank that made no progress for its hang limit


def stalled_peer(run_dir: Path, attempt: str, rank: int, min_idle_s: float) -> Failure | None:
    """After this rank's collective failed (or it died in one): the peer (of this attempt) that stopped
    making progress outside a collective at least min_idle_s ago while still alive, the longest ago, as
    its failure; None when no peer did. Read by the rank itself (runtime/tasks crashed) and by the local
    executor for a rank that NCCL's watchdog killed (SIGABRT) before it could say so."""
    now = time.time()
    stalled = []
    for path in (run_dir / FAILURES_DIR).glob(f"{attempt}.progress-*.json"):
        try:
            p = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if (p.get("rank") == rank or p.get("in_collective") or now - float(p.get("written", 0)) > PROGRESS_ALIVE_S
                or now - float(p.get("last_progress", now)) < min_idle_s):
            continue
        stalled.append(p)
    if not stalled:
        return None
    p = min(stalled, key=lambda x: float(x["last_progress"]))
    idle = now - float(p["last_progress"])
    return Failure(attempt, int(p["rank"]), str(p.get("node", "")), EXIT_HUNG,
                   f"made no progress for {idle:.0f} s (in {p.get('where', '?')}); rank {rank} timed out waiting "
                   f"for it", float(p["last_progress"]))


def in_collective(run_dir: Path, attempt: str, rank: int) -> bool:
    """Whether the rank's last progress file saw its main thread inside torch.distributed."""
    try:
        return bool(json.loads((run_dir / FAILURES_DIR / f"{attempt}.progress-{rank}.json").read_text())
                    .get("in_collective"))
    except (OSError, ValueError, AttributeError):
        return False


FLIGHT_RECORDER_WAIT_S = 2.0  # NCCL's watchdog writes its dumps a moment after the timeout


def flight_recorder_note(run_dir: Path) -> str:
    """'; NCCL flight recorder dumps in DIR' where ranks dumped their last collectives (a timeout), else ''."""
    folder = RunPaths(run_dir).nccl_traces
    if not folder.is_dir():
        return ""
    deadline = time.monotonic() + FLIGHT_RECORDER_WAIT_S
    while not any(folder.glob("rank_*")) and time.monotonic() < deadline:
        time.sleep(0.2)
    return f"; NCCL flight recorder dumps in {folder}" if any(folder.glob("rank_*")) else ""


# --- which signals reached the batch script (written by it, read by the ranks) --------------------

# SLURM signals the batch script on a preemption, a time limit or scancel, but not when srun tears a
# step down after one task failed; the script appends "<SIG> <epoch>" here for every stop signal.
BATCH_SIGNAL_SHELL = ".batch-signal.${SLURM_JOB_ID}.${SLURM_RESTART_COUNT:-0}"  # as the template writes it


def batch_signal_file(run_dir: Path, environ: Mapping[str, str] | None = None) -> Path:
    env = os.environ if environ is None else environ
    return run_dir / f".batch-signal.{env.get('SLURM_JOB_ID', '')}.{env.get('SLURM_RESTART_COUNT') or '0'}"


def batch_signals(run_dir: Path, environ: Mapping[str, str] | None = None) -> list[str]:
    """The stop signals the batch script of this attempt got, first first ([] if none or no file)."""
    try:
        text = batch_signal_file(run_dir, environ).read_text()
    except OSError:
        return []
    return [line.split()[0] for line in text.splitlines() if line.split()]


# --- a start's "startup" record in metrics.jsonl (written by rank 0, read by `hpcgpu report`) ------
def startup_fields(phases: Mapping[str, float]) -> dict[str, float]:
    """The record's field of each start-up phase: {"process group": 0.1} -> {"process_group_s": 0.1}."""
    return {f"{name.replace(' ', '_')}_s": seconds for name, seconds in phases.items()}


def startup_phases(record: Mapping[str, Any]) -> dict[str, Any]:
    """The phases of a "startup" record, in the order the job wrote them (startup_fields undone)."""
    return {k[:-2].replace("_", " "): v for k, v in record.items() if k.endswith("_s") and k != "total_s"}
