"""`hpcgpu estimate SPEC`: GPU memory per rank under each strategy (DDP, ZeRO-1/2/3 with and without
offload, FSDP2 with and without CPU offload), and what fits; for task: infer,
per GPU of a model copy by weight format (float32, bfloat16, int8, int4) and gpus_per_replica (1, 2,
4, 8) with the KV cache of the batch, and the gpus_per_replica submit would choose.

For task: train the rows follow train.gradient_checkpointing: without it (false), with it (true, rows
named `+ckpt`: each layer's input kept, one layer's activations recomputed; see gpu/estimate.py), or
without it plus `ckpt` columns with it (auto: the run plan tries each strategy without, then with it).
A second table sets full fine-tuning beside LoRA and QLoRA (train.lora: the frozen base in its dtype
or 4/8 bits, the adapters and their states), each without and with gradient checkpointing; where the
spec's own way does not fit and a lighter one does, one line names the spec keys that choose it. A
train.lora spec shows that table alone (its strategy is DDP) and its recommendation is the LoRA one.

Parameters are counted on the meta device (torch + transformers, imported here only: no weights are
loaded, no GPU is needed). The memory model is in hpcgpu/gpu/estimate.py.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

import click

from hpcgpu.cli.options import spec_options
from hpcgpu.errors import HpcgpuError
from hpcgpu.gpu.busy import smallest_gpu
from hpcgpu.gpu.estimate import (INFER_BATCH_CAP, INFER_FORMATS, REPLICA_WIDTHS, STRATEGIES, WEIGHT_BYTES,
                                 WEIGHTS_SHARE, GiB, InferDims, LoraDims, MaxMemory, ModelDims, Strategy,
                                 auto_infer_batch, count_params, dims_from_config, estimate, fewest_gpus_per_replica,
                                 fits, fmt_bytes, infer_dims, infer_split_estimate, infer_split_max_batch,
                                 max_micro_batch, offloaded_bytes, parse_max_memory, parse_size, plan_strategy,
                                 replica_fits, spec_weights_format, usable_bytes, weight_bytes, why_batches,
                                 with_checkpointing)
from hpcgpu.gpu.recommend import (Checkpointing, Method, Recommendation, compiled_step, fine_tuning_methods,
                                  lighter_method, method_recommendation, recommend_for_job)
from hpcgpu.infer_inputs import read_rows
from hpcgpu.launch.resolve import with_adapter_base
from hpcgpu.spec import Spec, load_spec


def rows(d: ModelDims, micro: int, world: int, gpu_total: int | None,
         checkpointing: Checkpointing = False) -> list[dict[str, Any]]:
    """One row per strategy: with checkpointing true every row is the `+ckpt` variant; with auto the
    plain rows carry the checkpointed figures as well (`checkpointed`), the run plan's second choice."""
    out = []
    for st in STRATEGIES:
        row = strategy_row(d, with_checkpointing(st) if checkpointing is True else st, micro, world, gpu_total)
        if checkpointing == "auto":
            ck = strategy_row(d, with_checkpointing(st), micro, world, gpu_total)
            row["checkpointed"] = {k: ck[k] for k in ("activations", "total", "fits", "max_micro_batch")}
        out.append(row)
    return out


def strategy_row(d: ModelDims, st: Strategy, micro: int, world: int, gpu_total: int | None,
                 lora: LoraDims | None = None) -> dict[str, Any]:
    e = estimate(d, st, micro, world, lora)
    return {"strategy": st.name, "zero_stage": st.zero_stage, "fsdp": st.fsdp, "offload": st.offload,
            "gradient_checkpointing": st.checkpointing,
            "weights": e.weights, "grads": e.grads, "optimizer": e.optimizer, "buffers": e.buffers,
            "activations": e.activations, "total": e.total, "host": e.host,
            "fits": fits(e, gpu_total) if gpu_total else None,
            "max_micro_batch": max_micro_batch(d, st, world, gpu_total, lora) if gpu_total else None}


