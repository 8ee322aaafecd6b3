"""One rank's run, from start to exit: the lifecycle every task shares (train, infer, command,
callable and the user's own `hpcgpu.init()`).

    start    logging, the start-up line, the stop signals taken over (runtime/signals.py); for the
             tasks with a Context also the progress watchdog, the process group and the device
             (runtime/context.py `init`)
    run      the task; its GPU sampler is `Run.monitor`, its metrics `Run.metrics`
    stop     a signal (or the HPCGPU_SIGNAL_AT drill) only sets a flag -> every rank agrees at its
             next safe point (runtime/agree.py, the one agreement) -> the task finishes the work in
             hand (its own hook: train flushes its step log, infer drops the rows in its slots, the
             command task waits for its program) -> `Run.stop`: the task's state saved where it has
             one (train and ctx.stop: a blocking checkpoint), then runtime/stop.py's `stop_job`
             (srun's teardown after a peer's crash raised as TornDown, the stop record, the requeue,
             exit code 75)
    close    exactly once (`Run.close`): the watchdog, the checkpoint manager (a background save
             finished, unless the task failed), metrics.jsonl and its trackers, the signals given back

A task supplies only its hooks: its safe points, what it saves and what its stop record says
(StopNote). The command task never loads torch: it uses this module without a Context.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from hpcgpu.contract import RunPaths, attempt_id, node_name
from hpcgpu.gpu.monitor import GpuMonitor
from hpcgpu.runtime.diagnostics import print_startup_line
from hpcgpu.runtime.env import DistEnv
from hpcgpu.runtime.logsetup import setup_logging
from hpcgpu.runtime.metrics import MetricsWriter
from hpcgpu.runtime.requeue import requeue_after_crash
from hpcgpu.runtime.signals import StopSignals, stop_signals
from hpcgpu.runtime.stop import StopNote, stop_job
from hpcgpu.runtime.watchdog import Watchdog
from hpcgpu.spec import Spec
from hpcgpu.spec.derive import signal_name

log = logging.getLogger("hpcgpu")

Save = Callable[[], None]


@dataclass
class Run:
    """One rank's run (module docstring). records: whether its stop writes metrics.jsonl's "stop"
    record (the command task's program owns that file: not there)."""

    spec: Spec | None
    env: DistEnv
    run_dir: Path
    signals: StopSignals = field(default_factory=StopSignals)
    watchdog: Watchdog | None = None
    checkpoint: Any = None  # a checkpoint manager, set by tasks that checkpoint
    records: bool = True
    closed: bool = field(default=False, init=False)
    _metrics: MetricsWriter | None = field(default=None, init=False)

    @classmethod
    def begin(cls, spec: Spec | None, run_dir: Path, env: DistEnv, records: bool = True) -> "Run":
        """Logging and the start-up line, first of all: what follows may fail."""
        setup_logging(env, run_dir)
        print_startup_line(env)
        return cls(spec, env, run_dir, records=records)

    def watch(self) -> None:
        """This rank's progress watchdog (runtime/watchdog.py), for tasks that beat it."""
        node = node_name()
        spec, env, run_dir = self.spec, self.env, self.run_dir
        self.watchdog = Watchdog(run_dir, attempt_id(), env.rank, node,
                                 spec.distributed.hang_timeout_s if spec else None,
                                 on_fire=(lambda: requeue_after_crash(env, spec, run_dir)) if spec else None).start()

    def catch_signals(self, on_signal: Callable[[int], None] | None = None) -> None:
        """The spec's stop signals from now on set this run's flag (one that came early included)."""
        self.signals.install(stop_signals(signal_name(self.spec) if self.spec else None), on_signal)

    @property
    def metrics(self) -> MetricsWriter:
        """<run dir>/metrics.jsonl (rank 0 writes; elsewhere a no-op)."""
        if self._metrics is None:
            self._metrics = MetricsWriter(RunPaths(self.run_dir).metrics, enabled=self.env.is_main)
        return self._metrics

    def open_metrics(self, tracking: Any) -> MetricsWriter:
        """metrics.jsonl feeding rank 0's TensorBoard / W&B (runtime/track.py)."""
        self._metrics = MetricsWriter(RunPaths(self.run_dir).metrics, enabled=self.env.is_main, tracking=tracking)
        return self._metrics

    def monitor(self, on_gpus: bool, on_sample: Callable[[list[dict[str, Any]]], None] | None = None) -> GpuMonitor:
        """gpu.jsonl while the task runs: local rank 0 of each node samples the node's GPUs."""
        monitor = self.spec.monitor if self.spec is not None else None
        return GpuMonitor(self.run_dir, self.env.local_rank, monitor.interval_s if monitor else 5.0,
                          node_rank=self.env.node_rank, enabled=bool(monitor and monitor.enabled) and on_gpus,
                          on_sample=on_sample)

    def stop(self, note: StopNote, save: Save | None = None, *, checked: bool = True,
             torn_down_code: int | None = None, say: Callable[[str], None] = log.info) -> int:
        """The end of an agreed stop, the same for every task: `save` (the task's state, blocking; none
        where its outputs are its checkpoint), then stop_job. checked: False where nothing ran yet (a
        signal then is no teardown). torn_down_code: the exit code of a teardown (default 128+SIGTERM)."""
        assert self.spec is not None  # only a run with a spec stops through hpcgpu (checked by ctx.stop)
        if save is not None:
            save()
        signum = self.signals.signum if checked else None
        codes = {} if torn_down_code is None else {"torn_down_code": torn_down_code}
        return stop_job(self.spec, self.env, self.run_dir, signum, note, self.metrics if self.records else None,
                        say=say, **codes)

    def close(self, finish_saves: bool = True) -> None:
        """Exactly once. finish_saves: wait for a background checkpoint (collective); not when leaving
        on an error (a peer may be dead)."""
        if self.closed:
            return
        self.closed = True
        if self.watchdog is not None:
            self.watchdog.stop()
        if finish_saves and self.checkpoint is not None:
            self.checkpoint.close()
        if self._metrics is not None:
            self._metrics.close()
        self.signals.restore()
