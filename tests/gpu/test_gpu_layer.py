"""CUDA only: the GPU layer on real GPUs through pynvml: `hpcgpu hw`, busy detection, gpu.jsonl from a
2-GPU run, the monitor's overhead, and the memory estimate against measured peak memory.

Skipped where CUDA is absent; run with `pytest tests/gpu -m gpu -s` to see the measured numbers.
Nothing here touches CUDA in the pytest process itself (every GPU user is a subprocess), so the
busy/idle readings are not disturbed by the test runner's own context.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

torch = pytest.importorskip("torch")

two_gpus = pytest.mark.two_gpus  # tests/gpu/conftest.py: gpu marker and the CUDA skips

REPO = Path(__file__).resolve().parents[2]
TEXT = REPO / "configs" / "data" / "pydocs.txt"
GiB = 1 << 30
PCI_ENV = {"CUDA_DEVICE_ORDER": "PCI_BUS_ID"}  # CUDA's device order = NVML's index order


def env(**extra: str) -> dict[str, str]:
    base = {k: v for k, v in os.environ.items() if k not in ("CUDA_VISIBLE_DEVICES", "HPCGPU_NVML_RECORDED")}
    return {**base, **PCI_ENV, **extra}


def hw_json(*args: str) -> dict:
    done = subprocess.run([sys.executable, "-m", "hpcgpu", "hw", "--json", *args], capture_output=True, text=True,
                          env=env(), timeout=60)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


CUDA_PROPS = """
import json, torch
print(json.dumps([{"name": torch.cuda.get_device_name(i), "total": torch.cuda.get_device_properties(i).total_memory,
                   "cc": "%d.%d" % torch.cuda.get_device_capability(i)} for i in range(torch.cuda.device_count())]))
