"""The one resolve step on the host: spec file + `--set` + flags + sweep -> checked, fully resolved specs.

`hpcgpu validate`, `hpcgpu sbatch`, `hpcgpu submit` (SLURM and local) and `hpcgpu queue` all read a
spec through `read_resolved`, so the spec a job runs is the same whichever command made it:
    load_spec (defaults files, YAML, --set, --gpus/--nodes)  ->  with_sweep (--sweep flags)
    ->  with_adapter_base (model.adapter alone: the base its adapter_config.json names)  ->  sweep_tasks
    ->  check_host (every task: what the job would fail on, found here; errors name their key)
    ->  resolve_gpus_per_replica (infer.gpus_per_replica: auto becomes a number, written to spec.yaml)
What differs between the commands is only how the job will run (`Use`): the local executor or SLURM,
and whether env_passthrough variables missing in this shell are an error, a warning or not looked at.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from hpcgpu.launch.chain import Upstream, pending_roots, with_after
from hpcgpu.launch.checks import adapter_base, check_host
from hpcgpu.launch.replicas import resolve_gpus_per_replica
from hpcgpu.launch.sweep import SweepTask, sweep_tasks, with_sweep
from hpcgpu.spec import Spec, load_spec

Say = Callable[[str], None]


@dataclass(frozen=True)
class Use:
    """How the command will use the specs, which decides what the host checks demand."""

    local: bool = False  # the local executor (here) rather than SLURM
    passthrough: str = "skip"  # env_passthrough unset here: "error", "warn" or "skip"
    when: str = "before submitting"  # when the user must set them (in the message)
    explain: bool = True  # say how infer.gpus_per_replica: auto was decided


VALIDATE = Use(explain=False)  # validate prints the resolved number in its summary
SBATCH = Use(passthrough="warn", when="in the shell that runs sbatch")  # the script reads them later
QUEUE = Use(local=True, passthrough="error")  # its jobs run here, as `submit --executor local`


def submit_use(local: bool, dry_run: bool) -> Use:
    """`hpcgpu submit` (local: the local executor): the job takes env_passthrough from this shell;
    --dry-run only warns."""
    return Use(local=local, passthrough="warn" if dry_run else "error")


@dataclass(frozen=True)
class Resolved:
    """A spec as a job runs it, and its sweep's tasks ([] without a sweep), each fully resolved."""

    spec: Spec
    tasks: list[SweepTask]

    @property
    def specs(self) -> list[Spec]:
        """What the jobs run: one spec per sweep task, or the spec itself."""
        return [task.spec for task in self.tasks] or [self.spec]


def read_resolved(spec_file: str, overrides: tuple[str, ...] = (), gpus: int | None = None,
                  nodes: int | None = None, sweeps: tuple[str, ...] = (), use: Use = VALIDATE,
                  say: Say | None = None, after: Upstream | None = None) -> Resolved:
    """Read SPEC with its --set/--gpus/--nodes/--sweep flags and resolve it (see the module's text);
    after: the job of `submit --after` (its run dir for ${after}; hpcgpu/launch/chain.py)."""
    spec = load_spec(spec_file, overrides, gpus=gpus, nodes=nodes, defaults=True)
    base = Path(spec_file).resolve().parent  # where load_spec made relative paths (`${after}/model`) absolute
    spec = with_sweep(with_after(spec, after, slurm=not use.local, base=base), sweeps)
    return resolve(spec, use, say, pending=pending_roots(after))


def resolve(spec: Spec, use: Use = VALIDATE, say: Say | None = None, pending: tuple[str, ...] = ()) -> Resolved:
    """Check a spec here (every sweep task) and decide what it leaves to the host (gpus_per_replica).
    pending: run dirs of jobs still to run, whose outputs the checks do not look for yet."""
    spec = with_adapter_base(spec)
    check_host([task.spec for task in sweep_tasks(spec)] or [spec], passthrough=use.passthrough,
               slurm=not use.local, warn=say, when=use.when, pending=pending)
    spec = resolve_gpus_per_replica(spec, local=use.local, say=say if use.explain else None)
    # the tasks of the resolved spec; a task that sweeps gpus_per_replica to auto decides its own
    tasks = [dataclasses.replace(task, spec=resolve_gpus_per_replica(task.spec, local=use.local))
             for task in sweep_tasks(spec)]
    return Resolved(spec, tasks)


def with_adapter_base(spec: Spec) -> Spec:
    """model.adapter without model.name_or_path: the base its adapter_config.json names, decided here once,
    so that the run's spec.yaml names it and the job loads what was checked (the check names a base it
    cannot find: checks.py adapter_problem)."""
    if not spec.model.adapter or spec.model.name_or_path or spec.model.config is not None:
        return spec
    base = adapter_base(spec.model.adapter)
    return dataclasses.replace(spec, model=dataclasses.replace(spec.model, name_or_path=base)) if base else spec