def method_rows(d: ModelDims, methods: list[Method], recs: list[Recommendation], micro: int, world: int,
                gpu_total: int | None, reshard_after_forward: bool = True) -> list[dict[str, Any]]:
    """One row per way to fine-tune (full, LoRA, QLoRA) at the micro batch, under the strategy its
    recommendation takes (LoRA: DDP), without gradient checkpointing and (`checkpointed`) with it; and
    what its recommendation chose. reshard_after_forward: distributed.fsdp's, for a recommendation of
    fsdp (only a spec that fixes it has one)."""
    out = []
    for m, rec in zip(methods, recs):
        st = plan_strategy(rec.zero_stage, rec.offload != "none", rec.offload == "params+optimizer",
                           fsdp=rec.strategy == "fsdp", reshard_after_forward=reshard_after_forward)
        row = strategy_row(d, st, micro, world, gpu_total, m.lora)
        ck = strategy_row(d, with_checkpointing(st), micro, world, gpu_total, m.lora)
        row["checkpointed"] = {k: ck[k] for k in ("activations", "total", "fits", "max_micro_batch")}
        out.append({"method": m.name, "name": f"{m.name} {st.name}" + (" (spec)" if m.own else ""), "spec": m.own,
                    "keys": m.keys, "base": None if m.lora is None else m.lora.base,
                    "adapter_params": 0 if m.lora is None else m.lora.adapter_params, **row,
                    "recommended": {"micro_batch": rec.micro_batch, "checkpointing": rec.checkpointing,
                                    "bytes_per_gpu": rec.bytes_per_gpu, "fits": rec.fits if gpu_total else None}})
    return out


def print_table(table: list[dict[str, Any]], label: str = "strategy", indent: str = "  ") -> None:
    """The rows as columns; the method table (label 'method') is set flush left, apart from the
    strategy table, whose rows are the indented ones."""
    cols = ("weights", "grads", "optimizer", "buffers", "activations", "total", "host")
    ckpt = any("checkpointed" in r for r in table)
    key = "strategy" if label == "strategy" else "name"
    width = max([24] + [len(r[key]) + 2 for r in table])
    click.echo(f"{indent}{label:<{width}}" + "".join(f"{c:>12}" for c in cols) + f"{'fits':>6}{'max micro':>11}"
               + (f"{'ckpt act':>12}{'ckpt total':>12}{'ckpt max':>10}" if ckpt else ""))
    for r in table:
        line = f"{indent}{r[key]:<{width}}" + "".join(f"{fmt_bytes(r[c]):>12}" for c in cols) + \
            f"{fit_text(r['fits']):>6}{max_text(r['max_micro_batch']):>11}"
        if "checkpointed" in r:
            c = r["checkpointed"]
            line += f"{fmt_bytes(c['activations']):>12}{fmt_bytes(c['total']):>12}{max_text(c['max_micro_batch']):>10}"
        click.echo(line)


def fit_text(value: bool | None) -> str:
    return "?" if value is None else "yes" if value else "no"


def max_text(value: int | None) -> str:
    return "-" if value is None else str(value)


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
    """Memory per GPU for SPEC under DDP, ZeRO-1/2/3 and FSDP2 (with and without offload): weights,
    grads, optimizer states, buffers and activations; what fits, and the largest micro batch that does.
    Beside them full fine-tuning, LoRA and QLoRA (train.lora), and which lighter one fits where the
    spec's does not. For task: infer, per GPU of a model copy by weight format and gpus_per_replica:
    weights, KV cache, activations; what fits, and the fewest GPUs a copy needs (gpus_per_replica: auto)."""
    # memory needs the model, the batch and data.seq_len, not the training text: no data.train required
    spec = with_adapter_base(load_spec(spec_file, overrides, gpus=gpus, nodes=nodes, need_data=False, defaults=True))
    if spec.task not in ("train", "infer"):
        raise HpcgpuError(f"task: estimate is for task: train or infer (this spec is task: {spec.task})")
    if gpu_memory and usable_bytes(parse_size(gpu_memory)) <= 0:  # not above what CUDA itself keeps
        raise HpcgpuError(f"--gpu-memory {gpu_memory}: no model fits in it; give a GPU's size, like 80G")
    gpu_total, gpu_what = (parse_size(gpu_memory), "--gpu-memory") if gpu_memory else smallest_gpu(
        spec.resources.devices, os.environ.get("CUDA_VISIBLE_DEVICES"))
    if spec.task == "infer":
        return estimate_infer(spec, gpu_total, gpu_what, prompt_tokens, as_json)
    return estimate_train(spec, gpu_total, gpu_what, micro_batch, as_json)


