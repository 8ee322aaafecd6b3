"""The LoRA and QLoRA memory model (train.lora): the adapters counted from the config against peft's own
count, the rows against numbers worked out by hand, the recommendation of a lighter way to fine-tune,
and `hpcgpu estimate` / `hpcgpu hw` as a user runs them."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import EVAL_TEXT, REPO
from hpcgpu.errors import SpecError
from hpcgpu.gpu.estimate import (DDP, GiB, INT4_BYTES, KBIT_REST_BYTES, dims_from_config, estimate, lora_dims,
                                 max_micro_batch, with_checkpointing)
from hpcgpu.gpu.recommend import (fine_tuning_methods, lighter_method, method_recommendation, recommend,
                                  recommend_for_job)
from hpcgpu.spec import spec_from_raw

FIXTURES = Path(__file__).parent / "fixtures"
TINY_GPT2 = {"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4, "vocab_size": 128, "n_positions": 64}
TINY_LLAMA = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 160, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 128}
LLAMA_1B = {"model_type": "llama", "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
            "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256, "tie_word_embeddings": True,
            "max_position_embeddings": 8192}  # Llama-3.2-1B's shape
LLAMA_8B = {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
            "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256, "tie_word_embeddings": False,
            "max_position_embeddings": 8192}  # Llama-3-8B's shape
GB24 = 24 << 30
CKPT = with_checkpointing(DDP)


# --- the adapters, against peft ----------------------------------------------------------------------

def peft_counts(cfg: dict, r: int, targets: object) -> tuple[int, int]:
    """(peft's trainable parameters, the weights of the layers it adapted) on a model built from cfg."""
    pytest.importorskip("peft")
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = dict(cfg)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(cfg.pop("model_type"), **cfg))
    peft_model = get_peft_model(model, LoraConfig(r=r, target_modules=targets))
    trainable, _ = peft_model.get_nb_trainable_parameters()
    adapted = sum(m.base_layer.weight.numel() for m in peft_model.modules() if hasattr(m, "base_layer")
                  and hasattr(m.base_layer, "weight"))
    return trainable, adapted


@pytest.mark.parametrize("cfg", [TINY_GPT2, TINY_LLAMA], ids=["gpt2", "llama"])
@pytest.mark.parametrize("r", [4, 16])
def test_all_linear_adapters_are_peft_s_count(cfg, r):
    trainable, adapted = peft_counts(cfg, r, "all-linear")
    ours = lora_dims(cfg, r, "auto")
    assert ours.adapter_params == trainable and ours.exact
    assert ours.linear_params == adapted  # all-linear adapts what bitsandbytes quantizes: the blocks' linears


@pytest.mark.parametrize("cfg,targets", [(TINY_GPT2, ["c_proj"]), (TINY_GPT2, ["attn.c_proj"]),
                                         (TINY_GPT2, ["h.0.attn.c_proj"]),
                                         ({**TINY_GPT2, "tie_word_embeddings": False}, ["c_attn", "lm_head"]),
                                         (TINY_LLAMA, ["q_proj", "v_proj"]),
                                         (TINY_LLAMA, ["mlp.down_proj", "lm_head"])],
                         ids=["gpt2-c_proj", "gpt2-attn.c_proj", "gpt2-one-block", "gpt2-untied-head", "llama-qv",
                              "llama-down-head"])
def test_a_list_of_names_adapts_what_peft_does(cfg, targets):
    assert lora_dims(cfg, 8, targets).adapter_params == peft_counts(cfg, 8, targets)[0]


@pytest.mark.parametrize("model_type", ["qwen2", "mistral", "phi3", "gpt_neox", "opt"])
def test_other_families_layer_names(model_type):
    cfg = {**TINY_LLAMA, "model_type": model_type, "pad_token_id": 0}
    if model_type == "opt":
        cfg = {"model_type": "opt", "hidden_size": 64, "ffn_dim": 160, "num_hidden_layers": 2,
               "num_attention_heads": 4, "vocab_size": 128, "word_embed_proj_dim": 64}
    assert lora_dims(cfg, 4, "auto").adapter_params == peft_counts(cfg, 4, "all-linear")[0]


