"""A run's report: one PNG (loss, tokens/s, per-GPU utilization, memory, power) and a text summary.

Host side: reads metrics.jsonl and gpu*.jsonl, imports matplotlib (Agg) and nothing heavier.
Panels exist only for data the run has, so a CPU run (no gpu.jsonl) or a run killed early still plots.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

from hpcgpu.errors import HpcgpuError

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


def _latest_per_step(recs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    # after a resume the steps since the checkpoint run again: the re-run's values are the ones that count
    by_step = {r["step"]: r for r in recs if isinstance(r.get("step"), int)}
    return [by_step[s] for s in sorted(by_step)]


def load_run(run_dir: str | Path) -> RunData:
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise HpcgpuError(f"RUN_DIR: {run_dir} is not a directory")
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    gpu = [r for p in sorted(run_dir.glob("gpu*.jsonl")) for r in read_jsonl(p)]
    if not metrics and not gpu:
        raise HpcgpuError(f"RUN_DIR: {run_dir} has no metrics.jsonl or gpu.jsonl (has the job started?)")
    return RunData(run_dir,
                   train=_latest_per_step([r for r in metrics if r.get("kind") == "train"]),
                   eval=_latest_per_step([r for r in metrics if r.get("kind") == "eval"]),
                   events=[r for r in metrics if r.get("kind") in ("resume", "stop", "end")], gpu=gpu)


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
        if not self.gpu_peak_mem:
            lines.append("GPUs             no GPU samples (gpu.jsonl) in this run")
        for key, peak in self.gpu_peak_mem.items():
            lines.append(f"{key:<16} peak memory {peak / GiB:.1f} GiB, mean util {self.gpu_mean_util[key]:.0f}%")
        return "\n".join(lines)


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
    multi = len({r.get("node", 0) for r in d.gpu}) > 1
    peak: dict[str, int] = {}
    utils: dict[str, list[float]] = {}
    for r in sorted(d.gpu, key=lambda r: (r.get("node", 0), r.get("gpu", 0))):
        key = gpu_key(r, multi)
        peak[key] = max(peak.get(key, 0), int(_num(r.get("mem_used")) or 0))
        utils.setdefault(key, [])
        if (u := _num(r.get("util"))) is not None:
            utils[key].append(u)
    return Summary(
        steps=max(steps) if steps else None, tokens=max(tokens) if tokens else None,
        mean_tokens_per_s=_mean(tok), mean_mfu=_mean(mfu),
        final_loss=_num(d.train[-1].get("loss")) if d.train else None,
        final_eval_loss=_num(d.eval[-1].get("loss")) if d.eval else None,
        restarts=sum(1 for r in d.events if r.get("kind") == "resume"),
        finished=any(r.get("kind") == "end" for r in d.events),
        gpu_peak_mem=peak, gpu_mean_util={k: _mean(v) or 0.0 for k, v in utils.items()},
        peak_allocated_gib=max((v for r in d.train if (v := _num(r.get("peak_mem_gib"))) is not None), default=None))


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
        times = [float(r["time"]) for r in d.gpu]
        t0 = min(times)
        unit, div = ("seconds", 1.0) if max(times) - t0 < 180 else ("minutes", 60.0)
        multi = len({r.get("node", 0) for r in d.gpu}) > 1
        series: dict[str, tuple[list[float], list[float]]] = {}
        for r in d.gpu:
            v = _num(r.get(field_))
            if v is not None:
                xs, ys = series.setdefault(gpu_key(r, multi), ([], []))
                xs.append((float(r["time"]) - t0) / div)
                ys.append(v / scale)
        for key, (xs, ys) in sorted(series.items()):
            ax.plot(xs, ys, label=key)
        ax.set_xlabel(unit)
        ax.set_ylabel(ylabel)
        if series:
            ax.legend(fontsize="small")
    return panel


def panels_for(d: RunData) -> list[tuple[str, Panel]]:
    """(title, draw) for each panel the data supports."""
    out: list[tuple[str, Panel]] = []
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


def write_report(run_dir: str | Path, out: str | Path | None = None) -> tuple[Path, list[str], Summary]:
    """report.png (or `out`), a sidecar report.json (panels + summary, for tools and tests), the summary."""
    d = load_run(run_dir)
    png = Path(out) if out else d.run_dir / "report.png"
    titles = plot(d, png)
    summary = summarize(d)
    png.with_suffix(".json").write_text(json.dumps({"png": str(png), "panels": titles, "summary": asdict(summary)},
                                                   indent=2))
    return png, titles, summary
