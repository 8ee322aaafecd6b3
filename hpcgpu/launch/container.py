"""`container:`: every rank runs inside an image, the one place each launcher asks (docs/containers.md).

A runtime back-end says two things, srunx-style: what the batch script's srun gets (`srun_args`:
pyxis's --container-* options) and what goes before each rank's `python -m hpcgpu run` (`prefix`:
`apptainer exec ...`). The sbatch body (sbatch.py, which submitit submits too) and the local
executor (local.py) both build the rank's command from `rank_argv` and `srun_words`, and nothing else
looks at `spec.container`'s runtime.

hpcgpu inside the image: the host's hpcgpu package is mounted read-only at HOST_CODE_DIR/hpcgpu and
put first on PYTHONPATH, so the ranks run the code that wrote the spec; the image supplies Python and
hpcgpu's dependencies (torch, pyyaml, ...), which each rank checks first (hpcgpu/image.py).
"""
from __future__ import annotations

import shlex
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import hpcgpu
from hpcgpu.image import ENV_CONTAINER_IMAGE
from hpcgpu.spec.load import is_local_path
from hpcgpu.spec.schema import Container, Spec

HOST_CODE_DIR = "/opt/hpcgpu-host"  # inside the container; holds the host's hpcgpu package
IMAGE_PYTHON = "python"  # the image's Python: the host's interpreter is not inside the image
URI_SCHEMES = ("docker://", "docker-archive:", "library://", "oras://", "shub://", "instance://", "http://",
               "https://")


def image_is_path(container: Container) -> bool:
    """A file (or sandbox folder) on the file system, not a registry image: apptainer takes a SIF path or a
    URI; pyxis an enroot image name or a squashfs path (one that starts with / . or ~)."""
    if container.runtime == "pyxis":
        return container.image.startswith(("/", ".", "~"))
    return not container.image.startswith(URI_SCHEMES)


def hpcgpu_package() -> Path:
    return Path(hpcgpu.__file__).resolve().parent


def code_mount() -> str:
    return f"{hpcgpu_package()}:{HOST_CODE_DIR}/hpcgpu:ro"


def container_env(container: Container) -> dict[str, str]:
    """The variables set over the image's: container.env, PYTHONPATH with hpcgpu's folder first, and the
    image's name for the rank's check of hpcgpu's dependencies (hpcgpu/image.py)."""
    env = {**container.env, ENV_CONTAINER_IMAGE: container.image}
    env["PYTHONPATH"] = ":".join(p for p in (HOST_CODE_DIR, container.env.get("PYTHONPATH")) if p)
    return env


def input_paths(spec: Spec) -> list[tuple[str, str]]:
    """(key, path) of every local input the spec names; a hub id (gpt2, org/name) is not one."""
    out = [(key, value) for key, value in (
        ("data.train", spec.data.train), ("data.eval", spec.data.eval),
        ("distributed.deepspeed.config", spec.distributed.deepspeed.config)) if value]
    if spec.task == "infer" and spec.infer.input:
        out.append(("infer.input", spec.infer.input))
    name = spec.model.name_or_path
    if name and is_local_path(name, Path.cwd()):
        out.append(("model.name_or_path", name))
    return out


def mounts(container: Container, spec: Spec, run_dir: Path) -> list[str]:
    """SRC:DST of every mount, the same path inside as outside so that spec.yaml's paths mean the same
    there: the runs dir (run_dir is <runs dir>/<name>/<id>: array tasks' run dirs are inside), the spec's
    inputs outside it, container.mounts, hpcgpu's code."""
    runs = run_dir.absolute().parent.parent
    inputs = [path for _, path in input_paths(spec)] + ([spec.model.adapter] if spec.model.adapter else [])
    outside = [p for p in (Path(i).expanduser().absolute() for i in inputs) if not p.is_relative_to(runs)]
    users = [str(Path(src).expanduser()) + ":" + dst for src, _, dst in (m.partition(":") for m in container.mounts)]
    return [*(f"{p}:{p}" for p in dict.fromkeys([runs, *outside])), *users, code_mount()]