def test_llama_1b_adapters_by_hand():
    """r x (in + out) per layer: q 2048->2048, k and v 2048->512, o 2048->2048, gate and up 2048->8192,
    down 8192->2048, over 16 layers (peft counted 11,272,192 on the GPU model too)."""
    r, h, kv, f = 16, 2048, 512, 8192
    per_layer = r * ((h + h) + 2 * (h + kv) + (h + h) + 2 * (h + f) + (f + h))
    a = lora_dims(LLAMA_1B, r, "auto")
    assert a.adapter_params == 16 * per_layer == 11_272_192
    assert a.adapted_inputs == 6 * h + f  # q, k, v, gate, up each keep their own copy of the hidden state


def test_a_name_no_layer_has_is_one_line_naming_the_key():
    with pytest.raises(SpecError) as err:
        lora_dims(TINY_LLAMA, 8, ["c_attn"])
    assert "train.lora.target_modules" in str(err.value) and "q_proj" in str(err.value)


# --- the rows -------------------------------------------------------------------------------------------

def test_lora_rows_by_hand():
    """No gradients or optimizer states for the frozen base; the adapters fp32 with their grads and
    AdamW's two states; int4 linears at 0.5 + 4/64 bytes, the rest fp32 (peft's k-bit preparation)."""
    d = dims_from_config(LLAMA_1B, 2048)
    p = d.n_params
    for base, weights in (("float32", 4 * p), ("bfloat16", 2 * p)):
        a = lora_dims(LLAMA_1B, 16, "auto", base=base)
        e = estimate(d, DDP, 1, 1, a)
        n = a.adapter_params
        assert (e.weights, e.grads, e.optimizer) == (weights + 4 * n, 4 * n, 8 * n)
    q = lora_dims(LLAMA_1B, 16, "auto", base="int4")
    e = estimate(d, DDP, 1, 1, q)
    rest = p - q.linear_params  # embeddings, norms: fp32 after peft's k-bit preparation
    assert e.weights == int(INT4_BYTES * q.linear_params) + KBIT_REST_BYTES * rest + 4 * q.adapter_params
    assert 1.4 * GiB < e.weights < 1.6 * GiB  # 1.53 GiB measured after loading on an H200 (adapters in)
    # the adapters' activations: their inputs kept (bf16 copy + dropout mask), none without dropout
    plain = estimate(d, DDP, 1, 1, lora_dims(LLAMA_1B, 16, "auto", dropout=0.0, base="bfloat16"))
    masked = estimate(d, DDP, 1, 1, lora_dims(LLAMA_1B, 16, "auto", dropout=0.05, base="bfloat16"))
    assert masked.activations - plain.activations == 16 * 2048 * (6 * 2048 + 8192)


@pytest.mark.parametrize("st", [DDP, CKPT], ids=["ddp", "ckpt"])
@pytest.mark.parametrize("micro", [1, 4])
def test_qlora_is_smaller_than_lora_is_smaller_than_full_for_1b(st, micro):
    d = dims_from_config(LLAMA_1B, 2048)
    full = estimate(d, st, micro, 1)
    lora32 = estimate(d, st, micro, 1, lora_dims(LLAMA_1B, base="float32"))  # model.dtype auto: fp32 in a train job
    lora16 = estimate(d, st, micro, 1, lora_dims(LLAMA_1B, base="bfloat16"))
    qlora = estimate(d, st, micro, 1, lora_dims(LLAMA_1B, base="int4"))
    assert qlora.total < lora32.total < full.total
    assert qlora.weights < lora16.weights < lora32.weights
    assert qlora.grads + qlora.optimizer < 0.01 * (full.grads + full.optimizer)


