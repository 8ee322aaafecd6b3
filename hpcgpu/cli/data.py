"""`hpcgpu data prepare`: tokenize training data once into prepared datasets (hpcgpu/data)."""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import sys
from pathlib import Path
from typing import Any, Iterator, Optional

import click

from hpcgpu.cli.options import read_spec, set_option
from hpcgpu.cli.submit import print_submitted
from hpcgpu.errors import UsageError
from hpcgpu.launch.checks import input_problems
from hpcgpu.launch.executors import Submit, executor_named
from hpcgpu.launch.registry import Registry
from hpcgpu.launch.resolve import resolve
from hpcgpu.spec.derive import mem_per_node


@click.group()
def data() -> None:
    """Prepared datasets: tokenize once, memory-map in every rank."""


@data.command()
@click.argument("spec_file", metavar="[SPEC]", required=False, type=click.Path(dir_okay=False))
@set_option
@click.option("--input", "input_path", metavar="FILE", type=click.Path(),
              help="A raw .txt/.jsonl/.parquet/.arrow file or folder to prepare (instead of SPEC).")
@click.option("--tokenizer", metavar="DIR", type=click.Path(),
              help="With --input: the tokenizer folder (default: the byte-level tokenizer).")
@click.option("--output", "-o", metavar="DIR", type=click.Path(file_okay=False),
              help="Write here (SPEC: DIR/train and DIR/eval) instead of the cache.")
@click.option("--text-field", default=None, metavar="F",
              help="The .jsonl field / parquet column with the text (default: data.text_field, text).")
@click.option("--format", "data_format", type=click.Choice(["text", "chat", "prompt_completion"]), default=None,
              help="With --input: the rows' format (default text; with SPEC: data.format).")
@click.option("--workers", type=click.IntRange(min=1), default=None,
              help="Tokenizer processes (default: the CPUs this process may use).")
@click.option("--submit", "as_job", is_flag=True,
              help="With SPEC: run this as a CPU job on SLURM (one task with the cores and memory of one of "
                   "SPEC's nodes, no GPU) and return at once with its job id.")
def prepare(spec_file: Optional[str], overrides: tuple[str, ...], input_path: Optional[str],
            tokenizer: Optional[str], output: Optional[str], text_field: Optional[str],
            workers: Optional[int], as_job: bool, data_format: Optional[str]) -> None:
    """Tokenize data.train and data.eval of SPEC (or --input FILE) into prepared datasets.

    \b
      hpcgpu data prepare exp.yaml                  fill the cache the job reads
      hpcgpu data prepare exp.yaml -o data/exp      write data/exp/train, data/exp/eval
      hpcgpu data prepare --input corpus.jsonl --tokenizer models/tok -o data/corpus
      hpcgpu data prepare exp.yaml --submit         the same as a CPU job on SLURM
    """
    if spec_file and input_path:
        raise UsageError("give either SPEC or --input FILE, not both")
    if spec_file and tokenizer:
        raise UsageError("--tokenizer goes with --input; with SPEC the model's tokenizer is used "
                         "(model.name_or_path)")
    if not (spec_file or input_path):
        raise UsageError("give SPEC, or --input FILE --output DIR [--tokenizer DIR]")
    if spec_file and data_format:
        raise UsageError("--format goes with --input; with SPEC the format is data.format")
    if as_job:
        if not spec_file:
            raise UsageError("--submit goes with SPEC (the job prepares that spec's data.train and data.eval)")
        submit_prepare_job(str(spec_file), overrides, output, text_field, workers)
        return
    with progress_log():
        if input_path:
            prepare_input(input_path, tokenizer, output, text_field or "text", workers, data_format or "text")
        else:
            prepare_spec(str(spec_file), overrides, output, text_field, workers)


def prepare_input(input_path: str, tokenizer: Optional[str], output: Optional[str], text_field: str,
                  workers: Optional[int], data_format: str) -> None:
    from hpcgpu.data import prepare as prepare_data  # numpy (and a tokenizer) load only to prepare

    if not output:
        raise UsageError("--input needs --output DIR (the folder to write the prepared dataset to)")
    done = prepare_data(input_path, tokenizer, output, text_field=text_field, workers=workers,
                        data_format=data_format)
    report("prepared", done)


