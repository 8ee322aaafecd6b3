"""Chained jobs: `hpcgpu submit SPEC --after JOB` runs SPEC once JOB has completed successfully.

JOB is a registry job id (`local-3`, a SLURM id `123`, an array task `123_4`, or an array's id
meaning all its tasks). The spec may write `${after}` in any string value (model.name_or_path:
${after}/model, infer.input: ${after}/outputs.jsonl): it becomes JOB's run dir (an array's: its
sweep dir), known from the registry at submit, before the spec is checked. While JOB has not ended,
the host checks skip the values that lie under its run dir: what it will write is not there yet.

- SLURM: the job is submitted at once with `--dependency=afterok:JOB` (one more sbatch option in
  slurm.extra, so that options.py renders it the same for the .sbatch text and submitit). A JOB
  that fails leaves it PENDING with Reason=DependencyNeverSatisfied; `hpcgpu status` says it will
  not run and to cancel it.
- The local executor: `hpcgpu submit` registers the job PENDING ("waiting for job JOB to
  complete", its run dir made now), waits (in the foreground) for JOB to end, then checks the spec
  again and runs it as that same job id; a JOB that did not complete leaves it CANCELLED, reason
  "not run: ...", and nothing runs.
- A JOB that has already ended: COMPLETED runs at once; otherwise one line, exit 2, nothing queued.
Host side: no torch.
"""
from __future__ import annotations

import dataclasses
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from hpcgpu.errors import HpcgpuError, SpecError, UsageError
from hpcgpu.launch.liveness import process_start
from hpcgpu.launch.registry import JobRecord, Registry
from hpcgpu.launch.rundir import make_run_dir
from hpcgpu.launch.state import find_job, is_final
from hpcgpu.spec import Spec

AFTER = "${after}"
_REFERENCE = re.compile(r"\$\{\s*after[^}]*\}")
Refresh = Callable[[Registry, list[JobRecord]], list[JobRecord]]
Say = Callable[[str], None]
POLL_S = 2.0


@dataclass(frozen=True)
class Upstream:
    """The job a chained submission waits for, as the registry knew it at submit."""

    ref: str  # the id as given: a job, an array, or one array task
    run_dir: Path
    state: str

    @property
    def ended(self) -> bool:
        return is_final(self.state)

    @property
    def completed(self) -> bool:
        return self.state == "COMPLETED"

    @property
    def on_slurm(self) -> bool:
        # SLURM's ids are numbers (`123`, an array task `123_4`); the local executor's are local-N
        return self.ref.partition("_")[0].isdigit()


def find_upstream(registry: Registry, ref: str, refresh: Refresh) -> Upstream:
    """JOB of --after, its state brought up to date; an unknown JOB is one line (exit 2)."""
    try:
        job, task = find_job(registry, ref)
    except HpcgpuError:
        raise UsageError(f"--after {ref}: no such job in the registry (`hpcgpu list` shows the known ones)") from None
    refresh(registry, [job])
    unit = job.task(task.id) if task is not None else job
    assert unit is not None
    return Upstream(ref.strip(), Path(unit.run_dir), unit.state)


# --- ${after} in the spec -------------------------------------------------------------------------