def test_checkpointing_keeps_fewer_activations_and_a_bigger_micro_batch_fits():
    d = dims_from_config(LLAMA_8B, 2048)
    q = lora_dims(LLAMA_8B, base="int4")
    assert estimate(d, CKPT, 1, 1, q).activations < estimate(d, DDP, 1, 1, q).activations / 2
    assert max_micro_batch(d, CKPT, 1, GB24, q) > max_micro_batch(d, DDP, 1, GB24, q) == 0


# --- the recommendation ----------------------------------------------------------------------------------

def train_spec(model: dict, **train) -> object:  # type: ignore[no-untyped-def]
    strategy = train.pop("strategy", "auto")
    return spec_from_raw({"name": "ft", "task": "train", "resources": {"gpus": 1}, "model": model,
                          "distributed": {"strategy": strategy},
                          "data": {"train": str(EVAL_TEXT), "seq_len": 2048},
                          "train": {"global_batch_size": 16, **train}})


def advice(spec, cfg: dict, gpu: int) -> str | None:  # type: ignore[no-untyped-def]
    methods = fine_tuning_methods(spec, cfg)
    return lighter_method(methods, [method_recommendation(spec, m, None, cfg, gpu, 1) for m in methods])


def test_8b_full_fine_tuning_does_not_fit_24gb_and_qlora_is_recommended():
    spec = train_spec({"config": LLAMA_8B}, strategy="ddp")
    line = advice(spec, LLAMA_8B, GB24)
    assert line is not None and line.startswith("full fine-tuning does not fit; ")
    assert "qlora (int4 base)" in line and "add train.lora: {r: 16}, model.quantization: int4" in line
    assert "model.name_or_path" in line  # a model.config base has no saved weights to quantize
    # strategy auto: full fine-tuning fits only by offloading the optimizer to host RAM, and says so
    line = advice(train_spec({"config": LLAMA_8B}), LLAMA_8B, GB24)
    assert line is not None and "fits only by offloading to host RAM" in line and "qlora (int4 base)" in line


def test_no_line_where_full_fine_tuning_fits():
    assert advice(train_spec({"config": LLAMA_1B}), LLAMA_1B, 140 << 30) is None
    assert advice(train_spec({"config": LLAMA_8B}, strategy="ddp"), LLAMA_8B, None) is None  # no GPU memory


def test_a_lora_spec_is_recommended_its_own_micro_batch_and_qlora_checkpoints(tmp_path):
    folder = tmp_path / "base"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(LLAMA_8B))
    spec = train_spec({"name_or_path": str(folder), "quantization": "int4"}, lora={"r": 16})
    rec = recommend_for_job(spec, None, LLAMA_8B, GB24, 1)
    q = lora_dims(LLAMA_8B, 16, "auto", base="int4")
    d = dims_from_config(LLAMA_8B, 2048)
    assert rec.method == "qlora (int4 base)" and rec.checkpointing and rec.strategy == "none" and rec.fits
    assert rec.micro_batch == max(m for m in (1, 2, 4, 8, 16) if m <= max_micro_batch(d, CKPT, 1, GB24, q))
    assert rec.bytes_per_gpu == estimate(d, CKPT, rec.micro_batch, 1, q).total
    assert rec.summary().startswith("qlora (int4 base), none + gradient checkpointing, micro batch")
    # the same base unquantized: model.dtype auto loads float32, which does not fit; bfloat16 and int4 do
    lora = train_spec({"name_or_path": str(folder)}, lora={"r": 16})
    assert not recommend_for_job(lora, None, LLAMA_8B, GB24, 1).fits
    line = advice(lora, LLAMA_8B, GB24)
    assert line is not None and line.startswith("lora (float32 base) does not fit; lora (bfloat16 base) does")
    assert "add model.dtype: bfloat16" in line and "add model.quantization: int4" in line
    # no ladder: LoRA trains under DDP, whatever it needs
    assert recommend(d, 8 << 30, 1, 16, lora=lora_dims(LLAMA_8B, base="float32")).zero_stage is None


