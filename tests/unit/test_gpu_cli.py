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
    assert set(rows) == {"ddp", "zero1", "zero2", "zero2+offload", "zero3", "zero3+offload", "zero3+offload-all",
                         "fsdp", "fsdp+offload"}
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
    assert done.returncode == 2 and "task: train or infer" in done.stderr and "Traceback" not in done.stderr


# --- estimate for task: infer ---------------------------------------------------------------------

LLAMA_8B = {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
            "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
            "max_position_embeddings": 8192, "tie_word_embeddings": False}


def infer_spec(tmp_path: Path, model: dict, **infer) -> Path:  # type: ignore[no-untyped-def]
    import yaml

    path = tmp_path / "infer.yaml"
    path.write_text(yaml.safe_dump({"name": "inf", "task": "infer", "resources": {"gpus": 4}, "model": model,
                                    "infer": {"input": str(REPO / "configs" / "data" / "prompts.jsonl"), **infer}}))
    return path


def test_estimate_infer_llama_8b_by_hand(tmp_path):
    """The numbers anyone can check: weights 2 bytes a parameter in bf16, the KV cache of GQA's 8 KV heads."""
    spec = infer_spec(tmp_path, {"config": LLAMA_8B}, max_new_tokens=256, batch_size=8)
    data = json.loads(hpcgpu("estimate", str(spec), "--json", "--gpu-memory", "80G", "--prompt-tokens",
                             "2048").stdout)
    params = data["params"]
    assert params == 8_030_261_248  # Llama-3-8B's count
    rows = {r["weights_format"]: r for r in data["formats"]}
    assert list(rows) == ["float32", "bfloat16", "int8", "int4"] and rows["bfloat16"]["spec"]
    assert rows["float32"]["weights"] == 4 * params and rows["bfloat16"]["weights"] == 2 * params
    embed = 128256 * 4096  # int8/int4 quantize the linear layers; the input embedding stays 16-bit
    assert rows["int8"]["weights"] == params - embed + 2 * embed
    kv_per_token = 2 * 32 * 8 * 128 * 2  # K and V, 32 layers, 8 KV heads x 128, bf16: 128 KiB
    assert rows["bfloat16"]["kv_cache"] == kv_per_token * 8 * (2048 + 256)
    assert rows["float32"]["kv_cache"] == 2 * rows["bfloat16"]["kv_cache"]
    assert rows["bfloat16"]["fits"] is True and rows["bfloat16"]["max_batch"] > 8
    assert (data["prompt_tokens"], data["new_tokens"], data["gpus_per_replica"]) == (2048, 256, "auto")
    assert data["recommended_gpus_per_replica"] == 1  # 15 GiB of bf16 weights: one 80G GPU a copy
    # score mode keeps no cache; its full-sequence logits grow with the batch
    score = json.loads(hpcgpu("estimate", str(spec), "--json", "--gpu-memory", "80G", "--prompt-tokens", "2048",
                              "--set", "infer.mode=score").stdout)
    assert all(r["kv_cache"] == 0 for r in score["formats"]) and score["new_tokens"] == 0


def test_estimate_infer_text_says_what_fits_and_what_does_not(tmp_path):
    spec = infer_spec(tmp_path, {"config": LLAMA_8B, "dtype": "float16"}, max_new_tokens=64)
    done = hpcgpu("estimate", str(spec), "--gpu-memory", "12G")
    assert done.returncode == 0, done.stderr
    out = done.stdout
    # model.config: the byte-level tokenizer, so the longest row is counted in bytes
    assert "rows of 51 tokens (the longest of 45 rows, in bytes) + 64 new; batch auto" in out
    assert "float16 (spec)" in out and "(later)" not in out
    assert "recommended: gpus_per_replica 2 (the fewest that hold the float16 weights) -> 2 copies" in out
    done = hpcgpu("estimate", str(spec), "--gpu-memory", "12G", "--gpus", "1")
    assert "DOES NOT FIT: float16 weights (15.0 GiB) need more than the one GPU of a node" in done.stdout
    done = hpcgpu("estimate", str(spec), "--gpu-memory", "80G", "--set", "model.dtype=auto")
    assert "bfloat16 (spec)" in done.stdout and "bfloat16 weights, one GPU per replica, batch" in done.stdout


def test_estimate_infer_counts_prompts_with_the_model_s_tokenizer(tmp_path):
    made = subprocess.run([sys.executable, str(REPO / "scripts" / "make_tiny_model.py"), str(tmp_path / "m")],
                          capture_output=True, text=True, timeout=300)
    assert made.returncode == 0, made.stderr
    spec = infer_spec(tmp_path, {"name_or_path": str(tmp_path / "m")}, batch_size=4, max_new_tokens=16)
    done = hpcgpu("estimate", str(spec), "--gpu-memory", "16G")
    assert done.returncode == 0, done.stderr
    assert "0.17M parameters" in done.stdout
    assert "(the longest of 45 rows of infer.input) + 16 new; batch 4" in done.stdout
    data = json.loads(hpcgpu("estimate", str(spec), "--json").stdout)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tmp_path / "m"))
    from hpcgpu.infer_inputs import read_rows

    longest = max(len(tok.encode(r.prompt)) if r.prompt else
                  len(tok.apply_chat_template(r.messages, add_generation_prompt=True, tokenize=True)["input_ids"])
                  for r in read_rows(REPO / "configs" / "data" / "prompts.jsonl"))
    assert data["prompt_tokens"] == longest and data["prompt_tokens_from"].startswith("the longest of 45")


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


def test_hw_of_a_callable_spec_gives_its_loader_workers(no_driver):
    done = hpcgpu("hw", str(REPO / "configs" / "cnn-callable.yaml"), "--set", "resources.cpus_per_gpu=4")
    assert done.returncode == 0, done.stderr
    assert "Recommended for cnn-callable (2 rank(s)):\n" in done.stdout  # no batch or seq_len it has not
    assert "ctx.loader gives each rank 3 loader workers (resources.cpus_per_gpu 4 - 1, at most 8)" in done.stdout
