"""One person's stop is one stop: stop signals that arrive within SAME_STOP_S of the first are copies of it.

A single Ctrl-C may reach a process two or three times within milliseconds: the shell signals every
process of the foreground group, `timeout` passes the signal it gets on to its child and then signals
its own group, srun and batch scripts relay what they get. Counting each copy as a new interrupt turned
one "checkpoint and stop" into "kill now". The local executor (a second stop kills the ranks) and the
ranks' handlers (a second signal is relayed to a command's program) both ask this one window.
Standard library only: `hpcgpu run` imports it before anything heavy (runtime/signals.py).
"""
from __future__ import annotations

import time
from typing import Callable

# Copies of one signal arrive within milliseconds; a person who means "kill now" presses again after
# reading "asking all ranks to checkpoint", which takes longer than this.
SAME_STOP_S = 2.0


class StopWindow:
    """Tells a new stop from a copy of the last one: `is_new()` for each stop signal, as it comes."""

    def __init__(self, window_s: float = SAME_STOP_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.window_s = window_s
        self.clock = clock
        self.started: float | None = None  # when the current stop began (its first signal)

    def is_new(self) -> bool:
        """True for the first signal and for one SAME_STOP_S or more after the stop it would repeat
        began (that one starts a new window); False for a copy within the window."""
        now = self.clock()
        if self.started is not None and now - self.started < self.window_s:
            return False
        self.started = now
        return True
