"""A local queue: the jobs of a queue file spread over a pool of GPUs on this machine.

Each job is an ordinary local job (its own run dir, registry record, logs, resume rules): the queue
registers it (launch/local_submit.py: run dir and record, so its job id and run dir are known before
it runs) and starts its executor, `python -m hpcgpu.launch.local_submit JOB_ID`, as a child with
CUDA_VISIBLE_DEVICES set to GPUs that no other job of the queue holds; how the job ended is read
back from the registry. Jobs start in file order as soon as enough GPUs are free; a later, smaller
job may start while an earlier, larger one waits (first fit), so a free GPU never idles behind a
big job. Without GPUs (no NVML, no --gpus) the jobs run one after another on the CPU.

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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Protocol, Sequence

from hpcgpu.contract import EXIT_STOPPED, RunPaths
from hpcgpu.errors import HpcgpuError
from hpcgpu.launch.registry import Registry
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
    exit_code: int | None = None  # None: not started
    job_id: str = ""
    run_dir: str = ""
    seconds: float = 0.0
    error: str = ""

    @property
    def state(self) -> str:
        if self.entry.finished_in and self.exit_code is None:
            return "SKIPPED"
        if self.exit_code is None:
            return "NOT STARTED"
        return {0: "COMPLETED", EXIT_STOPPED: "STOPPED"}.get(self.exit_code, "FAILED")


class Running(Protocol):
    def started(self) -> str: ...  # for the line saying the job started: ", job local-3" or ""
    def poll(self) -> int | None: ...
    def send(self, sig: int) -> None: ...
    def details(self) -> tuple[str, str, str]: ...  # job id, run dir, why it failed ("" if unknown)


class LocalJob:
    """One queued job: registered here (run dir, record), its executor a child in its own session
    (a terminal's Ctrl-C reaches the queue only; the queue forwards one signal). The executor dies
    with the queue (HPCGPU_PARENT_PID, hpcgpu/procs.py), and its ranks with it: start it from the
    thread that runs the queue."""

    def __init__(self, entry: QueueEntry, devices: list[str] | None, registry: Registry):
        from hpcgpu.launch import local_submit

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

    def details(self) -> tuple[str, str, str]:
        """From the registry: how the executor recorded the job's end (or, had it no chance to, that
        it ended without a word)."""
        from hpcgpu.launch.jobs import is_final, refresh

        record, _ = self.registry.find(self.record.job_id)
        if not is_final(record.state):
            refresh(self.registry, [record])
        error = record.reason if record.state not in ("COMPLETED", "PREEMPTED") else ""
        return record.job_id, record.run_dir, error


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

    def details(self) -> tuple[str, str, str]:
        return "", "", self.error


def local_starter(registry: Registry) -> "Starter":
    """How the queue starts a job: register it and start its executor (LocalJob)."""
    def start(entry: QueueEntry, devices: list[str] | None) -> Running:
        try:
            return LocalJob(entry, devices, registry)
        except HpcgpuError as exc:
            return NotStarted(exc)

    return start


Starter = Callable[[QueueEntry, "list[str] | None"], Running]


class GpuPool:
    """GPU ids handed to one job at a time; None for a CPU-only machine (one job at a time)."""

    def __init__(self, ids: Sequence[str] | None):
        self.ids = list(ids) if ids is not None else None
        self.free = list(self.ids or [])
        self.cpu_busy = False

    def take(self, n: int) -> list[str] | None:
        if self.ids is None:
            if self.cpu_busy:
                return None
            self.cpu_busy = True
            return []
        if len(self.free) < n:
            return None
        got, self.free = self.free[:n], self.free[n:]
        return got

    def give(self, devices: list[str]) -> None:
        if self.ids is None:
            self.cpu_busy = False
            return
        self.free = [d for d in self.ids if d in self.free or d in devices]  # back in pool order


class Queue:
    """Runs entries over a pool until all have ended; SIGINT/SIGTERM stop starting new jobs and
    are forwarded to the running ones (which checkpoint and exit 75)."""

    def __init__(self, entries: Sequence[QueueEntry], pool: GpuPool, start: Starter,
                 echo: Callable[[str], None], poll_s: float = 0.2):
        self.results = [QueueResult(e) for e in entries]
        self.pool, self.start, self.echo, self.poll_s = pool, start, echo, poll_s
        self.stopping = 0  # the signal that asked us to stop, 0 while running
        self.running: list[tuple[QueueResult, Running, list[str], float]] = []

    def run(self) -> list[QueueResult]:
        waiting = [r for r in self.results if not r.entry.finished_in]
        for r in self.results:
            if r.entry.finished_in:
                self.echo(f"[line {r.entry.line}] {r.entry.name}: finished earlier in {r.entry.finished_in}; "
                          "skipped (--new on the line runs it again)")
        with self._signals_forwarded():
            while True:
                if not self.stopping:
                    waiting = self._start_fitting(waiting, self.running)
                if not self.running:
                    if waiting and not self.stopping:  # the CLI checks every job fits the pool
                        raise RuntimeError(f"queue stalled: line {waiting[0].entry.line} fits no free GPUs")
                    break
                time.sleep(self.poll_s)
                self.running = self._reap(self.running)
        return self.results

    def _start_fitting(self, waiting: list[QueueResult], running: list) -> list[QueueResult]:
        left = []
        for r in waiting:
            devices = self.pool.take(r.entry.gpus)
            if devices is None:
                left.append(r)
                continue
            job = self.start(r.entry, devices if self.pool.ids is not None else None)
            r.devices = devices
            where = f"GPU {','.join(devices)}" if devices else "the CPU"
            self.echo(f"[line {r.entry.line}] {r.entry.name}: started on {where}{job.started()}")
            running.append((r, job, devices, time.monotonic()))
        return left

    def _reap(self, running: list) -> list:
        still = []
        for r, job, devices, t0 in running:
            code = job.poll()
            if code is None:
                still.append((r, job, devices, t0))
                continue
            r.exit_code, r.seconds = code, time.monotonic() - t0
            r.job_id, r.run_dir, r.error = job.details()
            self.pool.give(devices)
            how = {"COMPLETED": "finished", "STOPPED": "stopped at a checkpoint"}.get(r.state, f"failed (exit {code})")
            self.echo(f"[line {r.entry.line}] {r.entry.name}: {how} in {r.seconds:.1f} s; job {r.job_id or '?'}, "
                      f"run dir {r.run_dir or '?'}" + (f"; {r.error}" if r.state == "FAILED" and r.error else ""))
        return still

    @contextlib.contextmanager
    def _signals_forwarded(self) -> Iterator[None]:
        """SIGINT/SIGTERM start nothing new and reach the running jobs (as SIGTERM for a Ctrl-C)."""
        def handler(sig: int, _frame: object) -> None:
            if not self.stopping:
                self.echo(f"queue: {signal.Signals(sig).name}: no new jobs; the running ones stop at a checkpoint")
            self.stopping = sig
            for _, job, _, _ in self.running:
                job.send(signal.SIGTERM if sig == signal.SIGINT else sig)

        saved = {}
        if threading.current_thread() is threading.main_thread():
            saved = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, old in saved.items():
                signal.signal(sig, old)


def exit_code(results: Sequence[QueueResult]) -> int:
    """0 all done; 1 a job failed; 75 stopped or left unstarted (run the queue again to go on)."""
    states = {r.state for r in results}
    if "FAILED" in states:
        return 1
    if states & {"STOPPED", "NOT STARTED"}:
        return EXIT_STOPPED
    return 0


def summary_rows(results: Sequence[QueueResult]) -> list[tuple[str, ...]]:
    rows: list[tuple[str, ...]] = [("LINE", "NAME", "GPUS", "STATE", "EXIT", "SECONDS", "JOB", "RUN DIR")]
    for r in results:
        rows.append((str(r.entry.line), r.entry.name, ",".join(r.devices) or "-", r.state,
                     "-" if r.exit_code is None else str(r.exit_code), f"{r.seconds:.1f}" if r.seconds else "-",
                     r.job_id or "-", r.run_dir or r.entry.finished_in or "-"))
    return rows


def queue_file_lines(path: Path) -> list[tuple[int, str]]:
    """(line number, text) of the lines that name a job: blank lines and # comments dropped."""
    out = []
    for no, raw in enumerate(path.read_text().splitlines(), start=1):
        text = raw.split(" #", 1)[0].strip() if not raw.lstrip().startswith("#") else ""
        if text:
            out.append((no, text))
    return out
