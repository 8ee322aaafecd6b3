"""`hpcgpu estimate` for task: infer: per-GPU memory of a model copy by weight format and
gpus_per_replica, and the width the gpus_per_replica rule (the one submit and the job use) picks."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from click.testing import CliRunner

from conftest import REPO
from hpcgpu.gpu.estimate import (REPLICA_WIDTHS, WEIGHTS_SHARE, GiB, fewest_gpus_per_replica, infer_dims,
                                 infer_estimate, infer_split_estimate, infer_split_max_batch, parse_size,
                                 rows_room, usable_bytes)

pytest.importorskip("transformers")

LLAMA_8B = {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
            "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
            "max_position_embeddings": 8192, "tie_word_embeddings": False}
LLAMA_70B = {**LLAMA_8B, "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
             "num_attention_heads": 64}


def spec_file(tmp_path: Path, model: dict, gpus: int = 4, **infer: Any) -> str:
    path = tmp_path / "infer.yaml"
    path.write_text(yaml.safe_dump({"name": "inf", "task": "infer", "resources": {"gpus": gpus}, "model": model,
                                    "infer": {"input": str(REPO / "configs" / "data" / "prompts.jsonl"),
                                              "max_new_tokens": 256, "batch_size": 8, **infer}}))
    return str(path)


def estimate(spec: str, gpu_memory: str, *args: str) -> str:
    from hpcgpu.cli.estimate import estimate_cmd

    done = CliRunner().invoke(estimate_cmd, [spec, "--gpu-memory", gpu_memory, "--prompt-tokens", "2048", *args])
    assert done.exit_code == 0, done.output
    return done.stdout


def estimate_json(spec: str, gpu_memory: str, *args: str) -> dict[str, Any]:
    return json.loads(estimate(spec, gpu_memory, "--json", *args))


def rule(weights: int, gpu_memory: str, gpus: int) -> int | None:
    """The rule by hand: the fewest divisors g of the node's GPUs whose WEIGHTS_SHARE holds the weights."""
    budget = usable_bytes(parse_size(gpu_memory))
    return next((g for g in range(1, gpus + 1) if gpus % g == 0 and weights <= g * budget * WEIGHTS_SHARE), None)


def test_a_split_divides_weights_and_kv_cache_not_activations():
    d = infer_dims(LLAMA_8B)
    one = infer_estimate(d, "bfloat16", 8, 2048, 256)
    two = infer_split_estimate(d, "bfloat16", 8, 2048, 256, "generate", 2)
    assert (two.weights, two.kv_cache, two.activations) == (one.weights // 2, one.kv_cache // 2, one.activations)
    assert infer_split_estimate(d, "bfloat16", 8, 2048, 256, "generate", 1) == one
    top = infer_split_max_batch(d, "bfloat16", 2048, 256, "generate", 2, 20 * GiB)
    room = rows_room(20 * GiB - two.weights)  # the job's headroom beside a GPU's share of the weights

    def rows_bytes(batch: int) -> int:
        e = infer_split_estimate(d, "bfloat16", batch, 2048, 256, "generate", 2)
        return e.kv_cache + e.activations

    assert rows_bytes(top) <= room < rows_bytes(top + 1)


def test_llama_8b_16g_bfloat16_needs_two_gpus_int4_one(tmp_path):
    spec = spec_file(tmp_path, {"config": LLAMA_8B})
    data = estimate_json(spec, "16G")
    formats = {f["weights_format"]: f for f in data["formats"]}
    assert rule(formats["bfloat16"]["copy_weights"], "16G", 4) == 2  # 15.0 GiB > 85% of 14.2 GiB usable
    assert formats["bfloat16"]["recommended_gpus_per_replica"] == data["recommended_gpus_per_replica"] == 2
    assert formats["int4"]["recommended_gpus_per_replica"] == rule(formats["int4"]["copy_weights"], "16G", 4) == 1
    assert data["recommended"]["replicas"] == 2 and data["gpus_per_replica"] == "auto"
    out = estimate(spec, "16G")
    assert "recommended: gpus_per_replica 2 (the fewest that hold the bfloat16 weights) -> 2 copies" in out
    assert "bfloat16 weights, 2 GPUs per replica, batch 8: fits" in out
    assert "for a SLURM job set infer.gpus_per_replica: 2" in out  # submit takes auto as 1 without a cap
    # int4 quantizes a saved model as it loads: a folder with its config.json
    folder = tmp_path / "llama"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(LLAMA_8B))
    out = estimate(spec_file(tmp_path, {"name_or_path": str(folder), "quantization": "int4"}), "16G")
    assert "int4 (spec)" in out and "recommended: gpus_per_replica 1 (the fewest that hold the int4 weights) -> " \
        "4 copies" in out


