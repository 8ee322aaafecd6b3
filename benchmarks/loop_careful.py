"""The training loop a careful user writes (nanoGPT-style), the everyday bar for hpcgpu's train task.

    torchrun --standalone --nproc_per_node N benchmarks/loop_careful.py [--steps 600] [--warmup 50]

The model, precision and compile as benchmarks/loop_minimal.py (--model: HF GPT2LMHeadModel, GPT-2
124M, or LlamaForCausalLM in Llama-3.2-1B's shape, from a config, random init, sdpa, dropout 0;
torch.compile, then DDP when WORLD_SIZE > 1; bf16 autocast on CUDA), plus what a real run has, as
nanoGPT's train.py does it:

- data: a token array in host memory (--data-tokens random tokens, seeded, the same on every rank;
  uint16, uint32 where the vocabulary is larger); each micro batch is --micro-batch windows of
  --seq-len tokens at random offsets (torch RNG, seeded per rank), stacked, copied to pinned memory
  and sent with non_blocking=True; the next batch is drawn while the GPU still runs the forward
  pass (nanoGPT's prefetch)
- AdamW with decay / no-decay groups (weight decay 0.1 on >= 2-D tensors), betas (0.9, 0.95),
  fused on CUDA
- cosine LR with linear warmup (--lr-warmup steps; to lr/10 at the last step), set every step
- gradient clipping at --grad-clip (1.0)
- the loss read back (.item(), rank 0) only every --log-every steps, printed to stderr

Timing and output as loop_minimal.py: --warmup untimed steps, then --steps timed steps between two
synchronisations; rank 0 prints ONE JSON line (tokens_per_s, ms_per_step, mfu, ttfs_s,
step1_done_unix, ...). Needs torch, numpy and transformers; no hpcgpu.
"""
from __future__ import annotations

import time

T_START = time.time()  # the process start as this program sees it (before torch is imported)

import argparse  # noqa: E402
import contextlib  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import sys  # noqa: E402

import numpy as np  # noqa: E402
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
    ap.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    ap.add_argument("--precision", choices=["auto", "bf16", "fp32"], default="auto",
                    help="autocast dtype; auto: bf16 on CUDA, fp32 on the CPU")
    ap.add_argument("--lr", type=float, default=6e-4, help="peak learning rate")
    ap.add_argument("--lr-warmup", type=int, default=10, help="linear LR warmup steps")
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--grad-clip", type=float, default=1.0, help="max gradient norm (0: off)")
    ap.add_argument("--log-every", type=int, default=10, help="read the loss back every N steps")
    ap.add_argument("--data-tokens", type=int, default=1 << 22, help="tokens in the host-memory array")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--peak-tflops", type=float, default=None, help="the GPU's dense bf16 peak (default: by name)")
    args = ap.parse_args()
    model_defaults(ap, args)
    if args.warmup < 1 or args.steps < 1 or args.log_every < 1:
        ap.error("--warmup, --steps and --log-every must be >= 1")
    if args.data_tokens <= args.seq_len:
        ap.error("--data-tokens must exceed --seq-len")
    return args


def make_optimizer(model: torch.nn.Module, args: argparse.Namespace, device: torch.device) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": args.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95), fused=device.type == "cuda")


def lr_at(it: int, args: argparse.Namespace, total: int) -> float:
    """nanoGPT's get_lr: linear warmup, cosine decay to lr/10 over the run."""
    min_lr = args.lr / 10
    if it < args.lr_warmup:
        return args.lr * (it + 1) / (args.lr_warmup + 1)
    if it >= total:
        return min_lr
    ratio = (it - args.lr_warmup) / max(1, total - args.lr_warmup)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (args.lr - min_lr)


def main() -> None:
    args = parse_args()
    rank, world, device = setup_dist(args)
    amp = torch.bfloat16 if args.precision == "bf16" or (args.precision == "auto" and device.type == "cuda") else None
    raw = build_model(args, device)
    model: torch.nn.Module = raw
    ddp = world > 1
    if args.compile:
        model = torch.compile(model)
    if ddp:
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    opt = make_optimizer(raw, args, device)
    autocast = (lambda: torch.autocast(device.type, dtype=amp)) if amp is not None else contextlib.nullcontext

    dtype = np.uint16 if args.vocab <= 65536 else np.uint32  # nanoGPT's uint16 where the vocabulary fits
    data = np.random.default_rng(args.seed).integers(0, args.vocab, size=args.data_tokens, dtype=dtype)
    torch.manual_seed(1337 + args.seed + rank)  # each rank its own batch offsets

    def get_batch() -> torch.Tensor:
        ix = torch.randint(len(data) - args.seq_len, (args.micro_batch,)).tolist()
        x = torch.from_numpy(np.stack([data[i:i + args.seq_len].astype(np.int64) for i in ix]))
        if device.type == "cuda":
            return x.pin_memory().to(device, non_blocking=True)
        return x

    total = args.warmup + args.steps
    x = get_batch()
    it = 0

    def step() -> torch.Tensor:
        nonlocal x, it
        lr = lr_at(it, args, total)
        for group in opt.param_groups:
            group["lr"] = lr
        for i in range(args.accum):
            quiet = model.no_sync() if ddp and i < args.accum - 1 else contextlib.nullcontext()
            with quiet:
                with autocast():
                    loss = model(input_ids=x, labels=x).loss
                    if args.accum > 1:
                        loss = loss / args.accum
                x = get_batch()  # prefetch the next batch while the GPU runs the forward pass
                loss.backward()
        if args.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(raw.parameters(), args.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        it += 1
        if it % args.log_every == 0 and rank == 0:
            lossf = loss.item() * args.accum  # the only read-back: a sync every log interval, on rank 0
            print(f"step {it}: loss {lossf:.4f}, lr {lr:.3e}", file=sys.stderr, flush=True)
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
    final_loss = float(loss.detach().float().item()) * args.accum

    tokens = args.micro_batch * args.accum * args.seq_len * world * args.steps
    tok_s = tokens / elapsed
    name, peak = peak_flops(args, device)
    fpt = flops_per_token(raw, args)
    if rank == 0:
        print(json.dumps({
            "program": "careful", "tokens_per_s": tok_s, "ms_per_step": 1000 * elapsed / args.steps,
            "interval_ms": intervals.summary(),
            "timed_s": elapsed, "timed_steps": args.steps, "warmup_steps": args.warmup,
            "mfu": tok_s * fpt / (peak * world) if peak else None, "flops_per_token": fpt, "peak_flops": peak,
            "ttfs_s": step1_done - T_START, "step1_done_unix": step1_done, "process_start_unix": T_START,
            "final_loss": final_loss, "params": sum(p.numel() for p in raw.parameters()), "world": world,
            "device": name, "precision": "bf16" if amp is not None else "fp32", "compile": args.compile,
            "micro_batch": args.micro_batch, "accum": args.accum, "seq_len": args.seq_len,
            "log_every": args.log_every, "grad_clip": args.grad_clip, "data_tokens": args.data_tokens,
            "peak_mem_gib": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None,
        }), flush=True)
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
