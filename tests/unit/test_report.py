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

from conftest import EVAL_TEXT, REPO, only_run_dir, submit, train_spec, wait_for, write_spec_file
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
    # the one start: its time to the first step, and where it went
    assert len(s["startup_s"]) == 1 and s["startup_s"][0] > 0
    assert list(s["last_startup"]) == ["interpreter and imports", "process group", "data", "plan", "model",
                                       "resume", "first step"]
    assert f"start-up         {s['startup_s'][0]:.1f} s to the first step; the last: interpreter and imports" in out


def test_report_with_gpu_samples_and_a_restart(cpu_run, tmp_path, monkeypatch):
    run = copy_run(cpu_run, tmp_path)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    with GpuMonitor(run, 0, 0.05, source=RecordedSource.from_file(FIXTURES / "nvml_h100x8_shared.json"),
                    node_rank=0) as monitor:  # a few samples of both GPUs in gpu.jsonl
        assert wait_for(lambda: len(monitor.summaries) == 2 and all(s.samples >= 3 for s in monitor.summaries.values()),
                        timeout=30), monitor.summaries
    with open(run / "metrics.jsonl", "a") as fh:  # as a preempted and resumed job appends it
        fh.write(json.dumps({"kind": "resume", "time": time.time(), "step": 6, "checkpoint": "step-6"}) + "\n")
        fh.write(json.dumps({"kind": "startup", "time": time.time(), "step": 7, "total_s": 31.5,
                             "interpreter_and_imports_s": 3.0, "first_step_s": 28.5}) + "\n")
        fh.write('{"kind": "train", "step": 13, "loss": 2.')  # a line cut short by a kill
    out_png = tmp_path / "r.png"
    done = report(str(run), "-o", str(out_png))
    assert done.returncode == 0, done.stderr
    side = json.loads(out_png.with_suffix(".json").read_text())
    assert side["panels"] == ["loss", "tokens/s", "GPU utilization (%)", "GPU memory used (GiB)", "GPU power (W)"]
    assert non_blank(out_png).size == (1300, 1080)  # 3 rows of 2
    assert "restarts         1" in done.stdout
    # the restart's start-up is the last one; the spread covers both starts
    assert "start-up         31.5 s to the first step (" in done.stdout and "over 2 starts); the last: " \
        "interpreter and imports 3.0 s, first step 28.5 s" in done.stdout
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


def test_report_output_names_and_places(tmp_path):
    run = tmp_path / "r" / "1"
    run.mkdir(parents=True)
    (run / "metrics.jsonl").write_text(json.dumps({"kind": "train", "step": 1, "loss": 2.0, "tokens": 8}) + "\n")
    done = report(str(run), "-o", str(tmp_path / "plain"))  # no suffix: matplotlib's .png, and said so
    assert done.returncode == 0, done.stderr
    assert f"wrote {tmp_path / 'plain.png'} " in done.stdout
    assert (tmp_path / "plain.png").is_file() and (tmp_path / "plain.json").is_file()
    assert "(not finished)" in done.stdout
    (run / "FINISHED").write_text("done\n")  # a main(ctx) run: no "end" record, the marker says it
    assert "(not finished)" not in report(str(run)).stdout
    for bad, says in [("r.txt", "the plot is written as .png, .pdf, .svg; not .txt"),
                      ("/proc/x.png", "cannot write /proc/x.png")]:
        done = report(str(run), "-o", bad)
        assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
        assert says in done.stderr


def test_report_takes_a_job_id_for_its_run_dir(cpu_run, tmp_path):
    listed = subprocess.run([sys.executable, "-m", "hpcgpu", "list", "--json"], capture_output=True, text=True,
                            cwd=REPO, timeout=60)
    (job,) = [j["id"] for j in json.loads(listed.stdout) if j["run_dir"] == str(cpu_run)]
    by_id, by_dir = (report(ref, "-o", str(tmp_path / f"{n}.png")) for n, ref in enumerate((job, str(cpu_run))))
    assert by_id.returncode == 0, by_id.stderr
    assert by_id.stdout.replace("0.png", "1.png") == by_dir.stdout  # the same run's summary
    assert (tmp_path / "0.png").exists()


