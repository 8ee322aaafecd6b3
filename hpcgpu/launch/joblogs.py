"""A job's log files and what srun writes in them: which rank failed first, how, and its last line;
and a job's .out and .err merged in the order they were written (`hpcgpu logs`).

Logs are read from their end only (LOG_TAIL_BYTES): failures are at the end, and a log may be GBs.
"""
from __future__ import annotations

import heapq
import os
import re
import signal
import time
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
# the time hpcgpu's log lines start with (runtime/logsetup.py), after srun's rank label
LINE_TIME = re.compile(r"^(?:\s*\d+: ?)?(\d\d):(\d\d):(\d\d) ")
DAY_S = 86400
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


# --- .out and .err in the order they were written -----------------------------------------------------

def line_time(line: str) -> int | None:
    """The second of the day a log line says it was written at (`HH:MM:SS ` after an srun label)."""
    m = LINE_TIME.match(line)
    return int(m[1]) * 3600 + int(m[2]) * 60 + int(m[3]) if m else None


def written_keys(lines: list[str], written: float) -> list[float]:
    """When each line of one log was written, as seconds of the day, never decreasing (the file's own
    order is kept): a line's own time; an untimed line (a traceback, srun's, a program's print) is
    taken to come right after the timed line before it, and those after the last timed line (all of
    them, in a file without times, like most of an .err) at the file's last write, `written` (mtime)."""
    keys: list[float | None] = []
    last: float | None = None
    day = 0
    for line in lines:
        t = line_time(line)
        if t is not None:
            if last is not None and t + day < last - DAY_S / 2:
                day += DAY_S  # past midnight
            last = t + day if last is None else max(last, t + day)
        keys.append(last)
    end = time.localtime(written)
    at_end = end.tm_hour * 3600 + end.tm_min * 60 + end.tm_sec + day
    if last is not None:
        at_end = max(last, at_end + DAY_S if at_end < last - DAY_S / 2 else at_end)
    trailing = len(lines)
    while trailing and line_time(lines[trailing - 1]) is None:
        trailing -= 1
    first = next((k for k in keys if k is not None), at_end)
    return [at_end if i >= trailing else (k if k is not None else first) for i, k in enumerate(keys)]


def interleave(chunks: list[tuple[str, float]]) -> str:
    """Several logs' text (with each file's mtime) as one, line by line in the order they were written
    (written_keys); at the same second the earlier log's lines first (.out before .err)."""
    keyed = []
    for index, (text, written) in enumerate(chunks):
        lines = text.splitlines(keepends=True)
        keyed.append([(key, index, n, line) for n, (key, line) in enumerate(zip(written_keys(lines, written), lines))])
    merged = [line for _, _, _, line in heapq.merge(*keyed)]
    # a file's last line still being written (no newline yet) gets one where another file's lines follow it
    return "".join(line if line.endswith("\n") or n == len(merged) - 1 else line + "\n"
                   for n, line in enumerate(merged))
