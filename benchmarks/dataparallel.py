"""nn.DataParallel (one process driving every GPU) against one GPU of the same plain loop, and
optionally DDP (one process per GPU, what hpcgpu runs): the figure behind README's DataParallel note.

    python benchmarks/dataparallel.py [--gpus 2] [--repeats 3] [--modes one,dp,ddp]

Each mode is benchmarks/loop_minimal.py in a fresh process, GPT-2 124M, seq 1024, micro 16 per GPU,
bf16 autocast, fused AdamW, compile off for every mode (DataParallel re-replicates the module each
step, which torch.compile does not survive):

    one   1 GPU (CUDA_VISIBLE_DEVICES=0)
    dp    --data-parallel: one process, nn.DataParallel over --gpus GPUs, micro 16 x GPUs a step
    ddp   torchrun --nproc_per_node GPUS: DDP, one process a GPU

Modes interleave (one dp ddp one dp ddp ...), --repeats rounds; per mode the median and spread
(min-max) of tokens/s, and each mode against one GPU (ratio of medians; spread of the per-round
ratios). Timed steps per mode are set so each measurement lasts >= 20 s on an H100 (--steps-*);
shorter ones are flagged. Writes JSON to $OUT/dataparallel.json. The parent never touches CUDA.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def command(mode: str, gpus: int, steps: int, warmup: int, extra_args: list[str]) -> tuple[list[str], dict[str, str]]:
    common = ["--no-compile", "--steps", str(steps), "--warmup", str(warmup), *extra_args]
    visible = ",".join(str(i) for i in range(1 if mode == "one" else gpus))
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": visible}
    if mode == "ddp":
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={gpus}",
                str(HERE / "loop_minimal.py"), *common], env
    extra = ["--data-parallel"] if mode == "dp" else []
    return [sys.executable, str(HERE / "loop_minimal.py"), *common, *extra], env


def run(mode: str, gpus: int, steps: int, warmup: int, extra_args: list[str]) -> dict:
    cmd, env = command(mode, gpus, steps, warmup, extra_args)
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=HERE, env=env, timeout=600)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"{mode} failed (exit {proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1])


def spread(values: list[float], fmt: str = ",.0f") -> str:
    return f"{statistics.median(values):{fmt}} [{min(values):{fmt}}-{max(values):{fmt}}]"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gpus", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--modes", default="one,dp")
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--steps-one", type=int, default=260, help="timed steps at one GPU (~80 ms each on an H100)")
    ap.add_argument("--steps-dp", type=int, default=140, help="timed steps under DataParallel (~175 ms each at 2 H100s)")
    ap.add_argument("--steps-ddp", type=int, default=260, help="timed steps under DDP")
    ap.add_argument("--min-seconds", type=float, default=20.0)
    ap.add_argument("--loop-arg", action="append", default=[], help="passed to loop_minimal.py (a smoke run's tiny model)")
    args = ap.parse_args()
    modes = args.modes.split(",")
    steps = {"one": args.steps_one, "dp": args.steps_dp, "ddp": args.steps_ddp}
    results: dict[str, list[dict]] = {m: [] for m in modes}
    for rnd in range(args.repeats):
        for mode in modes:
            res = run(mode, args.gpus, steps[mode], args.warmup, args.loop_arg)
            results[mode].append(res)
            short = " (SHORT: under --min-seconds)" if res["timed_s"] < args.min_seconds else ""
            print(f"round {rnd + 1} {mode}: {res['tokens_per_s']:,.0f} tok/s, {res['ms_per_step']:.1f} ms/step, "
                  f"{res['timed_s']:.1f} s timed{short}", flush=True)
    device = results[modes[0]][0]["device"]
    print(f"# GPT-2 124M, seq 1024, micro 16 per GPU, bf16, compile off, {device}; {args.gpus} GPUs for dp/ddp; "
          f"{args.repeats} rounds interleaved; median [min-max]")
    summary = {}
    for mode in modes:
        tok = [r["tokens_per_s"] for r in results[mode]]
        line = f"{mode:<4} {spread(tok):>32} tok/s"
        if mode != "one" and "one" in results:
            per_round = [a["tokens_per_s"] / b["tokens_per_s"] for a, b in zip(results[mode], results["one"])]
            r = statistics.median(tok) / statistics.median(x["tokens_per_s"] for x in results["one"])
            summary[mode] = {"vs_one_gpu": r, "min": min(per_round), "max": max(per_round)}
            line += f"   vs one GPU {r:.3f}x [{min(per_round):.3f}-{max(per_round):.3f}]"
        print(line)
    out = Path(os.environ.get("OUT", "/tmp")) / "dataparallel.json"
    out.write_text(json.dumps({"results": results, "summary": summary, "gpus": args.gpus}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
