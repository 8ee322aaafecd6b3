"""A local queue: the jobs of a queue file spread over a pool of GPUs on this machine.

Each job is an ordinary `hpcgpu submit SPEC --executor local` (its own run dir, registry record,
logs, resume rules) started with CUDA_VISIBLE_DEVICES set to GPUs that no other job of the queue
holds. Jobs start in file order as soon as enough GPUs are free; a later, smaller job may start
while an earlier, larger one waits (first fit), so a free GPU never idles behind a big job.
Without GPUs (no NVML, no --gpus) the jobs run one after another on the CPU.

Host side: no torch here.
"""
from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Protocol, Sequence

from hpcgpu.contract import EXIT_STOPPED
from hpcgpu.procs import PARENT_PID_VAR

JOB_LINE = re.compile(r"job (\S+) \(local\), run dir (\S+)")


@dataclass(frozen=True)
class QueueEntry:
    """One line of the queue file, checked: the submit arguments and what the job needs."""

    line: int
    argv: tuple[str, ...]  # SPEC [--gpus N] [--set K=V]... [--new], SPEC made absolute
    name: str
    gpus: int
    finished_in: str = ""  # run dir of an identical spec that finished: the line is skipped


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
    def poll(self) -> int | None: ...
    def send(self, sig: int) -> None: ...
    def details(self) -> tuple[str, str, str]: ...  # job id, run dir, last error line


class SubmitProcess:
    """`hpcgpu submit ... --executor local` as a child in its own session (a terminal's Ctrl-C
    reaches the queue only; the queue forwards one signal), its stderr scanned for the job id.
    It dies with the queue (HPCGPU_PARENT_PID, hpcgpu/procs.py), and its ranks with it: start it
    from the thread that runs the queue."""

    def __init__(self, entry: QueueEntry, devices: list[str] | None):
        env = dict(os.environ)
        env[PARENT_PID_VAR] = str(os.getpid())  # the job (and its ranks) ends with the queue
        if devices is not None:
            env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"  # ids mean what nvidia-smi and NVML show
            env["CUDA_VISIBLE_DEVICES"] = ",".join(devices)
        self.job_id = self.run_dir = self.error = ""
        self.proc = subprocess.Popen([sys.executable, "-m", "hpcgpu", "submit", *entry.argv, "--executor", "local"],
                                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                     text=True, env=env, start_new_session=True)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            if m := JOB_LINE.search(line):
                self.job_id, self.run_dir = m.group(1), m.group(2)
            elif line.startswith("hpcgpu: error:") or "Traceback" in line:
                self.error = line.strip()

    def poll(self) -> int | None:
        code = self.proc.poll()
        if code is not None:
            self._reader.join(timeout=5)
        return code

    def send(self, sig: int) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)

    def details(self) -> tuple[str, str, str]:
        return self.job_id, self.run_dir, self.error


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
            self.echo(f"[line {r.entry.line}] {r.entry.name}: started on {where}")
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
