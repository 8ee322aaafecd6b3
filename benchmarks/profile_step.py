"""Where hpcgpu's training step differs from the minimal loop's: both profiled the same way (issue 15).

    # on a GPU machine (PYTHONPATH=<this checkout>), ~3 min at 2 GPUs with a warm compile cache:
    python benchmarks/profile_step.py --gpus 2 [--work /tmp/tvl] [--start 45 --steps 5]
    # tiny, on CPU ranks, to check the script end to end (measures nothing):
    python benchmarks/profile_step.py --smoke

Runs benchmarks/loop_minimal.py (torchrun) and hpcgpu's train task (`hpcgpu submit --executor local`)
on the model and settings of benchmarks/train_vs_loops.py (GPT-2 124M, seq 1024, micro 16, bf16,
compile, DDP), each with torch.profiler over optimizer steps --start .. --start + --steps - 1 (hpcgpu:
train.profile; the loop: --profile-dir; one warm-up step before the window, runtime/profile.py) and
TORCH_LOGS=graph_breaks,recompiles. Prints each program's rank-0 summary (ms/step in the window,
kernel / NCCL / compute time per step, GPU busy, the top ops) and the graph breaks and recompiles
each logged, and copies the traces (rank{R}.trace.json, Perfetto opens them) to $OUT/profile/.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
from pathlib import Path

from bench_common import work_dir
from train_vs_loops import child_env, hpcgpu_spec, launch, loop_cmd, random_text, tail


def settings(smoke: bool) -> argparse.Namespace:
    """train_vs_loops' defaults (its --smoke sizes on CPU ranks)."""
    a = argparse.Namespace(n_layer=12, n_embd=768, n_head=12, vocab=50304, seq_len=1024, micro_batch=16, accum=1,
                           compile=True, cpu=False, precision="bf16", lr=6e-4, seed=0, log_every=10,
                           data_tokens=1 << 22, child_env=["TORCH_LOGS=graph_breaks,recompiles"], hpcgpu_set=[])
    if smoke:
        a.n_layer, a.n_embd, a.n_head, a.vocab, a.seq_len, a.micro_batch = 2, 64, 2, 512, 64, 4
        a.compile, a.cpu, a.precision, a.data_tokens, a.log_every = False, True, "fp32", 1 << 16, 1
    return a


def compile_events(text: str) -> str:
    breaks = len(re.findall(r"Graph break", text))
    recompiles = len(re.findall(r"Recompiling function", text))
    return f"{breaks} graph break line(s), {recompiles} recompile(s) logged"


def profile_minimal(a: argparse.Namespace, work: Path, gpus: int, start: int, steps: int, timeout: float) -> str:
    out = work / "profile-minimal"
    shutil.rmtree(out, ignore_errors=True)
    total = start + steps
    cmd = loop_cmd(a, "minimal", gpus, warmup=total - 1, steps=1) + [
        "--profile-dir", str(out), "--profile-start", str(start), "--profile-steps", str(steps)]
    rc, _, stdout, stderr = launch(cmd, child_env(a, work), work / "logs" / f"profile-minimal-{gpus}g", timeout)
    if rc != 0:
        raise SystemExit(f"minimal loop failed (exit {rc}):\n{tail(stdout, 1000)}\n{tail(stderr)}")
    return collect("minimal", out, compile_events(stderr))


def profile_hpcgpu(a: argparse.Namespace, work: Path, data: Path, gpus: int, start: int, steps: int,
                   timeout: float) -> str:
    spec = hpcgpu_spec(a, work, data, gpus, start + steps, a.log_every, f"profile-{gpus}g")
    doc = json.loads(spec.read_text())
    doc["train"]["profile"] = {"start_step": start, "steps": steps}
    spec.write_text(json.dumps(doc, indent=1) + "\n")
    cmd = [sys.executable, "-m", "hpcgpu", "submit", str(spec), "--executor", "local", "--new", "--gpus", str(gpus)]
    rc, _, stdout, stderr = launch(cmd, child_env(a, work), work / "logs" / f"profile-hpcgpu-{gpus}g", timeout)
    if rc != 0:
        raise SystemExit(f"hpcgpu failed (exit {rc}):\n{tail(stdout, 1000)}\n{tail(stderr)}")
    run_dir = max((work / "runs" / f"profile-{gpus}g").iterdir(), key=lambda p: p.stat().st_mtime)
    logs = "".join(p.read_text(errors="replace") for p in sorted((run_dir / "logs").glob("rank-*.log")))
    shutil.rmtree(run_dir / "model", ignore_errors=True)
    return collect("hpcgpu", run_dir / "profile", compile_events(logs + stderr))


def collect(program: str, folder: Path, events: str) -> str:
    summary = folder / "rank0.txt"
    if not summary.exists():
        raise SystemExit(f"{program}: no profile summary at {summary}")
    dest = Path(os.environ.get("OUT", "")) / "profile" / program if os.environ.get("OUT") else None
    if dest is not None:
        shutil.rmtree(dest, ignore_errors=True)
        shutil.copytree(folder, dest)
    return f"=== {program}: {events}\n{summary.read_text()}"


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gpus", type=int, default=2, help="ranks of both programs (default 2)")
    ap.add_argument("--start", type=int, default=45, help="first profiled step (default 45: compile and warm-up done)")
    ap.add_argument("--steps", type=int, default=5, help="profiled steps (default 5)")
    ap.add_argument("--work", type=Path, default=None, help="work dir (train_vs_loops' keeps its compile cache)")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds a program may take")
    ap.add_argument("--smoke", action="store_true", help="tiny model on 2 CPU ranks, no compile: checks the script")
    args = ap.parse_args(argv)
    a = settings(args.smoke)
    if args.smoke:
        args.start, args.steps = 3, 2
    with work_dir(args.work, "profile-step-") as work:
        (work / "inductor-cache").mkdir(exist_ok=True)
        data = work / f"data-{a.data_tokens}-s{a.seed}.txt"
        if not data.exists():
            random_text(data, a.data_tokens, a.seed)
        print(profile_minimal(a, work, args.gpus, args.start, args.steps, args.timeout), flush=True)
        print(profile_hpcgpu(a, work, data, args.gpus, args.start, args.steps, args.timeout), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
