"""Experiment trackers: rank 0 mirrors metrics.jsonl and the GPU monitor's samples to TensorBoard and W&B.

    tracking = open_tracking(spec, paths, ctx.is_main)     # once per job; inactive off rank 0
    metrics = MetricsWriter(paths.metrics, enabled=ctx.is_main, tracking=tracking)
    tracking.start(resume_step)                              # train: the checkpoint's step; infer: none
    GpuMonitor(..., on_sample=tracking.gpu_sample if tracking.active else None)

MetricsWriter hands every record to `Tracking.record`, which turns the ones that matter (train, eval,
infer) into `{name: number}` at a step and logs them to each enabled Tracker. GPU samples come from
the monitor's thread; one lock serialises every call, so the backends need not be thread-safe.

A tracker that fails (disk full, W&B gone) logs one warning and is off for the rest of the job:
training never stops for a tracker. The packages are imported here only, in rank 0 of a job whose
spec enables them; `hpcgpu submit` checked that they are installed (launch/checks.py).
"""
from __future__ import annotations

import json
import logging
import os
import secrets
import threading
from pathlib import Path
from typing import Any, Callable, Mapping, Protocol

from hpcgpu.contract import RunPaths
from hpcgpu.spec import Spec
from hpcgpu.spec.load import spec_to_dict

log = logging.getLogger("hpcgpu")

Metrics = dict[str, float]

TENSORBOARD_DIR = "tensorboard"
WANDB_ID_FILE = "wandb-run-id"  # one W&B run per run dir, across requeues
WANDB_STEP_FILE = "wandb-step"  # the highest step W&B wrote (at a clean close): a resumed job sends later ones

# metrics.jsonl fields mirrored to the trackers, by record kind: field -> tracker name
TRAIN_FIELDS = {"loss": "train/loss", "lr": "train/lr", "tokens_per_s": "train/tokens_per_s", "mfu": "train/mfu",
                "ms_per_step": "train/ms_per_step", "peak_mem_gib": "train/peak_mem_gib", "tokens": "train/tokens"}
EVAL_FIELDS = {"loss": "eval/loss"}
INFER_FIELDS = {"rows": "infer/rows", "rows_per_s": "infer/rows_per_s", "tokens_per_s": "infer/tokens_per_s",
                "prompt_tokens_per_s": "infer/prompt_tokens_per_s", "peak_mem_gib": "infer/peak_mem_gib"}
# gpu.jsonl fields (one sample of one GPU) -> (name under gpu/<index>/, scale)
GPU_FIELDS = {"util": ("util", 1.0), "mem_used": ("mem_used_gib", 1 / 2**30), "power": ("power_w", 1.0),
              "temp": ("temp_c", 1.0)}


class Tracker(Protocol):
    """One backend. Called under Tracking's lock, from the main thread or the GPU monitor's."""

    name: str

    def config(self, values: dict[str, Any]) -> None:
        """The run's configuration: {"spec": the resolved spec, "plan": the run plan}."""

    def log(self, step: int, metrics: Metrics) -> None:
        """Numbers at a step; steps never go down within one job."""

    def close(self) -> None:
        """Flush and release; the last call."""


# ---------------------------------------------------------------- backends

class TensorBoardTracker:
    """Event files in <run dir>/tensorboard/ (`tensorboard --logdir runs/`)."""

    name = "tensorboard"

    def __init__(self, folder: Path, purge_step: int | None):
        from torch.utils.tensorboard import SummaryWriter  # the job has torch; tensorboard is the extra

        # purge_step: TensorBoard hides what an earlier writer logged at this step or later, i.e. the steps
        # an interrupted job ran past its last checkpoint; the resumed job logs them anew
        self.writer = SummaryWriter(str(folder), purge_step=purge_step, flush_secs=30)
        self.start_step = max(0, (purge_step or 1) - 1)

    def config(self, values: dict[str, Any]) -> None:
        text = json.dumps(values, indent=2, default=str)
        # indented four spaces: TensorBoard's text plugin shows it as a code block, as written
        self.writer.add_text("config", "\n".join("    " + line for line in text.splitlines()), self.start_step)

    def log(self, step: int, metrics: Metrics) -> None:
        for name, value in metrics.items():
            self.writer.add_scalar(name, value, step)

    def close(self) -> None:
        self.writer.close()


