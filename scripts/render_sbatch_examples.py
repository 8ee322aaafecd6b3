"""Render sbatch/<config>.sbatch for every spec in configs/: the script `hpcgpu sbatch` writes for it.

    .venv/bin/python scripts/render_sbatch_examples.py           # rewrite sbatch/ (and drop stale scripts)
    .venv/bin/python scripts/render_sbatch_examples.py --check   # exit 1 with a diff when sbatch/ is stale

The scripts are rendered by hpcgpu.launch.sbatch.render_sbatch, the code behind `hpcgpu sbatch`, with
placeholders where a real run has its own values: the run dir /path/to/runs/<name>/RUNID and the
Python /path/to/venv/bin/python. tests/unit/test_sbatch_folder.py runs the same check.
"""
from __future__ import annotations

import difflib
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CONFIGS = REPO / "configs"
FOLDER = REPO / "sbatch"
RUNS = Path("/path/to/runs")  # placeholders, as in tests/golden: no path of this machine in the files
PYTHON = "/path/to/venv/bin/python"
COMMAND = ".venv/bin/python scripts/render_sbatch_examples.py"


def configs() -> list[Path]:
    """The shipped specs (configs/*.yaml; configs/data/ holds their data)."""
    return sorted(CONFIGS.glob("*.yaml"))


def render(config: Path) -> str:
    from hpcgpu.launch.sbatch import render_sbatch
    from hpcgpu.spec import load_spec

    spec = load_spec(config)
    if spec.sweep:  # `hpcgpu sbatch` refuses a sweep too: one script is one job
        raise SystemExit(f"{config}: sweeps {', '.join(spec.sweep)}; a script here is one job")
    run_dir = RUNS / spec.name / "RUNID"
    return render_sbatch(spec, run_dir, run_dir / "spec.yaml", python=PYTHON, script_hint=str(run_dir / "job.sbatch"))


def expected() -> dict[str, str]:
    """File name in sbatch/ -> the text it must hold."""
    return {f"{config.stem}.sbatch": render(config) for config in configs()}


def problems(want: dict[str, str] | None = None) -> list[str]:
    """How sbatch/ differs from what the configs render to: missing, stale (with a diff), or orphaned."""
    want = expected() if want is None else want
    out = []
    for name, text in want.items():
        path = FOLDER / name
        if not path.exists():
            out.append(f"sbatch/{name} is missing (configs/{Path(name).stem}.yaml has no script)")
        elif path.read_text() != text:
            diff = "".join(difflib.unified_diff(path.read_text().splitlines(True), text.splitlines(True),
                                                fromfile=f"sbatch/{name}", tofile="rendered now"))
            out.append(f"sbatch/{name} is stale: configs/{Path(name).stem}.yaml renders to something else now "
                       f"(the rendering or the config changed)\n{diff}")
    for path in sorted(FOLDER.glob("*.sbatch")):
        if path.name not in want:
            out.append(f"sbatch/{path.name} has no config (no configs/{path.stem}.yaml)")
    return out


def write() -> list[str]:
    """Rewrite sbatch/ from configs/; returns what changed."""
    want = expected()
    changed = []
    FOLDER.mkdir(exist_ok=True)
    for path in sorted(FOLDER.glob("*.sbatch")):
        if path.name not in want:
            path.unlink()
            changed.append(f"removed sbatch/{path.name} (no configs/{path.stem}.yaml)")
    for name, text in want.items():
        path = FOLDER / name
        if not path.exists() or path.read_text() != text:
            changed.append(f"{'updated' if path.exists() else 'wrote'} sbatch/{name}")
            path.write_text(text)
    return changed


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
    print("\n".join(write()) or "sbatch/ is up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
