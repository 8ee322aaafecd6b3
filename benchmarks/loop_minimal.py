"""The minimal training loop: the ceiling a hand-written loop reaches for hpcgpu's train task.

    torchrun --standalone --nproc_per_node N benchmarks/loop_minimal.py [--steps 600] [--warmup 50]

A Hugging Face model from a config (random init, seeded; sdpa attention, dropout 0), by --model:
gpt2-124m (default), GPT2LMHeadModel, GPT-2 124M, vocab 50304, seq 1024, micro 16 (its forward with
the loss compiles as two graphs, split by transformers' warning about the unnamed loss, unless
--name-loss); llama-1b, LlamaForCausalLM in Llama-3.2-1B's shape (16 layers, hidden 2048, 32 heads,
8 KV heads, MLP 8192, vocab 128256, rope_theta 500000, tied embeddings), seq 2048, micro 4; the size
flags (--n-layer, --n-embd, --n-head, --vocab; llama: --n-kv-head, --intermediate), --seq-len and
--micro-batch override them. Compiled whole (torch.compile of the model, then DDP with its default
buckets when WORLD_SIZE > 1: the order hpcgpu and nanoGPT use), fused AdamW (on CUDA), bf16 autocast
(on CUDA; fp32 on the CPU unless --precision says otherwise). One fixed random batch, made on the
device once: no data pipeline at all. Each step is loss.backward(); opt.step();
opt.zero_grad(set_to_none=True): no clipping, no scheduler, nothing read back until the end.

--warmup untimed steps (step 1 compiles), then --steps timed steps between two synchronisations.
Rank 0 prints ONE JSON line at the end: tokens_per_s over the timed steps (tokens = micro x accum x
seq x world per step), ms_per_step, mfu (hpcgpu's FLOPs count: 6 x parameters + 12 x layers x heads x
head_dim x seq per token, over the GPU's dense bf16 peak; null on the CPU or an unknown GPU),
ttfs_s (the process start, time.time() at the top of this file, to step 1 done, synchronised),
step1_done_unix (the same instant, wall clock: the benchmark measures from its own launch), the final
loss and the setup. Needs torch and transformers; of hpcgpu only its GPU peak table (loop_common.py)
and, with --profile-dir, its profiler.

--profile-dir DIR: torch.profiler over steps N to N+K-1 (--profile-start N, default 10; --profile-steps
K, default 3; steps counted from 1 over --warmup then --steps) through hpcgpu's train.profile code
(hpcgpu/runtime/profile.py): DIR/rank{R}.trace.json and DIR/rank{R}.txt, one log line on stderr.
Profiled steps among the timed ones slow them down.
"""
from __future__ import annotations

import time

T_START = time.time()  # the process start as this program sees it (before torch is imported)

import argparse  # noqa: E402
import contextlib  # noqa: E402
import json  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from loop_common import (IntervalMarks, add_interval_arg, add_model_args, build_model,  # noqa: E402
                         flops_per_token, model_defaults, peak_flops, setup_dist, sync)