class WandbTracker:
    """A W&B run under <run dir>/wandb/; one run id for every start of the run dir."""

    name = "wandb"

    def __init__(self, spec: Spec, run_dir: Path):
        import wandb

        settings = spec.track.wandb
        assert settings is not None
        self.run_dir = run_dir
        # W&B refuses steps below the last it has (and adds nothing to one it closed): a resumed job sends
        # only steps after the highest one an earlier start wrote (kept in the run dir at its clean close),
        # so the steps between the last checkpoint and the stop keep the values of their first run
        self.floor = read_step(run_dir / WANDB_STEP_FILE)
        self.sent = self.floor
        self.run = wandb.init(
            project=settings.project or spec.name, entity=settings.entity, mode=settings.mode,
            tags=settings.tags or None, id=wandb_run_id(run_dir), resume="allow", dir=str(run_dir),
            name=f"{spec.name}-{run_dir.name}",
            # the job's log already has the console; hpcgpu's own GPU monitor samples (no second sampler)
            settings=wandb.Settings(silent=True, console="off", x_disable_stats=True))

    def config(self, values: dict[str, Any]) -> None:
        self.run.config.update(values, allow_val_change=True)

    def log(self, step: int, metrics: Metrics) -> None:
        if step <= self.floor or step < self.sent:
            return
        self.run.log(metrics, step=step)
        self.sent = step

    def close(self) -> None:
        try:
            self.run.finish()
        finally:
            # wandb's helper process (wandb-core) outlives finish() until wandb's exit hook ends it; a
            # requeue's SIGTERM to every process of the job would end it first, and the hook would print a
            # traceback. Ended now: after a clean finish, or once a SIGTERM already took it (the
            # tracker's one warning says so), nothing is left for the hook to trip on
            teardown_wandb_quietly()
        # Only now is what was logged written: a step file saved earlier could claim steps a killed
        # helper never wrote, and the resumed job would never send them. Claiming too few costs
        # nothing: W&B drops a step below one it has.
        if self.sent > self.floor:
            write_text_atomic(self.run_dir / WANDB_STEP_FILE, f"{self.sent}\n")


def teardown_wandb_quietly() -> None:
    import wandb

    try:
        wandb.teardown()
    except Exception:
        pass  # the service is gone: what failed is already reported


def wandb_run_id(run_dir: Path) -> str:
    """The run dir's W&B run id: read back, or made and kept on the first start."""
    path = run_dir / WANDB_ID_FILE
    try:
        found = path.read_text().strip()
        if found:
            return found
    except FileNotFoundError:
        pass
    run_id = secrets.token_hex(4)  # W&B ids: lower-case letters and digits
    write_text_atomic(path, run_id + "\n")
    return run_id


def read_step(path: Path) -> int:
    """The step in a step file; -1 when there is none (nothing sent yet)."""
    try:
        return int(path.read_text().strip())
    except (FileNotFoundError, ValueError):
        return -1


def write_text_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


# ---------------------------------------------------------------- the trackers of one job

