"""Checkpoint cost: how long a save blocks training, sync vs async, and save/load throughput.

    python benchmarks/checkpoint.py [--model gpt2-124m|tiny] [--repeats 3] [--dir /tmp/ckbench]

Model + AdamW state (after one step, so the optimizer state exists) saved through hpcgpu's
CheckpointManager (torch.distributed.checkpoint), single process, on the GPU when there is one, else
on the CPU (the output says which). "blocking" is the time the training loop waits in save(); for
async that is the copy to host memory, the write continues in the background.
Target: async blocks for at most 10% of the sync save time.
"""
from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hpcgpu.runtime.checkpoint import CheckpointManager, CheckpointPolicy  # noqa: E402

CONFIGS = {
    "gpt2-124m": dict(n_layer=12, n_head=12, n_embd=768, n_positions=1024, vocab_size=50304),
    "tiny": dict(n_layer=2, n_head=2, n_embd=64, n_positions=64, vocab_size=256),
}


def build(model_name: str, device: torch.device) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(**CONFIGS[model_name])).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randint(0, 256, (2, 64), device=device)
    model(input_ids=x, labels=x).loss.backward()
    opt.step()
    return model, opt


def tensors_of(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd}


def state_bytes(state: dict) -> int:
    total = 0

    def walk(v: object) -> None:
        nonlocal total
        if isinstance(v, torch.Tensor):
            total += v.numel() * v.element_size()
        elif isinstance(v, dict):
            for x in v.values():
                walk(x)
        elif isinstance(v, (list, tuple)):
            for x in v:
                walk(x)

    walk(state)
    return total


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="gpt2-124m", choices=sorted(CONFIGS))
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--dir", default=None)
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    where = torch.cuda.get_device_name(0) if device.type == "cuda" else "CPU"
    model, opt = build(args.model, device)
    size = state_bytes(tensors_of(model, opt))
    root = Path(args.dir or tempfile.mkdtemp(prefix="ckbench-"))
    results: dict[str, list[float]] = {"sync_blocking": [], "async_blocking": [], "async_total": [], "load": []}
    step = 0
    # one manager per mode for the whole run, as in training: buffers it keeps are reused by each save
    managers = {mode: CheckpointManager(root / mode, CheckpointPolicy(keep=1, async_save=(mode == "async")))
                for mode in ("sync", "async")}
    for _ in range(args.repeats):
        for mode in ("sync", "async"):
            step += 1
            mgr = managers[mode]
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            mgr.save(step, tensors_of(model, opt), {"step": step}, {})
            blocking = time.perf_counter() - t0
            mgr.finish_pending()
            total = time.perf_counter() - t0
            results[f"{mode}_blocking"].append(blocking)
            if mode == "async":
                results["async_total"].append(total)
        t0 = time.perf_counter()
        loaded = CheckpointManager(root / "sync", CheckpointPolicy()).load_latest(tensors_of(model, opt))
        results["load"].append(time.perf_counter() - t0)
        assert loaded is not None
    # the first save of each manager allocates its buffers once; report the steady state after it
    med = {k: statistics.median(v[1:] if len(v) > 1 and k != "load" else v) for k, v in results.items()}
    gb = size / 1e9
    print(f"# checkpoint of {args.model} + AdamW: {gb:.2f} GB of tensors, on {where}, median of saves 2..{args.repeats}")
    print(f"first saves (buffers allocated): sync {results['sync_blocking'][0] * 1000:.1f} ms, "
          f"async {results['async_blocking'][0] * 1000:.1f} ms")
    print(f"sync save   blocks {med['sync_blocking'] * 1000:9.1f} ms   ({gb / med['sync_blocking']:.2f} GB/s)")
    print(f"async save  blocks {med['async_blocking'] * 1000:9.1f} ms   (done after {med['async_total'] * 1000:.1f} ms)")
    print(f"load               {med['load'] * 1000:9.1f} ms   ({gb / med['load']:.2f} GB/s)")
    print(f"async/sync blocking ratio: {med['async_blocking'] / med['sync_blocking']:.3f} (target <= 0.10)")
    if not args.dir:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
