"""The memory estimate and the recommendations, against numbers worked out by hand."""
from __future__ import annotations

from pathlib import Path

import pytest

from conftest import EVAL_TEXT
from hpcgpu.errors import HpcgpuError
from hpcgpu.gpu.estimate import (ACT_PER_LAYER, ACT_PER_LAYER_EAGER, DDP, GiB, STRATEGIES, activation_bytes,
                                 analytic_params, dims_from_config, estimate, fits, max_micro_batch, parse_size,
                                 state_bytes, usable_bytes)
from hpcgpu.gpu.readings import RecordedSource
from hpcgpu.gpu.recommend import loader_workers, recommend, recommend_for_job
from hpcgpu.spec import spec_from_raw

GPT2 = {"model_type": "gpt2"}  # 124M: 12 layers, 768 wide, 12 heads, vocab 50257, 1024 positions
PSI = 124_439_808  # wte 38,597,376 + wpe 786,432 + 12 x 7,087,872 + ln_f 1,536
GPT2_MEDIUM = {"model_type": "gpt2", "n_layer": 24, "n_embd": 1024, "n_head": 16}
GPT2_XL = {"model_type": "gpt2", "n_layer": 48, "n_embd": 1600, "n_head": 25}
LLAMA_7B = {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
            "num_attention_heads": 32, "vocab_size": 32000}
H100_TOTAL = RecordedSource.from_file(Path(__file__).parent / "fixtures" / "nvml_h100_real.json").read()[0].memory_total
ZERO = {s.name: s for s in STRATEGIES}


def gpt2_dims(seq: int = 1024, compiled: bool = True, cfg: dict = GPT2):  # type: ignore[no-untyped-def]
    return dims_from_config(cfg, seq, compiled=compiled)


def test_gpt2_124m_parameters_from_the_config():
    assert analytic_params(GPT2)[0] == PSI
    assert analytic_params(GPT2_MEDIUM)[0] == 354_823_168


def test_meta_device_count_matches():
    pytest.importorskip("transformers")
    from hpcgpu.gpu.estimate import count_params

    spec = spec_from_raw({"name": "g", "task": "train", "model": {"config": GPT2},
                          "data": {"train": str(EVAL_TEXT)}})
    n, cfg = count_params(spec)
    assert n == PSI and cfg.n_embd == 768
    tiny_llama = {"model_type": "llama", "hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 2,
                  "num_attention_heads": 8, "num_key_value_heads": 2, "vocab_size": 1000}
    spec = spec_from_raw({"name": "l", "task": "train", "model": {"config": tiny_llama},
                          "data": {"train": str(EVAL_TEXT)}})
    assert count_params(spec)[0] == analytic_params(tiny_llama)[0]  # gated MLP, GQA, untied head


def test_ddp_model_states_are_16_bytes_per_parameter():
    d = gpt2_dims()
    w, g, o, buf, host = state_bytes(d, DDP, 1)
    assert (w, g, o) == (4 * PSI, 4 * PSI, 8 * PSI)  # fp32 weights, fp32 grads, Adam m + v
    assert w + g + o == 1_991_036_928  # 124.44M x 16 B = 1.99 GB
    assert buf == 2 * PSI and host == 0  # bf16 copies autocast keeps for backward
    assert state_bytes(d, DDP, 2)[3] == 6 * PSI  # + DDP's fp32 gradient buckets when there are peers


