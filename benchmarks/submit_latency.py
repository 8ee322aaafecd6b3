"""Submit latency: `hpcgpu submit SPEC` next to plain `sbatch` of the same rendered script.

    python benchmarks/submit_latency.py [-n 10] [--spec configs/hello-command.yaml]

Needs a SLURM cluster (tests/slurm/cluster.sh start gives a local one). Every command runs N times as
a fresh process, the way a user runs it; the jobs are submitted held (`--hold`, so nothing runs and
the cluster stays idle) and cancelled at the end; the registry is a temporary one. Printed: the
median wall time of each, the ratio to sbatch and the absolute overhead (target: <= 0.5 s).
No GPU involved: the numbers depend on the CPU, the file system and slurmctld.
"""
from __future__ import annotations

import argparse
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def timed(argv: list[str], env: dict[str, str]) -> tuple[float, str]:
    t0 = time.perf_counter()
    done = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, env=env)
    seconds = time.perf_counter() - t0
    if done.returncode != 0:
        sys.exit(f"{' '.join(argv[:4])} failed: {done.stderr.strip()}")
    return seconds, done.stdout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-n", type=int, default=10, help="runs per command (default 10)")
    parser.add_argument("--spec", default="configs/hello-command.yaml", help="the spec to submit")
    args = parser.parse_args()
    py = sys.executable
    jobs: list[str] = []
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "HPCGPU_REGISTRY": f"{tmp}/jobs.db"}
        common = ["--set", f"runs_dir={tmp}/runs", "--set", "slurm.extra.hold=true"]
        script = f"{tmp}/job.sbatch"
        timed([py, "-m", "hpcgpu", "sbatch", args.spec, "-o", script, *common], env)
        cases = {
            "sbatch job.sbatch (rendered by hpcgpu sbatch)": ["sbatch", script],
            f"hpcgpu submit {args.spec}": [py, "-m", "hpcgpu", "submit", args.spec, *common],
            f"hpcgpu submit {args.spec} --dry-run": [py, "-m", "hpcgpu", "submit", args.spec, "--dry-run", *common],
        }
        results: dict[str, float] = {}
        try:
            for label, argv in cases.items():
                times = []
                for _ in range(args.n + 1):  # the first run only warms the page cache
                    seconds, out = timed(argv, env)
                    times.append(seconds)
                    jobs += re.findall(r"(?:Submitted batch job|^job)\s+(\d+)", out, re.M)
                results[label] = statistics.median(times[1:])
        finally:
            if jobs:  # only the jobs this run submitted (all held)
                subprocess.run(["scancel", *jobs], capture_output=True)
    base = next(iter(results.values()))
    submit = results[f"hpcgpu submit {args.spec}"]
    print(f"# {platform.python_implementation()} {platform.python_version()}, {platform.machine()}, "
          f"{os.cpu_count()} CPUs, {subprocess.run(['sbatch', '--version'], capture_output=True, text=True).stdout.strip()}; "
          f"median of {args.n} runs each")
    width = max(len(label) for label in results)
    for label, seconds in results.items():
        print(f"{label:<{width}}  {seconds * 1000:7.1f} ms  {seconds / base:6.2f}x sbatch")
    print(f"overhead of hpcgpu submit over sbatch: {(submit - base) * 1000:.0f} ms "
          f"(target <= 500 ms: {'met' if submit - base <= 0.5 else 'NOT met'})")


if __name__ == "__main__":
    main()
