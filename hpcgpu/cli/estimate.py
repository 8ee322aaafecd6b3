"""`hpcgpu estimate SPEC`: GPU memory per rank under each strategy, and what fits.

Parameters are counted on the meta device (torch + transformers, imported here only: no weights are
loaded, no GPU is needed). The memory model is in hpcgpu/gpu/estimate.py.
"""
from __future__ import annotations

import json
import os
from typing import Any

import click

from hpcgpu.cli.options import spec_options
from hpcgpu.errors import HpcgpuError
from hpcgpu.gpu.busy import select
from hpcgpu.gpu.estimate import (STRATEGIES, ModelDims, count_params, dims_from_config, estimate, fits,
                                 fmt_bytes, max_micro_batch, parse_size, usable_bytes)
from hpcgpu.gpu.source import default_source
from hpcgpu.gpu.recommend import compiled_step, recommend_for_job
from hpcgpu.spec import Spec, load_spec


def detected_gpu(spec: Spec) -> tuple[int | None, str]:
    """The smallest total memory among the GPUs a job here would use, and what they are."""
    source = default_source()
    if not source.available():
        return None, "no GPU detected here"
    chosen, _ = select(source.read(processes=False), spec.resources.devices, os.environ.get("CUDA_VISIBLE_DEVICES"))
    if not chosen:
        return None, "no GPU visible here"
    smallest = min(chosen, key=lambda r: r.memory_total)
    return smallest.memory_total, f"{smallest.name}, detected"


def rows(d: ModelDims, micro: int, world: int, gpu_total: int | None) -> list[dict[str, Any]]:
    out = []
    for st in STRATEGIES:
        e = estimate(d, st, micro, world)
        out.append({"strategy": st.name, "zero_stage": st.zero_stage, "offload": st.offload,
                    "weights": e.weights, "grads": e.grads, "optimizer": e.optimizer, "buffers": e.buffers,
                    "activations": e.activations, "total": e.total, "host": e.host,
                    "fits": fits(e, gpu_total) if gpu_total else None,
                    "max_micro_batch": max_micro_batch(d, st, world, gpu_total) if gpu_total else None})
    return out


def print_table(table: list[dict[str, Any]]) -> None:
    cols = ("weights", "grads", "optimizer", "buffers", "activations", "total", "host")
    click.echo(f"  {'strategy':<18}" + "".join(f"{c:>12}" for c in cols) + f"{'fits':>6}{'max micro':>11}")
    for r in table:
        fit = "?" if r["fits"] is None else "yes" if r["fits"] else "no"
        top = "-" if r["max_micro_batch"] is None else str(r["max_micro_batch"])
        click.echo(f"  {r['strategy']:<18}" + "".join(f"{fmt_bytes(r[c]):>12}" for c in cols) + f"{fit:>6}{top:>11}")


@click.command()
@spec_options
@click.option("--gpu-memory", metavar="SIZE", default=None,
              help="Memory of one GPU, e.g. 80G or 40GB (default: the smallest GPU detected here).")
@click.option("--micro-batch", type=click.IntRange(min=1), default=None,
              help="Micro batch to estimate (default: train.micro_batch_size, or the recommended one for auto).")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def estimate_cmd(spec_file: str, overrides: tuple[str, ...], gpus: int | None, nodes: int | None,
                 gpu_memory: str | None, micro_batch: int | None, as_json: bool) -> None:
    """Memory per GPU for SPEC under DDP and ZeRO-1/2/3 (with and without offload): weights, grads,
    optimizer states, buffers and activations; what fits, and the largest micro batch that does."""
    # memory needs the model, the batch and data.seq_len, not the training text: no data.train required
    spec = load_spec(spec_file, overrides, gpus=gpus, nodes=nodes, need_data=False)
    if spec.task != "train":
        raise HpcgpuError(f"task: estimate is for task: train (this spec is task: {spec.task})")
    gpu_total, gpu_what = (parse_size(gpu_memory), "--gpu-memory") if gpu_memory else detected_gpu(spec)
    n_params, cfg = count_params(spec)
    d = dims_from_config(cfg, spec.data.seq_len, n_params, compiled_step(spec))
    world = spec.world_size
    rec = recommend_for_job(spec, n_params, cfg, gpu_total, world)
    micro = micro_batch or rec.micro_batch
    table = rows(d, micro, world, gpu_total)
    if as_json:
        click.echo(json.dumps({"params": n_params, "dims": d.__dict__, "world": world, "micro_batch": micro,
                               "gpu_memory": gpu_total, "usable": usable_bytes(gpu_total) if gpu_total else None,
                               "strategies": table, "recommendation": rec.__dict__}, indent=2))
        return
    model = spec.model.name_or_path or (spec.model.config or {}).get("model_type")
    click.echo(f"{spec.name}: {n_params / 1e6:,.2f}M parameters ({model}: {d.n_layers} layers, hidden {d.hidden}, "
               f"{d.heads} heads, vocab {d.vocab}); seq_len {spec.data.seq_len}, micro batch {micro}, "
               f"{world} rank(s)")
    if gpu_total:
        click.echo(f"GPU: {fmt_bytes(gpu_total)} ({gpu_what}), {fmt_bytes(usable_bytes(gpu_total))} usable "
                   "after the CUDA context and allocator slack")
    step = "compiled (train.compile)" if d.compiled else "eager (train.compile: false)"
    click.echo(f"memory per GPU; activations of a {step} DDP step, DeepSpeed rows eager; host: RAM per rank "
               "for offloaded states:")
    print_table(table)
    if gpu_total:
        click.echo(f"recommended: {rec.summary()}" + ("" if rec.fits else " (DOES NOT FIT)"))
        click.echo(f"  why: {rec.reason}")
    else:
        click.echo(f"{gpu_what}: give --gpu-memory (e.g. 80G) to check fit")