def estimate_train(spec: Spec, gpu_total: int | None, gpu_what: str, micro_batch: int | None,
                   as_json: bool) -> None:
    """task: train: the strategies' rows at the micro batch (full fine-tuning), full fine-tuning beside
    LoRA and QLoRA, and the recommendation the job's plan takes."""
    n_params, cfg = count_params(spec)
    d = dims_from_config(cfg, spec.data.seq_len, n_params, compiled_step(spec), spec.train.fused_loss is True)
    world = spec.world_size
    rec = recommend_for_job(spec, n_params, cfg, gpu_total, world)
    micro = micro_batch or rec.micro_batch
    table = rows(d, micro, world, gpu_total, spec.train.gradient_checkpointing)
    methods = fine_tuning_methods(spec, cfg)
    recs = [rec if m.own else method_recommendation(spec, m, n_params, cfg, gpu_total, world) for m in methods]
    mtable = method_rows(d, methods, recs, micro, world, gpu_total, spec.distributed.fsdp.reshard_after_forward)
    advice = lighter_method(methods, recs) if gpu_total else None
    if as_json:
        click.echo(json.dumps({"params": n_params, "dims": d.__dict__, "world": world, "micro_batch": micro,
                               "gpu_memory": gpu_total, "usable": usable_bytes(gpu_total) if gpu_total else None,
                               "strategies": table, "methods": mtable, "recommendation": rec.__dict__,
                               "advice": advice}, indent=2))
        return
    model = spec.model.name_or_path or (spec.model.config or {}).get("model_type")
    click.echo(f"{spec.name}: {n_params / 1e6:,.2f}M parameters ({model}: {d.n_layers} layers, hidden {d.hidden}, "
               f"{d.heads} heads, vocab {d.vocab}); seq_len {spec.data.seq_len}, micro batch {micro}, "
               f"{world} rank(s)")
    if gpu_total:
        click.echo(f"GPU: {fmt_bytes(gpu_total)} ({gpu_what}), {fmt_bytes(usable_bytes(gpu_total))} usable "
                   "after the CUDA context and allocator slack")
    step = "compiled (train.compile)" if d.compiled else "eager (train.compile: false)"
    if spec.train.lora is None:
        ckpt = {True: "every row with gradient checkpointing (+ckpt)", False: "no gradient checkpointing",
                "auto": "ckpt: the same with gradient checkpointing (auto tries it before the next strategy)"}[
            spec.train.gradient_checkpointing]
        click.echo(f"full fine-tuning, memory per GPU; activations of a {step} DDP/FSDP step, DeepSpeed rows eager; "
                   f"{ckpt}; host: RAM per rank for offloaded states:")
        print_table(table)
    print_methods(spec, methods, mtable, step)
    if gpu_total:
        click.echo(f"recommended: {rec.summary()}" + ("" if rec.fits else " (DOES NOT FIT)"))
        click.echo(f"  why: {rec.reason}")
        if advice:
            click.echo(advice)
    else:
        click.echo(f"{gpu_what}: give --gpu-memory (e.g. 80G) to check fit")