def _strings(value: Any, change: Callable[[str], str]) -> Any:
    """`value` with `change` applied to every string in it (spec dataclasses, lists, mappings)."""
    if isinstance(value, str):
        return change(value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        new = {f.name: _strings(getattr(value, f.name), change) for f in dataclasses.fields(value) if f.init}
        return dataclasses.replace(value, **new) if new != {f: getattr(value, f) for f in new} else value
    if isinstance(value, (list, tuple)):
        return type(value)(_strings(v, change) for v in value)
    if isinstance(value, dict):
        return {k: _strings(v, change) for k, v in value.items()}
    return value


def references(spec: Spec) -> list[str]:
    """The `${after...}` references written in the spec's values."""
    found: list[str] = []
    _strings(spec, lambda s: found.extend(_REFERENCE.findall(s)) or s)
    return found


def with_after(spec: Spec, upstream: Upstream | None, slurm: bool, base: Path | None = None) -> Spec:
    """`${after}` -> the upstream run dir; for SLURM, afterok on an upstream that has not ended.
    base: the spec's folder, which load_spec put before a relative path value (`${after}/model`).
    One line (exit 2) for `${after}` without --after, another reference, or an upstream that
    ended without completing or that SLURM cannot wait for."""
    refs = references(spec)
    odd = next((r for r in refs if r != AFTER), None)
    if odd:
        raise SpecError("", f"{odd}: the one reference to a finished job is {AFTER} (its run dir), "
                            f"e.g. {AFTER}/model")
    if upstream is None:
        if refs:
            raise UsageError(f"the spec uses {AFTER} (the run dir of the job it follows): "
                             "submit it with --after JOB")
        return spec
    if upstream.ended and not upstream.completed:
        raise UsageError(f"--after {upstream.ref}: that job ended {upstream.state}; this one would never run "
                         "(submit it once the job it follows has completed)")
    joined = f"{base}/{AFTER}" if base is not None else AFTER
    spec = _strings(spec, lambda s: s.replace(joined, AFTER).replace(AFTER, str(upstream.run_dir)))
    if slurm and not upstream.ended:
        spec = with_dependency(spec, upstream)
    return spec


def with_dependency(spec: Spec, upstream: Upstream) -> Spec:
    """slurm.extra gains dependency=afterok:JOB (options.py renders slurm.extra for sbatch and submitit)."""
    if not upstream.on_slurm:
        raise UsageError(f"--after {upstream.ref}: a SLURM job cannot wait for a job of the local executor; "
                         "submit this one with --executor local, or once that job has completed")
    if "dependency" in spec.slurm.extra:
        raise SpecError("slurm.extra.dependency", "set here and by --after: give one of them")
    extra = {**spec.slurm.extra, "dependency": f"afterok:{upstream.ref}"}
    return dataclasses.replace(spec, slurm=dataclasses.replace(spec.slurm, extra=extra))


def pending_roots(upstream: Upstream | None) -> tuple[str, ...]:
    """Run dirs whose outputs the host checks must not look for yet (the upstream still runs or waits)."""
    return (str(upstream.run_dir),) if upstream is not None and not upstream.ended else ()


# --- the local executor: wait, then run or record "not run" ----------------------------------------

def wait_upstream(registry: Registry, upstream: Upstream, refresh: Refresh, say: Say,
                  poll_s: float = POLL_S) -> Upstream:
    """Wait here until the upstream job has ended; its final state."""
    say(f"waiting for job {upstream.ref} ({upstream.state}) to complete before this one runs")
    while not upstream.ended:
        time.sleep(poll_s)
        upstream = find_upstream(registry, upstream.ref, refresh)
    return upstream


def not_run_reason(upstream_ref: str, upstream_state: str) -> str:
    return f"not run: job {upstream_ref} it waited for ended {upstream_state}"



def record_waiting(registry: Registry, spec: Spec, spec_ref: str, upstream: Upstream, executor: str) -> JobRecord:
    """The local job waiting here for its upstream, registered PENDING so that `hpcgpu status` shows it
    (its pid: this submit). Its run dir is made now, with the code snapshot of submit time, as a SLURM
    job's is; the job runs in it once the upstream has completed (local_submit.submit_local)."""
    run_dir = make_run_dir(spec, spec_file=spec_ref)
    record = JobRecord("", spec.name, spec_ref, str(run_dir), executor, state="PENDING",
                       reason=f"waiting for job {upstream.ref} to complete", after=upstream.ref,
                       pid=os.getpid(), pid_start=process_start(os.getpid()))
    return registry.add(record)


def record_not_run(registry: Registry, waiting: JobRecord, upstream: Upstream) -> JobRecord:
    """The waiting job that will never run: CANCELLED, so that `hpcgpu status` says why."""
    registry.update(waiting, state="CANCELLED", reason=not_run_reason(upstream.ref, upstream.state),
                    ended=time.time())
    return waiting
