"""The FSDP2 rows of the memory model (distributed.strategy: fsdp): sharded states that shrink with the
GPUs, CPU offload that moves them to host RAM, gradient checkpointing, the run plan's plan_strategy,
`hpcgpu estimate` printing them, and the automatic choice that never takes them."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from hpcgpu.gpu.estimate import (DDP, STRATEGIES, GiB, ModelDims, dims_from_config, estimate, fits,
                                 max_micro_batch, plan_strategy, with_checkpointing)
from hpcgpu.gpu.recommend import recommend

LLAMA_1B = {"model_type": "llama", "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
            "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256, "tie_word_embeddings": True,
            "max_position_embeddings": 8192}  # Llama-3.2-1B's shape
ROWS = {s.name: s for s in STRATEGIES}
FSDP, FSDP_OFFLOAD = ROWS["fsdp"], ROWS["fsdp+offload"]


def llama_1b(seq: int = 2048) -> ModelDims:
    return dims_from_config(LLAMA_1B, seq)


def states(d: ModelDims, st, world: int) -> int:  # type: ignore[no-untyped-def]
    e = estimate(d, st, 1, world)
    return e.weights + e.grads + e.optimizer


@pytest.mark.parametrize("world", [2, 4, 8])
def test_fsdp_needs_less_per_gpu_than_ddp(world):
    d = llama_1b()
    assert estimate(d, FSDP, 1, world).total < estimate(d, DDP, 1, world).total


def test_fsdp_states_shrink_with_more_gpus():
    d = llama_1b()
    by_world = [states(d, FSDP, n) for n in (1, 2, 4, 8)]
    assert by_world == sorted(by_world, reverse=True) and len(set(by_world)) == 4
    assert by_world[3] * 8 == pytest.approx(by_world[0], rel=1e-6)  # each rank holds 1/N of them
    totals = [estimate(d, FSDP, 1, n).total for n in (2, 4, 8)]
    assert totals == sorted(totals, reverse=True)


def test_cpu_offload_moves_the_states_to_host_ram():
    d = llama_1b()
    for world in (1, 2, 8):
        on_gpu, offloaded = estimate(d, FSDP, 1, world), estimate(d, FSDP_OFFLOAD, 1, world)
        assert offloaded.total < on_gpu.total
        assert on_gpu.host == 0 and offloaded.host == states(d, FSDP, world)  # moved, not gone
        assert (offloaded.weights, offloaded.grads, offloaded.optimizer) == (0, 0, 0)


def test_checkpointing_keeps_fewer_activations():
    d = llama_1b()
    for st in (FSDP, FSDP_OFFLOAD):
        ckpt = with_checkpointing(st)
        assert ckpt.name == f"{st.name}+ckpt" and ckpt.fsdp
        assert estimate(d, ckpt, 4, 4).activations < estimate(d, st, 4, 4).activations
        assert max_micro_batch(d, ckpt, 4, 24 * GiB) > max_micro_batch(d, st, 4, 24 * GiB)
    # FSDP computes with bf16 gathered weights: a checkpointed layer keeps a bf16 input, DDP an fp32 one
    assert estimate(d, with_checkpointing(FSDP), 4, 4).activations < \
        estimate(d, with_checkpointing(DDP), 4, 4).activations


def test_keeping_gathered_weights_to_the_backward_costs_memory():
    d = llama_1b()
    kept = plan_strategy(None, fsdp=True, reshard_after_forward=False)
    assert kept.name == "fsdp+no-reshard" and not kept.reshard_after_forward
    extra = estimate(d, kept, 1, 8).total - estimate(d, FSDP, 1, 8).total
    assert 0 < extra < 2 * d.n_params  # at most every block's bf16 weights


def test_plan_strategy_names_the_fsdp_rows():
    assert plan_strategy(None, fsdp=True) == FSDP
    assert plan_strategy(None, True, True, fsdp=True) == FSDP_OFFLOAD
    assert plan_strategy(None, True, True, True, fsdp=True) == with_checkpointing(FSDP_OFFLOAD)
    assert plan_strategy(None, True, True, True, fsdp=True).name == "fsdp+offload+ckpt"
    assert FSDP_OFFLOAD.offload == "params+optimizer"
    assert plan_strategy(None) == DDP and plan_strategy(3, True, True).name == "zero3+offload-all"
    with pytest.raises(ValueError, match="fsdp"):
        plan_strategy(3, fsdp=True)


def test_auto_never_chooses_fsdp():
    d = llama_1b()
    fsdp_only = []  # GPU sizes where FSDP fits on the GPU and no rung of the ladder does without offload
    for gib in range(6, 41):
        for world in (1, 2, 4, 8):
            for ckpt in (False, "auto", True):
                rec = recommend(d, gib * GiB, world, 16, checkpointing=ckpt)
                assert rec.strategy != "fsdp", (gib, world, ckpt)
                if rec.offload != "none" and fits(estimate(d, FSDP, rec.micro_batch, world), gib * GiB):
                    fsdp_only.append(gib)
    assert fsdp_only  # the test covers sizes where FSDP would have been a choice


# --- `hpcgpu estimate` ---------------------------------------------------------------------------------

def estimate_cli(tmp_path: Path, *args: str) -> str:
    pytest.importorskip("transformers")
    from click.testing import CliRunner

    from hpcgpu.cli.estimate import estimate_cmd

    spec = tmp_path / "l1b.yaml"
    spec.write_text(yaml.safe_dump({"name": "l1b", "task": "train", "resources": {"gpus": 4},
                                    "model": {"config": LLAMA_1B}, "data": {"seq_len": 2048},
                                    "train": {"global_batch_size": 16}}))
    done = CliRunner().invoke(estimate_cmd, [str(spec), "--gpu-memory", "24G", *args])
    assert done.exit_code == 0, done.output
    return done.output


def test_estimate_prints_fsdp_rows_and_recommends_no_fsdp(tmp_path):
    data = json.loads(estimate_cli(tmp_path, "--json"))
    rows = {r["strategy"]: r for r in data["strategies"]}
    assert list(rows)[-2:] == ["fsdp", "fsdp+offload"] and {"ddp", "zero3+offload-all"} <= set(rows)
    fsdp, off, ddp = rows["fsdp"], rows["fsdp+offload"], rows["ddp"]
    assert fsdp["fsdp"] and off["fsdp"] and not ddp["fsdp"]
    assert fsdp["total"] < ddp["total"] and off["total"] < fsdp["total"]
    assert off["host"] > 0 and fsdp["host"] == 0
    assert fsdp["checkpointed"]["activations"] < fsdp["activations"]  # gradient_checkpointing: auto
    assert fsdp["fits"] and off["max_micro_batch"] >= fsdp["max_micro_batch"] > 0
    assert data["recommendation"]["strategy"] != "fsdp"


def test_estimate_of_an_fsdp_spec(tmp_path):
    out = estimate_cli(tmp_path, "--set", "distributed.strategy=fsdp", "--set", "distributed.fsdp.cpu_offload=true",
                       "--set", "train.gradient_checkpointing=true")
    lines = out.splitlines()
    assert any(line.startswith("  fsdp+ckpt ") for line in lines)
    assert any(line.startswith("  fsdp+offload+ckpt ") for line in lines)
    assert any(line.startswith("full fsdp+offload (spec) ") for line in lines), out  # the spec's own row
    assert "recommended: fsdp offload params+optimizer + gradient checkpointing" in out
