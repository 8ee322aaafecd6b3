"""Render docs/spec.md, the spec reference, from the schema's own field help (hpcgpu/spec/schema.py).

    .venv/bin/python scripts/render_spec_docs.py           # rewrite docs/spec.md
    .venv/bin/python scripts/render_spec_docs.py --check   # exit 1 with a diff when docs/spec.md is stale

The Markdown comes from hpcgpu.spec.reference.spec_reference. tests/unit/test_docs.py runs the same check.
"""
from __future__ import annotations

import difflib
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TARGET = REPO / "docs" / "spec.md"
COMMAND = ".venv/bin/python scripts/render_spec_docs.py"


def expected() -> str:
    from hpcgpu.spec.reference import spec_reference

    return spec_reference()


def problems(want: str | None = None, target: Path | None = None) -> list[str]:
    """How docs/spec.md differs from what the schema renders to: missing, or stale (with a diff)."""
    want = expected() if want is None else want
    target = TARGET if target is None else target
    if not target.exists():
        return [f"{target.name} is missing"]
    have = target.read_text()
    if have == want:
        return []
    diff = "".join(difflib.unified_diff(have.splitlines(True), want.splitlines(True),
                                        fromfile=f"docs/{target.name}", tofile="rendered now"))
    return [f"docs/{target.name} is stale: hpcgpu/spec/schema.py (or the rendering) changed\n{diff}"]


def main(argv: list[str]) -> int:
    sys.path.insert(0, str(REPO))  # the checkout's hpcgpu, also when it is not installed
    if argv == ["--check"]:
        found = problems()
        for problem in found:
            print(problem, file=sys.stderr)
        if found:
            print(f"regenerate with: {COMMAND}", file=sys.stderr)
        return 1 if found else 0
    if argv:
        print(f"usage: {COMMAND} [--check]", file=sys.stderr)
        return 2
    want = expected()
    if TARGET.exists() and TARGET.read_text() == want:
        print("docs/spec.md is up to date")
        return 0
    TARGET.parent.mkdir(exist_ok=True)
    TARGET.write_text(want)
    print("wrote docs/spec.md")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
