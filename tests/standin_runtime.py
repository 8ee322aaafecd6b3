"""A stand-in `apptainer` for the container tests (unit and SLURM).

Why a stand-in: no container runtime can be installed on the test machines (no Debian or PyPI package
of apptainer, singularity or enroot/pyxis, and no image registry to pull from). The stand-in takes what
`apptainer exec` takes (apptainer-exec(1): `[--nv] [-B|--bind src[:dest[:opts]]]... [--env K=V]... IMAGE
COMMAND...`), records its argv and environment, and runs COMMAND on the host with the --env values and
the variables apptainer sets inside a container (APPTAINER_CONTAINER, APPTAINER_NAME): it proves what
hpcgpu hands the runtime and that every rank went through it, not that an image works.
"""
from __future__ import annotations

from pathlib import Path

STANDIN = """#!/bin/bash
set -e
[ "$1" = exec ] || {{ echo "stand-in apptainer: only exec" >&2; exit 2; }}
rec={records}/$$
printf '%s\\n' "$@" >"$rec.argv"
env -0 >"$rec.env"
shift
envs=()
while :; do
  case "$1" in
    --nv) shift ;;
    -B|--bind) shift 2 ;;
    --env) envs+=("$2"); shift 2 ;;
    *) break ;;
  esac
done
image=$1; shift
exec env APPTAINER_CONTAINER="$image" APPTAINER_NAME="$(basename "$image")" "${{envs[@]}}" "$@"
"""


def write_standin(folder: Path, name: str = "apptainer") -> tuple[Path, Path]:
    """folder/bin/<name> (put folder/bin first on PATH) -> (bin folder, records folder)."""
    bin_dir, records = folder / "bin", folder / "container-records"
    bin_dir.mkdir(parents=True, exist_ok=True)
    records.mkdir(exist_ok=True)
    exe = bin_dir / name
    exe.write_text(STANDIN.format(records=records))
    exe.chmod(0o755)
    return bin_dir, records


def calls(records: Path) -> list[tuple[list[str], dict[str, str]]]:
    """(argv, environment) of every call the stand-in got."""
    out = []
    for argv_file in sorted(records.glob("*.argv")):
        env_text = argv_file.with_suffix(".env").read_text()
        env = dict(item.split("=", 1) for item in env_text.split("\0") if "=" in item)
        out.append((argv_file.read_text().splitlines(), env))
    return out