def test_llama_8b_24g_and_80g_one_gpu_a_copy(tmp_path):
    spec = spec_file(tmp_path, {"config": LLAMA_8B})
    data = estimate_json(spec, "24G")  # 15.0 GiB of bf16 weights within 85% of 21.8 GiB usable
    weights = data["formats"][1]["copy_weights"]
    assert weights <= usable_bytes(24 * GiB) * WEIGHTS_SHARE and rule(weights, "24G", 4) == 1
    assert data["recommended_gpus_per_replica"] == 1
    out = estimate(spec, "80G")
    assert "recommended: gpus_per_replica 1 (the fewest that hold the bfloat16 weights) -> 4 copies" in out
    assert "bfloat16 weights, one GPU per replica, batch 8: fits" in out


def test_llama_70b_on_8_x_80g_by_the_rule(tmp_path):
    spec = spec_file(tmp_path, {"config": LLAMA_70B}, gpus=8)
    data = estimate_json(spec, "80G")
    weights = 2 * data["params"]
    expected = rule(weights, "80G", 8)
    assert expected == fewest_gpus_per_replica(weights, usable_bytes(80 * GiB), 8) == 4  # 131 GiB: 2 x 63.7 short
    assert data["recommended_gpus_per_replica"] == expected and data["recommended"]["replicas"] == 8 // expected
    assert "recommended: gpus_per_replica 4 (the fewest that hold the bfloat16 weights) -> 2 copies" in \
        estimate(spec, "80G")


def test_nothing_fits_suggests_int4_offload_or_more_gpus(tmp_path):
    out = estimate(spec_file(tmp_path, {"config": LLAMA_70B}, gpus=1), "80G")
    assert "DOES NOT FIT: bfloat16 weights (131.4 GiB) need more than the one GPU of a node" in out
    assert "model.quantization: int4 (one GPU a copy)" in out and "int8" not in out.splitlines()[-1]
    assert "CPU offload, infer.max_memory: auto,cpu=" in out and "more GPUs, resources.gpus: 4" in out


def test_cpu_offload_counts_toward_fitting(tmp_path):
    spec = spec_file(tmp_path, {"config": LLAMA_70B}, gpus=1, max_memory="70GiB,cpu=200GiB")
    data = estimate_json(spec, "80G")
    assert data["gpu_budget"] == 70 * GiB and data["cpu_offload"] == 200 * GiB
    bf16 = data["formats"][1]
    one = bf16["widths"][0]  # what 85% of the 70 GiB cap leaves goes to CPU memory
    assert one["offloaded"] == bf16["copy_weights"] - int(70 * GiB * WEIGHTS_SHARE)
    assert one["weights"] == bf16["copy_weights"] - one["offloaded"]
    assert one["fits"] and data["recommended_gpus_per_replica"] == 1
    assert "offloaded" in estimate(spec, "80G")


def test_a_fixed_gpus_per_replica_is_checked(tmp_path):
    spec = spec_file(tmp_path, {"config": LLAMA_8B}, gpus_per_replica=1)
    data = estimate_json(spec, "16G")
    assert (data["gpus_per_replica"], data["recommended_gpus_per_replica"]) == (1, 2)
    assert data["recommended"]["spec_setting_fits"] is False
    assert "infer.gpus_per_replica: 1 (the spec's) does not fit; 2 does" in estimate(spec, "16G")
    spec = spec_file(tmp_path, {"config": LLAMA_8B}, gpus_per_replica=4)
    assert "infer.gpus_per_replica: 4 (the spec's) fits" in estimate(spec, "16G")


