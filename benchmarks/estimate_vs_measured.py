"""`hpcgpu estimate` against the memory a training step really takes, on one GPU.

    python benchmarks/estimate_vs_measured.py [--models 124m,350m] [--micro 8] [--seq 1024] [--compile both]

The step is the trainer's own (hpcgpu build_model / build_optimizer: fp32 weights, bf16 autocast,
fused AdamW, zero_grad(set_to_none)), two optimizer steps of `accum` micro batches each, so the
optimizer states exist when the peak is read. Measured: torch.cuda.max_memory_allocated (what the
estimate models; nvidia-smi shows more: the CUDA context and the allocator's cache). Prints one line
per case and writes $OUT/estimate_vs_measured.json when OUT is set. Needs CUDA.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

MODELS = {  # GPT-2 small and medium
    "124m": {"model_type": "gpt2", "n_layer": 12, "n_head": 12, "n_embd": 768, "n_positions": 1024},
    "350m": {"model_type": "gpt2", "n_layer": 24, "n_head": 16, "n_embd": 1024, "n_positions": 1024},
}


def make_spec(cfg: dict, micro: int, seq: int, accum: int, compile_: bool):  # type: ignore[no-untyped-def]
    from hpcgpu.spec import spec_from_raw

    return spec_from_raw({"name": "estimate-check", "task": "train", "model": {"config": dict(cfg)},
                          "data": {"train": str(REPO / "configs" / "data" / "pydocs.txt"), "seq_len": seq},
                          "train": {"global_batch_size": micro * accum, "micro_batch_size": micro,
                                    "precision": "bf16", "compile": compile_}})


def measure(cfg: dict, micro: int, seq: int, accum: int = 1, compile_: bool = False, steps: int = 2) -> dict:
    """Peak allocated bytes of `steps` trainer-like optimizer steps, and the estimate for them."""
    import torch

    from hpcgpu.gpu.estimate import DDP, count_params, dims_from_config, estimate
    from hpcgpu.runtime.tasks.train import build_model, build_optimizer

    spec = make_spec(cfg, micro, seq, accum, compile_)
    dev = torch.device("cuda", 0)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(dev)
    base = torch.cuda.memory_allocated(dev)
    raw = build_model(spec, 0, dev).to(dev)
    model = torch.compile(raw) if compile_ else raw
    opt = build_optimizer(raw, spec, dev)
    vocab = raw.config.vocab_size
    for _ in range(steps):
        for _ in range(accum):
            x = torch.randint(0, vocab, (micro, seq), device=dev)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(input_ids=x, labels=x).loss / accum
            loss.backward()
        torch.nn.utils.clip_grad_norm_(raw.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize(dev)
    peak = torch.cuda.max_memory_allocated(dev) - base
    states = torch.cuda.memory_allocated(dev) - base  # weights + Adam moments, grads freed
    n, config = count_params(spec)
    e = estimate(dims_from_config(config, seq, n), DDP, micro, 1)
    del model, raw, opt
    torch.cuda.empty_cache()
    return {"params": n, "micro": micro, "seq": seq, "accum": accum, "compile": compile_, "measured": peak,
            "measured_states": states, "estimate": e.total, "estimate_activations": e.activations,
            "error": (e.total - peak) / peak}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="124m,350m")
    ap.add_argument("--micro", default="8")
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--accum", type=int, default=1)
    ap.add_argument("--compile", choices=["off", "on", "both"], default="off")
    args = ap.parse_args()
    import torch

    modes = {"off": [False], "on": [True], "both": [False, True]}[args.compile]
    rows = []
    print(f"device: {torch.cuda.get_device_name(0)}")
    for name in args.models.split(","):
        for micro in map(int, args.micro.split(",")):
            for c in modes:
                r = {"model": name, **measure(MODELS[name], micro, args.seq, args.accum, c)}
                rows.append(r)
                print(f"gpt2-{name} micro {micro} seq {args.seq} accum {args.accum} compile {c}: measured "
                      f"{r['measured'] / 2**30:.2f} GiB (states after step {r['measured_states'] / 2**30:.2f}), "
                      f"estimate {r['estimate'] / 2**30:.2f} GiB (activations {r['estimate_activations'] / 2**30:.2f}), "
                      f"error {r['error'] * 100:+.1f}%", flush=True)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "estimate_vs_measured.json").write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
