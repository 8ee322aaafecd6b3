"""Render a readable, standalone sbatch script for a spec."""
from __future__ import annotations

import re
import shlex
import sys
from importlib import resources
from pathlib import Path
from string import Template

from hpcgpu.errors import SpecError
from hpcgpu.hostlist import PORT_SHELL
from hpcgpu.launch.options import sbatch_options
from hpcgpu.spec.derive import nccl_env, signal_name
from hpcgpu.spec.schema import Spec


def directive_value(option: str, value: str) -> str:
    """A value as sbatch's own #SBATCH reader takes it: whitespace, '#' and quotes need double quotes."""
    if re.search(r"[\x00-\x1f]", value) or '"' in value or "\\" in value:
        raise SpecError(option, f"--{option} value {value!r} cannot be written to an #SBATCH line "
                        "(no double quotes, backslashes or control characters)")
    return f'"{value}"' if re.search(r"[\s#']", value) else value


def render_directives(options: list[tuple[str, str | None]]) -> str:
    # #SBATCH lines are read by sbatch, not by a shell: a value cannot run anything, and control
    # characters are refused so that no value can start a new line.
    return "\n".join(f"#SBATCH --{k}" if v is None else f"#SBATCH --{k}={directive_value(k, v)}"
                     for k, v in options)


def env_exports(spec: Spec) -> dict[str, str]:
    """Every variable the script exports before srun, in order (user env last, so it wins)."""
    env = dict(nccl_env(spec))
    env.update(spec.env)
    env.pop("MASTER_PORT", None)  # handled by the rendezvous block so a user value still wins
    return env


def render_sbatch(spec: Spec, run_dir: Path, spec_path: Path, python: str | None = None,
                  script_hint: str = "job.sbatch") -> str:
    template = Template(resources.files("hpcgpu.launch").joinpath("templates/job.sbatch").read_text())
    r = spec.resources
    user_port = spec.env.get("MASTER_PORT")
    return template.substitute(
        name=spec.name,
        task=spec.task,
        world=spec.world_size,
        nodes=r.nodes,
        gpus=r.gpus,
        cpus=r.cpus_per_gpu,
        script_hint=shlex.quote(re.sub(r"[\x00-\x1f]", "?", script_hint)),
        spec_path=spec_path,
        spec_path_q=shlex.quote(str(spec_path)),
        run_dir_q=shlex.quote(str(run_dir)),
        directives=render_directives(sbatch_options(spec, run_dir)),
        setup="\n".join(spec.slurm.setup) if spec.slurm.setup else "# (none)",
        env_lines="\n".join(f"export {k}={shlex.quote(v)}" for k, v in env_exports(spec).items()),
        # from the job id, not from the submitting shell: sbatch exports the caller's environment
        master_port=shlex.quote(user_port) if user_port else PORT_SHELL,
        python=shlex.quote(python or sys.executable),
        signal=signal_name(spec),
    )