def print_methods(spec: Spec, methods: list[Method], mtable: list[dict[str, Any]], step: str) -> None:
    """The full / LoRA / QLoRA table, with what the adapters are."""
    lora = next(m.lora for m in methods if m.lora is not None)
    targets = spec.train.lora.target_modules if spec.train.lora is not None else "auto"
    on = "every linear layer of attention and MLP" if targets == "auto" else ", ".join(targets)
    settings = "train.lora" if spec.train.lora is not None else "train.lora's defaults"
    click.echo(f"full fine-tuning, LoRA and QLoRA ({settings}: r {lora.r} on {on}, "
               f"{lora.adapter_params / 1e6:,.2f}M adapter parameters"
               + ("" if lora.exact else ", counted as for Llama's layer names") + f"), memory per GPU; "
               f"activations of a {step} step; frozen base: weights as loaded, no grads or optimizer states; "
               "ckpt: with gradient checkpointing:")
    print_table(mtable, label="method", indent="")


# --- task: infer ----------------------------------------------------------------------------------

DEFAULT_PROMPT_TOKENS = 512


def longest_row(spec: Spec) -> tuple[int | None, str]:
    """Tokens of the longest row of infer.input with the model's tokenizer (chat rows through its chat
    template), or None when the input or the tokenizer cannot be read here; and where that came from."""
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


@dataclass(frozen=True)
class InferSetup:
    """What the infer table depends on besides the weight format and the width."""
    d: InferDims
    prompt: int
    new: int
    mode: str
    fixed_batch: int | None  # infer.batch_size, None for auto
    budget: int | None  # memory one GPU of a copy may use (MaxMemory.gpu_budget); None: unknown
    memory: int | None  # a GPU's memory the batch is fitted into: --gpu-memory or detected, else the cap
    cap: int | None  # infer.max_memory's per-GPU cap, None: auto
    cpu: int  # CPU memory for offloaded weights (max_memory's cpu=), 0: none
    gpus: int  # resources.gpus: GPUs per node
    nodes: int
    config: Any = None  # the model's config: which engine a row runs on (gpu/estimate.py why_batches)
    engine: str = "slots"  # infer.engine

    def replicas(self, g: int) -> int | None:
        """Model copies at g GPUs a copy; None where g does not divide the GPUs of a node."""
        return self.nodes * self.gpus // g if self.gpus % g == 0 else None


def prompt_length(spec: Spec, prompt_tokens: int | None) -> tuple[int, str]:
    if prompt_tokens:
        return prompt_tokens, "--prompt-tokens"
    measured, prompt_from = longest_row(spec)
    if not measured:
        return DEFAULT_PROMPT_TOKENS, f"not measured: {prompt_from}; --prompt-tokens sets it"
    return measured, prompt_from


def width_row(s: InferSetup, fmt: str, g: int) -> dict[str, Any]:
    """Per-GPU memory of a copy in `fmt` split over g GPUs, at the spec's batch (auto: what the job's
    batch_size: auto picks), and whether it fits: the weights by the gpus_per_replica rule, the batch
    by the rule the job fits its batch with (max_batch)."""
    weights = weight_bytes(s.d, fmt)
    off, rule, top = 0, None, None  # GPU memory unknown: nothing to check against
    if s.budget is not None and s.memory is not None:
        off = offloaded_bytes(weights, g, s.budget, s.cpu)
        rule = replica_fits(weights, g, s.budget, s.cpu)
        top = infer_split_max_batch(s.d, fmt, s.prompt, s.new, s.mode, g, s.memory, off, s.cap) if rule else 0
    engine = row_engine(s, fmt, g, off)
    batch = s.fixed_batch or auto_infer_batch(top or 0, s.mode, engine=engine)
    e = infer_split_estimate(s.d, fmt, batch, s.prompt, s.new, s.mode, g, off)
    return {"gpus_per_replica": g, "possible": s.gpus % g == 0, "replicas": s.replicas(g), "engine": engine,
            "batch": batch,
            "weights": e.weights, "offloaded": off, "kv_cache": e.kv_cache, "activations": e.activations,
            "total": e.total, "fits": None if top is None else bool(rule and batch <= top), "max_batch": top}