class ContainerRuntime(Protocol):
    def srun_args(self, container: Container, binds: list[str], env_names: list[str]) -> list[str]:
        """Shell words for srun in the batch script ('"$PWD"' stays a shell expansion)."""

    def prefix(self, container: Container, binds: list[str], gpus: bool) -> list[str]:
        """argv before the rank's `python -m hpcgpu run`."""

    def exports(self, container: Container) -> dict[str, str]:
        """Variables the batch script exports before srun for the container."""


@dataclass(frozen=True)
class Apptainer:
    """`apptainer exec` (or `singularity exec`) around each rank. Documented flags (apptainer-exec(1)):
    `--nv` (NVIDIA GPUs), `-B/--bind src[:dest[:opts]]`, `--env K=V`; the host's environment reaches the
    container by default (no --cleanenv), and the current working directory is mounted by default."""

    executable: str

    def srun_args(self, container: Container, binds: list[str], env_names: list[str]) -> list[str]:
        return []

    def prefix(self, container: Container, binds: list[str], gpus: bool) -> list[str]:
        out = [self.executable, "exec", *(["--nv"] if gpus else [])]
        for bind in binds:
            out += ["--bind", bind]
        for key, value in container_env(container).items():
            out += ["--env", f"{key}={value}"]
        return [*out, container.image]

    def exports(self, container: Container) -> dict[str, str]:
        return {}  # --env sets them inside


class Pyxis:
    """pyxis (NVIDIA's SPANK plugin for enroot) adds to srun, per its usage page:
    `--container-image=IMAGE`, `--container-mounts=SRC:DST[:FLAGS][,...]`, `--container-workdir=PATH`,
    `--container-env=NAME[,...]` (exported host variables reach the container, but an image's own value
    wins unless named there)."""

    def srun_args(self, container: Container, binds: list[str], env_names: list[str]) -> list[str]:
        quoted = ",".join(shlex.quote(b) for b in binds)
        return [f"--container-image={shlex.quote(container.image)}",
                f'--container-mounts={quoted},"$PWD":"$PWD"',
                '--container-workdir="$PWD"',
                f"--container-env={','.join(env_names)}"]

    def prefix(self, container: Container, binds: list[str], gpus: bool) -> list[str]:
        return []

    def exports(self, container: Container) -> dict[str, str]:
        return container_env(container)  # named in --container-env: pyxis has no NAME=VALUE option


RUNTIMES: dict[str, ContainerRuntime] = {
    "apptainer": Apptainer("apptainer"),
    "singularity": Apptainer("singularity"),
    "pyxis": Pyxis(),
}


def runtime_of(spec: Spec) -> ContainerRuntime | None:
    return RUNTIMES[spec.container.runtime] if spec.container else None


def rank_argv(spec: Spec, spec_path: str, run_dir: Path, gpus: bool, python: str | None = None) -> list[str]:
    """What one rank runs: `[prefix] python -m hpcgpu run SPEC` (the image's python in a container)."""
    runtime = runtime_of(spec)
    if runtime is None or spec.container is None:
        return [python or sys.executable, "-m", "hpcgpu", "run", spec_path]
    prefix = runtime.prefix(spec.container, mounts(spec.container, spec, run_dir), gpus)
    return [*prefix, IMAGE_PYTHON, "-m", "hpcgpu", "run", spec_path]


def srun_words(spec: Spec, run_dir: Path, exported: list[str]) -> list[str]:
    """Shell words the batch script's srun gets for the container (none without one). `exported`:
    the variables the script exports, which must win over an image's own values."""
    runtime = runtime_of(spec)
    if runtime is None or spec.container is None:
        return []
    names = list(dict.fromkeys([*exported, *container_env(spec.container)]))
    return runtime.srun_args(spec.container, mounts(spec.container, spec, run_dir), names)


def container_exports(spec: Spec) -> dict[str, str]:
    """Variables the batch script exports before srun for the container (none without one)."""
    runtime = runtime_of(spec)
    return runtime.exports(spec.container) if runtime and spec.container else {}