class Tracking:
    """Rank 0's trackers: records of metrics.jsonl and GPU samples in, Tracker.log calls out."""

    def __init__(self, spec: Spec | None, paths: RunPaths | None,
                 openers: Mapping[str, Callable[[int | None], Tracker]] | None = None):
        self.spec, self.paths = spec, paths
        self.openers = dict(openers or {})
        self.active = bool(self.openers)
        self.trackers: list[Tracker] = []
        self.every = (spec.track.every_steps or spec.train.log_every) if spec is not None else 1
        self.step = 0  # the latest step seen (train) or rows done (infer): where GPU samples go
        self.started = self.closed = False
        self.lock = threading.Lock()

    def start(self, resume_step: int | None = None) -> None:
        """Open the trackers (once), before the clock of the first throughput record starts. Train
        passes the step it resumed at (0 on a fresh start): TensorBoard hides the steps an earlier job
        logged after it. Infer passes none (its steps, rows done, only grow)."""
        with self.lock:
            self._start(resume_step)

    def _start(self, resume_step: int | None) -> None:
        if self.started or self.closed or not self.active:
            return
        self.started = True
        self.step = resume_step or 0
        purge = resume_step + 1 if resume_step is not None else None
        for name, opener in self.openers.items():
            try:
                self.trackers.append(opener(purge))
            except Exception as exc:
                log.warning(f"tracker {name}: not started ({type(exc).__name__}: {exc}); the job goes on without it")
        values = self.config_values()
        self._each("config", lambda tracker: tracker.config(values))

    def config_values(self) -> dict[str, Any]:
        """The resolved spec and the run plan (plan.json, written before the first step)."""
        values: dict[str, Any] = {"spec": spec_to_dict(self.spec) if self.spec is not None else None, "plan": None}
        if self.paths is not None and self.paths.plan.exists():
            try:
                values["plan"] = json.loads(self.paths.plan.read_text())
            except (OSError, ValueError) as exc:
                log.warning(f"trackers: plan.json not read for the config: {exc}")
        return values

    def record(self, kind: str, fields: Mapping[str, Any]) -> None:
        """A metrics.jsonl record (from MetricsWriter.write, the main thread)."""
        if not self.active:
            return
        with self.lock:
            if kind == "train":
                self.step = int(fields["step"])
                if self._thin(self.step, fields.get("max_steps")):
                    self._log(self.step, pick(fields, TRAIN_FIELDS))
            elif kind == "eval":
                self._log(int(fields["step"]), pick(fields, EVAL_FIELDS))
            elif kind == "infer":
                self.step = int(fields["rows"])  # rows done: infer's steps
                self._log(self.step, pick(fields, INFER_FIELDS))

    def _thin(self, step: int, max_steps: Any) -> bool:
        """track.every_steps: every Nth step, and the first and last (the record carries the run plan's
        max_steps: with train.epochs the spec has none), as the train loop logs."""
        return step % self.every == 0 or step == 1 or step == max_steps

    def gpu_sample(self, records: list[dict[str, Any]]) -> None:
        """One GPU monitor sample (a record per GPU, as in gpu.jsonl), from the sampler thread. Samples
        before the trackers opened are dropped (they are in gpu.jsonl)."""
        metrics: Metrics = {}
        for rec in records:
            for key, (name, scale) in GPU_FIELDS.items():
                if isinstance(rec.get(key), (int, float)):
                    metrics[f"gpu/{rec['gpu']}/{name}"] = float(rec[key]) * scale
        with self.lock:
            if self.started and metrics:
                self._log(self.step, metrics)

    def _log(self, step: int, metrics: Metrics) -> None:
        if not metrics:
            return
        if not self.started:
            self._start(None)  # a record before start() opens them (without a TensorBoard purge)
        self._each(f"log at step {step}", lambda tracker: tracker.log(step, metrics))

    def _each(self, what: str, call: Callable[[Tracker], None]) -> None:
        for tracker in list(self.trackers):
            try:
                call(tracker)
            except Exception as exc:  # a tracker never stops the job
                log.warning(f"tracker {tracker.name}: {what} failed ({type(exc).__name__}: {exc}); "
                            "it is off for the rest of this job")
                self.trackers.remove(tracker)
                self._close_quietly(tracker)

    @staticmethod
    def _close_quietly(tracker: Tracker) -> None:
        try:
            tracker.close()
        except Exception:
            pass  # already reported as failed

    def close(self) -> None:
        with self.lock:
            self.closed = True
            self._each("close", lambda tracker: tracker.close())
            self.trackers.clear()


def pick(fields: Mapping[str, Any], names: Mapping[str, str]) -> Metrics:
    """The numeric fields among `names`, renamed for the trackers (None left out; a NaN loss is shown)."""
    out: Metrics = {}
    for key, name in names.items():
        value = fields.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            out[name] = float(value)
    return out


def tracker_openers(spec: Spec, run_dir: Path) -> dict[str, Callable[[int | None], Tracker]]:
    """The enabled trackers of a spec, each as a function of TensorBoard's purge step."""
    openers: dict[str, Callable[[int | None], Tracker]] = {}
    if spec.track.tensorboard:
        openers["tensorboard"] = lambda purge: TensorBoardTracker(run_dir / TENSORBOARD_DIR, purge)
    wandb = spec.track.wandb
    if wandb is not None and wandb.mode != "disabled":
        openers["wandb"] = lambda purge: WandbTracker(spec, run_dir)
    return openers


def open_tracking(spec: Spec, paths: RunPaths, is_main: bool) -> Tracking:
    """The job's trackers, decided once: active in rank 0 when the spec enables one. Nothing is
    imported or written until they start (train: Tracking.start; infer: its first record)."""
    return Tracking(spec, paths, tracker_openers(spec, paths.run_dir) if is_main else None)
