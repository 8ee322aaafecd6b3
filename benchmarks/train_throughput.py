"""hpcgpu's train task against a plain torchrun DDP loop, side by side in one run.

    python benchmarks/train_throughput.py --gpus 1,2 [--steps 40] [--micro 16] [--accum 2]

GPT-2 124M (random init, seq 1024, bf16 autocast, torch.compile, fused AdamW), the same per-GPU batch
for both; hpcgpu runs through the local executor (`hpcgpu submit --executor local`), the baseline
through torchrun (benchmarks/baseline_ddp.py). Prints tokens/s, MFU, the ratio hpcgpu/baseline and
the 2-GPU scaling; writes the table as JSON to $OUT/train_throughput.json when OUT is set.
Needs CUDA GPUs.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import string
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

GPT2_124M = {"model_type": "gpt2", "n_layer": 12, "n_head": 12, "n_embd": 768, "n_positions": 1024,
             "vocab_size": 50304, "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}


def flops_per_token(seq: int) -> float:
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(**{k: v for k, v in GPT2_124M.items() if k != "model_type"})
    with torch.device("meta"):
        n = sum(p.numel() for p in GPT2LMHeadModel(cfg).parameters())
    return 6 * n + 12 * 12 * 12 * 64 * seq


def peak() -> tuple[str, float]:
    import torch

    from hpcgpu.gpu.peak import peak_flops

    name = torch.cuda.get_device_name(0)
    return name, peak_flops(name) or float("nan")


def random_text(path: Path, n_bytes: int) -> None:
    rng = random.Random(0)
    alphabet = string.ascii_letters + string.digits + " .,\n"
    path.write_text("".join(rng.choices(alphabet, k=n_bytes)))


def run_hpcgpu(tmp: Path, gpus: int, args: argparse.Namespace) -> float:
    data = tmp / "data.txt"
    need = args.micro * args.accum * gpus * (args.steps + 2) * args.seq
    if not data.exists() or data.stat().st_size < need:
        random_text(data, need)
    spec = {
        "name": f"bench{gpus}", "task": "train", "runs_dir": str(tmp / "runs"),
        "resources": {"gpus": gpus, "cpus_per_gpu": 4},
        "model": {"config": GPT2_124M},
        "data": {"train": str(data), "seq_len": args.seq},
        "train": {"global_batch_size": args.micro * args.accum * gpus, "micro_batch_size": args.micro,
                  "max_steps": args.steps, "log_every": args.log_every, "warmup_steps": 5, "precision": "bf16",
                  "compile": bool(args.compile), "eval_every": 0},
    }
    path = tmp / f"bench{gpus}.yaml"
    path.write_text(yaml.safe_dump(spec))
    proc = subprocess.run([sys.executable, "-m", "hpcgpu", "submit", str(path), "--executor", "local", "--new"],
                          capture_output=True, text=True, cwd=REPO)
    if proc.returncode != 0:
        raise SystemExit(f"hpcgpu run failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    run_dir = Path(proc.stderr.split("run dir ")[1].split()[0].rstrip(","))
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    timed = [r for r in recs if r["kind"] == "train" and r["step"] > args.warmup]
    tokens = sum(r["tokens_per_s"] * r["ms_per_step"] / 1000 for r in timed)
    return tokens / sum(r["ms_per_step"] / 1000 for r in timed)


def run_baseline(gpus: int, args: argparse.Namespace) -> float:
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={gpus}",
         str(REPO / "benchmarks" / "baseline_ddp.py"), "--micro", str(args.micro), "--accum", str(args.accum),
         "--seq", str(args.seq), "--steps", str(args.steps), "--warmup", str(args.warmup),
         "--compile", str(args.compile)],
        capture_output=True, text=True, cwd=REPO)
    if proc.returncode != 0:
        raise SystemExit(f"baseline failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")][-1]
    return float(json.loads(line)["tokens_per_s"])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gpus", default="1,2")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--micro", type=int, default=16)
    ap.add_argument("--accum", type=int, default=2)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--compile", type=int, default=1)
    ap.add_argument("--log-every", type=int, default=5, help="hpcgpu's log interval (the baseline prints nothing)")
    args = ap.parse_args()
    name, peak_flops = peak()
    fpt = flops_per_token(args.seq)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for gpus in [int(g) for g in args.gpus.split(",")]:
            base = run_baseline(gpus, args)
            ours = run_hpcgpu(Path(tmp), gpus, args)
            rows.append({"gpus": gpus, "hpcgpu_tok_s": ours, "baseline_tok_s": base, "ratio": ours / base,
                         "hpcgpu_mfu": ours * fpt / (peak_flops * gpus), "baseline_mfu": base * fpt / (peak_flops * gpus)})
    print(f"# GPT-2 124M, seq {args.seq}, micro {args.micro} x accum {args.accum} per GPU, bf16, "
          f"compile={bool(args.compile)}, steps {args.steps} (first {args.warmup} untimed); {name}")
    print(f"{'gpus':>4} {'hpcgpu tok/s':>14} {'baseline tok/s':>15} {'ratio':>7} {'hpcgpu MFU':>11} {'base MFU':>9}")
    for r in rows:
        print(f"{r['gpus']:>4} {r['hpcgpu_tok_s']:>14,.0f} {r['baseline_tok_s']:>15,.0f} {r['ratio']:>7.3f} "
              f"{r['hpcgpu_mfu'] * 100:>10.1f}% {r['baseline_mfu'] * 100:>8.1f}%")
    by = {r["gpus"]: r for r in rows}
    if 1 in by and 2 in by:
        print(f"2-GPU scaling: hpcgpu {by[2]['hpcgpu_tok_s'] / by[1]['hpcgpu_tok_s']:.2f}x, "
              f"baseline {by[2]['baseline_tok_s'] / by[1]['baseline_tok_s']:.2f}x")
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "train_throughput.json").write_text(json.dumps({"gpu": name, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
