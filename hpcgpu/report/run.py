"""A run's report: one PNG (loss, tokens/s, per-GPU utilization, memory, power) and a text summary.

Host side: reads metrics.jsonl and gpu*.jsonl, imports matplotlib (Agg) and nothing heavier.
Panels exist only for data the run has, so a CPU run (no gpu.jsonl) or a run killed early still plots.

A `task: infer` run (spec.yaml, else plan.json, else its "infer" records say so) gets its own panels:
rows done, rows/s and tokens/s over wall time, restarts marked, then the same per-GPU panels as train
on the same clock; its summary gives rows done/total, mean rows/s and tokens/s, peak memory and whether
outputs.jsonl is complete (the FINISHED marker).
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import yaml

from hpcgpu.contract import FINISHED_MARKER, RunPaths, is_finished, startup_phases
from hpcgpu.errors import HpcgpuError
from hpcgpu.launch.snapshot import commit_text

GiB = 1 << 30


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Complete records only: a line cut short by a kill is skipped; none if the file is not there."""
    out: list[dict[str, Any]] = []
    if not path.exists():
        return out
    for line in path.read_text(errors="replace").splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(rec, dict):
            out.append(rec)
    return out


def _num(v: Any) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else None


def _y(v: Any) -> float:
    """A value to plot: a gap (NaN) where the record has none ("nan" strings, nulls)."""
    x = _num(v)
    return math.nan if x is None else x


@dataclass
class RunData:
    run_dir: Path
    train: list[dict[str, Any]] = field(default_factory=list)  # one record per step: the newest wins
    eval: list[dict[str, Any]] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)  # resume / stop / end
    gpu: list[dict[str, Any]] = field(default_factory=list)
    task: str = "train"  # spec.yaml's task; "infer" gets the infer panels and summary
    mode: str | None = None  # task: infer: generate | score (None: not known)
    infer: list[dict[str, Any]] = field(default_factory=list)  # the "infer" progress records, in file order
    # one list of "infer" records per start of the job (Progress counts rows/s, tokens from each start)
    infer_starts: list[list[dict[str, Any]]] = field(default_factory=list)
    rows_total: int | None = None  # task: infer: the input's rows (plan.json, when no record says)
    startups: list[dict[str, Any]] = field(default_factory=list)  # task: train: rank 0's "startup", one per start