# --- the commands --------------------------------------------------------------------------------------

def hpcgpu(*args: str, **env: str) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if k not in ("HPCGPU_DEBUG", "CUDA_VISIBLE_DEVICES",
                                                                "HPCGPU_NVML_RECORDED")}
    return subprocess.run([sys.executable, "-m", "hpcgpu", *args], capture_output=True, text=True, cwd=REPO,
                          env={**base, **env}, timeout=120)


def spec_file(tmp_path: Path, model: dict, **train) -> Path:  # type: ignore[no-untyped-def]
    import yaml

    path = tmp_path / "ft.yaml"
    path.write_text(yaml.safe_dump({"name": "ft", "task": "train", "resources": {"gpus": 1}, "model": model,
                                    "data": {"train": str(EVAL_TEXT), "seq_len": 2048},
                                    "train": {"global_batch_size": 16, **train}}))
    return path


def method_lines(out: str) -> dict[str, str]:
    """The rows of the full / LoRA / QLoRA table (set flush left) by method."""
    rows = [line for line in out.splitlines() if line.startswith(("full ", "lora (", "qlora (")) and "GiB" in line
            and "fine-tuning" not in line and "does not fit" not in line]
    return {"full" if line.startswith("full ") else line[:line.index(")") + 1]: line for line in rows}


def test_estimate_shows_full_lora_and_qlora_and_recommends_qlora(tmp_path):
    spec = spec_file(tmp_path, {"config": LLAMA_8B})
    done = hpcgpu("estimate", str(spec), "--gpu-memory", "24G", "--set", "distributed.strategy=ddp")
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "full fine-tuning, LoRA and QLoRA (train.lora's defaults: r 16 on every linear layer of attention and " \
           "MLP, 41.94M adapter parameters)" in out
    rows = method_lines(out)
    assert set(rows) == {"full", "lora (float32 base)", "lora (bfloat16 base)", "qlora (int4 base)"}, out
    full, qlora = rows["full"].split(), rows["qlora (int4 base)"].split()
    assert full[1:3] == ["ddp", "(spec)"] and full[-7] == "no" and full[-1] == "0"  # not even with ckpt
    assert qlora[4:6] == ["7.7", "GiB"]  # the frozen int4 base + fp32 rest + adapters
    assert int(qlora[-1]) >= 1  # fits with gradient checkpointing
    advice_lines = [line for line in out.splitlines() if line.startswith("full fine-tuning does not fit; ")]
    assert len(advice_lines) == 1 and "model.quantization: int4" in advice_lines[0]
    data = json.loads(hpcgpu("estimate", str(spec), "--json", "--gpu-memory", "24G", "--set",
                             "distributed.strategy=ddp").stdout)
    methods = {m["method"]: m for m in data["methods"]}
    assert methods["qlora (int4 base)"]["adapter_params"] == 41_943_040 and methods["full"]["spec"]
    assert methods["qlora (int4 base)"]["recommended"]["fits"] and not methods["full"]["recommended"]["fits"]
    assert data["advice"] == advice_lines[0]


def test_estimate_of_a_qlora_spec(tmp_path):
    folder = tmp_path / "base"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(LLAMA_8B))
    spec = spec_file(tmp_path, {"name_or_path": str(folder), "quantization": "int4"},
                     lora={"r": 8, "target_modules": ["q_proj", "v_proj"]})
    done = hpcgpu("estimate", str(spec), "--gpu-memory", "24G")
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "train.lora: r 8 on q_proj, v_proj, 3.41M adapter parameters" in out
    assert "ddp (spec)" in method_lines(out)["qlora (int4 base)"]
    assert "\n  zero2 " not in out  # a train.lora spec: no table of ZeRO strategies
    assert "recommended: qlora (int4 base), none + gradient checkpointing" in out
    done = hpcgpu("estimate", str(spec), "--gpu-memory", "24G", "--set", "train.lora.target_modules=[c_attn]")
    assert done.returncode == 2 and "train.lora.target_modules" in done.stderr and "Traceback" not in done.stderr


