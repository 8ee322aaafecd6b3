"""`hpcgpu estimate SPEC`: GPU memory per rank under each strategy, and what fits; for task: infer,
per model copy by weight format (float32, bfloat16, int8, int4) with the KV cache of the batch.

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
from hpcgpu.gpu.estimate import (INFER_FORMATS, STRATEGIES, ModelDims, count_params, dims_from_config, estimate,
                                 fits, fmt_bytes, infer_dims, infer_estimate, infer_max_batch, max_micro_batch,
                                 parse_size, spec_weights_format, usable_bytes)
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
@click.option("--prompt-tokens", type=click.IntRange(min=1), default=None,
              help="task: infer: tokens of the longest row (default: measured on infer.input with the "
                   "model's tokenizer, else 512).")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def estimate_cmd(spec_file: str, overrides: tuple[str, ...], gpus: int | None, nodes: int | None,
                 gpu_memory: str | None, micro_batch: int | None, prompt_tokens: int | None, as_json: bool) -> None:
    """Memory per GPU for SPEC under DDP and ZeRO-1/2/3 (with and without offload): weights, grads,
    optimizer states, buffers and activations; what fits, and the largest micro batch that does.
    For task: infer, one model copy on one GPU by weight format: weights, KV cache, activations."""
    # memory needs the model, the batch and data.seq_len, not the training text: no data.train required
    spec = load_spec(spec_file, overrides, gpus=gpus, nodes=nodes, need_data=False)
    if spec.task not in ("train", "infer"):
        raise HpcgpuError(f"task: estimate is for task: train or infer (this spec is task: {spec.task})")
    gpu_total, gpu_what = (parse_size(gpu_memory), "--gpu-memory") if gpu_memory else detected_gpu(spec)
    if spec.task == "infer":
        return estimate_infer(spec, gpu_total, gpu_what, prompt_tokens, as_json)
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


# --- task: infer ----------------------------------------------------------------------------------

DEFAULT_PROMPT_TOKENS = 512


def longest_row(spec: Spec) -> tuple[int | None, str]:
    """Tokens of the longest row of infer.input with the model's tokenizer (chat rows through its chat
    template), or None when the input or the tokenizer cannot be read here; and where that came from."""
    from hpcgpu.infer_rows import read_rows

    if not spec.infer.input:
        return None, "no infer.input"
    try:
        rows = read_rows(spec.infer.input, spec.infer.mode)
    except HpcgpuError as exc:
        return None, f"infer.input not read: {exc}"
    if not spec.model.name_or_path:  # model.config: the job's byte-level tokenizer, a token a byte
        texts = [r.text if r.text is not None else r.prompt if r.prompt is not None
                 else "\n".join(m["content"] for m in r.messages or []) for r in rows]
        return max(len(t.encode("utf-8")) for t in texts), f"the longest of {len(rows)} rows, in bytes"
    try:
        from transformers import AutoTokenizer

        # a hub id is looked up in the local cache only: no download, no retries
        tokenizer = AutoTokenizer.from_pretrained(spec.model.name_or_path, local_files_only=True)
    except Exception:  # noqa: BLE001 - no tokenizer here (a hub id not in the cache)
        return None, "no tokenizer here to count with"
    longest = 0
    for row in rows:
        if row.messages is not None:
            try:
                text = tokenizer.apply_chat_template(row.messages, add_generation_prompt=True, tokenize=False)
                n = len(tokenizer.encode(text, add_special_tokens=False))
            except Exception:  # noqa: BLE001 - no chat template: the contents, a lower bound
                n = len(tokenizer.encode("\n".join(m["content"] for m in row.messages)))
        else:
            n = len(tokenizer.encode(row.prompt if row.text is None else row.text))
        longest = max(longest, n)
    return longest, f"the longest of {len(rows)} rows of infer.input"


def estimate_infer(spec: Spec, gpu_total: int | None, gpu_what: str, prompt_tokens: int | None,
                   as_json: bool) -> None:
    n_params, cfg = count_params(spec)
    d = infer_dims(cfg, n_params)
    inf = spec.infer
    if prompt_tokens:
        prompt, prompt_from = prompt_tokens, "--prompt-tokens"
    else:
        measured, prompt_from = longest_row(spec)
        prompt = measured or DEFAULT_PROMPT_TOKENS
        if not measured:
            prompt_from = f"not measured: {prompt_from}; --prompt-tokens sets it"
    new = 0 if inf.mode == "score" else inf.max_new_tokens
    chosen = spec_weights_format(spec)
    formats = [chosen if f == "bfloat16" and chosen == "float16" else f for f in INFER_FORMATS]
    fixed_batch = inf.batch_size if isinstance(inf.batch_size, int) else None
    table = []
    for fmt in formats:
        top = infer_max_batch(d, fmt, prompt, new, inf.mode, gpu_total) if gpu_total else None
        batch = fixed_batch or max(1, top or 1)
        e = infer_estimate(d, fmt, batch, prompt, new, inf.mode)
        table.append({"weights_format": fmt, "spec": fmt == chosen, "batch": batch, "weights": e.weights,
                      "kv_cache": e.kv_cache, "activations": e.activations, "total": e.total,
                      "fits": e.total <= usable_bytes(gpu_total) if gpu_total else None, "max_batch": top,
                      "in_this_version": fmt not in ("int8", "int4")})
    mine = next(r for r in table if r["spec"])
    too_long = d.context is not None and prompt + new > d.context
    if as_json:
        click.echo(json.dumps({"task": "infer", "params": n_params, "dims": d.__dict__, "mode": inf.mode,
                               "prompt_tokens": prompt, "prompt_tokens_from": prompt_from, "new_tokens": new,
                               "replicas": spec.world_size, "gpus_per_replica": 1, "gpu_memory": gpu_total,
                               "usable": usable_bytes(gpu_total) if gpu_total else None,
                               "exceeds_context": too_long, "formats": table}, indent=2))
        return
    model = spec.model.name_or_path or (spec.model.config or {}).get("model_type")
    click.echo(f"{spec.name}: {n_params / 1e6:,.2f}M parameters ({model}: {d.n_layers} layers, hidden {d.hidden}, "
               f"{d.heads} heads, vocab {d.vocab}); {inf.mode}, {spec.world_size} replica(s) x 1 GPU")
    click.echo(f"rows of {prompt} tokens ({prompt_from})" + (f" + {new} new" if new else "") +
               (f"; batch {fixed_batch}" if fixed_batch else "; batch auto"))
    if too_long:
        click.echo(f"warning: {prompt + new} tokens are more than the model's context of {d.context}")
    if gpu_total:
        click.echo(f"GPU: {fmt_bytes(gpu_total)} ({gpu_what}), {fmt_bytes(usable_bytes(gpu_total))} usable "
                   "after the CUDA context and allocator slack")
    click.echo("memory of one model copy on one GPU (gpus_per_replica 1):")
    cols = ("weights", "kv_cache", "activations", "total")
    click.echo(f"  {'weights as':<20}{'batch':>7}" + "".join(f"{c.replace('_', ' '):>13}" for c in cols)
               + f"{'fits':>6}{'max batch':>11}")
    for r in table:
        name = r["weights_format"] + (" (spec)" if r["spec"] else "" if r["in_this_version"] else " (later)")
        fit = "?" if r["fits"] is None else "yes" if r["fits"] else "no"
        top = "-" if r["max_batch"] is None else str(r["max_batch"])
        click.echo(f"  {name:<20}{r['batch']:>7}" + "".join(f"{fmt_bytes(r[c]):>13}" for c in cols)
                   + f"{fit:>6}{top:>11}")
    click.echo("  (later): int8/int4 weights are not in this version" +
               ("" if fixed_batch else "; batch auto: the largest that fits"))
    if not gpu_total:
        click.echo(f"{gpu_what}: give --gpu-memory (e.g. 80G) to check fit")
    elif mine["max_batch"]:
        batch = fixed_batch or mine["max_batch"]
        verdict = "fits" if mine["fits"] else \
            f"does not fit at batch {fixed_batch}; use batch_size <= {mine['max_batch']}"
        click.echo(f"{mine['weights_format']} weights, one GPU per replica, batch {batch}: {verdict}")
    else:
        click.echo(f"DOES NOT FIT: {mine['weights_format']} weights and one row need more than one GPU; a model "
                   "spread over several GPUs (gpus_per_replica) and int8/int4 weights are not in this version")
