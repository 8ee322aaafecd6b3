"""A local queue: the jobs of a queue file spread over a pool of GPUs on this machine.

Each job is an ordinary local job (its own run dir, registry record, logs, resume rules): the queue
registers it (launch/local_submit.py: run dir and record, so its job id and run dir are known before
it runs) and starts its executor, `python -m hpcgpu.launch.local_submit JOB_ID`, as a child with
CUDA_VISIBLE_DEVICES set to GPUs that no other job of the queue holds; how the job ended is read
back from the registry. Jobs start in file order as soon as enough GPUs are free; a later, smaller
job may start while an earlier, larger one waits (first fit), so a free GPU never idles behind a
big job. Without GPUs (no NVML, no --gpus) the jobs run one after another on the CPU.

The GPUs are read again before each dispatch (GpuWatch): one that someone else uses is skipped
until it has been free in N readings in a row; the GPUs the queue's own jobs hold are not judged
(what runs there is the queue's). A job that fails may be retried (the same line again, which
resumes its unfinished run dir).

Host side: no torch here.
"""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Iterator, NamedTuple, Protocol, Sequence

from hpcgpu.contract import EXIT_STOPPED, RunPaths
from hpcgpu.errors import HpcgpuError
from hpcgpu.gpu.busy import BusyThresholds, busy_reasons, usage_text
from hpcgpu.gpu.readings import GpuReading, GpuSource
from hpcgpu.launch import local_submit
from hpcgpu.launch.executors import refresh
from hpcgpu.launch.progress import stop_summary
from hpcgpu.launch.registry import Registry
from hpcgpu.launch.state import is_final
from hpcgpu.procs import PARENT_PID_VAR
from hpcgpu.spec import Spec

LAUNCHER_LOG = "launcher.log"  # <run dir>/logs/: a queued job's executor's own messages (its stderr)


@dataclass(frozen=True)
class QueueEntry:
    """One job of the queue file, checked: its resolved spec (read once) and what the job needs."""

    line: int
    argv: tuple[str, ...]  # what the line amounts to, as `hpcgpu submit` arguments (shown by --dry-run)
    name: str
    gpus: int
    finished_in: str = ""  # run dir of an identical spec that finished: the line is skipped
    spec: Spec | None = field(default=None, compare=False, repr=False)
    spec_ref: str = ""  # the spec file, as the registry records it
    fresh: bool = False  # --new: always a fresh run dir


@dataclass
class QueueResult:
    entry: QueueEntry
    devices: list[str] = field(default_factory=list)
    exit_code: int | None = None  # None: not started; else the last attempt's
    job_id: str = ""
    run_dir: str = ""
    seconds: float = 0.0  # all attempts together
    error: str = ""
    attempts: int = 0
    failures: list[str] = field(default_factory=list)  # "attempt 1: <why>", one per failed attempt
    gpu_labels: list[str] = field(default_factory=list)  # the table's: "1:GPU-1f0c2a7e" (index, short UUID)
    cancelled: bool = False  # the registry says CANCELLED (`hpcgpu cancel`, once or twice): not a failure

    @property
    def state(self) -> str:
        if self.entry.finished_in and self.exit_code is None:
            return "SKIPPED"
        if self.exit_code is None:
            return "NOT STARTED"
        if self.cancelled and self.exit_code != 0:
            return "CANCELLED"
        # exit 75, stopped at a checkpoint: the registry's (and `list`'s) word for it
        return {0: "COMPLETED", EXIT_STOPPED: "PREEMPTED"}.get(self.exit_code, "FAILED")


class JobEnd(NamedTuple):
    job_id: str
    run_dir: str
    error: str  # why it failed ("" if unknown)
    state: str = ""  # the registry's (CANCELLED: `hpcgpu cancel`, never retried)


class Running(Protocol):
    def started(self) -> str: ...  # for the line saying the job started: ", job local-3" or ""
    def poll(self) -> int | None: ...
    def send(self, sig: int) -> None: ...
    def details(self) -> JobEnd: ...