PROBE = """
import sys
from hpcgpu.cli import main
try:
    main(sys.argv[1:])
except SystemExit as exc:
    code = exc.code
print("HEAVY=" + ",".join(sorted(m for m in ("torch", "transformers", "peft") if m in sys.modules)), file=sys.stderr)
"""


def test_hw_spec_recommends_qlora_on_24gb_cards_without_torch(tmp_path):
    nvml = json.loads((FIXTURES / "nvml_a100x4.json").read_text())
    for gpu in nvml["gpus"]:
        gpu["memory_total"], gpu["memory_free"] = GB24, GB24 - gpu["memory_used"]
    recorded = tmp_path / "nvml24.json"
    recorded.write_text(json.dumps(nvml))
    spec = spec_file(tmp_path, {"config": LLAMA_8B})
    done = subprocess.run([sys.executable, "-c", PROBE, "hw", str(spec), "--devices", "0", "--set",
                           "distributed.strategy=ddp"], capture_output=True, text=True, cwd=REPO, timeout=120,
                          env={**os.environ, "HPCGPU_NVML_RECORDED": str(recorded)})
    assert "HEAVY=\n" in done.stderr, done.stderr
    assert "(DOES NOT FIT)" in done.stdout
    assert "  full fine-tuning does not fit; " in done.stdout and "model.quantization: int4" in done.stdout
    info = json.loads(hpcgpu("hw", str(spec), "--devices", "0", "--json", "--set", "distributed.strategy=ddp",
                             HPCGPU_NVML_RECORDED=str(recorded)).stdout)
    assert "qlora (int4 base)" in info["recommendation"]["advice"]


# torch.cuda.max_memory_allocated of hpcgpu's train task, QLoRA (int4, r 16 all-linear, dropout 0.05) on the 8B
# Llama shape, seq 2048, gradient checkpointing, one NVIDIA H200 (benchmarks/qlora_big.py; RESULTS.md, #35)
MEASURED_8B_QLORA = [(True, False, 2, 22.66), (True, False, 1, 15.91), (False, False, 2, 17.09),
                     (False, False, 1, 13.13), (False, True, 2, 12.08)]


@pytest.mark.parametrize("compiled,fused,micro,measured", MEASURED_8B_QLORA,
                         ids=["compiled-m2", "compiled-m1", "eager-m2", "eager-m1", "fused-eager-m2"])
def test_8b_qlora_estimate_is_within_20_percent_of_the_peak_measured_on_an_h200(
        compiled: bool, fused: bool, micro: int, measured: float) -> None:
    d = dims_from_config(LLAMA_8B, 2048, compiled=compiled, fused_loss=fused)
    got = estimate(d, CKPT, micro, 1, lora_dims(LLAMA_8B, base="int4")).total / GiB
    assert abs(got / measured - 1) <= 0.2, (got, measured)


def test_a_fused_loss_under_lora_frees_the_logits_and_holds_no_head_gradient() -> None:
    """The head is frozen under train.lora: the fused loss keeps no fp32 gradient of it (full training does)."""
    q = lora_dims(LLAMA_8B, base="int4")
    plain, fused = (dims_from_config(LLAMA_8B, 2048, fused_loss=f) for f in (False, True))
    freed = estimate(plain, DDP, 2, 1, q).activations - estimate(fused, DDP, 2, 1, q).activations
    full_freed = estimate(plain, DDP, 2, 1).activations - estimate(fused, DDP, 2, 1).activations
    assert freed - full_freed == 4 * 128256 * 4096
