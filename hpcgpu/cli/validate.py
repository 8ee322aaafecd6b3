"""`hpcgpu validate SPEC`: check a spec and print the resolved summary."""
from __future__ import annotations

from pathlib import Path

import click

from hpcgpu.cli.options import spec_options
from hpcgpu.launch.options import sbatch_options
from hpcgpu.launch.resolve import VALIDATE, read_resolved
from hpcgpu.launch.sweep import check_one_script
from hpcgpu.spec import dump_spec
from hpcgpu.spec.derive import fixed_max_steps
from hpcgpu.spec.load import spec_sources


@click.command()
@spec_options
@click.option("--full", is_flag=True, help="Print the whole resolved spec as YAML, and where each value set came "
              "from (a file line, a defaults file's, or a flag).")
def validate(spec_file: str, overrides: tuple[str, ...], gpus: int | None, nodes: int | None, full: bool) -> None:
    """Check SPEC and print what it resolves to."""
    # input files, model type, runs_dir: what the job would fail on, found here
    resolved = read_resolved(spec_file, overrides, gpus, nodes, use=VALIDATE,
                             say=lambda message: click.echo(f"hpcgpu: {message}", err=True))
    if resolved.tasks:
        check_one_script(resolved.tasks)  # as `submit` to SLURM would refuse it: one job array shares one script
    spec = resolved.spec
    r = spec.resources
    click.echo(f"{spec_file}: ok")
    click.echo(f"  name      {spec.name}")
    click.echo(f"  task      {spec.task}")
    per = spec.gpus_per_task
    click.echo(f"  ranks     {spec.world_size} ({r.nodes} node(s) x {r.gpus} GPU(s)"
               + (f", one model copy per {per} GPUs" if per > 1 else "") +
               f", {r.cpus_per_gpu * per} CPU(s) per rank)")
    click.echo(f"  time      {r.time}")
    click.echo(f"  strategy  {spec.distributed.strategy}")
    if spec.task == "train":
        t = spec.train
        click.echo(f"  model     {spec.model.name_or_path or (spec.model.config or {}).get('model_type')}")
        click.echo(f"  batch     {t.global_batch_size} sequences/step x {spec.data.seq_len} tokens, "
                   f"micro batch {t.micro_batch_size}, "
                   + (f"{steps} steps" if (steps := fixed_max_steps(spec)) else
                      f"{t.epochs} epoch(s) (the job derives the steps from the data)"))
    if spec.task == "command":
        click.echo(f"  command   {' '.join(spec.command or [])}")
    if spec.env_passthrough:
        click.echo(f"  from env  {' '.join(spec.env_passthrough)} (taken from the shell you submit from)")
    opts = " ".join(f"--{k}" + ("" if v is None else f"={v}") for k, v in sbatch_options(spec, Path("RUN_DIR")))
    click.echo(f"  sbatch    {opts}")
    if full:
        print_sources(spec_sources(spec_file, overrides, gpus, nodes))
        click.echo("---")  # below: exactly the spec.yaml a run dir gets
        click.echo(dump_spec(spec), nl=False)


def print_sources(sources: dict[str, str]) -> None:
    """Where each value set came from: the spec's lines, a defaults file's, or a flag."""
    click.echo("  sources   (a key not listed is its default)")
    width = max(map(len, sources), default=0)
    for key, source in sources.items():
        click.echo(f"    {key:<{width}}  {source}")
