"""How a run ends, shared by the job and the launchers (kept here so host code needs no runtime import)."""
from __future__ import annotations

import time
from pathlib import Path

EXIT_FINISHED = 0
EXIT_STOPPED = 75  # EX_TEMPFAIL: stopped at a checkpoint after a preemption/timeout signal or Ctrl-C

FINISHED_MARKER = "FINISHED"  # in a run dir: the run is done and never trains (or requeues) again


def is_finished(run_dir: Path) -> bool:
    return (run_dir / FINISHED_MARKER).exists()


def write_finished(run_dir: Path) -> None:
    (run_dir / FINISHED_MARKER).write_text(time.strftime("%Y-%m-%dT%H:%M:%S") + "\n")
