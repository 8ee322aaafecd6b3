"""The baseline: a plain hand-written torchrun DDP loop (what users write without hpcgpu).

    torchrun --nproc_per_node N benchmarks/baseline_ddp.py --micro 16 --accum 2 --steps 40

Same model (HF GPT-2 from a config, random init), batch, bf16 autocast, torch.compile, fused AdamW
and no_sync accumulation as hpcgpu's train task; random token batches (no data pipeline cost, which
favours the baseline). Prints one JSON line with the mean tokens/s over the timed steps.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--micro", type=int, default=16)
    ap.add_argument("--accum", type=int, default=2)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--compile", type=int, default=1)
    args = ap.parse_args()

    from transformers import GPT2Config, GPT2LMHeadModel

    rank, local, world = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=12, n_head=12, n_embd=768, n_positions=args.seq, vocab_size=50304,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = GPT2LMHeadModel(cfg).cuda()
    raw = model
    if args.compile:
        model = torch.compile(model)
    model = DDP(model, device_ids=[local])
    opt = torch.optim.AdamW(raw.parameters(), lr=3e-4, fused=True)
    gen = torch.Generator(device="cuda").manual_seed(rank)
    tokens_per_step = args.micro * args.accum * args.seq * world

    times = []
    for step in range(args.steps):
        t0 = time.perf_counter()
        for i in range(args.accum):
            x = torch.randint(0, 256, (args.micro, args.seq), device="cuda", generator=gen)
            sync = contextlib.nullcontext() if i == args.accum - 1 else model.no_sync()
            with sync, torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(input_ids=x, labels=x).loss / args.accum
                loss.backward()
        torch.nn.utils.clip_grad_norm_(raw.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss_v = loss.detach().float()
        dist.all_reduce(loss_v)  # the per-step loss every real loop logs
        loss_v.item()
        times.append(time.perf_counter() - t0)
    timed = times[args.warmup:]
    tok_s = tokens_per_step * len(timed) / sum(timed)
    if rank == 0:
        n = sum(p.numel() for p in raw.parameters())
        print(json.dumps({"tokens_per_s": tok_s, "ms_per_step": 1000 * sum(timed) / len(timed),
                          "params": n, "world": world}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