"""


def cuda_devices() -> list[dict]:
    """What torch sees, asked in a subprocess: this process never makes a CUDA context of its own."""
    done = subprocess.run([sys.executable, "-c", CUDA_PROPS], capture_output=True, text=True, env=env(), timeout=120)
    return json.loads(done.stdout)


def test_hw_lists_the_gpus():
    info = hw_json()
    cuda = cuda_devices()
    assert info["nvml"] and info["driver"]
    assert len(info["gpus"]) == len(cuda) == torch.cuda.device_count()
    assert [g["name"] for g in info["gpus"]] == [c["name"] for c in cuda], (info["gpus"], cuda)
    for g, c in zip(info["gpus"], cuda):
        assert abs(g["memory_total"] - c["total"]) / c["total"] < 0.03  # CUDA hides a small reserve
        assert g["compute_capability"] == c["cc"]
        assert 0 <= g["utilization"] <= 100 and g["power_draw"] > 0 and g["power_limit"] >= g["power_draw"]
        assert g["temperature"] > 0 and g["sm_clock"] > 0


HOLD = """
import sys, time, torch
x = torch.empty(int(sys.argv[1]), dtype=torch.uint8, device="cuda")
x.fill_(1)
print("ready", flush=True)
time.sleep(120)
"""


@two_gpus
def test_a_gpu_holding_memory_is_busy_the_other_is_not():
    held = int(0.15 * hw_json()["gpus"][1]["memory_total"])  # over the 10% default on any card (H200: 21 GiB)
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(held)], stdout=subprocess.PIPE, text=True,
                              env=env(CUDA_VISIBLE_DEVICES="1"))
    try:
        assert holder.stdout.readline().strip() == "ready"
        time.sleep(1.0)  # let NVML's process list catch up
        gpus = {g["index"]: g for g in hw_json("--devices", "0,1")["gpus"]}
    finally:
        holder.kill()
        holder.wait()
    busy, idle = gpus[1], gpus[0]
    print(f"\nheld GPU 1: {busy['memory_used'] / GiB:.1f} GiB used, reasons {busy['busy_reasons']}; "
          f"GPU 0: {idle['memory_used'] / GiB:.1f} GiB used, reasons {idle['busy_reasons']}")
    assert busy["busy"] and any(r.startswith("memory") for r in busy["busy_reasons"])
    assert busy["memory_used"] > held
    assert holder.pid in [p["pid"] for p in busy["processes"]]
    assert not idle["busy"], idle


def submit(spec: dict, tmp: Path, name: str, *args: str) -> tuple[subprocess.CompletedProcess, Path]:
    spec = {"runs_dir": str(tmp / "runs"), **spec, "name": name}
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(spec))
    done = subprocess.run([sys.executable, "-m", "hpcgpu", "submit", str(path), "--executor", "local", "--new", *args],
                          capture_output=True, text=True, timeout=600, env=env())
    runs = sorted((tmp / "runs" / name).glob("*"))
    assert done.returncode == 0 and runs, done.stdout[-3000:] + done.stderr[-3000:]
    return done, runs[-1]


def records(path: Path, kind: str | None = None) -> list[dict]:
    out = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in out if kind is None or r.get("kind") == kind]


def small_spec(gpus: int, steps: int, interval: float, **train) -> dict:  # type: ignore[no-untyped-def]
    return {"task": "train", "resources": {"gpus": gpus, "cpus_per_gpu": 2},
            "model": {"config": {"model_type": "gpt2", "n_layer": 4, "n_head": 4, "n_embd": 256, "n_positions": 256,
                                 "vocab_size": 256, "bos_token_id": 0, "eos_token_id": 0}},
            "data": {"train": str(TEXT), "seq_len": 256},
            "train": {"global_batch_size": 32, "micro_batch_size": 8, "max_steps": steps, "lr": 1e-3,
                      "warmup_steps": 5, "log_every": 1, "compile": False, **train},
            "monitor": {"interval_s": interval}}


@two_gpus
def test_two_gpu_run_writes_gpu_jsonl(tmp_path):
    done, run = submit(small_spec(2, 60, 0.5), tmp_path, "monitored")
    assert (run / "gpu.jsonl").exists(), done.stdout[-2000:]
    recs = records(run / "gpu.jsonl")
    assert {r["gpu"] for r in recs} == {0, 1}
    for r in recs:
        assert 0 <= r["util"] <= 100 and 0 < r["mem_used"] < r["mem_total"] and r["power"] > 0
        assert r["temp"] > 0 and r["sm_clock"] > 0 and r["node"] == 0
    times = sorted({r["time"] for r in recs})
    gaps = sorted(b - a for a, b in zip(times, times[1:]))
    assert len(times) >= 3 and gaps[len(gaps) // 2] >= 0.4  # every 0.5 s (the last sample comes at stop)
    assert "gpu monitor: gpu 0:" in done.stdout and "gpu monitor: gpu 1:" in done.stdout  # the end-of-run summary
    print(f"\n{len(recs)} gpu.jsonl lines; peak util {max(r['util'] for r in recs):.0f}%, "
          f"peak memory {max(r['mem_used'] for r in recs) / GiB:.1f} GiB")
    report = subprocess.run([sys.executable, "-m", "hpcgpu", "report", str(run)], capture_output=True, text=True,
                            env=env(), timeout=120)
    assert report.returncode == 0 and "gpu 1" in report.stdout, report.stderr


def test_monitor_off_samples_nothing(tmp_path):
    """monitor.enabled: false trains without a sampler (its cost is measured in
    benchmarks/monitor_overhead.py, not asserted here)."""
    proc, off = submit({**small_spec(1, 10, 0.2), "monitor": {"enabled": False}}, tmp_path, "mon-off")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert records(off / "metrics.jsonl", "train") and not (off / "gpu.jsonl").exists()


GPT2 = {"124m": {"model_type": "gpt2", "n_layer": 12, "n_head": 12, "n_embd": 768},
        "350m": {"model_type": "gpt2", "n_layer": 24, "n_head": 16, "n_embd": 1024}}


def peak_spec(cfg: dict) -> dict:
    """hpcgpu's own trainer (compile: auto = on, bf16 autocast, fused AdamW), micro 8 x accum 2, seq 1024."""
    return {"task": "train", "resources": {"gpus": 1, "cpus_per_gpu": 2}, "model": {"config": dict(cfg)},
            "data": {"train": str(TEXT), "seq_len": 1024},
            "train": {"global_batch_size": 16, "micro_batch_size": 8, "max_steps": 3, "warmup_steps": 1,
                      "log_every": 1}, "monitor": {"enabled": False}}


