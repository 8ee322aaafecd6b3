"""Reading a job's output in tests: what the program printed, apart from hpcgpu's own lines."""
from __future__ import annotations

import re

HPCGPU_LOG_LINE = re.compile(r"^(\s*\d+: )?\d\d:\d\d:\d\d ")  # hpcgpu's own lines: a time first


def program_lines(text: str) -> list[str]:
    """The lines of a job's output that its program printed (srun's rank label kept), without
    hpcgpu's own timestamped lines (the start-up line, the GPU monitor's)."""
    return [line for line in text.splitlines() if line.strip() and not HPCGPU_LOG_LINE.match(line)]
