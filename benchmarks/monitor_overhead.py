"""What the GPU monitor costs: one NVML sample, and the slowdown of a Python-bound loop beside it.

    python benchmarks/monitor_overhead.py [--interval 0.2] [--seconds 3] [--train --repeats 2]

A training step is mostly GPU time; the only way a sampler thread can slow it is by taking the GIL
from the thread that launches kernels. So this times (1) one sample of all visible GPUs
(NvmlSource.read, as the monitor calls it) and (2) a pure-Python loop, the worst case for GIL
contention, with and without a monitor at the given interval, and (3) with --train on a GPU: the
same 1-GPU GPT-2 124M run with the monitor on and off, alternated --repeats times, median ms/step
of each. With HPCGPU_NVML_RECORDED=FILE (1) and (2) run on recorded readings (no GPU), which times
the Python side only.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from deepspeed_bench import random_text, submit, train_records  # noqa: E402
from hpcgpu.gpu.monitor import GpuMonitor  # noqa: E402
from hpcgpu.gpu.source import default_source  # noqa: E402


def python_loop(seconds: float) -> float:
    """Iterations per second of a loop that holds the GIL."""
    n, end = 0, time.perf_counter() + seconds
    while time.perf_counter() < end:
        sum(i * i for i in range(200))
        n += 1
    return n / seconds


def train_ms_per_step(tmp: Path, data: Path, monitor: dict, tag: str) -> float:
    """Median ms/step (after 10 warm-up steps) of hpcgpu's trainer on one GPU."""
    doc = {"name": f"mon-{tag}", "task": "train", "runs_dir": str(tmp / "runs"),
           "resources": {"gpus": 1, "cpus_per_gpu": 4}, "monitor": monitor,
           "model": {"config": {"model_type": "gpt2", "n_layer": 12, "n_head": 12, "n_embd": 768,
                                "n_positions": 1024, "vocab_size": 256}},
           "data": {"train": str(data), "seq_len": 1024},
           "train": {"global_batch_size": 8, "micro_batch_size": 8, "max_steps": 60, "warmup_steps": 5,
                     "log_every": 1, "compile": False}}
    spec = tmp / f"mon-{tag}.yaml"
    spec.write_text(yaml.safe_dump(doc))
    code, run_dir, tail = submit(spec, "--new")
    if code != 0 or run_dir is None:
        sys.exit(f"training run failed ({code}): {tail[-1500:]}")
    return statistics.median(r["ms_per_step"] for r in train_records(run_dir) if r["step"] > 10)


def in_training(interval: float, repeats: int) -> None:
    with tempfile.TemporaryDirectory() as tmp_s:
        tmp = Path(tmp_s)
        data = tmp / "data.txt"
        random_text(data, 3_000_000)
        on, off = [], []
        for i in range(repeats):  # alternated, so drift in clocks or temperature hits both sides
            on.append(train_ms_per_step(tmp, data, {"interval_s": interval}, f"on{i}"))
            off.append(train_ms_per_step(tmp, data, {"enabled": False}, f"off{i}"))
    a, b = statistics.median(on), statistics.median(off)
    print(f"in training (GPT-2 124M, 1 GPU, micro 8 x 1024, compile off): {a:.2f} ms/step with the monitor "
          f"every {interval} s, {b:.2f} without: {(a - b) / b * 100:+.2f}% (runs on {on}, off {off})")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--interval", type=float, default=0.2)
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--train", action="store_true", help="also time training with the monitor on and off")
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    source = default_source()
    if not source.available():
        sys.exit("no NVML here (and HPCGPU_NVML_RECORDED not set): nothing to measure")
    gpus = source.read(processes=False)
    indices = [g.index for g in gpus]
    times = []
    for _ in range(200):
        t0 = time.perf_counter()
        source.read(indices, processes=False)
        times.append(time.perf_counter() - t0)
    per = statistics.median(times) * 1e6
    print(f"{len(gpus)} x {gpus[0].name}: one sample of all GPUs {per:.0f} us (median of 200); at the default "
          f"5 s interval that is {per / 5e6 * 100:.4f}% of one core")
    base = python_loop(args.seconds)
    with tempfile.TemporaryDirectory() as tmp, GpuMonitor(tmp, 0, args.interval):
        loaded = python_loop(args.seconds)
    base2 = python_loop(args.seconds)
    ref = (base + base2) / 2
    print(f"Python-bound loop: {ref:,.0f} it/s alone, {loaded:,.0f} it/s beside a monitor sampling every "
          f"{args.interval} s: {(ref - loaded) / ref * 100:+.2f}% (run-to-run noise: "
          f"{abs(base - base2) / ref * 100:.2f}%)")
    if args.train:
        in_training(args.interval, args.repeats)


if __name__ == "__main__":
    main()
