"""The job side of the code snapshot (launch/snapshot.py): paths of the submit-time tree mapped into
<run dir>/code/, so that every rank, requeue and resume runs the copy and never the working tree."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from hpcgpu.contract import RunPaths


@dataclass(frozen=True)
class CodeMap:
    """The tree a snapshot was taken of (`source`) and its copy (`copy`)."""
    source: Path
    copy: Path

    def mapped(self, path: str | os.PathLike) -> Path | None:
        """The copy of `path` (absolute, or relative to the working dir), None for a path outside the tree."""
        try:
            inside = Path(os.path.abspath(path)).relative_to(self.source)
        except ValueError:
            return None
        return self.copy / inside

    def working_dir(self) -> Path | None:
        """Where the program runs: the copy of the working dir where that lies in the tree."""
        here = self.mapped(os.getcwd())
        return here if here is not None and here.is_dir() else None

    def argument(self, arg: str) -> str:
        """A program argument naming a file of the snapshot, as an absolute path into the copy (the
        script itself: Python then imports its sibling modules from the copy too)."""
        if not arg or arg.startswith("-"):
            return arg
        try:
            target = self.mapped(arg)
            is_file = target is not None and target.is_file()
        except (OSError, ValueError):  # a `python -c` program text: too long for a path, or a NUL in it
            return arg
        return str(target) if target is not None and is_file else arg


def code_map(paths: RunPaths) -> CodeMap | None:
    """The run's snapshot as provenance.json records it; None without one (code.snapshot: false, or a
    run dir made before snapshots)."""
    try:
        snapshot = json.loads(paths.provenance.read_text()).get("snapshot")
        source = Path(snapshot["source"])
    except (OSError, ValueError, AttributeError, TypeError, KeyError):
        return None
    return CodeMap(source, paths.code) if paths.code.is_dir() else None


def mapped_search_path(code: CodeMap, entries: list[str]) -> list[str]:
    """Import paths (sys.path, PYTHONPATH) with those in the tree (the working dir's '' included) moved
    into the copy, the copy's working dir and root first: a module of the tree imports from the snapshot."""
    moved = [str(code.mapped(e or os.getcwd()) or e) for e in entries]
    here = code.working_dir()
    first = [str(p) for p in (here, code.copy) if p is not None]
    return first + [e for e in moved if e not in first]
