"""Render a readable, standalone sbatch script for a spec."""
from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from string import Template

from hpcgpu.errors import SpecError
from hpcgpu.hostlist import PORT_SHELL
from hpcgpu.contract import BATCH_SIGNAL_SHELL, ENV_JOB_START, ENV_RUN_DIR
from hpcgpu.launch.container import container_exports, rank_argv, srun_words
from hpcgpu.launch.options import asks_gpus, per_node_text, sbatch_options
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


@dataclass(frozen=True)
class ArrayIndex:
    """Where a job array's tasks find their specs: line (SLURM_ARRAY_TASK_ID + offset + 1) of tasks_file.

    A sweep larger than MaxArraySize is split into several arrays over one index; each array's
    task ids start at 0 again, hence the offset.
    """

    tasks_file: Path
    offset: int = 0


def _template(name: str) -> Template:
    return Template(resources.files("hpcgpu.launch").joinpath(f"templates/{name}").read_text())


def array_block(index: ArrayIndex) -> str:
    """Shell lines that find this array task's spec and send its output to its own run dir."""
    tasks_q = shlex.quote(str(index.tasks_file))
    log = '"$run_dir/slurm-${SLURM_ARRAY_JOB_ID}_${SLURM_ARRAY_TASK_ID}'
    return (
        f"# --- array task: its resolved spec is line SLURM_ARRAY_TASK_ID+{index.offset}+1 of the sweep index ---\n"
        f'spec_path=$(sed -n "$(( SLURM_ARRAY_TASK_ID + {index.offset} + 1 ))p" {tasks_q})\n'
        f'if [ -z "$spec_path" ]; then echo "hpcgpu: array task $SLURM_ARRAY_TASK_ID is not in "{tasks_q} >&2; exit 1; fi\n'
        'run_dir=$(dirname "$spec_path")\n'
        "# SLURM's --output is one pattern for the whole array: each task logs into its own run dir\n"
        f'exec >>{log}.out" 2>>{log}.err"\n\n'
    )


def render_body(spec: Spec, run_dir: Path, spec_path: Path, python: str | None = None,
                array: ArrayIndex | None = None) -> str:
    """The script after the #SBATCH lines: setup, environment, rendezvous, srun of `hpcgpu run`.

    Shared by `hpcgpu sbatch` and `hpcgpu submit` (submitit writes the #SBATCH lines there), so both
    paths run the same commands with the same environment and signal forwarding.
    """
    r = spec.resources
    user_port = spec.env.get("MASTER_PORT")
    return _template("job-body.sh").substitute(
        array_block=array_block(array) if array else "",
        tasks=spec.tasks_per_node,
        cpus=r.cpus_per_gpu * spec.gpus_per_task,
        launch_what=launch_what(spec),
        spec_path_q='"$spec_path"' if array else shlex.quote(str(spec_path)),
        run_dir_q='"$run_dir"' if array else shlex.quote(str(run_dir)),
        setup="\n".join(spec.slurm.setup) if spec.slurm.setup else "# (none)",
        env_lines="\n".join(f"export {k}={shlex.quote(v)}"
                            for k, v in (env_exports(spec) | container_exports(spec)).items()),
        # from the job id, not from the submitting shell: sbatch exports the caller's environment
        master_port=shlex.quote(user_port) if user_port else PORT_SHELL,
        rank_command=rank_command(spec, run_dir, '"$spec_path"' if array else shlex.quote(str(spec_path)), python),
        signal=signal_name(spec),
        batch_signal_file=BATCH_SIGNAL_SHELL,
    )


# what the script exports for the ranks, beside env_exports: pyxis must keep them over an image's values
LAUNCH_ENV = ("PYTHONUNBUFFERED", ENV_JOB_START, ENV_RUN_DIR, "MASTER_ADDR", "MASTER_PORT")
SPEC_WORD = "\0spec"  # stands for the spec path, which is shell text already ("$spec_path" in an array)


def rank_command(spec: Spec, run_dir: Path, spec_path_q: str, python: str | None) -> str:
    """srun's command: a container's srun options, then what each rank runs (launch/container.py)."""
    argv = rank_argv(spec, SPEC_WORD, run_dir, gpus=asks_gpus(spec), python=python)
    words = [spec_path_q if w == SPEC_WORD else shlex.quote(w) for w in argv]
    srun = srun_words(spec, run_dir, [*env_exports(spec), *LAUNCH_ENV])
    # the last five: `python -m hpcgpu run SPEC`; before them a runtime's prefix (apptainer exec ...)
    lines = [" ".join(part) for part in (srun, words[:-5]) if part]
    return " \\\n  ".join([*lines, " ".join(words[-5:])])


def launch_what(spec: Spec) -> str:
    """The comment above srun: what one task is."""
    g = spec.gpus_per_task
    if not asks_gpus(spec):
        return "CPU tasks (slurm.gpu_request: none), all running the same entrypoint"
    if g == 1:
        return "one task per GPU, all running the same entrypoint"
    return (f"one task per model copy of {g} GPUs (infer.gpus_per_replica), all running the same entrypoint; "
            f"every task sees the node's GPUs and takes GPUs [{g}*SLURM_LOCALID, {g}*SLURM_LOCALID+{g}) of "
            "them (CUDA_VISIBLE_DEVICES narrowed in the task)")


def render_sbatch(spec: Spec, run_dir: Path, spec_path: Path, python: str | None = None,
                  script_hint: str = "job.sbatch") -> str:
    r = spec.resources
    return _template("job.sbatch").substitute(
        name=spec.name,
        task=spec.task,
        world=spec.world_size,
        nodes=r.nodes,
        per_node=per_node_text(spec),
        replicas=f", {spec.world_size} model copies of {spec.gpus_per_task} GPUs" if spec.gpus_per_task > 1 else "",
        script_hint=shlex.quote(re.sub(r"[\x00-\x1f]", "?", script_hint)),
        spec_path=spec_path,
        directives=render_directives(sbatch_options(spec, run_dir)),
        body=render_body(spec, run_dir, spec_path, python),
    )