@pytest.mark.parametrize("make, says", [
    ("missing", "is not a directory"), ("empty", "has the job started?"),
    ("garbage", "has a metrics.jsonl without one complete record"),
    ("logs only", "the job ended before its first record; its logs are in"),
])
def test_report_errors_are_one_line(tmp_path, make, says):
    run = tmp_path / "run"
    if make != "missing":
        run.mkdir()
    if make == "garbage":
        (run / "metrics.jsonl").write_text("not json\n")
    if make == "logs only":
        (run / "logs").mkdir()
        (run / "logs" / "rank-0.log").write_text("Traceback ...\n")
    done = report(str(run))
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and done.stderr.startswith("hpcgpu: error: RUN_DIR")
    assert says in done.stderr


# ---------------------------------------------------------------- task: infer (a run dir made by hand)

INFER_START_1 = [  # what Progress writes: rows/s and tokens/s are means since this start's first batch
    {"kind": "infer", "time": 1000.0, "rows": 8, "rows_total": 45, "rows_per_s": 4.0, "tokens_per_s": 100.0,
     "prompt_tokens_per_s": 50.0, "tokens": 200, "elapsed_s": 2.0, "peak_mem_gib": 1.25},
    {"kind": "infer", "time": 1010.0, "rows": 24, "rows_total": 45, "rows_per_s": 2.0, "tokens_per_s": 50.0,
     "prompt_tokens_per_s": 40.0, "tokens": 600, "elapsed_s": 12.0, "peak_mem_gib": 1.5},
    {"kind": "stop", "time": 1011.0, "rows": 24, "reason": "preempted", "restart_count": 0},
]
INFER_START_2 = [
    {"kind": "resume", "time": 1060.0, "rows": 24, "rows_total": 45, "restart_count": 1},
    {"kind": "infer", "time": 1062.0, "rows": 32, "rows_total": 45, "rows_per_s": 4.0, "tokens_per_s": 80.0,
     "prompt_tokens_per_s": 60.0, "tokens": 160, "elapsed_s": 2.0, "peak_mem_gib": 1.5},
    {"kind": "infer", "time": 1067.0, "rows": 45, "rows_total": 45, "rows_per_s": 3.0, "tokens_per_s": 60.0,
     "prompt_tokens_per_s": 30.0, "tokens": 420, "elapsed_s": 7.0, "peak_mem_gib": 1.75},
    {"kind": "end", "time": 1067.5, "rows": 45, "rows_this_start": 21, "tokens": 420, "elapsed_s": 7.5},
]


def infer_run(tmp_path: Path, records: list[dict], mode: str = "generate", gpus: int = 2,
              finished: bool = False) -> Path:
    """An infer run dir as the job leaves it: spec.yaml (configs/tiny-infer.yaml), plan.json, metrics.jsonl,
    gpu.jsonl sampled every 5 s over both starts, outputs.jsonl and FINISHED once finished."""
    import yaml

    run = tmp_path / "runs" / "tiny-infer" / "1"
    run.mkdir(parents=True)
    spec = yaml.safe_load((REPO / "configs" / "tiny-infer.yaml").read_text())
    spec["infer"]["mode"] = mode
    (run / "spec.yaml").write_text(yaml.safe_dump(spec))
    (run / "plan.json").write_text(json.dumps({"task": "infer", "world_size": gpus, "precision": "bf16",
                                               "infer": {"mode": mode, "replicas": gpus, "rows": 45}}))
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    samples = [{"time": t + 0.5 * g, "node": 0, "gpu": g, "util": 90 - 10 * g, "mem_used": (20 - 2 * g) << 30,
                "mem_total": 80 << 30, "temp": 50, "power": 400.0, "sm_clock": 1980}
               for t in [*range(995, 1015, 5), *range(1055, 1070, 5)] for g in range(gpus)]
    (run / "gpu.jsonl").write_text("".join(json.dumps(r) + "\n" for r in samples))
    if finished:
        (run / "outputs.jsonl").write_text("".join(json.dumps({"index": i, "text": "x"}) + "\n" for i in range(45)))
        (run / "FINISHED").write_text("2025-01-01T00:00:00\n")
    return run


