"""Checks at width (4+ GPUs): launcher parity, GPU subsets, ZeRO-2 at width, preemption round trip.

    python benchmarks/four_gpus.py [--gpus 4] [--subset 0,2,3]

1. The same GPT-2 124M spec through the local executor and through `hpcgpu run` under a hand-set
   SLURM-style environment (one process per GPU): tokens/s of each.
2. ZeRO-2 against DDP at the full width (compile off for both): tokens/s and the ratio.
3. resources.devices = SUBSET: NVML is polled during the run; the job must use exactly those GPUs.
4. Preemption at full width: a signal to one rank, agreed stop, checkpoint, resume; the loss curve
   against the uninterrupted run.
Writes four_gpus.json to $OUT when set. Needs CUDA GPUs.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))

from deepspeed_bench import MODELS, random_text, submit, summarize  # noqa: E402


def spec(tmp: Path, name: str, gpus: int, steps: int, strategy: str = "ddp", compile_: bool = True,
         devices: str | None = None, micro: int = 16, accum: int = 2) -> Path:
    cfg, _ = MODELS["gpt2-124m"]
    data = tmp / "data.txt"
    need = micro * accum * gpus * (steps + 2) * 1024
    if not data.exists() or data.stat().st_size < need:
        random_text(data, need)
    doc = {"name": name, "task": "train", "runs_dir": str(tmp / "runs"),
           "resources": {"gpus": gpus, "cpus_per_gpu": 4, **({"devices": devices} if devices else {})},
           "distributed": {"strategy": "deepspeed" if strategy == "zero2" else "ddp", "deepspeed": {"zero_stage": 2}},
           "model": {"config": cfg}, "data": {"train": str(data), "seq_len": 1024},
           "train": {"global_batch_size": micro * accum * gpus, "micro_batch_size": micro, "max_steps": steps,
                     "log_every": 1, "warmup_steps": 2, "lr": 3e-4, "precision": "bf16", "compile": compile_},
           "checkpoint": {"every_steps": 10**6}}
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def checked(result: tuple[int, Path | None, str], what: str) -> tuple[int, Path | None, str]:
    """A failed run is a figure of nan in the table and its output tail on stderr, never silence."""
    if result[0] != 0:
        print(f"{what} failed with exit {result[0]}:\n{result[2][-1500:]}", file=sys.stderr)
    return result


def slurm_style(spec_path: Path, gpus: int, run_dir: Path) -> int:
    """One `hpcgpu run` per GPU with the variables srun would set (all GPUs visible to each task)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    procs = []
    for rank in range(gpus):
        env = {**os.environ, "HPCGPU_RUN_DIR": str(run_dir), "SLURM_PROCID": str(rank), "SLURM_LOCALID": str(rank),
               "SLURM_NTASKS": str(gpus), "SLURM_TASKS_PER_NODE": str(gpus), "SLURM_NNODES": "1",
               "SLURM_NODEID": "0", "SLURM_STEP_ID": "0", "SLURM_JOB_ID": "777", "SLURM_JOB_NODELIST": "localhost",
               "SLURM_CPUS_PER_TASK": "4", "MASTER_ADDR": "127.0.0.1",
               "CUDA_VISIBLE_DEVICES": ",".join(str(i) for i in range(gpus))}
        log = open(run_dir / f"rank-{rank}.log", "w")
        procs.append(subprocess.Popen([sys.executable, "-m", "hpcgpu", "run", str(spec_path)], env=env,
                                      stdout=log, stderr=subprocess.STDOUT, cwd=REPO))
    codes = [p.wait() for p in procs]
    return max(codes)


