"""`hpcgpu report RUN_DIR` on the run dir of a real tiny CPU training run (local executor)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from PIL import Image

from conftest import EVAL_TEXT, REPO, only_run_dir, submit, train_spec, write_spec_file
from hpcgpu.gpu.monitor import GpuMonitor
from hpcgpu.gpu.readings import RecordedSource

FIXTURES = Path(__file__).parent / "fixtures"


def report(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "HPCGPU_DEBUG"}
    return subprocess.run([sys.executable, "-m", "hpcgpu", "report", *args], capture_output=True, text=True,
                          cwd=REPO, env=env, timeout=120)


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real 12-step training run on 2 CPU ranks, with an eval every 6 steps."""
    folder = tmp_path_factory.mktemp("report")
    spec = train_spec("reportrun", data={"eval": str(EVAL_TEXT)}, train={"eval_every": 6, "eval_batches": 1})
    path = write_spec_file(folder, spec)
    done = submit(path, timeout=240)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return only_run_dir(folder / "runs", "reportrun")


def copy_run(run: Path, tmp_path: Path) -> Path:
    out = tmp_path / "runs" / run.parent.name / run.name
    shutil.copytree(run, out, ignore=shutil.ignore_patterns("checkpoints", "model"))
    return out


def non_blank(png: Path) -> Image.Image:
    img = Image.open(png)
    img.load()
    assert img.format == "PNG"
    colors = img.convert("RGB").getcolors(maxcolors=1 << 20)
    assert colors is None or len(colors) > 50  # lines, text and axes, not one flat colour
    return img


def test_report_of_a_cpu_run_plots_what_it_has(cpu_run, tmp_path):
    run = copy_run(cpu_run, tmp_path)
    done = report(str(run))
    assert done.returncode == 0, done.stderr
    side = json.loads((run / "report.json").read_text())
    assert side["panels"] == ["loss", "tokens/s"]  # no gpu.jsonl: no GPU panels, none empty
    img = non_blank(run / "report.png")
    assert img.size == (1300, 360)  # 2 panels side by side, 100 dpi
    out = done.stdout
    assert "steps            12\n" in out and f"tokens           {12 * 8 * 64:,}" in out
    assert "restarts         0" in out and "mean tokens/s" in out and "(eval " in out
    assert "no GPU samples (gpu.jsonl) in this run" in out
    s = side["summary"]
    assert s["steps"] == 12 and s["finished"] and s["mean_mfu"] is None and s["final_eval_loss"] > 0


def test_report_with_gpu_samples_and_a_restart(cpu_run, tmp_path, monkeypatch):
    run = copy_run(cpu_run, tmp_path)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    with GpuMonitor(run, 0, 0.05, source=RecordedSource.from_file(FIXTURES / "nvml_h100x8_shared.json"), node_rank=0):
        time.sleep(0.3)
    with open(run / "metrics.jsonl", "a") as fh:  # as a preempted and resumed job appends it
        fh.write(json.dumps({"kind": "resume", "time": time.time(), "step": 6, "checkpoint": "step-6"}) + "\n")
        fh.write('{"kind": "train", "step": 13, "loss": 2.')  # a line cut short by a kill
    out_png = tmp_path / "r.png"
    done = report(str(run), "-o", str(out_png))
    assert done.returncode == 0, done.stderr
    side = json.loads(out_png.with_suffix(".json").read_text())
    assert side["panels"] == ["loss", "tokens/s", "GPU utilization (%)", "GPU memory used (GiB)", "GPU power (W)"]
    assert non_blank(out_png).size == (1300, 1080)  # 3 rows of 2
    assert "restarts         1" in done.stdout
    assert "gpu 0            peak memory 62.0 GiB, mean util 98%" in done.stdout
    assert set(side["summary"]["gpu_peak_mem"]) == {"gpu 0", "gpu 1"}


def test_report_json(cpu_run, tmp_path):
    run = copy_run(cpu_run, tmp_path)
    data = json.loads(report(str(run), "--json").stdout)
    assert data["summary"]["restarts"] == 0 and data["png"].endswith("report.png")


def test_gpu_only_run_and_nan_losses(tmp_path):
    run = tmp_path / "r" / "1"
    run.mkdir(parents=True)
    recs = [{"kind": "train", "step": 1, "loss": "nan", "tokens_per_s": None, "tokens": 8, "peak_mem_gib": 1.5}]
    (run / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in recs) + "\n")
    (run / "gpu.jsonl").write_text(json.dumps({"time": 1.0, "node": 0, "gpu": 0, "util": 50, "mem_used": 1 << 30,
                                               "mem_total": 80 << 30, "temp": 40, "power": None, "sm_clock": 1000}) + "\n")
    done = report(str(run))
    assert done.returncode == 0, done.stderr
    side = json.loads((run / "report.json").read_text())
    assert side["panels"] == ["loss", "GPU utilization (%)", "GPU memory used (GiB)", "GPU power (W)"]
    assert "peak allocated   1.50 GiB (torch, rank 0)" in done.stdout


@pytest.mark.parametrize("make", ["missing", "empty"])
def test_report_errors_are_one_line(tmp_path, make):
    run = tmp_path / "run"
    if make == "empty":
        run.mkdir()
    done = report(str(run))
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and done.stderr.startswith("hpcgpu: error: RUN_DIR")