def row_engine(s: InferSetup, fmt: str, g: int, offloaded: int) -> str:
    """The engine the job runs a copy of this format and placement on: its batch cap differs."""
    quantization = fmt if fmt in ("int8", "int4") else "none"
    devices = g + (1 if offloaded else 0)
    return "batches" if why_batches(s.mode, s.engine, s.config, quantization, s.prompt + s.new, devices) else "slots"


def fewest_width(s: InferSetup, fmt: str) -> int | None:
    """gpus_per_replica: auto for `fmt`, by the rule submit and the job use."""
    if s.budget is None:
        return None
    return fewest_gpus_per_replica(weight_bytes(s.d, fmt), s.budget, s.gpus, s.cpu)


def format_entry(s: InferSetup, fmt: str, chosen: str, widths: list[int]) -> dict[str, Any]:
    """One weight format: its rows per width; the top-level keys are those of one GPU (width 1)."""
    rows = [width_row(s, fmt, g) for g in widths]
    one = {k: v for k, v in rows[0].items() if k not in ("gpus_per_replica", "possible", "replicas")}
    return {"weights_format": fmt, "spec": fmt == chosen, **one, "copy_weights": weight_bytes(s.d, fmt),
            "recommended_gpus_per_replica": fewest_width(s, fmt), "widths": rows}


def suggestions(s: InferSetup, fmt: str) -> list[str]:
    """What would fit when no width of a node does: smaller weights, CPU offload, more GPUs."""
    assert s.budget is not None
    out = []
    for q in ("int8", "int4"):
        g = fewest_width(s, q) if WEIGHT_BYTES[q] < WEIGHT_BYTES[fmt] else None
        if g:
            out.append(f"model.quantization: {q} ({gpus_text(g)} a copy)")
    weights, room = weight_bytes(s.d, fmt), int(s.gpus * max(0, s.budget) * WEIGHTS_SHARE)
    cap = "auto" if s.cap is None else fmt_bytes_gib(s.cap)
    out.append(f"CPU offload, infer.max_memory: {cap},cpu={fmt_bytes_gib(weights - room)} (slow)")
    more = next((1 << k for k in range(1, 12) if 1 << k > s.gpus and replica_fits(weights, 1 << k, s.budget, s.cpu)),
                None)
    if more:
        out.append(f"more GPUs, resources.gpus: {more} (a copy over all {more})")
    return out


def gpus_text(g: int) -> str:
    return "one GPU" if g == 1 else f"{g} GPUs"


def copies_text(n: int | None) -> str:
    return f"{n} {'copy' if n == 1 else 'copies'}"


def fmt_bytes_gib(n: int) -> str:
    """A size the spec takes, rounded up to a whole GiB."""
    return f"{-(-n // GiB)}GiB"


def recommend_infer(s: InferSetup, fmt: str, spec_g: int | str) -> dict[str, Any]:
    """gpus_per_replica for the spec's weights: the fewest that fit, the copies that gives, the batch
    there, the spec's own setting checked, and what to change when nothing fits."""
    g = fewest_width(s, fmt)
    row = width_row(s, fmt, g) if g else None
    mine = width_row(s, fmt, spec_g) if isinstance(spec_g, int) else None
    return {"weights_format": fmt, "gpus_per_replica": g, "replicas": s.replicas(g) if g else None,
            "batch": row["batch"] if row else None, "batch_fits": row["fits"] if row else None,
            "max_batch": row["max_batch"] if row else None, "spec_gpus_per_replica": spec_g,
            "spec_setting_fits": mine["fits"] if mine else None,
            "suggestions": suggestions(s, fmt) if s.budget is not None and not g else []}


