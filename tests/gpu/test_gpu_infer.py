"""CUDA only: task: infer with one model copy per GPU — bf16 on the card, 2 replicas give the 1-replica
outputs, a stopped run resumes to the same outputs."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

torch = pytest.importorskip("torch")

two_gpus = pytest.mark.two_gpus

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()
MODEL = {"model_type": "gpt2", "n_layer": 2, "n_head": 4, "n_embd": 128, "n_positions": 128, "vocab_size": 256,
         "bos_token_id": 0, "eos_token_id": 0, "initializer_range": 0.5}


def run(tmp: Path, name: str, gpus: int, env: dict | None = None) -> tuple[subprocess.CompletedProcess, Path]:
    rows = tmp / "prompts.jsonl"
    if not rows.exists():
        rows.write_text("".join(json.dumps({"id": f"r{i}", "prompt": " ".join(WORDS[(i * 5 + k) % 12]
                                                                           for k in range(1 + i % 9))}) + "\n"
                                for i in range(64)))
    spec = {"name": name, "task": "infer", "runs_dir": str(tmp / "runs"), "resources": {"gpus": gpus},
            "model": {"config": MODEL}, "infer": {"input": str(rows), "max_new_tokens": 16, "batch_size": 8}}
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(spec))
    proc = subprocess.run([sys.executable, "-m", "hpcgpu", "submit", str(path), "--executor", "local"],
                          capture_output=True, text=True, timeout=600, env={**os.environ, **(env or {})})
    return proc, next((tmp / "runs" / name).iterdir())


@two_gpus
def test_two_replicas_on_two_gpus_give_the_one_gpu_outputs_and_resume_exactly(tmp_path):
    one, one_dir = run(tmp_path, "one", 1)
    assert one.returncode == 0, one.stdout[-3000:] + one.stderr[-3000:]
    plan = json.loads((one_dir / "plan.json").read_text())
    assert plan["precision"] == "bf16" and plan["infer"]["replicas"] == 1
    two, two_dir = run(tmp_path, "two", 2)
    assert two.returncode == 0, two.stdout[-3000:] + two.stderr[-3000:]
    assert (two_dir / "outputs.jsonl").read_text() == (one_dir / "outputs.jsonl").read_text()
    stopped, dir3 = run(tmp_path, "stopped", 2, env={"HPCGPU_SIGNAL_AT": "2:1"})
    assert stopped.returncode == 75, stopped.stdout[-3000:] + stopped.stderr[-3000:]
    resumed, again = run(tmp_path, "stopped", 2)
    assert resumed.returncode == 0 and again == dir3, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert (dir3 / "outputs.jsonl").read_text() == (one_dir / "outputs.jsonl").read_text()


# ---------------------------------------------------------------- a model copy over two GPUs; int8/int4

def llama_dir(tmp: Path, layers: int = 8, hidden: int = 1024) -> Path:
    """A Llama-shaped model (nn.Linear layers: what bitsandbytes quantizes) saved with its BPE tokenizer."""
    out = tmp / f"llama-{layers}x{hidden}"
    if out.exists():
        return out
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
    from make_tiny_model import DATA, train_tokenizer
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = train_tokenizer(DATA, 512)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=hidden, intermediate_size=hidden * 8 // 3 // 64 * 64,
                         num_hidden_layers=layers, num_attention_heads=hidden // 64, num_key_value_heads=hidden // 128,
                         max_position_embeddings=512, bos_token_id=tok.eos_token_id, eos_token_id=tok.eos_token_id,
                         pad_token_id=tok.pad_token_id, tie_word_embeddings=False)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(out)
    tok.save_pretrained(out)
    return out


def run_dir_model(tmp: Path, name: str, model: Path, gpus: int, quantization: str = "none",
                  **infer: object) -> tuple[subprocess.CompletedProcess, Path]:
    rows = tmp / "prompts-llama.jsonl"
    if not rows.exists():
        rows.write_text("".join(json.dumps({"id": i, "prompt": " ".join(WORDS[(i * 7 + k) % 12] for k in range(2 + i % 11))})
                                + "\n" for i in range(48)))
    spec = {"name": name, "task": "infer", "runs_dir": str(tmp / "runs"), "resources": {"gpus": gpus},
            "monitor": {"interval_s": 0.5}, "model": {"name_or_path": str(model), "quantization": quantization},
            "infer": {"input": str(rows), "max_new_tokens": 24, "batch_size": 8, **infer}}
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(spec))
    proc = subprocess.run([sys.executable, "-m", "hpcgpu", "submit", str(path), "--executor", "local"],
                          capture_output=True, text=True, timeout=600, env=dict(os.environ))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc, next((tmp / "runs" / name).iterdir())


def ms_per_token(run: Path) -> float:
    end = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if '"end"' in x][-1]
    return 1000 * end["elapsed_s"] / max(1, end["tokens"])


@two_gpus
def test_a_model_split_over_two_gpus_gives_the_one_gpu_outputs(tmp_path):
    model = llama_dir(tmp_path)
    _, one = run_dir_model(tmp_path, "whole", model, 1)
    # 2 GPUs, one copy over both; the cap (below the weights' ~0.2 GiB) forces the split
    _, split = run_dir_model(tmp_path, "split", model, 2, gpus_per_replica=2, max_memory="150MiB")
    assert (split / "outputs.jsonl").read_text() == (one / "outputs.jsonl").read_text()
    log = (split / "logs" / "rank-0.log").read_text()
    placed = [line for line in log.splitlines() if "placement: cuda:" in line]
    assert len(placed) == 2 and "placement: cuda:0: " in placed[0] and "placement: cuda:1: " in placed[1], log[-3000:]
    assert not (split / "logs" / "rank-1.log").exists()  # one task drives both GPUs
    samples = [json.loads(x) for x in next(split.glob("gpu*.jsonl")).read_text().splitlines()]
    used = {s["gpu"]: max(t["mem_used"] for t in samples if t["gpu"] == s["gpu"]) for s in samples}
    assert len(used) == 2 and all(v > 100 * 2 ** 20 for v in used.values()), used  # NVML: the copy is on both
    print(f"\nsplit over 2 GPUs: {ms_per_token(split):.2f} ms/token vs one GPU {ms_per_token(one):.2f} ms/token "
          f"(batch 8, 24 new tokens, {placed})")


def allocated_gib(run: Path) -> float:
    """The GPU memory the loaded model held, from the placement line the job logs."""
    line = next(x for x in (run / "logs" / "rank-0.log").read_text().splitlines() if "placement: cuda:0" in x)
    return float(line.rsplit("|", 1)[1].split("GiB")[0])


@pytest.mark.parametrize("quant", ["int8", "int4"])
def test_quantized_weights_load_and_generate(tmp_path, quant):
    pytest.importorskip("bitsandbytes")
    model = llama_dir(tmp_path, layers=8, hidden=2048)
    _, bf16 = run_dir_model(tmp_path, "bf16", model, 1)
    _, q = run_dir_model(tmp_path, quant, model, 1, quantization=quant)
    rows = [json.loads(x) for x in (q / "outputs.jsonl").read_text().splitlines()]
    # random weights: a row may end at once on an end-of-text token; the rest generate
    assert [r["id"] for r in rows] == list(range(48)) and sum(bool(r["text"]) for r in rows) >= 40
    assert f"({quant} weights)" in (q / "logs" / "rank-0.log").read_text()
    print(f"\n{quant}: {allocated_gib(q):.2f} GiB allocated after load vs bf16 {allocated_gib(bf16):.2f} GiB; "
          f"{ms_per_token(q):.2f} vs {ms_per_token(bf16):.2f} ms/token")
    assert allocated_gib(q) < (0.7 if quant == "int8" else 0.45) * allocated_gib(bf16)
