"""Stop signals that arrive while a rank is still starting (before torch, the spec, the task).

`hpcgpu run` installs this first, before any heavy import: a preemption signal two seconds into a
job would otherwise kill the rank (the default action of SIGUSR2 and SIGTERM) with no checkpoint and
no requeue. Signals are only remembered here; the task's stop flag takes them over once it exists.
Only the standard library (and the run contract) is imported, so installing costs microseconds.
"""
from __future__ import annotations

import os
import signal
import time
from types import FrameType

from hpcgpu.contract import ENV_PENDING_SIGNAL

# every signal a spec may name as its preemption signal, plus SIGTERM/SIGINT (the spec is not read yet)
CANDIDATES = ("TERM", "INT", "USR1", "USR2", "XCPU", "HUP", "QUIT", "ALRM")

_received: list[tuple[int, float]] = []


def _remember(signum: int, frame: FrameType | None) -> None:
    _received.append((signum, time.time()))


def catch_early_signals() -> None:
    """Remember, instead of dying of, every candidate stop signal from now on."""
    for name in CANDIDATES:
        signum = getattr(signal, f"SIG{name}", None)
        if signum is not None and signal.getsignal(signum) in (signal.SIG_DFL, signal.default_int_handler):
            signal.signal(signum, _remember)
    # the batch script got a stop signal before srun started this rank
    pending = getattr(signal, f"SIG{os.environ.get(ENV_PENDING_SIGNAL, '')}", None)
    if isinstance(pending, signal.Signals) and not _received:
        _received.append((int(pending), time.time()))


def release_others(wanted: list[int]) -> None:
    """Give back the candidates that are not stop signals of this spec, honouring one that came early
    (a SIGHUP during start-up still ends the rank, as it would have without us)."""
    for name in CANDIDATES:
        signum = getattr(signal, f"SIG{name}", None)
        if signum is None or signum in wanted or signal.getsignal(signum) is not _remember:
            continue
        signal.signal(signum, signal.default_int_handler if signum == signal.SIGINT else signal.SIG_DFL)
        if any(s == signum for s, _ in _received):
            signal.raise_signal(signum)


def early_signal(wanted: list[int]) -> tuple[int, float] | None:
    """The first remembered signal among `wanted` (the spec's stop signals), with when it came."""
    return next(((s, t) for s, t in _received if s in wanted), None)
