"""The job's stop signals: the one module that installs their handlers, in every task.

A handler only remembers (never works in a handler): the rank acts at its next safe point, where the
ranks agree (runtime/agree.py). Two phases:
- `catch_early_signals`, installed by `hpcgpu run` before any heavy import (the spec is not read yet):
  a preemption signal two seconds into a job would otherwise kill the rank (the default action of
  SIGUSR2 and SIGTERM) with no checkpoint and no requeue. It remembers every candidate signal.
- `StopSignals.install`, once the spec says which signals stop the job (`stop_signals`): takes over
  the spec's signals (one that came early counts as received), gives the others back (honouring one
  that came early: a SIGHUP during start-up still ends the rank, as it would have without us).
Only the standard library and the run contract are imported, so that `hpcgpu run` installs the early
handlers within milliseconds of starting (importing the spec took 0.4 s: a USR2 in that window killed
the rank); the command task, which never loads torch, uses this module too.
"""
from __future__ import annotations

import os
import signal
import time
from types import FrameType
from typing import Callable

from hpcgpu.contract import ENV_PENDING_SIGNAL
from hpcgpu.stopwindow import StopWindow

# every signal a spec may name as its preemption signal, plus SIGTERM/SIGINT (the spec is not read yet)
CANDIDATES = ("TERM", "INT", "USR1", "USR2", "XCPU", "HUP", "QUIT", "ALRM")

_early: list[tuple[int, float]] = []


def _remember(signum: int, frame: FrameType | None) -> None:
    _early.append((signum, time.time()))


def catch_early_signals() -> None:
    """Remember, instead of dying of, every candidate stop signal from now on."""
    for name in CANDIDATES:
        signum = getattr(signal, f"SIG{name}", None)
        if signum is not None and signal.getsignal(signum) in (signal.SIG_DFL, signal.default_int_handler):
            signal.signal(signum, _remember)
    # the batch script got a stop signal before srun started this rank
    pending = getattr(signal, f"SIG{os.environ.get(ENV_PENDING_SIGNAL, '')}", None)
    if isinstance(pending, signal.Signals) and not _early:
        _early.append((int(pending), time.time()))


def _release_others(wanted: list[int]) -> None:
    for name in CANDIDATES:
        signum = getattr(signal, f"SIG{name}", None)
        if signum is None or signum in wanted or signal.getsignal(signum) is not _remember:
            continue
        signal.signal(signum, signal.default_int_handler if signum == signal.SIGINT else signal.SIG_DFL)
        if any(s == signum for s, _ in _early):
            signal.raise_signal(signum)


def stop_signals(preemption: str | None) -> list[int]:
    """SIGTERM, SIGINT and the spec's preemption signal (its name in slurm.signal, e.g. USR2)."""
    names = {"TERM", "INT"}
    if preemption is not None:
        names.add(preemption)
    return sorted({getattr(signal, f"SIG{n}") for n in names if hasattr(signal, f"SIG{n}")})


class StopSignals:
    """This rank's stop signals. signum/when: the first one (it tells why the job stops), also one that
    came during start-up (`early`); received: each signal the handler saw, once (under `scancel --full`
    one reaches a rank from SLURM and from the batch script), but for one of another kind that came
    within the window of the stop under way (StopWindow: `timeout`, a shell or srun relaying one
    person's stop): a copy of it. on_signal: called for each new one (the command task hands it to its
    program); it must be as light as a handler may be."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self.when: float | None = None
        self.early = False
        self.received: list[int] = []
        self.on_signal: Callable[[int], None] | None = None
        self._previous: dict[int, object] = {}
        self._window = StopWindow()

    def install(self, signums: list[int], on_signal: Callable[[int], None] | None = None) -> None:
        self.on_signal = on_signal
        for signum in signums:
            self._previous[signum] = signal.signal(signum, self._handle)
        _release_others(signums)
        came = next(((s, t) for s, t in _early if s in signums), None)
        if came is not None and self.signum is None:
            # it came while the rank was starting: acted on at the first safe point
            (self.signum, self.when), self.early = came, True

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if signum in self.received or not self._window.is_new():
            return
        self.received.append(signum)
        if self.signum is None:  # the first signal tells why we stop
            self.signum, self.when = signum, time.time()
        if self.on_signal is not None:
            self.on_signal(signum)

    def restore(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)  # type: ignore[arg-type]
        self._previous.clear()
        self.on_signal = None

    @property
    def is_set(self) -> bool:
        return self.signum is not None
