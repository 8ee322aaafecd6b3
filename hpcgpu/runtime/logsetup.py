"""The `hpcgpu` logger of a rank: INFO from rank 0, warnings from the others; Python warnings (the
libraries' deprecation notices and the like) go to the rank's log file once each, not to the console
or the job's .err (no torch here, so the command task's wrapper can use it too)."""
from __future__ import annotations

import logging
import sys
import warnings
from pathlib import Path
from typing import TextIO

from hpcgpu.contract import RunPaths
from hpcgpu.runtime.env import DistEnv

DATE_FORMAT = "%H:%M:%S"
WARNINGS_LOGGER = "py.warnings"
PYTHON_SHOWWARNING = warnings.showwarning


def setup_logging(env: DistEnv, run_dir: Path) -> None:
    level = logging.INFO if env.is_main else logging.WARNING
    logger = logging.getLogger("hpcgpu")
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stdout)
        handler.setFormatter(line_format(env))
        logger.addHandler(handler)
        logger.propagate = False
    logger.setLevel(level)
    route_warnings(env, RunPaths(run_dir).rank_log(env.rank))


def line_format(env: DistEnv) -> logging.Formatter:
    prefix = f"[rank {env.rank}] " if env.world_size > 1 else ""
    return logging.Formatter(f"%(asctime)s {prefix}%(message)s", DATE_FORMAT)


class OncePerText(logging.Filter):
    """Each distinct warning (its text and where it was raised) once: Python's own once-per-place
    forgets what it showed whenever a library enters `warnings.catch_warnings`, which many do per call."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        if text in self.seen:
            return False
        self.seen.add(text)
        return True


class WarningsFile(logging.FileHandler):
    """The handler `route_warnings` installs (known by its class when a process starts another run),
    opened at the first warning: a run without any gets no logs/ folder from it."""

    def __init__(self, path: Path) -> None:
        super().__init__(path, delay=True)

    def _open(self):  # type: ignore[no-untyped-def]
        Path(self.baseFilename).parent.mkdir(parents=True, exist_ok=True)
        return super()._open()


def route_warnings(env: DistEnv, log_file: Path) -> None:
    """`warnings.warn` from here on: one line each in `log_file` (the local executor's rank-N.log, which
    it also writes, line by line, in append mode; under SLURM a file of this rank's warnings only)."""
    logger = logging.getLogger(WARNINGS_LOGGER)
    for old in [h for h in logger.handlers if isinstance(h, WarningsFile)]:
        logger.removeHandler(old)
        old.close()
    handler = WarningsFile(log_file)
    handler.setFormatter(line_format(env))
    handler.addFilter(OncePerText())
    logger.addHandler(handler)
    logger.propagate = False
    warnings.showwarning = warning_to_log


def warning_to_log(message: Warning | str, category: type[Warning], filename: str, lineno: int,
                   file: TextIO | None = None, line: str | None = None) -> None:
    """warnings.showwarning: the warning without its source line (logging.captureWarnings' adds it)."""
    if file is not None:  # a caller that names the stream gets it
        PYTHON_SHOWWARNING(message, category, filename, lineno, file, line)
        return
    logging.getLogger(WARNINGS_LOGGER).warning("%s:%s: %s: %s", filename, lineno, category.__name__, message)