def prepare_spec(spec_file: str, overrides: tuple[str, ...], output: Optional[str], text_field: Optional[str],
                 workers: Optional[int]) -> None:
    # numpy (and a tokenizer) load only to prepare
    from hpcgpu.data import ensure_prepared, load_tokenizer, looks_prepared, open_training_data
    from hpcgpu.data import prepare as prepare_data

    spec = read_spec(spec_file, overrides)
    inputs = [(key, value) for key, value in (("data.train", spec.data.train), ("data.eval", spec.data.eval))
              if value]
    if not inputs:
        raise UsageError(f"{spec_file}: no data.train or data.eval to prepare")
    tok = load_tokenizer(spec.model.name_or_path)  # as the job loads it: the same cache entries
    field = text_field or spec.data.text_field
    fmt = spec.data.format
    for key, path in inputs:
        if looks_prepared(path):
            open_training_data(path, tok, data_format=fmt)  # made with the model's tokenizer and format?
            click.echo(f"{key}: {path} is a prepared dataset already")
        elif output:
            done = prepare_data(path, tok, Path(output) / key.split(".")[1], text_field=field, workers=workers,
                                data_format=fmt)
            report(key, done)
        else:
            report(key, ensure_prepared(path, tok, field, spec.data.cache_dir, workers, data_format=fmt))


def submit_prepare_job(spec_file: str, overrides: tuple[str, ...], output: Optional[str],
                       text_field: Optional[str], workers: Optional[int]) -> None:
    """`data prepare SPEC` as a job of its own, through the same submission path as `hpcgpu submit`."""
    spec = read_spec(spec_file, overrides)
    if not (spec.data.train or spec.data.eval):
        raise UsageError(f"{spec_file}: no data.train or data.eval to prepare")
    problems = input_problems(spec)
    if problems:
        raise UsageError(problems[0])  # found now, not after the job's wait in the queue
    slurm = executor_named("slurm")
    # the resolve step's host checks, as for `hpcgpu submit`: what the job would fail on, found here
    # (no warnings: SPEC's track settings are not this job's, whose command is ours)
    job = resolve(prepare_job_spec(spec, spec_file, overrides, output, text_field, workers), slurm.use(dry_run=False))
    for record in slurm.submit(job, str(Path(spec_file).resolve()), Registry(), Submit(fresh=True)):
        print_submitted(record, job.spec)


def prepare_job_spec(spec: Any, spec_file: str, overrides: tuple[str, ...], output: Optional[str],
                     text_field: Optional[str], workers: Optional[int]) -> Any:
    """A `task: command` spec that runs `hpcgpu data prepare SPEC` on one node with no GPU: one task
    with the cores and memory SPEC asks for on a node; its slurm settings (partition, account, setup
    lines) are SPEC's."""
    r = spec.resources
    cores = r.cpus_per_gpu * r.gpus
    argv = [sys.executable, "-m", "hpcgpu", "data", "prepare", str(Path(spec_file).resolve()),
            "--workers", str(workers or cores)]
    for override in overrides:
        argv += ["--set", override]
    if output:
        argv += ["--output", str(Path(output).resolve())]
    if text_field:
        argv += ["--text-field", text_field]
    resources = dataclasses.replace(r, nodes=1, gpus=1, cpus_per_gpu=cores, mem_per_gpu=mem_per_node(spec))
    slurm = dataclasses.replace(spec.slurm, gpu_request="none")
    return dataclasses.replace(spec, name=f"{spec.name}-prepare", task="command", command=argv, sweep={},
                               resources=resources, slurm=slurm)


def report(what: str, done: Any) -> None:
    m = done.manifest
    click.echo(f"{what}: {done.path}")
    counts = f"  {m['num_tokens']:,} tokens, {m['num_documents']:,} documents, {m['dtype']}"
    if done.built:
        click.echo(f"{counts}, {done.seconds:.1f} s, {done.tokens_per_s:,.0f} tokens/s")
    else:
        click.echo(f"{counts}, reused from the cache (prepared in {m.get('seconds', 0):.1f} s)")


class EchoHandler(logging.Handler):
    """Log lines to stderr as the CLI prints (sys.stderr looked up at each line)."""

    def emit(self, record: logging.LogRecord) -> None:
        click.echo(f"hpcgpu: {record.getMessage()}", err=True)


@contextlib.contextmanager
def progress_log() -> Iterator[None]:
    """The data package logs what it does (preparing, reusing, waiting, progress): show it, then
    leave the `hpcgpu` logger as it was."""
    logger = logging.getLogger("hpcgpu")
    handler, level = EchoHandler(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
