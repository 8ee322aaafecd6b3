"""`hpcgpu hw` and `hpcgpu estimate` as a user runs them; hw, report and --help never import torch."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import EVAL_TEXT, REPO

FIXTURES = Path(__file__).parent / "fixtures"
H100 = str(FIXTURES / "nvml_h100x8_shared.json")


def hpcgpu(*args: str, recorded: str | None = None, **env: str) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if k not in ("HPCGPU_DEBUG", "CUDA_VISIBLE_DEVICES",
                                                                "HPCGPU_NVML_RECORDED")}
    if recorded:
        base["HPCGPU_NVML_RECORDED"] = recorded
    return subprocess.run([sys.executable, "-m", "hpcgpu", *args], capture_output=True, text=True, cwd=REPO,
                          env={**base, **env}, timeout=120)


def gpt2_spec(tmp_path: Path, **train) -> Path:  # type: ignore[no-untyped-def]
    import yaml

    path = tmp_path / "gpt2.yaml"
    path.write_text(yaml.safe_dump({"name": "gpt2-small", "task": "train", "resources": {"gpus": 2, "cpus_per_gpu": 4},
                                    "model": {"config": {"model_type": "gpt2"}},
                                    "data": {"train": str(EVAL_TEXT), "seq_len": 1024},
                                    "train": {"global_batch_size": 64, **train}}))
    return path


@pytest.fixture(scope="module")
def no_driver() -> None:
    from hpcgpu.gpu.nvml import NvmlSource

    if NvmlSource().available():
        pytest.skip("this machine has an NVIDIA driver")


def test_hw_without_a_driver(no_driver):
    done = hpcgpu("hw")
    assert done.returncode == 0 and done.stderr == ""
    assert "GPUs: none: no NVIDIA driver (NVML) on this machine" in done.stdout
    assert "CPUs:" in done.stdout and "RAM" in done.stdout


def test_hw_json_without_a_driver(no_driver):
    done = hpcgpu("hw", "--json")
    assert done.returncode == 0, done.stderr
    info = json.loads(done.stdout)
    assert info["gpus"] == [] and info["nvml"] is False and info["cpu"]["threads"] >= 1
    assert info["memory"]["total"] > 0


def test_hw_recorded_shared_node_busy_flags():
    info = json.loads(hpcgpu("hw", "--json", recorded=H100).stdout)
    assert [g["index"] for g in info["gpus"]] == list(range(8)) and info["driver"] == "580.159.04"
    assert [g["index"] for g in info["gpus"] if g["busy"]] == [0, 1, 4, 7]
    g0 = info["gpus"][0]
    assert g0["compute_capability"] == "9.0" and g0["processes"][0]["name"] == "python"
    assert info["warnings"] == []  # nothing was chosen: the table says which are busy


def test_hw_text_table_and_warnings_for_chosen_busy_gpus(tmp_path):
    done = hpcgpu("hw", "--devices", "2,4", recorded=H100)
    assert done.returncode == 0
    rows = [line for line in done.stdout.splitlines() if "NVIDIA H100" in line]
    assert len(rows) == 2 and " free " in rows[0] and " BUSY " in rows[1] and "98765 python3 (1.0 GiB)" in rows[1]
    assert done.stderr.strip() == "hpcgpu: warning: GPU 4 (NVIDIA H100 80GB HBM3) is busy: 1 compute process(es)"
    quiet = hpcgpu("hw", "--devices", "2,4", "--ignore-processes", recorded=H100)
    assert quiet.stderr == ""


def test_hw_honours_cuda_visible_devices_and_thresholds():
    info = json.loads(hpcgpu("hw", "--json", recorded=H100, CUDA_VISIBLE_DEVICES="7,3").stdout)
    assert [g["index"] for g in info["gpus"]] == [7, 3] and len(info["warnings"]) == 1
    info = json.loads(hpcgpu("hw", "--json", "--busy-util", "50", recorded=H100, CUDA_VISIBLE_DEVICES="7,3").stdout)
    assert info["warnings"] == [] and info["thresholds"]["util_pct"] == 50


def test_hw_spec_devices_and_recommendation(tmp_path):
    spec = gpt2_spec(tmp_path)
    done = hpcgpu("hw", str(spec), "--set", "resources.devices=0,2", "--set", "resources.busy.memory_pct=90",
                  recorded=H100)
    assert done.returncode == 0, done.stderr
    assert "Recommended for gpt2-small (2 rank(s), global batch 64, seq_len 1024)" in done.stdout
    assert "ddp, micro batch 32 x accum 1, 3 loader workers" in done.stdout
    assert "GPU 0" in done.stderr and "memory" not in done.stderr  # 78% < 90%: busy by util and process only
    info = json.loads(hpcgpu("hw", str(spec), "--json", recorded=H100).stdout)
    assert info["recommendation"]["micro_batch"] == 32 and info["recommendation"]["strategy"] == "ddp"


def test_hw_bad_flags_one_line():
    for args in (["--devices", "a,b"], ["--set", "x=1"], ["--busy-util", "200"]):
        done = hpcgpu("hw", *args)
        assert done.returncode == 2 and "Traceback" not in done.stderr, args


def test_estimate_table_for_gpt2_on_80g(tmp_path):
    done = hpcgpu("estimate", str(gpt2_spec(tmp_path, micro_batch_size=8)), "--gpu-memory", "80G")
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "124.44M parameters (gpt2: 12 layers, hidden 768, 12 heads, vocab 50257)" in out
    rows = {line.split()[0]: line for line in out.splitlines() if line.startswith("  ") and line.split()[0] != "why:"
            and "GiB" in line}
    assert set(rows) == {"ddp", "zero1", "zero2", "zero2+offload", "zero3", "zero3+offload", "zero3+offload-all"}
    assert rows["ddp"].split()[1:3] == ["0.5", "GiB"] and " yes " in rows["ddp"]
    assert "recommended: ddp, micro batch 8 x accum 4" in out


def test_estimate_json_and_unknown_gpu(tmp_path, no_driver):
    spec = gpt2_spec(tmp_path)
    done = hpcgpu("estimate", str(spec))
    assert done.returncode == 0 and "give --gpu-memory (e.g. 80G) to check fit" in done.stdout
    data = json.loads(hpcgpu("estimate", str(spec), "--json", "--gpu-memory", "40GB").stdout)
    assert data["params"] == 124_439_808 and data["gpu_memory"] == 40 << 30
    assert data["strategies"][0]["weights"] == 4 * 124_439_808


def test_estimate_needs_no_training_data(tmp_path):
    """Memory is the model, the batch and data.seq_len: estimate works before the data exists;
    validate (and sbatch/submit) of the same train spec still ask for data.train."""
    import yaml

    spec = gpt2_spec(tmp_path, micro_batch_size=8)
    doc = yaml.safe_load(spec.read_text())
    doc["data"].pop("train")
    spec.write_text(yaml.safe_dump(doc))
    done = hpcgpu("estimate", str(spec), "--gpu-memory", "80G")
    assert done.returncode == 0, done.stderr
    assert "124.44M parameters" in done.stdout and "seq_len 1024" in done.stdout
    done = hpcgpu("validate", str(spec))
    assert done.returncode == 2 and "data.train: task: train needs a training text file" in done.stderr


def test_estimate_errors_are_one_line(tmp_path):
    done = hpcgpu("estimate", str(gpt2_spec(tmp_path)), "--gpu-memory", "lots")
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and "--gpu-memory" in done.stderr
    done = hpcgpu("estimate", "configs/hello-command.yaml")
    assert done.returncode == 2 and "task: train" in done.stderr and "Traceback" not in done.stderr


PROBE = """
import sys
from hpcgpu.cli import main
try:
    main(sys.argv[1:])
except SystemExit as exc:
    code = exc.code
heavy = sorted(m for m in ("torch", "transformers", "deepspeed") if m in sys.modules)
print("HEAVY=" + ",".join(heavy), "CODE=" + str(code), file=sys.stderr)
"""


@pytest.mark.parametrize("args", [["--help"], ["hw"], ["hw", "--json"], ["hw", "SPEC"], ["report", "RUN"]])
def test_host_commands_do_not_import_torch(tmp_path, args):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text(json.dumps({"kind": "train", "step": 1, "loss": 5.0, "tokens_per_s": 10.0,
                                                   "tokens": 64}) + "\n")
    args = [str(gpt2_spec(tmp_path)) if a == "SPEC" else str(run) if a == "RUN" else a for a in args]
    done = subprocess.run([sys.executable, "-c", PROBE, *args], capture_output=True, text=True, cwd=REPO,
                          env={**os.environ, "HPCGPU_NVML_RECORDED": H100}, timeout=120)
    assert "HEAVY= CODE=0" in done.stderr, done.stderr