def estimate_infer(spec: Spec, gpu_total: int | None, gpu_what: str, prompt_tokens: int | None,
                   as_json: bool) -> None:
    n_params, cfg = count_params(spec)
    d = infer_dims(cfg, n_params)
    inf = spec.infer
    prompt, prompt_from = prompt_length(spec, prompt_tokens)
    max_memory = parse_max_memory(inf.max_memory)
    s = InferSetup(d=d, prompt=prompt, new=0 if inf.mode == "score" else inf.max_new_tokens, mode=inf.mode,
                   fixed_batch=inf.batch_size if isinstance(inf.batch_size, int) else None,
                   budget=max_memory.gpu_budget(gpu_total), memory=gpu_total or max_memory.gpu, cap=max_memory.gpu,
                   cpu=max_memory.cpu, gpus=spec.resources.gpus, nodes=spec.resources.nodes, config=cfg,
                   engine=inf.engine)
    chosen = spec_weights_format(spec)
    formats = [chosen if f == "bfloat16" and chosen == "float16" else f for f in INFER_FORMATS]
    rec = recommend_infer(s, chosen, inf.gpus_per_replica)
    extra = {g for g in (rec["gpus_per_replica"], inf.gpus_per_replica) if isinstance(g, int)}
    widths = sorted(set(REPLICA_WIDTHS) | extra)
    table = [format_entry(s, fmt, chosen, widths) for fmt in formats]
    too_long = d.context is not None and prompt + s.new > d.context
    if as_json:
        g = inf.gpus_per_replica if isinstance(inf.gpus_per_replica, int) else rec["gpus_per_replica"] or 1
        click.echo(json.dumps({"task": "infer", "params": n_params, "dims": d.__dict__, "mode": inf.mode,
                               "prompt_tokens": prompt, "prompt_tokens_from": prompt_from, "new_tokens": s.new,
                               "replicas": s.replicas(g), "gpus_per_replica": inf.gpus_per_replica,
                               "recommended_gpus_per_replica": rec["gpus_per_replica"], "gpu_memory": gpu_total,
                               "usable": usable_bytes(gpu_total) if gpu_total else None, "gpu_budget": s.budget,
                               "cpu_offload": s.cpu, "exceeds_context": too_long, "formats": table,
                               "recommended": rec}, indent=2))
        return
    print_infer_header(spec, s, n_params, prompt_from, gpu_total, gpu_what, max_memory)
    if too_long:
        click.echo(f"warning: {prompt + s.new} tokens are more than the model's context of {d.context}")
    print_widths_table(s, table)
    print_recommended(s, rec, gpu_what)


def print_infer_header(spec: Spec, s: InferSetup, n_params: int, prompt_from: str, gpu_total: int | None,
                       gpu_what: str, max_memory: MaxMemory) -> None:
    d, model = s.d, spec.model.name_or_path or (spec.model.config or {}).get("model_type")
    click.echo(f"{spec.name}: {n_params / 1e6:,.2f}M parameters ({model}: {d.n_layers} layers, hidden {d.hidden}, "
               f"{d.heads} heads, vocab {d.vocab}); {s.mode}, {s.nodes} node(s) x {s.gpus} GPU(s), "
               f"gpus_per_replica {spec.infer.gpus_per_replica}")
    click.echo(f"rows of {s.prompt} tokens ({prompt_from})" + (f" + {s.new} new" if s.new else "") +
               (f"; batch {s.fixed_batch}" if s.fixed_batch else "; batch auto"))
    if gpu_total:
        click.echo(f"GPU: {fmt_bytes(gpu_total)} ({gpu_what}), {fmt_bytes(usable_bytes(gpu_total))} usable "
                   "after the CUDA context and allocator slack")
    if max_memory.gpu is not None:
        click.echo(f"infer.max_memory: a GPU of a copy may use {fmt_bytes(s.budget)}")
    if s.cpu:
        click.echo(f"infer.max_memory: up to {fmt_bytes(s.cpu)} of a copy's weights offloaded to CPU memory")


