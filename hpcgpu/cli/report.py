"""`hpcgpu report RUN_DIR`: a PNG of the run (train: loss, tokens/s; infer: rows and rows/s, tokens/s;
GPU use) and a text summary. No torch."""
from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import click

from hpcgpu.cli.jobs import one_unit
from hpcgpu.errors import HpcgpuError, UsageError
from hpcgpu.launch.registry import Registry
from hpcgpu.launch.state import find_job
from hpcgpu.report import write_report  # matplotlib loads only when the plot is drawn


@click.command()
@click.argument("run_dir", metavar="RUN_DIR|JOB", type=click.Path(file_okay=False))
@click.option("-o", "--output", type=click.Path(dir_okay=False), default=None,
              help="Where to write the plot: .png (default RUN_DIR/report.png), .pdf or .svg; the summary "
                   "goes beside it as .json.")
@click.option("--json", "as_json", is_flag=True, help="The summary as JSON.")
def report(run_dir: str, output: str | None, as_json: bool) -> None:
    """Plot a run (its folder, or a job id: `hpcgpu report local-3`): train/eval loss, tokens/s, and per-GPU utilization, memory and power over time
    (from metrics.jsonl and gpu.jsonl); print steps, tokens, mean tokens/s, MFU, peak memory, restarts.

    A task: infer run: rows done, rows/s and tokens/s (generated; scored in mode score) over wall
    time, stops and resumes marked, and the same GPU panels; print rows done/total, mean rows/s and
    tokens/s, peak memory, restarts and whether outputs.jsonl is complete (FINISHED)."""
    run_dir = job_run_dir(run_dir)
    path = plot_path(output)
    try:
        png, panels, summary = write_report(run_dir, path)
    except OSError as exc:
        if path is None or exc.filename is None or Path(exc.filename) not in (path, path.with_suffix(".json")):
            raise
        raise UsageError(f"-o {output}: cannot write {exc.filename}: {exc.strerror}") from None
    if as_json:
        click.echo(json.dumps({"png": str(png), "panels": panels, "summary": asdict(summary)}, indent=2))
        return
    click.echo(summary.text())
    click.echo(f"wrote {png} ({', '.join(panels) or 'no panels: nothing to plot yet'})")


def job_run_dir(ref: str) -> str:
    """RUN_DIR as given, or the run dir of the job (or array task) with that id in the registry."""
    if Path(ref).exists() or Path(ref).is_absolute() or "/" in ref:
        return ref
    try:
        job, task = find_job(Registry(), ref)
    except HpcgpuError:
        return ref  # neither a folder nor a job: the report says the folder is missing
    return one_unit(job, task, "report").run_dir


PLOT_FORMATS = (".png", ".pdf", ".svg")


def plot_path(output: str | None) -> Path | None:
    """-o as the file that will be written (matplotlib adds .png to a name without a suffix), checked
    before anything is drawn: a format or a place it cannot write is one line."""
    if not output:
        return None
    path = Path(output)
    if not path.suffix:
        path = path.with_name(path.name + ".png")
    if path.suffix.lower() not in PLOT_FORMATS:
        raise UsageError(f"-o {output}: the plot is written as {', '.join(PLOT_FORMATS)}; not {path.suffix}")
    folder = path.resolve().parent
    if not folder.is_dir():
        raise UsageError(f"-o: the folder of {output} does not exist")
    return path
