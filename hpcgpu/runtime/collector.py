"""train.gc_every: Python's garbage collection at fixed steps, the same on every rank.

Left automatic, a collection starts whenever a process has allocated enough objects, at a different
moment on every rank, and stops that rank's host for milliseconds to tens of milliseconds. On one GPU
the queued kernels hide it; with several ranks the others wait for the paused one in the next
gradient all-reduce, and the pauses of all ranks add up. So during the training loop the automatic
collection is off and every rank collects the young generations at the same steps (torchtitan's
gc_freq does the same). Automatic collection is back on when the loop ends.
"""
from __future__ import annotations

import gc


class StepCollector:
    """Owns Python's garbage collection between `start` and `close`; every=0 leaves it automatic."""

    GENERATION = 1  # the young generations: what a step's temporaries end up in

    def __init__(self, every: int):
        self.every = every
        self._was_enabled = gc.isenabled()

    def start(self) -> None:
        if self.every:
            gc.disable()
            gc.collect(self.GENERATION)

    def after_step(self, step: int) -> None:
        if self.every and step % self.every == 0:
            gc.collect(self.GENERATION)

    def close(self) -> None:
        if self.every and self._was_enabled:
            gc.enable()