def test_zero_stages_partition_as_the_paper_says():
    d, n = gpt2_dims(), 8
    assert state_bytes(d, ZERO["zero1"], n)[:3] == (2 * PSI, 2 * PSI, 12 * PSI // n)
    assert state_bytes(d, ZERO["zero2"], n)[:3] == (2 * PSI, 2 * PSI // n, 12 * PSI // n)
    assert state_bytes(d, ZERO["zero3"], n)[:3] == (2 * PSI // n, 2 * PSI // n, 12 * PSI // n)
    assert state_bytes(d, ZERO["zero2+offload"], n)[2] == 0 and state_bytes(d, ZERO["zero2+offload"], n)[4] == 16 * PSI // n
    assert state_bytes(d, ZERO["zero3+offload-all"], n)[:3] == (0, 0, 0)
    totals = [estimate(d, ZERO[k], 1, n).total for k in ("zero1", "zero2", "zero3", "zero3+offload", "zero3+offload-all")]
    assert totals == sorted(totals, reverse=True)  # every step down the ladder saves memory


def test_activations_gpt2_124m_micro8_seq1024():
    s, b, h, layers, vocab = 1024, 8, 768, 12, 50257
    logits = b * s * vocab * 10  # bf16 logits + fp32 copy + fp32 log-softmax
    assert activation_bytes(gpt2_dims(), 8) == layers * s * b * h * 34 + logits == 6_683_967_488
    assert ACT_PER_LAYER == 34 and ACT_PER_LAYER_EAGER == 90
    assert activation_bytes(gpt2_dims(compiled=False), 8) == layers * s * b * h * 90 + logits
    assert activation_bytes(gpt2_dims(), 8, ZERO["zero2"]) == activation_bytes(gpt2_dims(compiled=False), 8)
    eager_attn = dims_from_config({**GPT2, "_attn_implementation": "eager"}, 1024)
    assert activation_bytes(eager_attn, 8) - activation_bytes(gpt2_dims(), 8) == layers * 5 * 12 * s * s * b
    e = estimate(gpt2_dims(), DDP, 8, 1)
    assert e.total == 18 * PSI + 6_683_967_488  # 8.3 GiB; an H100 measured 6.97 GiB (compiled, accum 2)


def test_max_micro_batch_is_the_edge_of_fitting():
    d = gpt2_dims()
    for st in (DDP, ZERO["zero2"], ZERO["zero3+offload"]):
        m = max_micro_batch(d, st, 2, H100_TOTAL)
        assert fits(estimate(d, st, m, 2), H100_TOTAL) and not fits(estimate(d, st, m + 1, 2), H100_TOTAL)
    assert usable_bytes(80 * GiB) == int(80 * GiB * 0.95) - GiB
    xl = dims_from_config(GPT2_XL, 1024)
    assert max_micro_batch(xl, DDP, 2, 16 * GiB) == 0  # 1.56B x 22 B of states alone is 32 GiB


@pytest.mark.parametrize("text,value", [("80G", 80 * GiB), ("80GB", 80 * GiB), ("79.6GiB", int(79.6 * GiB)),
                                        ("81559M", 81559 << 20), ("40", 40 * GiB), ("1T", 1 << 40)])
def test_parse_size(text, value):
    assert parse_size(text) == value


def test_parse_size_error_names_the_flag():
    with pytest.raises(HpcgpuError, match="--gpu-memory"):
        parse_size("lots")


# ---------------------------------------------------------------- recommendations

@pytest.mark.parametrize("size", ["0G", "1K"])
def test_a_gpu_memory_no_model_fits_in_is_one_line(size):
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "hpcgpu", "estimate", str(Path(__file__).parents[2] / "configs" /
                           "tiny-gpt2.yaml"), "--gpu-memory", size], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and done.stderr == (f"hpcgpu: error: --gpu-memory {size}: no model fits in it; "
                                                    "give a GPU's size, like 80G\n"), done.stderr


@pytest.mark.parametrize("setting, line", [
    ("model.config.n_head=3", "model.config: embed_dim must be divisible by num_heads (got embed_dim: 128 and "
                              "num_heads: 3)."),
    ("model.config.model_type=gtp2", "model.config.model_type: unknown model type 'gtp2' (transformers "),
])
def test_a_model_transformers_cannot_build_is_one_line(setting, line, capsys):
    pytest.importorskip("transformers")
    from hpcgpu.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["estimate", str(Path(__file__).parents[2] / "configs" / "tiny-gpt2.yaml"), "--set", setting])
    err = capsys.readouterr().err.splitlines()[-1]
    assert exit_.value.code == 2 and err.startswith(f"hpcgpu: error: {line}") and len(err) < 200, err


def test_small_model_on_h100_gets_ddp_and_the_largest_dividing_micro_batch():
    rec = recommend(gpt2_dims(), H100_TOTAL, world=2, global_batch=64, cpus_per_gpu=8)
    assert rec.strategy == "ddp" and rec.zero_stage is None and rec.offload == "none"
    assert rec.micro_batch == 32 and rec.accum == 1 and rec.fits  # 32 per rank; it fits (~30 GiB)
    assert rec.workers == 7 and "micro 32 x accum 1 x 2 rank(s) = global 64" in rec.reason
    rec = recommend(gpt2_dims(), 24 * GiB, world=2, global_batch=64)
    assert (rec.micro_batch, rec.accum) == (16, 2)  # 24 GiB: max 20 sequences, 16 divides 32


def test_one_rank_is_strategy_none():
    assert recommend(gpt2_dims(), H100_TOTAL, world=1, global_batch=8).strategy == "none"


def test_optimizer_states_do_not_fit_then_zero2():
    # GPT-2 XL on 4 x 32 GiB: DDP needs 22 B/param = 32 GiB + activations; ZeRO-2 shards grads + Adam
    rec = recommend(dims_from_config(GPT2_XL, 1024), 32 * GiB, world=4, global_batch=32)
    assert (rec.strategy, rec.zero_stage, rec.offload) == ("deepspeed", 2, "none")
    assert "ddp needs" in rec.reason


def test_parameters_do_not_fit_then_zero3_then_offload():
    llama = dims_from_config(LLAMA_7B, 512)  # 6.74B parameters
    assert recommend(llama, 40 * GiB, world=8, global_batch=64).zero_stage == 2
    rec = recommend(llama, 24 * GiB, world=8, global_batch=64)  # ZeRO-2's full bf16 weights: 12.6 GiB
    assert (rec.zero_stage, rec.offload, rec.micro_batch) == (3, "none", 1) and "zero2 needs 31.2 GiB" in rec.reason
    rec = recommend(llama, 24 * GiB, world=2, global_batch=64)  # ZeRO-3 over 2 GPUs: 58 GiB
    assert (rec.zero_stage, rec.offload) == (2, "optimizer") and rec.fits
    rec = recommend(llama, 16 * GiB, world=2, global_batch=64)
    assert (rec.zero_stage, rec.offload) == (3, "params+optimizer") and rec.fits


def test_nothing_fits_says_so():
    rec = recommend(dims_from_config(LLAMA_7B, 4096), 8 * GiB, world=1, global_batch=4)
    assert not rec.fits and rec.reason.startswith("does not fit")


def test_fixed_settings_are_kept_and_checked():
    rec = recommend(gpt2_dims(), H100_TOTAL, world=2, global_batch=64, micro=4)
    assert (rec.micro_batch, rec.accum, rec.strategy) == (4, 8, "ddp")
    with pytest.raises(HpcgpuError, match="micro_batch_size: 5"):
        recommend(gpt2_dims(), H100_TOTAL, world=2, global_batch=64, micro=5)
    with pytest.raises(HpcgpuError, match="global_batch_size: 10"):
        recommend(gpt2_dims(), H100_TOTAL, world=4, global_batch=10)


def test_without_gpu_memory_the_old_cpu_rule():
    rec = recommend(gpt2_dims(), None, world=2, global_batch=48)
    assert (rec.micro_batch, rec.accum, rec.strategy) == (8, 3, "ddp")  # largest divisor of 24 up to 8
    assert recommend(gpt2_dims(), None, world=2, global_batch=14).micro_batch == 7


def test_loader_workers():
    assert [loader_workers(c) for c in (1, 2, 4, 16)] == [0, 1, 3, 8]


def test_recommend_for_job_reads_the_spec():
    spec = spec_from_raw({"name": "g", "task": "train", "resources": {"gpus": 4, "cpus_per_gpu": 4},
                          "model": {"config": GPT2}, "data": {"train": str(EVAL_TEXT), "seq_len": 1024},
                          "train": {"global_batch_size": 128}})
    rec = recommend_for_job(spec, PSI, GPT2, H100_TOTAL, 4)
    assert rec.strategy == "ddp" and rec.micro_batch * rec.accum * 4 == 128 and rec.workers == 3
    fixed = spec_from_raw({**spec_to_raw(spec), "distributed": {"strategy": "deepspeed",
                                                              "deepspeed": {"zero_stage": 3}}})
    rec = recommend_for_job(fixed, PSI, GPT2, H100_TOTAL, 4)
    assert (rec.strategy, rec.zero_stage) == ("deepspeed", 3)
    eager = recommend_for_job(spec_from_raw({**spec_to_raw(spec), "train": {"global_batch_size": 128,
                                                                            "compile": False}}),
                              PSI, GPT2, H100_TOTAL, 4)
    assert eager.micro_batch <= rec.micro_batch


def spec_to_raw(spec):  # type: ignore[no-untyped-def]
    from hpcgpu.spec import spec_to_dict

    return spec_to_dict(spec)


def test_the_run_plan_fills_only_auto():
    """The job's run plan takes auto's micro batch and strategy (with its ZeRO stage) from the
    recommendation and keeps what the spec fixes; the spec itself is never rewritten."""
    from hpcgpu.runtime.plan import plan_train

    base = {"name": "g", "task": "train", "model": {"config": LLAMA_7B}, "resources": {"gpus": 8},
            "data": {"train": str(EVAL_TEXT), "seq_len": 512}, "train": {"global_batch_size": 64}}
    spec = spec_from_raw(base)

    def plan_of(s):  # type: ignore[no-untyped-def]
        return plan_train(s, 8, device_type="cuda", gpu_memory=24 * GiB, bf16_supported=True,
                          count_model=lambda: (None, LLAMA_7B)).training

    rec = recommend_for_job(spec, None, LLAMA_7B, 24 * GiB, 8)
    tuned = plan_of(spec)
    assert tuned.micro_batch == rec.micro_batch == 1 and tuned.strategy == "deepspeed"
    assert tuned.zero_stage == 3 and not tuned.offload_optimizer
    assert spec.train.micro_batch_size == "auto" and spec.distributed.strategy == "auto"
    fixed = spec_from_raw({**base, "train": {"global_batch_size": 64, "micro_batch_size": 2},
                           "distributed": {"strategy": "ddp"}})
    kept = plan_of(fixed)
    assert (kept.micro_batch, kept.strategy, kept.zero_stage) == (2, "ddp", None)
