"""What the GPU monitor costs: one NVML sample, and the slowdown of a Python-bound loop beside it.

    python benchmarks/monitor_overhead.py [--interval 0.2] [--seconds 3]

A training step is mostly GPU time; the only way a sampler thread can slow it is by taking the GIL
from the thread that launches kernels. So this times (1) one sample of all visible GPUs
(NvmlSource.read, as the monitor calls it) and (2) a pure-Python loop, the worst case for GIL
contention, with and without a monitor at the given interval. The in-training number (ms/step with
the monitor on vs off) is tests/gpu/test_gpu_layer.py::test_monitor_overhead. With
HPCGPU_NVML_RECORDED=FILE it runs on recorded readings (no GPU), which times the Python side only.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hpcgpu.gpu.monitor import GpuMonitor  # noqa: E402
from hpcgpu.gpu.readings import default_source  # noqa: E402


def python_loop(seconds: float) -> float:
    """Iterations per second of a loop that holds the GIL."""
    n, end = 0, time.perf_counter() + seconds
    while time.perf_counter() < end:
        sum(i * i for i in range(200))
        n += 1
    return n / seconds


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--interval", type=float, default=0.2)
    ap.add_argument("--seconds", type=float, default=3.0)
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


if __name__ == "__main__":
    main()
