"""`hpcgpu report RUN_DIR`: a PNG of the run (train: loss, tokens/s; infer: rows and rows/s, tokens/s;
GPU use) and a text summary. No torch."""
from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import click

from hpcgpu.errors import UsageError


@click.command()
@click.argument("run_dir", metavar="RUN_DIR", type=click.Path(file_okay=False))
@click.option("-o", "--output", type=click.Path(dir_okay=False), default=None,
              help="Where to write the PNG (default: RUN_DIR/report.png).")
@click.option("--json", "as_json", is_flag=True, help="The summary as JSON.")
def report(run_dir: str, output: str | None, as_json: bool) -> None:
    """Plot a run: train/eval loss, tokens/s, and per-GPU utilization, memory and power over time
    (from metrics.jsonl and gpu.jsonl); print steps, tokens, mean tokens/s, MFU, peak memory, restarts.

    A task: infer run: rows done, rows/s and tokens/s (generated; scored in mode score) over wall
    time, stops and resumes marked, and the same GPU panels; print rows done/total, mean rows/s and
    tokens/s, peak memory, restarts and whether outputs.jsonl is complete (FINISHED)."""
    from hpcgpu.report import write_report

    if output and not Path(output).resolve().parent.is_dir():
        raise UsageError(f"-o: the folder of {output} does not exist")
    png, panels, summary = write_report(run_dir, output)
    if as_json:
        click.echo(json.dumps({"png": str(png), "panels": panels, "summary": asdict(summary)}, indent=2))
        return
    click.echo(summary.text())
    click.echo(f"wrote {png} ({', '.join(panels) or 'no panels: nothing to plot yet'})")
