"""A job's log files and what srun writes in them: which rank failed first, how, and its last line.

Logs are read from their end only (LOG_TAIL_BYTES): failures are at the end, and a log may be GBs.
"""
from __future__ import annotations

import os
import re
import signal
from dataclasses import dataclass
from pathlib import Path

from hpcgpu.contract import EXIT_STOPPED, RunPaths
from hpcgpu.launch.registry import JobRecord, TaskRecord


LOG_TAIL_BYTES = 64 * 1024  # failures are at the end of a log: never read a whole (multi-GB) one
# srun's report of a task that ended badly: "srun: error: n2: task 1: Exited with exit code 3",
# "srun: error: n1: tasks 0-1,3: Killed", "srun: error: n1: task 0: Segmentation fault (core dumped)"
SRUN_TASK_LINE = re.compile(r"^srun: error: (?P<node>[^\s:]+): tasks? (?P<tasks>\d[\d,\-]*): (?P<how>.+?)\s*$")
RANK_LABEL = re.compile(r"^\s*(\d+): ?(.*)$")  # srun --label pads the rank to the widest one
SCHEDULER_LINE = re.compile(r"^(srun|slurmstepd(-[^\s:]+)?|slurmd)(\[\d+\])?: ")
SRUN_ERROR = re.compile(r"^srun: (error|fatal): ")
# the GPU monitor's end-of-job summary comes after a program's last error: it is never the reason
MONITOR_LINE = re.compile(r"^(\d\d:\d\d:\d\d )?(\[rank \d+\] )?gpu monitor: ")
SIGNAL_TEXTS = {text.lower(): int(sig) for sig in signal.Signals if (text := signal.strsignal(sig))}


def slurm_log_files(job: JobRecord, task: TaskRecord | None) -> list[Path]:
    """A SLURM job's (or array task's) slurm-<id>.out and .err, in its run dir."""
    if task is not None:
        run_dir, stem = Path(task.run_dir), f"slurm-{task.id}"
    else:
        run_dir, stem = Path(job.run_dir), f"slurm-{job.job_id}"
    return [run_dir / f"{stem}.out", run_dir / f"{stem}.err"]


def rank_log(unit: JobRecord | TaskRecord, rank: int | None = None) -> Path:
    """A local job's (or sweep task's) logs/rank-N.log (rank 0 unless named)."""
    return RunPaths(Path(unit.run_dir)).rank_log(rank or 0)


@dataclass(frozen=True)
class TaskEnd:
    """One rank that srun reported as failed."""

    rank: int
    node: str
    exit_code: int | None
    how: str  # srun's words: "Exited with exit code 3", "Killed", "Out Of Memory"


def tail_lines(path: Path, max_bytes: int = LOG_TAIL_BYTES) -> list[str]:
    """The last lines of a file, reading at most max_bytes ([] if it is not there)."""
    try:
        with open(path, "rb") as fh:
            size = fh.seek(0, os.SEEK_END)
            fh.seek(max(0, size - max_bytes))
            lines = fh.read().decode(errors="replace").splitlines()
    except OSError:
        return []
    return lines[1:] if size > max_bytes else lines  # the first one is cut by the seek


def first_failed_task(lines: list[str]) -> TaskEnd | None:
    """The first task srun reported as failed in the last run of the log.

    A requeued job appends every run to the same log, so the failed run's block of srun lines is
    read backwards and ends at a task named twice (an earlier run) or at a run stopped at a
    checkpoint (exit 75) before it."""
    block: list[TaskEnd] = []
    seen: set[int] = set()
    for line in reversed(lines):
        m = SRUN_TASK_LINE.match(line)
        if not m:
            continue
        ranks, code = task_ids(m["tasks"]), srun_exit_code(m["how"])
        if code == EXIT_STOPPED or seen.intersection(ranks):
            if block:
                break
            continue
        seen.update(ranks)
        block.append(TaskEnd(ranks[0], m["node"], code, m["how"]))
    return block[-1] if block else None


def task_ids(text: str) -> list[int]:
    """srun's task list `0-1,3` -> [0, 1, 3]."""
    out: list[int] = []
    for part in text.split(","):
        low, _, high = part.partition("-")
        if low.isdigit():
            out.extend(range(int(low), int(high if high.isdigit() else low) + 1))
    return out


def srun_exit_code(how: str) -> int | None:
    """srun's words for how a task ended -> the shell's exit code (a signal N -> 128+N)."""
    m = re.match(r"Exited with exit code (\d+)", how)
    if m:
        return int(m.group(1))
    text = how.replace("(core dumped)", "").strip().lower()
    if text == "out of memory":
        return 128 + signal.SIGKILL  # the kernel's OOM killer
    sig = SIGNAL_TEXTS.get(text)
    return 128 + sig if sig else None


def rank_error_line(rank: int, *logs: list[str]) -> str:
    """The last line a rank wrote (srun --label: `N: text`), stderr first, not srun's own."""
    for lines in logs:
        line = last_line(lines, rank)
        if line:
            return line
    return ""


def last_line(lines: list[str], rank: int | None = -1, srun_errors: bool = False) -> str:
    """The last non-empty line: of one rank (`N: ` labels), of no rank (None: the batch script's
    own lines), or any (-1: an unlabelled log); scheduler lines are skipped, but for srun's own
    errors where `srun_errors` (a step that never started: "srun: error: Unable to confirm allocation")."""
    for line in reversed(lines):
        m = RANK_LABEL.match(line)
        if rank == -1:
            text = line
        elif rank is None:
            text = "" if m else line
        else:
            text = m.group(2) if m and int(m.group(1)) == rank else ""
        text = text.strip()
        if srun_errors and SRUN_ERROR.match(text):
            return text
        if text and not SCHEDULER_LINE.match(text) and not MONITOR_LINE.match(text):
            return text
    return ""