class LocalJob:
    """One queued job: registered here (run dir, record), its executor a child in its own session
    (a terminal's Ctrl-C reaches the queue only; the queue forwards one signal). The executor dies
    with the queue (HPCGPU_PARENT_PID, hpcgpu/procs.py), and its ranks with it: start it from the
    thread that runs the queue."""

    def __init__(self, entry: QueueEntry, devices: list[str] | None, registry: Registry):
        assert entry.spec is not None
        env = dict(os.environ)
        env[PARENT_PID_VAR] = str(os.getpid())  # the job (and its ranks) ends with the queue
        if devices is not None:
            env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"  # ids mean what nvidia-smi and NVML show
            env["CUDA_VISIBLE_DEVICES"] = ",".join(devices)
        self.registry = registry
        self.record, self.resumed = local_submit.register(entry.spec, entry.spec_ref, registry, fresh=entry.fresh,
                                                          environ=env)
        logs = RunPaths(Path(self.record.run_dir)).logs
        logs.mkdir(parents=True, exist_ok=True)
        try:
            with open(logs / LAUNCHER_LOG, "a") as log:
                self.proc = subprocess.Popen(
                    [sys.executable, "-m", "hpcgpu.launch.local_submit", self.record.job_id],
                    stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,  # rank 0's output: logs/rank-0.log
                    stderr=log, env=env, start_new_session=True)
        except OSError as exc:
            registry.update(self.record, state="FAILED", reason=f"cannot start the local executor: {exc}",
                            ended=time.time())
            raise HpcgpuError(self.record.reason) from None
        local_submit.executor_started(registry, self.record, self.proc.pid)

    def started(self) -> str:
        return f", job {self.record.job_id}" + (f", resuming {self.record.run_dir}" if self.resumed else "")

    def poll(self) -> int | None:
        return self.proc.poll()

    def send(self, sig: int) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)

    def details(self) -> JobEnd:
        """From the registry: how the executor recorded the job's end (or, had it no chance to, that
        it ended without a word)."""
        record, _ = self.registry.find(self.record.job_id)
        if not is_final(record.state):
            refresh(self.registry, [record])
        error = record.reason if record.state not in ("COMPLETED", "PREEMPTED") else ""
        return JobEnd(record.job_id, record.run_dir, error, record.state)


class NotStarted:
    """A job whose registration failed (a runs_dir that cannot hold its run dir): one line, exit 2."""

    def __init__(self, error: HpcgpuError):
        self.error, self.code = str(error), error.exit_code

    def started(self) -> str:
        return ""

    def poll(self) -> int | None:
        return self.code

    def send(self, sig: int) -> None:
        pass

    def details(self) -> JobEnd:
        return JobEnd("", "", self.error, "FAILED")


def local_starter(registry: Registry) -> "Starter":
    """How the queue starts a job: register it and start its executor (LocalJob)."""
    def start(entry: QueueEntry, devices: list[str] | None) -> Running:
        try:
            return LocalJob(entry, devices, registry)
        except HpcgpuError as exc:
            return NotStarted(exc)

    return start


Starter = Callable[[QueueEntry, "list[str] | None"], Running]


class GpuWatch:
    """Which GPUs of the pool others leave free, read from NVML (or a recording) before each dispatch.

    A GPU is usable while its last `free_checks` readings found it free (busy rules: busy.py); one
    free in the first reading is usable at once, as the pool has always taken it. A busy reading
    starts the count again, so a GPU between two of someone's jobs is not grabbed. GPUs the queue's
    own jobs hold are not judged: the processes there are the queue's.
    """

    def __init__(self, source: GpuSource, thresholds: BusyThresholds, free_checks: int,
                 first: Sequence[GpuReading]):
        self.source, self.th, self.free_checks = source, thresholds, free_checks
        self.free_in_a_row = {str(r.index): 0 if busy_reasons(r, thresholds) else free_checks for r in first}
        self.first_unused = True  # the first reading is the one the pool was chosen by: the first dispatch's
        self.failed = False

    def usable(self, gpu: str) -> bool:
        return self.free_in_a_row.get(gpu, 0) >= self.free_checks

    def look(self, held: set[str], echo: Callable[[str], None]) -> None:
        """Read the GPUs and count, for each one no job of ours holds, its free readings in a row."""
        if self.first_unused:
            self.first_unused = False
            return
        try:
            readings = {str(r.index): r for r in self.source.read(processes=True)}
        except Exception as exc:  # a driver hiccup must not take the running jobs down with the queue
            if not self.failed:
                echo(f"queue: reading the GPUs failed ({exc}); going on with the last reading")
            self.failed = True
            return
        for gpu in self.free_in_a_row:
            if gpu not in held:
                self._count(gpu, readings.get(gpu), echo)

    def _count(self, gpu: str, reading: GpuReading | None, echo: Callable[[str], None]) -> None:
        reasons = ["not in the reading"] if reading is None else busy_reasons(reading, self.th)
        was_usable = self.usable(gpu)
        if reasons:
            self.free_in_a_row[gpu] = 0
            if was_usable:
                echo(f"queue: GPU {gpu} busy: {', '.join(reasons)}" + (f"; {usage_text(reading)}" if reading else "")
                     + f"; not used until free in {self.free_checks} readings in a row")
            return
        self.free_in_a_row[gpu] += 1
        if not was_usable and self.usable(gpu):
            echo(f"queue: GPU {gpu} free in {self.free_checks} readings in a row: back in the pool")


