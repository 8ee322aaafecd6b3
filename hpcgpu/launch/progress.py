"""A run's progress from its run dir: the last records of metrics.jsonl (and an infer run's written rows),
read from the end of the file so that `hpcgpu status` stays quick on a long run; and how a run that
stopped goes on (its newest complete checkpoint, the command that resumes it, where a job resumed from)."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from hpcgpu.contract import RunPaths, checkpoint_step, complete_checkpoints
from hpcgpu.errors import HpcgpuError
from hpcgpu.launch.rundir import recorded_width
from hpcgpu.spec import dump_spec, load_spec


@dataclass(frozen=True)
class RunProgress:
    """How far a run got: a train run's step and loss, an infer run's rows; and its rate so far."""

    step: int | None = None
    loss: float | None = None
    rows: int | None = None  # task: infer: rows written, of rows_total
    rows_total: int | None = None
    max_steps: int | None = None
    tokens_per_s: float | None = None  # train: the last logged interval's
    rate: float | None = None  # steps/s (train) or rows/s (infer) over this start of the job so far

    def text(self) -> str:
        """'step 120/1000 (loss 2.7021)', 'rows 45/45', or '-'."""
        if self.rows is not None:
            return f"rows {self.rows}/{self.rows_total if self.rows_total is not None else '?'}"
        if self.step is None:
            return "-"
        of = f"/{self.max_steps}" if self.max_steps else ""
        return f"step {self.step}{of}" + (f" (loss {self.loss:.4f})" if isinstance(self.loss, (int, float)) else "")

    def eta_s(self) -> float | None:
        """Seconds left at the rate so far: (max_steps - step) or (rows_total - rows) over it."""
        if not self.rate:
            return None
        if self.rows is not None and self.rows_total is not None:
            return max(0, self.rows_total - self.rows) / self.rate
        if self.step is not None and self.max_steps:
            return max(0, self.max_steps - self.step) / self.rate
        return None


def tail_records(run_dir: str | Path, tail_bytes: int = 65536) -> list[dict]:
    """The records at the end of metrics.jsonl (only its last `tail_bytes` are read)."""
    path = RunPaths(Path(run_dir)).metrics
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            size = fh.tell()
            fh.seek(max(0, size - tail_bytes))
            lines = fh.read().decode(errors="replace").splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut by the seek, or still being written
        if isinstance(record, dict):
            out.append(record)
    return out


def run_warnings(run_dir: str | Path) -> list[str]:
    """What the run warned of in metrics.jsonl (e.g. ranks that ran apart), each text once."""
    texts = [r["text"] for r in tail_records(run_dir) if r.get("kind") == "warning" and isinstance(r.get("text"), str)]
    return list(dict.fromkeys(texts))


def stop_summary(run_dir: str | Path) -> str:
    """How a run that exited 75 stopped, from its last stop record: a train run stopped before its
    first step saved nothing (rerunning starts it, not resumes it)."""
    stop = next((r for r in reversed(tail_records(run_dir)) if r.get("kind") == "stop"), {})
    if stop.get("saved") is False:
        return "stopped before its first step, nothing saved"
    if isinstance(stop.get("step"), int):
        return f"stopped at step {stop['step']}, at its checkpoint"
    if isinstance(stop.get("rows"), int):
        return f"stopped after {stop['rows']} rows, all written"
    return "stopped at a checkpoint"


def steps_per_s(records: list[dict]) -> float | None:
    """Steps per second over the train records since the job last (re)started, eval and checkpoint
    time included: what the remaining steps will take."""
    since: list[dict] = []
    for r in records:
        if r.get("kind") in ("resume", "start"):
            since = []
        elif r.get("kind") == "train" and isinstance(r.get("time"), (int, float)):
            since.append(r)
    if len(since) >= 2 and since[-1]["time"] > since[0]["time"]:
        return (since[-1]["step"] - since[0]["step"]) / (since[-1]["time"] - since[0]["time"])
    ms = since[-1].get("ms_per_step") if since else None
    return 1000.0 / ms if isinstance(ms, (int, float)) and ms > 0 else None


WRITTEN_ROWS_MAX_BYTES = 64 << 20  # counted while status stays quick; a larger output keeps its record's count


def written_rows(run_dir: str | Path) -> int | None:
    """task: infer: the complete rows its replicas have written (the lines of outputs/replica-*.jsonl;
    a row cut by a kill has no newline yet), or None where they are too large to count here."""
    files = RunPaths(Path(run_dir)).replica_output_files()
    try:
        if not files or sum(f.stat().st_size for f in files) > WRITTEN_ROWS_MAX_BYTES:
            return None
        return sum(f.read_bytes().count(b"\n") for f in files)
    except OSError:
        return None


def last_progress(run_dir: str | Path, tail_bytes: int = 65536) -> RunProgress:
    """The last progress record of metrics.jsonl ({"kind": "train"}; task: infer, "infer" or its
    "end"), reading only the end of the file."""
    records = tail_records(run_dir, tail_bytes)
    for record in reversed(records):
        kind = record.get("kind")
        if kind == "train":
            return RunProgress(record.get("step"), record.get("loss"), max_steps=record.get("max_steps"),
                            tokens_per_s=record.get("tokens_per_s"), rate=steps_per_s(records))
        if kind == "infer":
            rows, on_disk = record.get("rows"), written_rows(run_dir)
            if isinstance(rows, int) and on_disk is not None:
                rows = max(rows, on_disk)  # the record is up to a progress interval old, or a kill's last
            return RunProgress(rows=rows, rows_total=record.get("rows_total"), rate=record.get("rows_per_s"))
        if kind == "end" and "rows" in record:
            return RunProgress(rows=record["rows"], rows_total=record["rows"])
    return RunProgress()


# --- how a stopped run goes on ----------------------------------------------------------------------

def last_checkpoint(run_dir: str | Path) -> Path | None:
    """The newest complete checkpoints/step-N of a run: the one a resume takes."""
    done = complete_checkpoints(RunPaths(Path(run_dir)).checkpoints)
    return done[-1] if done else None


def resume_spec(spec_file: str, run_dir: str | Path) -> str:
    """The spec file whose `hpcgpu submit` resumes the run dir: the one it was submitted from where that
    still resolves to the run's spec word for word (no --set or --gpus was given, the file is unchanged),
    else the run dir's own spec.yaml (the resolved spec: submitting it finds the same run)."""
    recorded = RunPaths(Path(run_dir)).spec
    try:
        if dump_spec(load_spec(spec_file, defaults=True)) == recorded.read_text():
            return spec_file
    except (HpcgpuError, OSError, ValueError):
        pass  # moved, changed or broken since: the run dir's copy still resumes
    return str(recorded)


