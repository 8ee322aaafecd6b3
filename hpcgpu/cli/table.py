"""Plain column tables, as `hpcgpu list`, `status` and `queue` print them."""
from __future__ import annotations

from typing import Sequence


def format_table(rows: Sequence[Sequence[str]]) -> str:
    """Left-aligned columns two spaces apart, no trailing blanks; rows[0] is the header."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows)
