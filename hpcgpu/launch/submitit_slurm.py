"""Submission through submitit's SLURM executor: it writes the batch file and runs sbatch.

How submitit is used, and why not its pickled-function path:
- The #SBATCH lines are exactly `sbatch_options` (the one mapping spec -> options), handed to
  `SlurmExecutor.update_parameters(additional_parameters=...)`; submitit's own defaults that would
  add to them (wckey, its USR2@90 signal, its log paths) are overridden or removed, and
  `check_same_options` proves on every submission that the file asks for nothing else.
- The command is the body `hpcgpu sbatch` renders (setup, exports, rendezvous, background srun of
  `python -m hpcgpu run <run dir>/spec.yaml` with signal forwarding), with `use_srun=False` so
  submitit does not wrap it in an srun of its own.
- submitit runs `sbatch <file>` with this process's environment and no `--export`, so the job gets
  the submitting environment (SLURM's default): env_passthrough's variables reach the job without
  their values being written anywhere (tests/unit/test_submit_host.py checks this with a fake sbatch).
- No pickle and no `python -m submitit.core._submit` inside the job: that process installs its
  own USR2/TERM handlers and runs `scontrol requeue` itself, which would race the preemption
  contract (flag, agreed stop, checkpoint, rank 0 requeues, array-task aware). It would also start
  a second interpreter per rank and leave result pickles nobody reads.
"""
from __future__ import annotations

import contextlib
import io
import re
import shlex
import uuid
from pathlib import Path
from typing import Any

import submitit
from submitit.core.utils import FailedJobError
from submitit.slurm.slurm import _get_default_parameters

from hpcgpu.errors import HpcgpuError, SchedulerError
from hpcgpu.launch.sbatch import render_directives

Options = list[tuple[str, "str | None"]]


class HpcgpuSlurmExecutor(submitit.SlurmExecutor):
    """submitit's SlurmExecutor, submitting a shell command instead of a pickled function."""

    @classmethod
    def affinity(cls) -> int:
        # submitit refuses to build an executor where `srun` is missing; --dry-run must work on a
        # laptop, and a real submission without sbatch fails with a clear SchedulerError below.
        return 2


def submitit_parameters(options: Options) -> dict[str, Any]:
    """sbatch options -> submitit parameters that render exactly those #SBATCH lines.

    Every option goes through `additional_parameters`, keyed the way submitit keys its own
    parameters (job_name, not job-name), so ours replace submitit's defaults instead of doubling them.
    """
    named = set(_get_default_parameters())
    extra: dict[str, Any] = {}
    for option, value in options:
        key = option.replace("-", "_") if option.replace("-", "_") in named else option
        extra[key] = True if value is None else value  # a later duplicate wins, as in sbatch
    # wckey=None drops submitit's `--wckey=submitit`; use_srun=False: our command runs srun itself
    return {"additional_parameters": extra, "wckey": None, "use_srun": False}


def make_executor(folder: Path, options: Options) -> HpcgpuSlurmExecutor:
    executor = HpcgpuSlurmExecutor(folder=folder)
    executor.update_parameters(**submitit_parameters(options))
    return executor


def submission_text(folder: Path, options: Options, command: str) -> str:
    """The batch file submitit would submit (for --dry-run), checked against the options."""
    text = make_executor(folder, options)._make_submission_file_text(command, uuid.uuid4().hex)
    check_same_options(text, options)
    return text


_DIRECTIVE = re.compile(r"^#SBATCH\s+--([a-z][a-z0-9-]*)(?:=(.*))?$")


def directives_of(text: str) -> dict[str, str | None]:
    """#SBATCH options of a batch file as sbatch reads them (the last of a repeated option wins)."""
    out: dict[str, str | None] = {}
    for line in text.splitlines():
        m = _DIRECTIVE.match(line.strip())
        if m:
            value = m.group(2)
            out[m.group(1)] = None if value is None else " ".join(shlex.split(value))
    return out


def check_same_options(text: str, options: Options) -> None:
    """The batch file asks for exactly what `hpcgpu sbatch` would (guards against submitit changes)."""
    want = directives_of(render_directives(options))
    got = directives_of(text)
    if got != want:
        diff = sorted(set(got.items()) ^ set(want.items()), key=str)
        raise HpcgpuError(f"submitit {submitit.__version__} wrote #SBATCH options that differ from "
                          f"`hpcgpu sbatch`: {diff}; use `hpcgpu sbatch` and plain sbatch meanwhile")


def submit_command(folder: Path, options: Options, command: str) -> str:
    """Write the batch file with submitit, run sbatch; return the job id.

    sbatch's refusal (bad account, QOS, node list, limits) becomes one SchedulerError line with
    SLURM's own words. submitit prints that stderr itself too; it is captured so the user sees it once.
    """
    executor = make_executor(folder, options)
    check_same_options(executor._make_submission_file_text(command, "check"), options)
    captured = io.StringIO()
    try:
        with contextlib.redirect_stderr(captured), contextlib.redirect_stdout(captured):
            # _submit_command: submitit's own "submit this command" step (no pickle); it writes
            # <folder>/<job id>_submission.sh, which stays in the run dir as the record of what ran
            job = executor._submit_command(command)
    except FileNotFoundError:
        raise SchedulerError("sbatch not found: is this a SLURM login node? (--executor local runs here)") from None
    except FailedJobError as exc:
        raise SchedulerError(sbatch_message(str(exc) or captured.getvalue())) from None
    except OSError as exc:  # the run dir vanished or is not writable
        raise HpcgpuError(f"cannot write the batch file in {folder}: {exc}") from None
    remove_submission_symlink(folder, job.paths.submission_file)
    return str(job.job_id)


def remove_submission_symlink(folder: Path, submitted: Path) -> None:
    """submitit leaves `.submission_file_<uuid>.sh` as a link to `<job id>_submission.sh`: one name is enough."""
    for link in folder.glob(".submission_file_*.sh"):
        try:
            if link.is_symlink() and Path(link.readlink()) == submitted:
                link.unlink()
        except OSError:
            pass


def sbatch_message(stderr: str) -> str:
    """SLURM's message in one line, e.g. `sbatch: error: Batch job submission failed: Invalid account`."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    errors = [line for line in lines if "error" in line.lower()] or lines
    return "; ".join(errors) if errors else "sbatch failed without a message"
