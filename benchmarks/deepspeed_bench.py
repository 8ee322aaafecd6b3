"""DDP vs ZeRO-2 vs ZeRO-3 through hpcgpu's train task, side by side in one run, plus a preempt/resume.

    python benchmarks/deepspeed_bench.py [--gpus 2] [--models gpt2-124m,llama-1b] [--steps 20]

Every row is `hpcgpu submit --executor local --gpus N` of the same spec with only
distributed.strategy / zero_stage changed: tokens/s (steps after the first few), its ratio to DDP,
and rank 0's peak GPU memory (torch.cuda.max_memory_allocated). compile is off for all rows, so the
rows differ only in the strategy. Then a preempt/resume round trip under ZeRO-3: stop at a step,
resume, and compare the loss curve with the uninterrupted row. Needs CUDA GPUs and deepspeed.
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

MODELS = {
    "gpt2-124m": ({"model_type": "gpt2", "n_layer": 12, "n_head": 12, "n_embd": 768, "n_positions": 1024,
                   "vocab_size": 50304, "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0},
                  {"micro": 16, "accum": 2, "seq": 1024}),
    "llama-1b": ({"model_type": "llama", "hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 16,
                  "num_attention_heads": 16, "num_key_value_heads": 16, "vocab_size": 32000,
                  "max_position_embeddings": 2048},
                 {"micro": 4, "accum": 2, "seq": 1024}),
}
STRATEGIES = {"ddp": ("ddp", 0), "zero2": ("deepspeed", 2), "zero3": ("deepspeed", 3)}


def random_text(path: Path, n: int) -> None:
    rng = random.Random(0)
    path.write_text("".join(rng.choices(string.ascii_letters + " .,\n", k=n)))


def spec_for(tmp: Path, model: str, strategy: str, gpus: int, steps: int) -> Path:
    cfg, shape = MODELS[model]
    kind, stage = STRATEGIES[strategy]
    data = tmp / "data.txt"
    need = shape["micro"] * shape["accum"] * gpus * (steps + 2) * shape["seq"]
    if not data.exists() or data.stat().st_size < need:
        random_text(data, need)
    doc = {"name": f"{model}-{strategy}", "task": "train", "runs_dir": str(tmp / "runs"),
           "resources": {"gpus": gpus, "cpus_per_gpu": 4},
           "distributed": {"strategy": kind, "deepspeed": {"zero_stage": stage or 2}},
           "model": {"config": cfg}, "data": {"train": str(data), "seq_len": shape["seq"]},
           "train": {"global_batch_size": shape["micro"] * shape["accum"] * gpus, "micro_batch_size": shape["micro"],
                     "max_steps": steps, "log_every": 1, "warmup_steps": 2, "lr": 3e-4, "precision": "bf16",
                     "compile": False},
           "checkpoint": {"every_steps": 10**6}}
    path = tmp / f"{model}-{strategy}.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def submit(spec: Path, *args: str, env: dict | None = None) -> tuple[int, Path | None, str]:
    proc = subprocess.run([sys.executable, "-m", "hpcgpu", "submit", str(spec), "--executor", "local", *args],
                          capture_output=True, text=True, cwd=REPO, env={**os.environ, **(env or {})})
    marker = "unfinished run " if "unfinished run " in proc.stderr else "run dir "
    run_dir = Path(proc.stderr.split(marker)[1].split()[0].rstrip(",")) if marker in proc.stderr else None
    return proc.returncode, run_dir, proc.stdout[-2000:] + proc.stderr[-2000:]


def train_records(run_dir: Path) -> list[dict]:
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in recs if r["kind"] == "train"]


def summarize(run_dir: Path, skip: int) -> dict:
    recs = train_records(run_dir)
    timed = [r for r in recs if r["step"] > skip]
    seconds = sum(r["ms_per_step"] / 1000 for r in timed)
    tokens = sum(r["tokens_per_s"] * r["ms_per_step"] / 1000 for r in timed)
    return {"tok_s": tokens / seconds, "peak_gib": max(r.get("peak_mem_gib") or 0 for r in recs),
            "losses": {r["step"]: r["loss"] for r in recs}}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gpus", type=int, default=2)
    ap.add_argument("--models", default="gpt2-124m,llama-1b")
    ap.add_argument("--strategies", default="ddp,zero2,zero3")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--skip", type=int, default=5)
    ap.add_argument("--preempt", default="gpt2-124m", help="model for the ZeRO-3 preempt/resume round trip")
    args = ap.parse_args()
    import torch

    gpu = torch.cuda.get_device_name(0)
    rows, notes = [], []
    with tempfile.TemporaryDirectory() as tmp_s:
        tmp = Path(tmp_s)
        for model in args.models.split(","):
            for strategy in args.strategies.split(","):
                code, run_dir, tail = submit(spec_for(tmp, model, strategy, args.gpus, args.steps), "--new")
                if code != 0 or run_dir is None:
                    rows.append({"model": model, "strategy": strategy, "error": tail.strip().splitlines()[-1:]})
                    continue
                rows.append({"model": model, "strategy": strategy, **summarize(run_dir, args.skip),
                             "run_dir": str(run_dir)})
        if args.preempt:
            spec = spec_for(tmp, args.preempt, "zero3", args.gpus, args.steps)
            stop_at = args.steps // 2
            code1, run_dir, _ = submit(spec, "--new", env={"HPCGPU_SIGNAL_AT": f"{stop_at}:1"})
            code2, run_dir2, tail = submit(spec)
            full = next((r for r in rows if r["model"] == args.preempt and r["strategy"] == "zero3"), None)
            if run_dir and full and "losses" in full and code2 == 0:
                resumed = summarize(run_dir, args.skip)["losses"]
                diff = max(abs(resumed[s] - full["losses"][s]) for s in full["losses"] if s in resumed)
                notes.append(f"ZeRO-3 preempt/resume ({args.preempt}): signal at step {stop_at} "
                             f"(stop after {stop_at + 1}) exit {code1}, "
                             f"resume exit {code2}, same run dir {run_dir == run_dir2}, max |loss diff| vs "
                             f"uninterrupted over {len(resumed)} steps: {diff:.2e}")
            else:
                notes.append(f"ZeRO-3 preempt/resume failed: exits {code1}/{code2}: {tail[-500:]}")
    print(f"# {args.gpus} x {gpu}; bf16, compile off, {args.steps} steps (first {args.skip} untimed)")
    print(f"{'model':<10} {'strategy':<8} {'tok/s':>12} {'vs ddp':>7} {'peak GiB (rank 0)':>18}")
    for r in rows:
        if "error" in r:
            print(f"{r['model']:<10} {r['strategy']:<8} failed: {r['error']}")
            continue
        ddp = next((x for x in rows if x["model"] == r["model"] and x["strategy"] == "ddp" and "tok_s" in x), None)
        ratio = f"{r['tok_s'] / ddp['tok_s']:.2f}" if ddp else "-"
        print(f"{r['model']:<10} {r['strategy']:<8} {r['tok_s']:>12,.0f} {ratio:>7} {r['peak_gib']:>18.1f}")
    for n in notes:
        print(n)
    if os.environ.get("OUT"):
        slim = [{k: v for k, v in r.items() if k not in ("losses", "run_dir")} for r in rows]
        Path(os.environ["OUT"], "deepspeed_bench.json").write_text(json.dumps({"gpu": gpu, "rows": slim,
                                                                               "notes": notes}, indent=1))


if __name__ == "__main__":
    main()