def _latest_per_step(recs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    # after a resume the steps since the checkpoint run again: the re-run's values are the ones that count
    by_step = {r["step"]: r for r in recs if isinstance(r.get("step"), int)}
    return [by_step[s] for s in sorted(by_step)]


def nothing_to_report(run_dir: Path) -> str:
    """Why a run dir has no records to plot, in words a user can act on."""
    paths = RunPaths(run_dir)
    if paths.metrics.exists():
        return "has a metrics.jsonl without one complete record (not a run's, or cut short)"
    logs = paths.logs
    if logs.is_dir() and any(logs.iterdir()):
        return f"has no metrics.jsonl: the job ended before its first record; its logs are in {logs}"
    return "has no metrics.jsonl or gpu.jsonl (has the job started?)"


def load_run(run_dir: str | Path) -> RunData:
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise HpcgpuError(f"RUN_DIR: {run_dir} is not a directory")
    paths = RunPaths(run_dir)
    metrics = read_jsonl(paths.metrics)
    gpu = [r for p in paths.gpu_logs() for r in read_jsonl(p)]
    if not metrics and not gpu:
        raise HpcgpuError(f"RUN_DIR: {run_dir} {nothing_to_report(run_dir)}")
    events = [r for r in metrics if r.get("kind") in ("resume", "stop", "end")]
    task, mode, rows_total = _task_of(run_dir, metrics)
    if task == "infer":
        return RunData(run_dir, events=events, gpu=gpu, task=task, mode=mode,
                       infer=[r for r in metrics if r.get("kind") == "infer"], infer_starts=_infer_starts(metrics),
                       rows_total=rows_total)
    return RunData(run_dir,
                   train=_latest_per_step([r for r in metrics if r.get("kind") == "train"]),
                   eval=_latest_per_step([r for r in metrics if r.get("kind") == "eval"]),
                   events=events, gpu=gpu, startups=[r for r in metrics if r.get("kind") == "startup"])


def _task_of(run_dir: Path, metrics: list[dict[str, Any]]) -> tuple[str, str | None, int | None]:
    """(task, infer mode, input rows) from the run's spec.yaml and plan.json; without them an "infer"
    record in metrics.jsonl says it is an infer run."""
    task = mode = rows = None
    try:
        spec = yaml.safe_load(RunPaths(run_dir).spec.read_text())
    except (OSError, yaml.YAMLError):
        spec = None
    if isinstance(spec, dict):
        task = spec.get("task") if isinstance(spec.get("task"), str) else None
        inf = spec.get("infer")
        mode = inf.get("mode") if isinstance(inf, dict) and isinstance(inf.get("mode"), str) else None
    try:
        plan = json.loads(RunPaths(run_dir).plan.read_text())
    except (OSError, ValueError):
        plan = None
    if isinstance(plan, dict):
        inf = plan.get("infer")
        task = task or (plan.get("task") if isinstance(plan.get("task"), str) else None)
        if isinstance(inf, dict):
            mode = mode or (inf.get("mode") if isinstance(inf.get("mode"), str) else None)
            rows = inf.get("rows") if isinstance(inf.get("rows"), int) else None
    if task is None:
        task = "infer" if any(r.get("kind") == "infer" for r in metrics) else "train"
    return task, mode, rows


def _infer_starts(metrics: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """The "infer" records cut at each start of the job: a start follows a stop or resume record, or its
    elapsed_s (seconds since that start's first batch began) is below the record before's."""
    starts: list[list[dict[str, Any]]] = []
    cut, last_elapsed = True, None
    for r in metrics:
        kind = r.get("kind")
        if kind in ("stop", "resume"):
            cut = True
        elif kind == "infer":
            elapsed = _num(r.get("elapsed_s"))
            if cut or (elapsed is not None and last_elapsed is not None and elapsed < last_elapsed):
                starts.append([])
            starts[-1].append(r)
            cut, last_elapsed = False, elapsed if elapsed is not None else last_elapsed
    return starts


# ---------------------------------------------------------------- summary

@dataclass
class Summary:
    steps: int | None
    tokens: int | None
    mean_tokens_per_s: float | None
    mean_mfu: float | None
    final_loss: float | None
    final_eval_loss: float | None
    restarts: int
    finished: bool
    gpu_peak_mem: dict[str, int]  # "node N gpu M" or "gpu M" -> bytes, as NVML saw them (all processes)
    gpu_mean_util: dict[str, float]
    peak_allocated_gib: float | None = None  # rank 0's torch.cuda.max_memory_allocated (metrics.jsonl)
    startup_s: list[float] = field(default_factory=list)  # each start's process start -> first step done
    last_startup: dict[str, float] = field(default_factory=dict)  # the newest start's phases, in order
    commit: str | None = None  # the code's commit, "abc1234 dirty" (provenance.json)

    def text(self) -> str:
        def f(v: float | None, spec: str) -> str:
            return "-" if v is None else format(v, spec)

        lines = [f"steps            {f(self.steps, 'd')}" + ("" if self.finished else " (not finished)"),
                 f"tokens           {f(self.tokens, ',d')}",
                 f"mean tokens/s    {f(self.mean_tokens_per_s, ',.0f')}",
                 f"mean MFU         {'-' if self.mean_mfu is None else f'{self.mean_mfu * 100:.1f}%'}",
                 f"final loss       {f(self.final_loss, '.4f')}" + (
                     f" (eval {self.final_eval_loss:.4f})" if self.final_eval_loss is not None else ""),
                 f"restarts         {self.restarts}"]
        if self.peak_allocated_gib is not None:
            lines.append(f"peak allocated   {self.peak_allocated_gib:.2f} GiB (torch, rank 0)")
        if self.startup_s:
            lines.append(self._startup_line())
        if not self.gpu_peak_mem:
            lines.append("GPUs             no GPU samples (gpu.jsonl) in this run")
        for key, peak in self.gpu_peak_mem.items():
            lines.append(f"{key:<16} peak memory {peak / GiB:.1f} GiB, mean util {self.gpu_mean_util[key]:.0f}%")
        if self.commit:
            lines.append(f"commit           {self.commit}")
        return "\n".join(lines)

    def _startup_line(self) -> str:
        n = len(self.startup_s)
        spread = f" ({min(self.startup_s):.1f}-{max(self.startup_s):.1f} s over {n} starts)" if n > 1 else ""
        phases = ", ".join(f"{name} {s:.1f} s" for name, s in self.last_startup.items())
        return f"start-up         {self.startup_s[-1]:.1f} s to the first step{spread}; the last: {phases}"


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def gpu_key(r: dict[str, Any], multi_node: bool) -> str:
    return f"node {r.get('node', 0)} gpu {r.get('gpu')}" if multi_node else f"gpu {r.get('gpu')}"


def summarize(d: RunData) -> Summary:
    # the first logged step carries start-up (compile, warm-up): leave it out of the means when there are others
    steady = d.train[1:] if len(d.train) > 1 else d.train
    tok = [v for r in steady if (v := _num(r.get("tokens_per_s"))) is not None]
    mfu = [v for r in steady if (v := _num(r.get("mfu"))) is not None]
    tokens = [int(r["tokens"]) for r in d.train + d.events if isinstance(r.get("tokens"), int)]
    steps = [int(r["step"]) for r in d.train + d.events if isinstance(r.get("step"), int)]
    peak, mean_util = _gpu_stats(d)
    return Summary(
        steps=max(steps) if steps else None, tokens=max(tokens) if tokens else None,
        mean_tokens_per_s=_mean(tok), mean_mfu=_mean(mfu),
        final_loss=_num(d.train[-1].get("loss")) if d.train else None,
        final_eval_loss=_num(d.eval[-1].get("loss")) if d.eval else None,
        restarts=sum(1 for r in d.events if r.get("kind") == "resume"),
        # the train task's "end" record, or the FINISHED marker every task leaves (your own main(ctx)
        # writes no "end" record unless it chooses to)
        finished=any(r.get("kind") == "end" for r in d.events) or is_finished(d.run_dir),
        gpu_peak_mem=peak, gpu_mean_util=mean_util,
        peak_allocated_gib=max((v for r in d.train if (v := _num(r.get("peak_mem_gib"))) is not None), default=None),
        startup_s=[v for r in d.startups if (v := _num(r.get("total_s"))) is not None],
        last_startup=_phases(d.startups[-1]) if d.startups else {}, commit=commit_text(d.run_dir))


def _phases(record: dict[str, Any]) -> dict[str, float]:
    """A startup record's phases that are numbers, in the order the job wrote them."""
    values = {name: _num(v) for name, v in startup_phases(record).items()}
    return {name: v for name, v in values.items() if v is not None}


def _gpu_stats(d: RunData) -> tuple[dict[str, int], dict[str, float]]:
    """Per GPU: peak memory used (bytes) and mean utilization (%), from gpu*.jsonl."""
    multi = len({r.get("node", 0) for r in d.gpu}) > 1
    peak: dict[str, int] = {}
    utils: dict[str, list[float]] = {}
    for r in sorted(d.gpu, key=lambda r: (r.get("node", 0), r.get("gpu", 0))):
        key = gpu_key(r, multi)
        peak[key] = max(peak.get(key, 0), int(_num(r.get("mem_used")) or 0))
        utils.setdefault(key, [])
        if (u := _num(r.get("util"))) is not None:
            utils[key].append(u)
    return peak, {k: _mean(v) or 0.0 for k, v in utils.items()}


# ---------------------------------------------------------------- task: infer summary

@dataclass
class InferSummary:
    task: str  # "infer": report.json tells the two summaries apart
    mode: str | None  # generate | score
    rows: int | None  # rows done (written to outputs): the most any record counts
    rows_total: int | None
    mean_rows_per_s: float | None  # rows / seconds, over the logged time of every start
    mean_tokens_per_s: float | None  # generated tokens / seconds (generate)
    mean_prompt_tokens_per_s: float | None  # prompt tokens / seconds (score: the tokens scored)
    # what the means are over: each start's newest record (a stopped start's last batches, up to 10 s of
    # them, are in none), so these undercount a run that was stopped; the model loading is left out
    logged_generated_tokens: int | None
    logged_s: float | None
    restarts: int  # resume records: starts that went on from rows written before
    stops: list[str]  # each stop record's reason, in order
    finished: bool  # the FINISHED marker: outputs.jsonl was merged whole
    output_rows: int | None  # lines in outputs.jsonl (None: not there)
    gpu_peak_mem: dict[str, int]
    gpu_mean_util: dict[str, float]
    peak_allocated_gib: float | None = None  # torch.cuda.max_memory_allocated, max over the replicas
    commit: str | None = None

    def text(self) -> str:
        lines = []
        total = "?" if self.rows_total is None else str(self.rows_total)
        if self.mean_rows_per_s is None and not self.rows:
            lines.append(f"rows             none yet: metrics.jsonl has no infer records (no batch has finished; "
                         f"0/{total} rows)")
        else:
            lines.append(f"rows             {self.rows or 0}/{total}" + ("" if self.finished else " (not finished)"))
        if self.mean_rows_per_s is not None:
            lines.append(f"mean rows/s      {self.mean_rows_per_s:,.2f}")
            if self.mode == "score":
                lines.append(f"mean tokens/s    {_fmt(self.mean_prompt_tokens_per_s, ',.0f')} scored (prompt tokens)")
            else:
                lines.append(f"mean tokens/s    {_fmt(self.mean_tokens_per_s, ',.0f')} generated, "
                             f"{_fmt(self.mean_prompt_tokens_per_s, ',.0f')} prompt")
        lines.append(f"restarts         {self.restarts}" +
                     (f" (stopped {len(self.stops)}x: {', '.join(self.stops)})" if self.stops else ""))
        if self.peak_allocated_gib is not None:
            lines.append(f"peak allocated   {self.peak_allocated_gib:.2f} GiB (torch, max over replicas)")
        if self.finished and self.output_rows is not None:
            lines.append(f"outputs.jsonl    complete: {self.output_rows} rows ({FINISHED_MARKER})")
        elif self.finished:
            lines.append(f"outputs.jsonl    missing, though the run is marked {FINISHED_MARKER}")
        else:
            lines.append(f"outputs.jsonl    not complete (no {FINISHED_MARKER} marker yet; rows so far are in "
                         f"outputs/replica-*.jsonl)")
        if not self.gpu_peak_mem:
            lines.append("GPUs             no GPU samples (gpu.jsonl) in this run")
        for key, peak in self.gpu_peak_mem.items():
            lines.append(f"{key:<16} peak memory {peak / GiB:.1f} GiB, mean util {self.gpu_mean_util[key]:.0f}%")
        if self.commit:
            lines.append(f"commit           {self.commit}")
        return "\n".join(lines)


def _fmt(v: float | None, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def _count_lines(path: Path) -> int | None:
    if not path.is_file():
        return None
    n = 0
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 20):
            n += chunk.count(b"\n")
    return n


def _rows_total(d: RunData) -> int | None:
    totals = [int(r["rows_total"]) for r in d.infer + d.events if isinstance(r.get("rows_total"), int)]
    return max(totals) if totals else d.rows_total


def summarize_infer(d: RunData) -> InferSummary:
    # each start's newest record covers that start: rows/s and tokens/s are means since its first batch
    rows_s = tok = prompt = elapsed = 0.0
    for start in d.infer_starts:
        last = start[-1]
        dt = _num(last.get("elapsed_s"))
        if dt is None or dt <= 0:
            continue
        elapsed += dt
        rows_s += (_num(last.get("rows_per_s")) or 0.0) * dt
        gen = _num(last.get("tokens"))  # generated since that start
        tok += gen if gen is not None else (_num(last.get("tokens_per_s")) or 0.0) * dt
        prompt += (_num(last.get("prompt_tokens_per_s")) or 0.0) * dt
    timed = elapsed > 0
    rows = [int(r["rows"]) for r in d.infer + d.events if isinstance(r.get("rows"), int)]
    peak, mean_util = _gpu_stats(d)
    finished = is_finished(d.run_dir)
    return InferSummary(
        task="infer", mode=d.mode, rows=max(rows) if rows else None,
        rows_total=_rows_total(d),
        mean_rows_per_s=rows_s / elapsed if timed else None, mean_tokens_per_s=tok / elapsed if timed else None,
        mean_prompt_tokens_per_s=prompt / elapsed if timed else None,
        logged_generated_tokens=round(tok) if timed else None, logged_s=elapsed if timed else None,
        restarts=sum(1 for r in d.events if r.get("kind") == "resume"),
        stops=[str(r.get("reason", "?")) for r in d.events if r.get("kind") == "stop"],
        finished=finished, output_rows=_count_lines(RunPaths(d.run_dir).outputs) if finished else None,
        gpu_peak_mem=peak, gpu_mean_util=mean_util,
        peak_allocated_gib=max((v for r in d.infer if (v := _num(r.get("peak_mem_gib"))) is not None), default=None),
        commit=commit_text(d.run_dir))


# ---------------------------------------------------------------- the figure

Panel = Callable[[Any, RunData], None]


def _loss(ax: Any, d: RunData) -> None:
    ax.plot([r["step"] for r in d.train], [_y(r.get("loss")) for r in d.train], label="train")
    if d.eval:
        ax.plot([r["step"] for r in d.eval], [_y(r.get("loss")) for r in d.eval], "o-", label="eval")
    for r in d.events:
        if r.get("kind") == "resume" and isinstance(r.get("step"), int):
            ax.axvline(r["step"], color="grey", linestyle=":", linewidth=1)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.legend()


def _tokens(ax: Any, d: RunData) -> None:
    ax.plot([r["step"] for r in d.train], [_y(r.get("tokens_per_s")) for r in d.train])
    ax.set_xlabel("step")
    ax.set_ylabel("tokens/s")


def _gpu_panel(field_: str, ylabel: str, scale: float = 1.0) -> Panel:
    def panel(ax: Any, d: RunData) -> None:
        if d.task == "infer":  # the progress panels' clock, restarts marked
            t0, unit, div = _infer_clock(d)
            gpu = [r for r in d.gpu if _num(r.get("time")) is not None]
            _mark_restarts(ax, d, t0, div)
        else:
            times = [float(r["time"]) for r in d.gpu]
            t0 = min(times)
            unit, div = ("seconds", 1.0) if max(times) - t0 < 180 else ("minutes", 60.0)
            gpu = d.gpu
        multi = len({r.get("node", 0) for r in d.gpu}) > 1
        series: dict[str, tuple[list[float], list[float]]] = {}
        for r in gpu:
            v = _num(r.get(field_))
            if v is not None:
                xs, ys = series.setdefault(gpu_key(r, multi), ([], []))
                xs.append((float(r["time"]) - t0) / div)
                ys.append(v / scale)
        for key, (xs, ys) in sorted(series.items()):
            if d.task == "infer":
                xs, ys = _break_at_stops(d, xs, ys, t0, div)
            ax.plot(xs, ys, label=key)
        ax.set_xlabel(unit)
        ax.set_ylabel(ylabel)
        if series:
            ax.legend(fontsize="small")
    return panel


def _break_at_stops(d: RunData, xs: list[float], ys: list[float], t0: float, div: float
                    ) -> tuple[list[float], list[float]]:
    """A gap in the line where the job was down (a stop between two samples): no line across it."""
    stops = sorted((t - t0) / div for r in d.events
                   if r.get("kind") == "stop" and (t := _num(r.get("time"))) is not None)
    if not stops:
        return xs, ys
    pts = sorted(zip(xs, ys))
    out_x, out_y = [], []
    for i, (x, y) in enumerate(pts):
        if i and any(pts[i - 1][0] < s <= x for s in stops):
            out_x.append(math.nan)
            out_y.append(math.nan)
        out_x.append(x)
        out_y.append(y)
    return out_x, out_y


# task: infer: wall time from the run's first record (metrics or GPU sample), as the GPU panels show it

def _infer_clock(d: RunData) -> tuple[float, str, float]:
    times = [t for r in d.infer + d.events + d.gpu if (t := _num(r.get("time"))) is not None]
    t0 = min(times, default=0.0)
    return (t0, "seconds", 1.0) if max(times, default=0.0) - t0 < 180 else (t0, "minutes", 60.0)


def _mark_restarts(ax: Any, d: RunData, t0: float, div: float, label: bool = False) -> None:
    """A stop (red dashed) and a resume (grey dotted, as train's loss panel) where they happened."""
    seen: set[str] = set()
    for r in d.events:
        kind, t = r.get("kind"), _num(r.get("time"))
        if kind in ("stop", "resume") and t is not None:
            style = dict(color="tab:red", linestyle="--") if kind == "stop" else dict(color="grey", linestyle=":")
            ax.axvline((t - t0) / div, linewidth=1, label=kind if label and kind not in seen else None, **style)
            seen.add(kind)


def _timed(d: RunData, recs: list[dict[str, Any]], key: str) -> tuple[list[float], list[float], str]:
    t0, unit, div = _infer_clock(d)
    pts = sorted((t, v) for r in recs if (t := _num(r.get("time"))) is not None and (v := _num(r.get(key))) is not None)
    return [(t - t0) / div for t, _ in pts], [v for _, v in pts], unit


def _rows_done(ax: Any, d: RunData) -> None:
    # every record with a row count: the progress records and the stops, resumes and the end
    xs, ys, unit = _timed(d, d.infer + d.events, "rows")
    ax.plot(xs, ys, ".-", label="rows done")
    total = _rows_total(d)
    if total is not None:
        ax.axhline(total, color="black", linestyle="--", linewidth=0.8, label=f"total {total}")
    t0, _, div = _infer_clock(d)
    _mark_restarts(ax, d, t0, div, label=True)
    ax.set_xlabel(unit)
    ax.set_ylabel("rows")
    ax.legend(fontsize="small")


def _infer_rate(key: str, ylabel: str) -> Panel:
    def panel(ax: Any, d: RunData) -> None:
        # one line per start: each start's rates are means since its own first batch
        for n, start in enumerate(d.infer_starts):
            xs, ys, _ = _timed(d, start, key)
            ax.plot(xs, ys, ".-", color="tab:blue", label="since each start" if n == 0 else None)
        t0, unit, div = _infer_clock(d)
        _mark_restarts(ax, d, t0, div)
        ax.set_xlabel(unit)
        ax.set_ylabel(ylabel)
    return panel


def _infer_panels(d: RunData) -> list[tuple[str, Panel]]:
    out: list[tuple[str, Panel]] = []
    if any(_num(r.get("rows")) is not None and _num(r.get("time")) is not None for r in d.infer + d.events):
        out.append(("rows done", _rows_done))
    if any(_num(r.get("rows_per_s")) is not None for r in d.infer):
        out.append(("rows/s", _infer_rate("rows_per_s", "rows/s")))
    key, title = (("prompt_tokens_per_s", "prompt tokens/s (scored)") if d.mode == "score" else
                  ("tokens_per_s", "generated tokens/s"))
    if any(_num(r.get(key)) is not None for r in d.infer):
        out.append((title, _infer_rate(key, "tokens/s")))
    return out


def panels_for(d: RunData) -> list[tuple[str, Panel]]:
    """(title, draw) for each panel the data supports."""
    out: list[tuple[str, Panel]] = []
    if d.task == "infer":
        out += _infer_panels(d)
    if d.train or d.eval:
        out.append(("loss", _loss))
    if any(_num(r.get("tokens_per_s")) is not None for r in d.train):
        out.append(("tokens/s", _tokens))
    if any(isinstance(r.get("time"), (int, float)) for r in d.gpu):
        out += [("GPU utilization (%)", _gpu_panel("util", "%")),
                ("GPU memory used (GiB)", _gpu_panel("mem_used", "GiB", GiB)),
                ("GPU power (W)", _gpu_panel("power", "W"))]
    return out


def plot(d: RunData, out: Path) -> list[str]:
    """Write the PNG; returns the panel titles, in order."""
    import matplotlib

    matplotlib.use("Agg")  # no display on a login node
    import matplotlib.pyplot as plt

    panels = panels_for(d)
    cols = 2 if len(panels) > 1 else 1
    rows = max(1, math.ceil(len(panels) / cols))
    fig, axes = plt.subplots(rows, cols, figsize=(6.5 * cols, 3.6 * rows), squeeze=False)
    flat = [ax for row in axes for ax in row]
    for ax, (title, draw) in zip(flat, panels):
        draw(ax, d)
        ax.set_title(title)
        ax.grid(alpha=0.3)
    for ax in flat[len(panels):]:
        ax.set_visible(False)
    fig.suptitle(f"{d.run_dir.parent.name}/{d.run_dir.name}")
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return [title for title, _ in panels]


def write_report(run_dir: str | Path, out: str | Path | None = None
                 ) -> tuple[Path, list[str], Summary | InferSummary]:
    """report.png (or `out`), a sidecar report.json (panels + summary, for tools and tests), the summary."""
    d = load_run(run_dir)
    png = Path(out) if out else d.run_dir / "report.png"
    titles = plot(d, png)
    summary: Summary | InferSummary = summarize_infer(d) if d.task == "infer" else summarize(d)
    png.with_suffix(".json").write_text(json.dumps({"png": str(png), "panels": titles, "summary": asdict(summary)},
                                                   indent=2))
    return png, titles, summary