class GpuPool:
    """GPU ids handed to one job at a time; None for a CPU-only machine (one job at a time).
    With a watch, only GPUs it finds usable are handed out; `info` names the GPUs (from NVML)."""

    def __init__(self, ids: Sequence[str] | None, watch: GpuWatch | None = None,
                 info: dict[str, GpuReading] | None = None):
        self.ids = list(ids) if ids is not None else None
        self.free = list(self.ids or [])
        self.cpu_busy = False
        self.watch, self.info = watch, info or {}

    def ready(self) -> list[str]:
        """The free GPUs a job may get now (free: no job of ours holds it; usable: others leave it free)."""
        return [d for d in self.free if self.watch is None or self.watch.usable(d)]

    def look(self, echo: Callable[[str], None]) -> None:
        """Read the GPUs again (with a watch): what others do may have changed since the last dispatch."""
        if self.watch is not None and self.ids is not None:
            self.watch.look({d for d in self.ids if d not in self.free}, echo)

    def take(self, n: int) -> list[str] | None:
        if self.ids is None:
            if self.cpu_busy:
                return None
            self.cpu_busy = True
            return []
        ready = self.ready()
        if len(ready) < n:
            return None
        got = ready[:n]
        self.free = [d for d in self.free if d not in got]
        return got

    def give(self, devices: list[str]) -> None:
        if self.ids is None:
            self.cpu_busy = False
            return
        self.free = [d for d in self.ids if d in self.free or d in devices]  # back in pool order

    def describe(self, devices: list[str]) -> str:
        """For the line saying a job started: 'GPU 1 (NVIDIA H100 80GB HBM3, GPU-1f0c...)' or 'GPU 0,1'."""
        if not devices:
            return "the CPU"
        if not all(d in self.info for d in devices):
            return f"GPU {','.join(devices)}"
        return ", ".join(f"GPU {d} ({self.info[d].name}, {self.info[d].uuid})" for d in devices)

    def labels(self, devices: list[str]) -> list[str]:
        """For the summary table: index and short UUID ('1:GPU-1f0c2a7e'), or the index alone."""
        return [f"{d}:{self.info[d].uuid[:12]}" if d in self.info else d for d in devices]


@dataclass
class Started:
    result: QueueResult
    job: Running
    devices: list[str]
    t0: float


