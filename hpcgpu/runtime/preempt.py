"""Preemption signals only set a flag; ranks agree on it at step boundaries (never work in a handler)."""
from __future__ import annotations

import signal
import time
from types import FrameType
from typing import Callable

from hpcgpu.runtime.early import early_signal, release_others
from hpcgpu.spec import Spec
from hpcgpu.spec.derive import signal_name


class StopFlag:
    """Set by the preemption signal or SIGTERM; read by the training loop at step boundaries."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self.when: float | None = None
        self._previous: dict[int, object] = {}

    def install(self, signums: list[int]) -> None:
        for signum in signums:
            self._previous[signum] = signal.signal(signum, self._handle)
        release_others(signums)
        early = early_signal(signums)
        if early is not None and self.signum is None:
            # it came while the rank was starting: acted on at the first step boundary
            self.signum, self.when = early

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signum is None:  # the first signal tells why we stop
            self.signum, self.when = signum, time.time()

    def restore(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)  # type: ignore[arg-type]
        self._previous.clear()

    @property
    def is_set(self) -> bool:
        return self.signum is not None


def stop_signals(spec: Spec | None) -> list[int]:
    names = {"TERM", "INT"}
    if spec is not None:
        names.add(signal_name(spec))
    return sorted({getattr(signal, f"SIG{n}") for n in names if hasattr(signal, f"SIG{n}")})


AgreeFn = Callable[[bool], bool]
