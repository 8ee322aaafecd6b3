"""The error tree. Every error a user can cause maps to one exit code, caught once at the CLI boundary."""
from __future__ import annotations

from hpcgpu.contract import EXIT_SCHEDULER, EXIT_USAGE


class HpcgpuError(Exception):
    """A problem the user can fix: bad spec, flag or file. One line, exit 2."""

    exit_code = EXIT_USAGE


class SpecError(HpcgpuError):
    """A spec key is missing, unknown, mistyped or out of range."""

    def __init__(self, path: str, message: str, source: str | None = None, line: int | None = None):
        self.path, self.message, self.source, self.line = path, message, source, line
        where = source or ""
        if source and line:
            where = f"{source}:{line}"
        prefix = f"{where}: " if where else ""
        key = f"{path}: " if path else ""
        super().__init__(f"{prefix}{key}{message}")


class UsageError(HpcgpuError):
    """A command-line flag or argument is wrong."""


class EnvironmentError_(HpcgpuError):
    """The job's environment (SLURM/torchrun variables, GPUs) is inconsistent."""


class SchedulerError(HpcgpuError):
    """The scheduler refused or failed (sbatch, squeue, scontrol). Exit 3."""

    exit_code = EXIT_SCHEDULER


class JobFailed(HpcgpuError):
    """A job we waited for ended non-zero; its own code becomes ours."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code
