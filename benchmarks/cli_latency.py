"""Host-side CLI latency: `hpcgpu --help` and `hpcgpu sbatch` next to a bare `import click`.

    python benchmarks/cli_latency.py [-n 10]

Each command runs N times as a fresh process (the way a user runs it); the median wall time is printed,
and its ratio to the `python -c "import click"` floor (interpreter start + click, which every hpcgpu
command pays). No GPU involved: the numbers depend on the CPU and the file system.
"""
from __future__ import annotations

import argparse
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def median_s(argv: list[str], n: int) -> float:
    subprocess.run(argv, cwd=REPO, capture_output=True, check=True)  # warm the page cache
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        subprocess.run(argv, cwd=REPO, capture_output=True, check=True)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-n", type=int, default=10, help="runs per command (default 10)")
    args = parser.parse_args()
    py = sys.executable
    with tempfile.TemporaryDirectory() as tmp:
        cases = [
            ('python -c "import click"', [py, "-c", "import click"]),
            ("hpcgpu --help", [py, "-m", "hpcgpu", "--help"]),
            ("hpcgpu sbatch configs/tiny-gpt2.yaml -o TMP",
             [py, "-m", "hpcgpu", "sbatch", "configs/tiny-gpt2.yaml", "-o", f"{tmp}/job.sbatch",
              "--set", f"runs_dir={tmp}/runs"]),
        ]
        results = [(label, median_s(argv, args.n)) for label, argv in cases]
    base = results[0][1]
    print(f"# {platform.python_implementation()} {platform.python_version()}, {platform.machine()}, "
          f"median of {args.n} runs each")
    width = max(len(label) for label, _ in results)
    for label, seconds in results:
        print(f"{label:<{width}}  {seconds * 1000:7.1f} ms  {seconds / base:5.2f}x import click")


if __name__ == "__main__":
    main()