def poll_gpu_processes(stop: threading.Event, seen: set[int]) -> None:
    """Adds to `seen` every GPU (NVML index) that runs a compute process while polling."""
    from hpcgpu.gpu.source import default_source

    source = default_source()
    while not stop.is_set():
        seen.update(r.index for r in source.read() if r.processes)
        time.sleep(0.5)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gpus", type=int, default=4)
    ap.add_argument("--subset", default="0,2,3")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--skip", type=int, default=8)
    ap.add_argument("--only", default="launchers,zero2,subset,preempt")
    args = ap.parse_args()
    import torch

    gpu = torch.cuda.get_device_name(0)
    out: dict = {"gpu": gpu, "gpus": args.gpus}
    lines = [f"# {args.gpus} x {gpu}, GPT-2 124M, seq 1024, micro 16 x accum 2 per GPU, bf16"]
    only = args.only.split(",")
    with tempfile.TemporaryDirectory() as tmp_s:
        tmp = Path(tmp_s)
        if "launchers" in only:
            p = spec(tmp, "local", args.gpus, args.steps)
            code, run_dir, tail = checked(submit(p, "--new"), "local executor run")
            local = summarize(run_dir, args.skip)["tok_s"] if code == 0 and run_dir else float("nan")
            sdir = tmp / "slurm-style"
            code2 = slurm_style(p, args.gpus, sdir)
            srun = summarize(sdir, args.skip)["tok_s"] if code2 == 0 else float("nan")
            out["launchers"] = {"local_tok_s": local, "slurm_env_tok_s": srun, "exit": [code, code2]}
            lines.append(f"compile on: local executor {local:,.0f} tok/s | hand-set SLURM env {srun:,.0f} tok/s "
                         f"(exit {code}/{code2})")
        if "zero2" in only:
            res = {}
            for strat in ("ddp", "zero2"):
                code, run_dir, tail = checked(submit(spec(tmp, f"w-{strat}", args.gpus, args.steps, strat,
                                                          compile_=False), "--new"), f"{strat} run")
                res[strat] = summarize(run_dir, args.skip) if code == 0 and run_dir else {"tok_s": float("nan"),
                                                                                          "peak_gib": 0}
            out["zero2"] = {k: {"tok_s": v["tok_s"], "peak_gib": v["peak_gib"]} for k, v in res.items()}
            lines.append(f"compile off: DDP {res['ddp']['tok_s']:,.0f} tok/s ({res['ddp']['peak_gib']:.1f} GiB) | "
                         f"ZeRO-2 {res['zero2']['tok_s']:,.0f} tok/s ({res['zero2']['peak_gib']:.1f} GiB) | "
                         f"ratio {res['zero2']['tok_s'] / res['ddp']['tok_s']:.2f}")
        if "subset" in only and args.subset:
            n = len(args.subset.split(","))
            stop, seen = threading.Event(), set()
            t = threading.Thread(target=poll_gpu_processes, args=(stop, seen), daemon=True)
            t.start()
            code, run_dir, tail = submit(spec(tmp, "subset", n, 12, compile_=False, devices=args.subset), "--new")
            stop.set()
            t.join()
            busy = sorted(seen)
            out["subset"] = {"asked": args.subset, "gpus_with_processes": busy, "exit": code}
            lines.append(f"devices {args.subset}: GPUs with our processes during the run: {busy} (exit {code}); "
                         f"{'OK' if busy == [int(i) for i in args.subset.split(',')] else 'MISMATCH'}")
        if "preempt" in only:
            p = spec(tmp, "pre", args.gpus, args.steps, compile_=False, micro=8, accum=1)
            c0, full_dir, _ = submit(p, "--new")
            c1, run_dir, _ = submit(p, "--new", env={"HPCGPU_SIGNAL_AT": f"{args.steps // 2}:{args.gpus - 1}"})
            c2, run_dir2, _ = submit(p)
            if full_dir and run_dir and c2 == 0:
                a, b = summarize(full_dir, 0)["losses"], summarize(run_dir, 0)["losses"]
                diff = max(abs(a[s] - b[s]) for s in a)
                out["preempt"] = {"exits": [c0, c1, c2], "max_loss_diff": diff, "resumed_same_dir": run_dir == run_dir2}
                lines.append(f"preempt at {args.gpus} GPUs: signal to rank {args.gpus - 1} at step {args.steps // 2} "
                             "(stop after the next), "
                             f"exits {c0}/{c1}/{c2}, resumed in the same run dir {run_dir == run_dir2}, "
                             f"max |loss diff| vs uninterrupted {diff:.2e}")
            else:
                out["preempt"] = {"exits": [c0, c1, c2]}
                lines.append(f"preempt at {args.gpus} GPUs failed: exits {c0}/{c1}/{c2}")
    print("\n".join(lines))
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "four_gpus.json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