class Queue:
    """Runs entries over a pool until all have ended; SIGINT/SIGTERM stop starting new jobs and
    are forwarded to the running ones (which checkpoint and exit 75). A failed job goes back to
    the waiting ones while it has retries left."""

    def __init__(self, entries: Sequence[QueueEntry], pool: GpuPool, start: Starter,
                 echo: Callable[[str], None], poll_s: float = 0.2, retries: int = 0):
        self.results = [QueueResult(e) for e in entries]
        self.pool, self.start, self.echo, self.poll_s, self.retries = pool, start, echo, poll_s, retries
        self.stopping = 0  # the signal that asked us to stop, 0 while running
        self.running: list[Started] = []

    def run(self) -> list[QueueResult]:
        waiting = [r for r in self.results if not r.entry.finished_in]
        for r in self.results:
            if r.entry.finished_in:
                self.echo(f"[line {r.entry.line}] {r.entry.name}: finished earlier in {r.entry.finished_in}; "
                          "skipped (--new on the line runs it again)")
        with self._signals_forwarded():
            while True:
                if waiting and not self.stopping:
                    self.pool.look(self.echo)  # before each dispatch: the GPUs as they are now
                    waiting = self._start_fitting(waiting)
                if not self.running and (not waiting or self.stopping):
                    break
                if not self.running and self.pool.watch is None:  # the CLI checks every job fits the pool
                    raise RuntimeError(f"queue stalled: line {waiting[0].entry.line} fits no free GPUs")
                time.sleep(self.poll_s)
                due = {id(r) for r in waiting + self._reap()}  # by identity: two lines may read alike
                waiting = [r for r in self.results if id(r) in due]  # file order, retries in their place
        return self.results

    def _start_fitting(self, waiting: list[QueueResult]) -> list[QueueResult]:
        left = []
        for r in waiting:
            devices = self.pool.take(r.entry.gpus)
            if devices is None:
                left.append(r)
                continue
            r.attempts += 1
            # a retry resumes the run dir the failed attempt left, even for a --new line
            entry = r.entry if r.attempts == 1 else replace(r.entry, fresh=False)
            job = self.start(entry, devices if self.pool.ids is not None else None)
            r.devices, r.gpu_labels = devices, self.pool.labels(devices)
            attempt = f" (attempt {r.attempts} of {self.retries + 1})" if r.attempts > 1 else ""
            self.echo(f"[line {r.entry.line}] {r.entry.name}: started{attempt} on {self.pool.describe(devices)}"
                      f"{job.started()}")
            self.running.append(Started(r, job, devices, time.monotonic()))
        return left

    def _reap(self) -> list[QueueResult]:
        """Record the jobs that ended and give their GPUs back; returns the failed ones to retry."""
        still, again = [], []
        for run in self.running:
            code = run.job.poll()
            if code is None:
                still.append(run)
                continue
            r, seconds, end = run.result, time.monotonic() - run.t0, run.job.details()
            r.exit_code, r.job_id, r.run_dir, r.error = code, end.job_id, end.run_dir, end.error
            r.cancelled = end.state == "CANCELLED"
            r.seconds += seconds
            self.pool.give(run.devices)
            if r.state == "FAILED":
                r.failures.append(f"attempt {r.attempts}: {r.error or f'exit code {code}'}")
            retry = r.state == "FAILED" and r.attempts <= self.retries and not self.stopping
            self.echo(self._ended_line(r, seconds, retry))
            if retry:
                again.append(r)
        self.running = still
        return again

    def _ended_line(self, r: QueueResult, seconds: float, retry: bool) -> str:
        if r.state == "PREEMPTED":
            how = stop_summary(r.run_dir) if r.run_dir else "stopped at a checkpoint"
        else:
            how = {"COMPLETED": "finished", "CANCELLED": f"cancelled ({r.error or 'hpcgpu cancel'})"}.get(
                r.state, f"failed (exit {r.exit_code})")
        line = (f"[line {r.entry.line}] {r.entry.name}: {how} in {seconds:.1f} s; job {r.job_id or '?'}, "
                f"run dir {r.run_dir or '?'}" + (f"; {r.error}" if r.state == "FAILED" and r.error else ""))
        return line + (f"; retrying (attempt {r.attempts + 1} of {self.retries + 1})" if retry else "")

    @contextlib.contextmanager
    def _signals_forwarded(self) -> Iterator[None]:
        """SIGINT/SIGTERM start nothing new and reach the running jobs (as SIGTERM for a Ctrl-C)."""
        def handler(sig: int, _frame: object) -> None:
            if not self.stopping:
                self.echo(f"queue: {signal.Signals(sig).name}: no new jobs; the running ones stop at a checkpoint")
            self.stopping = sig
            for run in self.running:
                run.job.send(signal.SIGTERM if sig == signal.SIGINT else sig)

        saved = {}
        if threading.current_thread() is threading.main_thread():
            saved = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, old in saved.items():
                signal.signal(sig, old)


def exit_code(results: Sequence[QueueResult]) -> int:
    """0 all done; 1 a job failed; 75 stopped, cancelled or left unstarted (run the queue again to go on)."""
    states = {r.state for r in results}
    if "FAILED" in states:
        return 1
    if states & {"PREEMPTED", "CANCELLED", "NOT STARTED"}:
        return EXIT_STOPPED
    return 0


def summary_rows(results: Sequence[QueueResult]) -> list[tuple[str, ...]]:
    """One row per job; REASON (last: it has spaces) is its latest failure, 'attempt N: why'."""
    rows: list[tuple[str, ...]] = [("LINE", "NAME", "GPUS", "STATE", "EXIT", "TRIES", "SECONDS", "JOB", "RUN DIR",
                                    "REASON")]
    for r in results:
        rows.append((str(r.entry.line), r.entry.name, ",".join(r.gpu_labels) or "-", r.state,
                     "-" if r.exit_code is None else str(r.exit_code), str(r.attempts) if r.attempts else "-",
                     f"{r.seconds:.1f}" if r.seconds else "-", r.job_id or "-",
                     r.run_dir or r.entry.finished_in or "-", r.failures[-1] if r.failures else "-"))
    return rows


def queue_file_lines(path: Path) -> list[tuple[int, str]]:
    """(line number, text) of the lines that name a job: blank lines and # comments dropped."""
    out = []
    for no, raw in enumerate(path.read_text().splitlines(), start=1):
        text = raw.split(" #", 1)[0].strip() if not raw.lstrip().startswith("#") else ""
        if text:
            out.append((no, text))
    return out
