"""The one stop of every task after an agreed stop signal, and the drill that sends one.

train, infer, ctx.stop and the command task all leave the same way, through their run's
`Run.stop` (runtime/run.py, the whole stop protocol): a SIGTERM that was srun ending the step after
another rank failed is that crash (TornDown: raised, never requeued); otherwise the reason (timeout,
preempted, ...), one "stop" record in metrics.jsonl (not the command task's: its program owns the
file), the trackers closed, rank 0 requeues (capped by slurm.max_requeues) and the exit code of a
stopped run, 75. What differs by task is only what the record and the line say (train: step and
saved; infer: rows).
"""
from __future__ import annotations

import logging
import os
import signal
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from hpcgpu.contract import ENV_SIGNAL_AT, EXIT_STOPPED
from hpcgpu.runtime.env import DistEnv
from hpcgpu.runtime.metrics import MetricsWriter
from hpcgpu.runtime.requeue import TornDown, describe_stop, requeue, stop_reason, torn_down_by
from hpcgpu.spec import Spec
from hpcgpu.spec.derive import signal_name

log = logging.getLogger("hpcgpu")


@dataclass(frozen=True)
class StopNote:
    """What a task says of its stop. at: the record's leading fields (train {"step": N}, infer
    {"rows": N}); after: fields after reason and restart_count (train's "saved"); line: the log line
    after "<reason>: "."""

    at: dict[str, Any]
    line: str
    after: dict[str, Any] = field(default_factory=dict)


def stop_job(spec: Spec, env: DistEnv, run_dir: Path, signum: int | None, note: StopNote,
             metrics: MetricsWriter | None = None, torn_down_code: int = 128 + signal.SIGTERM,
             say: Callable[[str], None] = log.info) -> int:
    """After an agreed stop: raise TornDown for srun's teardown after a peer's crash (signum None: no
    such check, nothing ran yet), else record and say why, requeue, and return EXIT_STOPPED."""
    why = torn_down_by(spec, env, signum, run_dir)
    if why is not None:
        raise TornDown(why, torn_down_code)
    reason = stop_reason(spec, env)
    if metrics is not None:
        metrics.write("stop", **note.at, reason=reason, restart_count=env.restart_count, **note.after)
    say(f"{describe_stop(reason)}: {note.line}")
    if metrics is not None:
        metrics.close_trackers()  # before the requeue's SIGTERM reaches W&B's helper process
    requeue(env, spec, reason)
    return EXIT_STOPPED


def inject_signal(spec: Spec | None, rank: int, count: int, armed: bool = True) -> None:
    """Fault injection for tests and drills: HPCGPU_SIGNAL_AT="N[:RANK]" makes that rank send itself
    the spec's stop signal when its `count` (train: optimizer steps; infer: batches run) reaches N,
    exactly as `scancel --signal` would. armed: False where a resumed run must go on instead (train:
    at the step it resumed from; infer: a start that found rows already written)."""
    spec_at = os.environ.get(ENV_SIGNAL_AT)
    if not spec_at or not armed or spec is None:
        return
    at, _, only = spec_at.partition(":")
    if count == int(at) and (not only or int(only) == rank):
        os.kill(os.getpid(), getattr(signal, f"SIG{signal_name(spec)}"))