def test_report_of_an_infer_run_with_a_restart(tmp_path):
    run = infer_run(tmp_path, INFER_START_1 + INFER_START_2, finished=True)
    done = report(str(run))
    assert done.returncode == 0, done.stderr
    side = json.loads((run / "report.json").read_text())
    assert side["panels"] == ["rows done", "rows/s", "generated tokens/s",
                              "GPU utilization (%)", "GPU memory used (GiB)", "GPU power (W)"]
    assert (run / "report.png").stat().st_size > 20_000
    assert non_blank(run / "report.png").size == (1300, 1080)  # 3 rows of 2
    # the means weigh each start by its logged time: the last record of each start covers it
    secs = 12.0 + 7.0
    rows_s, gen_s, prompt_s = (2.0 * 12 + 3.0 * 7) / secs, (600 + 420) / secs, (40.0 * 12 + 30.0 * 7) / secs
    out = done.stdout
    assert "rows             45/45\n" in out
    assert f"mean rows/s      {rows_s:,.2f}\n" in out and f"{rows_s:,.2f}" == "2.37"
    assert f"mean tokens/s    {gen_s:,.0f} generated, {prompt_s:,.0f} prompt\n" in out  # 54, 36
    assert "restarts         1 (stopped 1x: preempted)\n" in out
    assert "peak allocated   1.75 GiB (torch, max over replicas)\n" in out
    assert "outputs.jsonl    complete: 45 rows (FINISHED)\n" in out
    assert "gpu 0            peak memory 20.0 GiB, mean util 90%\n" in out
    assert "gpu 1            peak memory 18.0 GiB, mean util 80%\n" in out
    assert "loss" not in out and "steps" not in out  # not train's summary
    s = side["summary"]
    assert s["task"] == "infer" and s["rows"] == 45 and s["rows_total"] == 45 and s["finished"]
    assert s["mean_rows_per_s"] == pytest.approx(rows_s) and s["mean_tokens_per_s"] == pytest.approx(gen_s)
    assert s["logged_generated_tokens"] == 1020 and s["logged_s"] == secs


def test_report_of_an_unfinished_score_run(tmp_path):
    recs = [dict(r, tokens_per_s=0.0, tokens=0) if r["kind"] == "infer" else r for r in INFER_START_1]
    run = infer_run(tmp_path, recs, mode="score", gpus=0)
    data = json.loads(report(str(run), "--json").stdout)
    assert data["panels"] == ["rows done", "rows/s", "prompt tokens/s (scored)"]
    assert data["summary"]["rows"] == 24 and not data["summary"]["finished"]
    done = report(str(run))
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "rows             24/45 (not finished)\n" in out and "mean rows/s      2.00\n" in out
    assert "mean tokens/s    40 scored (prompt tokens)\n" in out and "generated" not in out
    assert "restarts         0 (stopped 1x: preempted)\n" in out
    assert "outputs.jsonl    not complete (no FINISHED marker yet" in out
    assert "no GPU samples (gpu.jsonl) in this run" in out


@pytest.mark.parametrize("has", ["stop record", "gpu samples"])
def test_infer_run_with_no_infer_records_yet(tmp_path, has):
    # stopped while loading the model (a stop record, no batch), or loading with the GPU monitor on
    stop = {"kind": "stop", "time": 1000.0, "rows": 0, "reason": "timeout", "restart_count": 0}
    run = infer_run(tmp_path, [stop] if has == "stop record" else [], gpus=2 if has == "gpu samples" else 0)
    if has == "gpu samples":
        (run / "metrics.jsonl").unlink()
    done = report(str(run))
    assert done.returncode == 0, done.stderr
    lines = [ln for ln in done.stdout.splitlines() if "infer records" in ln]
    assert lines == ["rows             none yet: metrics.jsonl has no infer records (no batch has finished; 0/45 rows)"]
    assert "mean rows/s" not in done.stdout and (run / "report.png").stat().st_size > 0
