"""The progress watchdog of every rank: a rank that makes no progress is named, with where it was.

Progress is a beat: an optimizer step (runtime/training.py), a batch from ctx.data_loader, a finished
checkpoint save, an inference batch, or `ctx.heartbeat()` in the user's own loop. A daemon thread
checks every CHECK_S:

- It writes the rank's progress file, failures/<attempt>.progress-<rank>.json: the wall time of the
  last beat and where the main thread is now (function, file:line; whether inside torch.distributed).
  A peer whose collective timed out reads them (stalled_peer) and names the rank that stopped making
  progress outside a collective, instead of itself: waiting for a stalled rank is not the failure.
- A rank with no beat for its limit prints its threads' stacks (faulthandler) into its log, records the failure ("rank 1 on n2 made no
  progress for 300 s (in save at checkpoint.py:139)", timed at its last beat: it failed when it
  stalled) and exits EXIT_HUNG, which ends the job as a crash (not requeued unless slurm.max_retries).
  The limit: distributed.hang_timeout_s, FIRST_FACTOR times that before the first beat (loading,
  compiling). Left null: max(FLOOR_S, STEP_FACTOR x the median time between beats), armed once
  ARM_BEATS beats have shown the rank's pace: a loop of the user's own that saves once an hour is
  never cut at 5 minutes. Checkpoint saves and loads (`slow`) get SLOW_FACTOR times the limit.
"""
from __future__ import annotations

import contextlib
import faulthandler
import json
import os
import statistics
import sys
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any, Callable, Iterator

from hpcgpu.contract import (EXIT_HUNG, FAILURES_DIR, PROGRESS_ALIVE_S, Failure, record_failure,
                             reserve_failure_record, reserve_path)

CHECK_S = 5.0  # how often the thread looks (and rewrites the progress file: shared filesystems)
FLOOR_S = 300.0  # the derived limit is never shorter
STEP_FACTOR = 20  # the derived limit: this many median beat intervals
FIRST_FACTOR = 3  # before the first beat: start-up, loading, compiling
ARM_BEATS = 3  # beats before a derived limit applies
SLOW_FACTOR = 4  # a checkpoint's save or load: this many limits
ALIVE_S = PROGRESS_ALIVE_S  # a progress file older than this: its rank is gone, not stalled

_current: "Watchdog | None" = None


def beat() -> None:
    """Progress in this rank (no-op without a watchdog): one monotonic read and a counter."""
    if _current is not None:
        _current.beat()


@contextlib.contextmanager
def slow(factor: float = SLOW_FACTOR) -> Iterator[None]:
    """A stretch without beats that may take longer than a step (a checkpoint's save or load)."""
    dog = _current
    if dog is None:
        yield
        return
    before = dog.factor
    dog.factor = before * factor
    try:
        yield
    finally:
        dog.factor = before
        dog.beat()


def where(frame: Any) -> tuple[str, bool]:
    """'function at file:line' of the innermost frame outside the standard library and site-packages
    (the user's code or hpcgpu's), and whether the stack is inside torch.distributed (waiting for peers)."""
    frames = []
    while frame is not None:
        frames.append(frame)
        frame = frame.f_back
    files = [f.f_code.co_filename for f in frames]
    in_collective = any(f"torch{os.sep}distributed{os.sep}" in name for name in files)
    stdlib = os.path.dirname(os.__file__)
    own = next((f for f in frames if "site-packages" not in f.f_code.co_filename
                and not f.f_code.co_filename.startswith(stdlib) and not f.f_code.co_filename.startswith("<")
                and not f.f_code.co_filename.endswith("watchdog.py")),
               frames[0] if frames else None)
    if own is None:
        return "?", in_collective
    return f"{own.f_code.co_name} at {os.path.basename(own.f_code.co_filename)}:{own.f_lineno}", in_collective


class Watchdog:
    def __init__(self, run_dir: Path, attempt: str, rank: int, node: str, timeout_s: float | None,
                 on_fire: Callable[[], object] | None = None):
        self.run_dir, self.attempt, self.rank, self.node = run_dir, attempt, rank, node
        self.on_fire = on_fire  # before the exit: a requeue where slurm.max_retries asks for one
        self.timeout_s = timeout_s
        self.factor = 1.0
        self.beats = 0
        self.last = time.monotonic()
        self.last_wall = time.time()
        self.intervals: deque[float] = deque(maxlen=64)
        self.main = threading.main_thread()
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, name="hpcgpu-watchdog", daemon=True)
        self.progress_path = run_dir / FAILURES_DIR / f"{attempt}.progress-{rank}.json"

    def beat(self) -> None:
        now = time.monotonic()
        if self.beats:
            self.intervals.append(now - self.last)
        self.beats += 1
        self.last, self.last_wall = now, time.time()

    def limit(self) -> float:
        """Seconds without a beat before the rank is called stalled (inf: not armed yet)."""
        if self.timeout_s is not None:
            base = float(self.timeout_s) * (FIRST_FACTOR if self.beats == 0 else 1)
        elif self.beats >= ARM_BEATS:
            base = max(FLOOR_S, STEP_FACTOR * statistics.median(self.intervals))
        else:
            return float("inf")
        return base * self.factor

    def start(self) -> "Watchdog":
        global _current
        _current = self
        reserve_failure_record(self.run_dir, self.attempt, self.rank)  # the reason fits a disk that fills up
        self.thread.start()
        return self

    def stop(self) -> None:
        global _current
        if _current is self:
            _current = None
        self.done.set()
        for path in (self.progress_path, reserve_path(self.run_dir, self.attempt, self.rank)):
            try:
                path.unlink()
            except OSError:
                pass

    def _run(self) -> None:
        while not self.done.wait(CHECK_S):
            idle = time.monotonic() - self.last
            spot, in_collective = self.main_where()
            self.write_progress(spot, in_collective)
            if idle > self.limit() and not self.done.is_set():
                self.fire(idle, spot)

    def main_where(self) -> tuple[str, bool]:
        frame = sys._current_frames().get(self.main.ident or -1)
        return where(frame) if frame is not None else ("?", False)

    def write_progress(self, spot: str, in_collective: bool) -> None:
        body = {"rank": self.rank, "node": self.node, "beats": self.beats, "last_progress": self.last_wall,
                "written": time.time(), "where": spot, "in_collective": in_collective}
        try:
            self.progress_path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.progress_path.with_name(f".{self.progress_path.name}.tmp")
            tmp.write_text(json.dumps(body))
            os.replace(tmp, self.progress_path)
        except OSError:
            pass  # a full or read-only disk must not turn into another failure here

    def fire(self, idle: float, spot: str) -> None:
        message = f"made no progress for {idle:.0f} s (in {spot})"
        print(f"hpcgpu: rank {self.rank} on {self.node} {message}; the stacks of its threads:",
              file=sys.stderr, flush=True)
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        sys.stderr.flush()
        record_failure(self.run_dir, Failure(self.attempt, self.rank, self.node, EXIT_HUNG, message, self.last_wall))
        try:
            if self.on_fire is not None:
                self.on_fire()
        finally:
            os._exit(EXIT_HUNG)