# dense bf16 tensor FLOP/s (no sparsity), hpcgpu/gpu/peak.py's numbers; the first match wins


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_args(ap)  # --model, the size flags, --seq-len, --micro-batch
    add_interval_arg(ap)
    ap.add_argument("--accum", type=int, default=1, help="micro batches per optimizer step (no_sync before the last)")
    ap.add_argument("--steps", type=int, default=600, help="timed optimizer steps, after --warmup")
    ap.add_argument("--warmup", type=int, default=50, help="untimed steps first (>= 1; step 1 compiles)")
    ap.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True, help="torch.compile the model")
    ap.add_argument("--name-loss", action="store_true",
                    help="model.loss_type = 'ForCausalLM': GPT2LMHeadModel's forward then compiles as one graph with "
                         "the loss, not two (transformers' warning about the unnamed loss is a graph break); 2%% "
                         "slower on an H100 (benchmarks/RESULTS.md), why hpcgpu's step compiles its loss apart")
    ap.add_argument("--compile-outer", action="store_true",
                    help="compile the DDP-wrapped module instead (DDPOptimizer splits the graph at buckets)")
    ap.add_argument("--data-parallel", action="store_true",
                    help="one process driving every visible GPU through nn.DataParallel (micro batch per GPU): "
                         "what HF Trainer falls back to under plain `python` on a multi-GPU node")
    ap.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    ap.add_argument("--precision", choices=["auto", "bf16", "fp32"], default="auto",
                    help="autocast dtype; auto: bf16 on CUDA, fp32 on the CPU")
    ap.add_argument("--lr", type=float, default=6e-4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--peak-tflops", type=float, default=None, help="the GPU's dense bf16 peak (default: by name)")
    ap.add_argument("--profile-dir", default=None, help="torch.profiler trace and summary per rank go here")
    ap.add_argument("--profile-start", type=int, default=10, help="first profiled step, counted from 1 over "
                    "--warmup and --steps")
    ap.add_argument("--profile-steps", type=int, default=3, help="profiled steps")
    args = ap.parse_args()
    model_defaults(ap, args)
    if args.warmup < 1 or args.steps < 1:
        ap.error("--warmup and --steps must be >= 1")
    if args.profile_start < 1 or args.profile_steps < 1:
        ap.error("--profile-start and --profile-steps must be >= 1")
    if args.data_parallel and args.compile:
        ap.error("--data-parallel needs --no-compile (DataParallel replicates the module every step)")
    return args


def step_profiler(args: argparse.Namespace, rank: int, device: torch.device) -> Any:
    """hpcgpu's train.profile over the same step numbers, or None without --profile-dir."""
    if not args.profile_dir:
        return None
    import logging
    from pathlib import Path

    from hpcgpu.runtime.profile import StepProfiler

    logging.basicConfig(level=logging.INFO, format="%(message)s")  # its line goes to stderr: stdout stays JSON
    return StepProfiler.for_dir(Path(args.profile_dir), args.profile_start, args.profile_steps, rank, device,
                                max_steps=args.warmup + args.steps)


def main() -> None:
    args = parse_args()
    rank, world, device = setup_dist(args)
    amp = torch.bfloat16 if args.precision == "bf16" or (args.precision == "auto" and device.type == "cuda") else None
    raw = build_model(args, device)
    model: torch.nn.Module = raw
    ddp = world > 1
    if args.compile and not args.compile_outer:
        model = torch.compile(model)
    if ddp:
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    if args.compile and args.compile_outer:
        model = torch.compile(model)
    replicas = 1
    if args.data_parallel and device.type == "cuda":
        replicas = torch.cuda.device_count()
        model = torch.nn.DataParallel(model)  # scatters the batch, replicates the weights, gathers the losses
    opt = torch.optim.AdamW(raw.parameters(), lr=args.lr, fused=device.type == "cuda")
    gen = torch.Generator(device=device).manual_seed(args.seed + 1 + rank)
    x = torch.randint(0, args.vocab, (args.micro_batch * replicas, args.seq_len), device=device, generator=gen)
    autocast = (lambda: torch.autocast(device.type, dtype=amp)) if amp is not None else contextlib.nullcontext
    profiler = step_profiler(args, rank, device)
    steps_done = 0

    def step() -> torch.Tensor:
        nonlocal steps_done
        for i in range(args.accum):
            quiet = model.no_sync() if ddp and i < args.accum - 1 else contextlib.nullcontext()
            with quiet:
                with autocast():
                    loss = model(input_ids=x, labels=x).loss.mean()  # DataParallel: one loss a GPU
                (loss / args.accum if args.accum > 1 else loss).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        steps_done += 1
        if profiler is not None:
            profiler.after_step(steps_done)
        return loss

    loss = step()
    sync(device)  # step 1 done: the first instant a result of it could be read
    step1_done = time.time()
    for _ in range(args.warmup - 1):
        loss = step()
    sync(device)
    intervals = IntervalMarks(device, args.interval)
    t0 = time.perf_counter()
    intervals.mark()
    for i in range(args.steps):
        loss = step()
        intervals.after_step(i + 1)
    sync(device)
    elapsed = time.perf_counter() - t0
    if profiler is not None:
        profiler.close()
    final_loss = float(loss.detach().float().item())  # the only read-back of the loss

    gpus = world * replicas
    tokens = args.micro_batch * args.accum * args.seq_len * gpus * args.steps
    tok_s = tokens / elapsed
    name, peak = peak_flops(args, device)
    fpt = flops_per_token(raw, args)
    if rank == 0:
        print(json.dumps({
            "program": "minimal", "tokens_per_s": tok_s, "ms_per_step": 1000 * elapsed / args.steps,
            "interval_ms": intervals.summary(),
            "timed_s": elapsed, "timed_steps": args.steps, "warmup_steps": args.warmup,
            "mfu": tok_s * fpt / (peak * gpus) if peak else None, "flops_per_token": fpt, "peak_flops": peak,
            "ttfs_s": step1_done - T_START, "step1_done_unix": step1_done, "process_start_unix": T_START,
            "final_loss": final_loss, "params": sum(p.numel() for p in raw.parameters()), "world": world, "gpus": gpus,
            "data_parallel": args.data_parallel,
            "device": name, "precision": "bf16" if amp is not None else "fp32", "compile": args.compile,
            "compile_outer": args.compile_outer, "micro_batch": args.micro_batch, "accum": args.accum,
            "seq_len": args.seq_len,
            "peak_mem_gib": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None,
        }), flush=True)
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