def test_json_rows_per_width(tmp_path):
    data = estimate_json(spec_file(tmp_path, {"config": LLAMA_8B}), "80G")
    assert {"params", "dims", "mode", "prompt_tokens", "new_tokens", "replicas", "gpus_per_replica", "gpu_memory",
            "usable", "exceeds_context", "formats", "recommended", "recommended_gpus_per_replica"} <= set(data)
    assert [f["weights_format"] for f in data["formats"]] == ["float32", "bfloat16", "int8", "int4"]
    bf16 = data["formats"][1]
    widths = bf16["widths"]
    assert [w["gpus_per_replica"] for w in widths] == list(REPLICA_WIDTHS)
    assert [w["possible"] for w in widths] == [True, True, True, False]  # 8 does not divide 4 GPUs
    assert [w["replicas"] for w in widths] == [4, 2, 1, None]
    assert widths[0]["weights"] == bf16["weights"] == bf16["copy_weights"] == 2 * data["params"]
    assert widths[2]["weights"] == bf16["copy_weights"] // 4 and widths[2]["kv_cache"] == widths[0]["kv_cache"] // 4
    assert widths[2]["activations"] == widths[0]["activations"]
    assert set(data["recommended"]) >= {"weights_format", "gpus_per_replica", "replicas", "batch", "batch_fits",
                                        "spec_gpus_per_replica", "spec_setting_fits", "suggestions"}


def test_no_later_wording(tmp_path):
    out = estimate(spec_file(tmp_path, {"config": LLAMA_8B}), "12G")
    assert "(later)" not in out and "not in this version" not in out and "int8" in out


@pytest.mark.parametrize("mode, gpu_memory", [("generate", "80G"), ("score", "24G")])
def test_the_estimate_shows_the_batch_the_job_picks(tmp_path, monkeypatch, mode: str, gpu_memory: str):
    """One memory model: `hpcgpu estimate`'s max batch and auto batch for one GPU a copy are what the
    job's batch_size: auto fits into the same card (HPCGPU_GPU_MEMORY standing for it)."""
    from types import SimpleNamespace

    import torch
    from transformers import AutoConfig

    from hpcgpu.runtime.plan import plan_infer
    from hpcgpu.runtime.tasks.infer import memory_budget, row_bytes
    from hpcgpu.spec import load_spec

    path = spec_file(tmp_path, {"config": LLAMA_8B}, batch_size="auto", mode=mode)
    one_gpu = estimate_json(path, gpu_memory)["formats"][1]["widths"][0]  # bfloat16, one GPU a copy
    config = AutoConfig.for_model(**LLAMA_8B)
    weights = SimpleNamespace(numel=lambda: infer_dims(config).n_params, element_size=lambda: 2)
    monkeypatch.setenv("HPCGPU_GPU_MEMORY", gpu_memory)
    budget = memory_budget(SimpleNamespace(parameters=lambda: [weights]), torch.device("cpu"), None)
    per_row = row_bytes(config, mode, 2048 + (256 if mode == "generate" else 0), "bf16")
    plan = plan_infer(load_spec(path, ()), 4, device_type="cuda", precision="bf16", rows=100_000, max_tokens=2048,
                      budget_bytes=budget, bytes_per_row=per_row)
    assert budget // per_row == one_gpu["max_batch"] > 1
    assert plan.inference.batch_size == one_gpu["batch"]


def test_each_row_shows_the_engine_the_job_runs_it_on_and_its_auto_cap(tmp_path):
    """A small model on an 80 GB card fits more rows than any cap: a bfloat16 copy on one GPU runs on
    the slot engine (512 slots), an int4 copy or a copy split over 2 GPUs on batches (256 rows), as the
    job decides it (gpu/estimate.py why_batches); infer.engine: batches puts every row there."""
    small = {**LLAMA_8B, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1024}
    formats = {f["weights_format"]: f for f in
               estimate_json(spec_file(tmp_path, {"config": small}, batch_size="auto"), "80GiB")["formats"]}
    by_width = {g["gpus_per_replica"]: g for g in formats["bfloat16"]["widths"]}
    assert (by_width[1]["engine"], by_width[1]["batch"]) == ("slots", 512)
    assert (by_width[2]["engine"], by_width[2]["batch"]) == ("batches", 256)
    assert (formats["int4"]["engine"], formats["int4"]["batch"]) == ("batches", 256)
    (tmp_path / "b").mkdir()
    batches = estimate_json(spec_file(tmp_path / "b", {"config": small}, batch_size="auto", engine="batches"), "80GiB")
    assert {(f["engine"], f["batch"]) for f in batches["formats"]} == {("batches", 256)}
