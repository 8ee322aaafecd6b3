"""SLURM hostlist expressions and the rendezvous port rule, shared by the launchers and the job.

Pure Python, no imports of ours: the sbatch renderer, the local executor and the in-job environment
detection must agree on these exactly.
"""
from __future__ import annotations

import re

PORT_BASE = 10000
PORT_SPAN = 20000  # ports 10000-29999: below Linux's ephemeral range (32768+)


def expand_hostlist(expr: str) -> list[str]:
    """`gpu[01-03,07],cpu5` -> ['gpu01', 'gpu02', 'gpu03', 'gpu07', 'cpu5'] (zero padding kept)."""
    hosts: list[str] = []
    for item in _split_top_level(expr.strip()):
        hosts.extend(_expand_item(item))
    return hosts


def _split_top_level(expr: str) -> list[str]:
    items, depth, cur = [], 0, ""
    for ch in expr:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"unbalanced ']' in hostlist {expr!r}")
        if ch == "," and depth == 0:
            items.append(cur)
            cur = ""
        else:
            cur += ch
    if depth:
        raise ValueError(f"unbalanced '[' in hostlist {expr!r}")
    items.append(cur)
    return [i for i in (s.strip() for s in items) if i]


def _expand_item(item: str) -> list[str]:
    m = re.search(r"\[([^\[\]]*)\]", item)
    if not m:
        return [item]
    prefix, suffix = item[: m.start()], item[m.end():]
    out: list[str] = []
    for part in m.group(1).split(","):
        for value in _expand_range(part.strip(), item):
            out.extend(_expand_item(prefix + value + suffix))
    return out


def _expand_range(part: str, item: str) -> list[str]:
    if not re.fullmatch(r"\d+(-\d+)?", part):
        raise ValueError(f"bad range {part!r} in hostlist {item!r}")
    lo, _, hi = part.partition("-")
    if not hi:
        return [lo]
    if int(hi) < int(lo):
        raise ValueError(f"descending range {part!r} in hostlist {item!r}")
    width = len(lo)
    return [str(n).zfill(width) for n in range(int(lo), int(hi) + 1)]


def port_for_job(job_id: str | int, step_id: str | int | None = None) -> int:
    """MASTER_PORT derived from the job id, so two jobs sharing a node never collide on 29500.

    Steps after the first (two srun steps side by side in one allocation) are spread apart too;
    step 0 and the batch script share the plain rule that the sbatch script computes in bash.
    """
    digits = re.sub(r"\D", "", str(job_id)) or "0"
    step = int(step_id) if step_id is not None and str(step_id).isdigit() else 0
    return PORT_BASE + (int(digits) + 7919 * step) % PORT_SPAN


# The same rule in bash, for the rendered sbatch script (kept next to the Python rule on purpose).
PORT_SHELL = f"$(( {PORT_BASE} + SLURM_JOB_ID % {PORT_SPAN} ))"


def scontrol_fields(text: str) -> dict[str, str]:
    """`scontrol show job -o`'s one line as {Key: value} (JobState, Restarts, StdOut, ...)."""
    return dict(field.split("=", 1) for field in text.split() if "=" in field)