@dataclass(frozen=True)
class Resumed:
    """A job that went on from an earlier job's checkpoint (or written rows) in the same run dir."""

    step: int | None
    rows: int | None
    width: int | None  # ranks now (the run's plan.json)
    was: int | None  # ranks the checkpoint was written at (its own plan.json), where it is still there

    def text(self) -> str:
        """'from step 40 (at 2 GPUs, was 4)', 'after 45 rows'."""
        where = f"after {self.rows} rows" if self.rows is not None else f"from step {self.step}"
        if self.width is None:
            return where
        at = f"{self.width} GPU" + ("s" if self.width != 1 else "")
        return f"{where} (at {at}, was {self.was})" if self.was not in (None, self.width) else f"{where} (at {at})"


def resumed_since(run_dir: str | Path, since: float, until: float | None = None) -> Resumed | None:
    """The resume that began a job submitted at `since` in this run dir (`until` the next job's
    submission there): the first resume record written between them that is no requeue's (restart_count 0: the job's own start, going on from an
    earlier job's checkpoint). The whole file is scanned for resume lines only (status of one job)."""
    try:
        with open(RunPaths(Path(run_dir)).metrics, "rb") as fh:
            lines = [line for line in fh if b'"resume"' in line]
    except OSError:
        return None
    for line in lines:
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        when = record.get("time", 0)
        if record.get("kind") != "resume" or record.get("restart_count") or when < since \
                or (until is not None and when >= until):
            continue
        checkpoint = RunPaths(Path(run_dir)).checkpoints / str(record.get("checkpoint", ""))
        was = recorded_width(checkpoint)[0] if record.get("checkpoint") else None
        return Resumed(record.get("step"), record.get("rows"), recorded_width(Path(run_dir))[0], was)
    return None