def print_widths_table(s: InferSetup, table: list[dict[str, Any]]) -> None:
    click.echo("memory per GPU of a model copy split over gpus_per_replica GPUs (weights and KV cache divide, "
               "activations do not):")
    cols = ("weights",) + (("offloaded",) if s.cpu else ()) + ("kv_cache", "activations", "total")
    click.echo(f"  {'weights as':<17}{'gpus':>5}{'copies':>7}{'batch':>7}"
               + "".join(f"{c.replace('_', ' '):>12}" for c in cols) + f"{'fits':>6}{'max batch':>11}")
    for entry in table:
        for i, r in enumerate(entry["widths"]):
            name = entry["weights_format"] + (" (spec)" if entry["spec"] else "") if i == 0 else ""
            fit = "?" if r["fits"] is None else "yes" if r["fits"] else "no"
            top = "-" if not r["max_batch"] else str(r["max_batch"])
            copies = "-" if r["replicas"] is None else str(r["replicas"])
            click.echo(f"  {name:<17}{r['gpus_per_replica']:>5}{copies:>7}{r['batch']:>7}"
                       + "".join(f"{fmt_bytes(r[c]):>12}" for c in cols) + f"{fit:>6}{top:>11}")
    notes = [] if s.budget is None else [f"fits: weights within {WEIGHTS_SHARE:.0%} of each GPU"
                                         + (" (and CPU memory)" if s.cpu else "") + ", the batch within the rest"]
    if not s.fixed_batch:
        caps = (f"{INFER_BATCH_CAP['slots']} slots on the slot engine, {INFER_BATCH_CAP['generate']} rows on "
                "batches (int8/int4, a split or offloaded copy)") if s.mode == "generate" else INFER_BATCH_CAP[s.mode]
        notes.append(f"batch auto: as the job picks it, the largest power of two that fits, at most {caps} "
                     "(fewer for a short input)")
    if any(not r["possible"] for r in table[0]["widths"]):
        notes.append(f"copies -: the width does not divide resources.gpus ({s.gpus})")
    if notes:
        click.echo("  " + "; ".join(notes))


def print_recommended(s: InferSetup, rec: dict[str, Any], gpu_what: str) -> None:
    fmt, g, spec_g = rec["weights_format"], rec["gpus_per_replica"], rec["spec_gpus_per_replica"]
    if s.budget is None:
        click.echo(f"{gpu_what}: give --gpu-memory (e.g. 80G) to check fit; gpus_per_replica auto is decided at "
                   "submit from the GPU memory (1 when it is unknown)")
        return
    if g is None:
        click.echo(f"DOES NOT FIT: {fmt} weights ({fmt_bytes(weight_bytes(s.d, fmt))}) need more than the "
                   f"{gpus_text(s.gpus)} of a node; try " + "; or ".join(rec["suggestions"]))
    else:
        click.echo(f"recommended: gpus_per_replica {g} (the fewest that hold the {fmt} weights) -> "
                   f"{copies_text(rec['replicas'])} over {s.nodes} node(s) x {s.gpus} GPU(s)")
        verdict = "fits" if rec["batch_fits"] else \
            f"does not fit; use batch_size <= {rec['max_batch']}" if rec["max_batch"] else \
            f"does not fit: not even one row of {s.prompt + s.new} tokens beside the weights"
        click.echo(f"{fmt} weights, {gpus_text(g)} per replica, batch {rec['batch']}: {verdict}")
        if g > 1 and spec_g == "auto" and s.cap is None:
            click.echo(f"  for a SLURM job set infer.gpus_per_replica: {g} (or infer.max_memory): submit cannot see "
                       "the cluster's GPUs and takes auto as 1 without a cap")
    if isinstance(spec_g, int):
        mine = "fits" if rec["spec_setting_fits"] else "does not fit"
        click.echo(f"infer.gpus_per_replica: {spec_g} (the spec's) {mine}" +
                   ("" if rec["spec_setting_fits"] or g is None else f"; {g} does"))