def measured_and_estimated_peaks(tmp_path: Path, specs: dict[str, dict]) -> dict[str, tuple[float, float]]:
    """name -> (measured peak, `hpcgpu estimate`'s ddp row) in bytes, for train specs run through the
    local executor, one per GPU at once where there are two (the trainer logs max_memory_allocated
    as peak_mem_gib in metrics.jsonl)."""
    parallel = torch.cuda.device_count() >= 2
    procs: dict[str, tuple[Path, subprocess.Popen]] = {}
    outputs: dict[str, str] = {}
    for gpu, (name, body) in enumerate(specs.items()):
        spec = {"runs_dir": str(tmp_path / "runs"), "name": name, **body}
        spec["resources"]["devices"] = str(gpu if parallel else 0)
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump(spec))
        procs[name] = (path, subprocess.Popen(
            [sys.executable, "-m", "hpcgpu", "submit", str(path), "--executor", "local", "--new"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env()))
        if not parallel:
            outputs[name] = procs[name][1].communicate(timeout=480)[0]
    peaks = {}
    for name, (path, proc) in procs.items():
        out = outputs.get(name) or proc.communicate(timeout=480)[0]
        assert proc.returncode == 0, out[-3000:]
        run = sorted((tmp_path / "runs" / name).glob("*"))[-1]
        measured = max(r["peak_mem_gib"] for r in records(run / "metrics.jsonl", "train")) * GiB
        est = subprocess.run([sys.executable, "-m", "hpcgpu", "estimate", str(path), "--json", "--gpu-memory", "80G"],
                             capture_output=True, text=True, env=env(), timeout=120)
        assert est.returncode == 0, est.stderr
        estimate = json.loads(est.stdout)["strategies"][0]["total"]  # ddp row; one rank: no DDP buckets
        print(f"\n{name} micro 8 seq 1024 accum 2 (compiled): measured peak {measured / GiB:.2f} GiB, "
              f"estimate {estimate / GiB:.2f} GiB, error {(estimate - measured) / measured * 100:+.1f}%")
        peaks[name] = (measured, estimate)
    return peaks


def test_estimate_matches_measured_peak_memory(tmp_path):
    """GPT-2 124M and 350M: the estimate within 25% of the measured peak."""
    peaks = measured_and_estimated_peaks(tmp_path, {f"peak-{n}": peak_spec(cfg) for n, cfg in GPT2.items()})
    errors = {name: (est - got) / got for name, (got, est) in peaks.items()}
    assert all(abs(e) <= 0.25 for e in errors.values()), errors


def test_gradient_checkpointing_cuts_measured_peak_memory_as_estimated(tmp_path):
    """GPT-2 350M, the same spec with train.gradient_checkpointing false and true. The checkpointed
    run's measured peak is within 25% of `hpcgpu estimate`'s `+ckpt` row, and below the run without
    it by at least half the saving the estimate predicts."""
    specs = {}
    for ckpt in (False, True):
        specs[f"ckpt-{ckpt}".lower()] = spec = peak_spec(GPT2["350m"])
        spec["train"]["gradient_checkpointing"] = ckpt
    (plain, plain_est), (ckpt, ckpt_est) = measured_and_estimated_peaks(tmp_path, specs).values()
    assert abs(ckpt_est - ckpt) / ckpt <= 0.25
    assert plain - ckpt >= 0.5 * (plain_est - ckpt_est)
