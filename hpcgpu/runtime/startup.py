"""Where a rank's start-up time goes, from its process start to the end of its first step.

Time to first step is what a user waits for on every start and every requeue; compile dominates it
on GPUs, but the interpreter and imports, the process group, the data, the model and the resume each
take their share. The clock marks the end of each phase; after the first step (made to finish on the
GPU with one synchronize, once per start) rank 0 logs one line and writes a "startup" record.
"""
from __future__ import annotations

import logging
import os
import time
from typing import Any

from hpcgpu.contract import startup_fields

log = logging.getLogger("hpcgpu")


def process_start_time() -> float | None:
    """This process's start as a Unix time, from /proc (Linux); None where that is not readable."""
    try:
        with open(f"/proc/{os.getpid()}/stat") as fh:
            # the command name (field 2) may hold spaces: the fields after it start past the last ')'
            fields = fh.read().rsplit(")", 1)[1].split()
        ticks = int(fields[19])  # field 22, starttime: clock ticks after boot
        # the age against the boot clock (not /proc/stat's btime: whole seconds, up to 1 s off)
        age = time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
        return time.time() - age
    except (OSError, ValueError, IndexError, AttributeError):
        return None


class StartupClock:
    """Phases of a start, each the time since the previous mark (the first since the process began)."""

    def __init__(self) -> None:
        self.started = process_start_time()
        self.last = self.started if self.started is not None else time.time()
        self.phases: dict[str, float] = {}
        self.done = False

    def mark(self, phase: str) -> None:
        now = time.time()
        self.phases[phase] = max(0.0, now - self.last)
        self.last = now

    def first_step_done(self, device: Any, metrics: Any, step: int) -> None:
        """Once per start: wait for the first step's kernels, then log and record the phases."""
        if self.done:
            return
        self.done = True
        if getattr(device, "type", "cpu") == "cuda":
            import torch

            torch.cuda.synchronize(device)
        self.mark("first step")
        total = sum(self.phases.values())
        metrics.write("startup", step=step, total_s=total, process_start=self.started,
                      **startup_fields(self.phases))
        since = "process start" if self.started is not None else "the clock's start"
        log.info(f"start-up: {total:.1f} s from {since} to step {step} done ("
                 + ", ".join(f"{name} {s:.1f} s" for name, s in self.phases.items()) + ")")
