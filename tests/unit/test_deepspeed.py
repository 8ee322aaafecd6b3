"""DeepSpeed ZeRO on CPU ranks (gloo) through the local executor: training, DDP agreement, exact resume."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import step_losses
from resumes import assert_resumed

pytest.importorskip("deepspeed")
pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
TEXT = REPO / "configs" / "data" / "pydocs-eval.txt"
STEPS = 10


def doc(runs: Path, strategy: str = "deepspeed", stage: int = 2, offload: bool = False, **train) -> dict:
    return {
        "name": f"ds{stage}{'o' if offload else ''}",
        "task": "train",
        "resources": {"gpus": 2, "cpus_per_gpu": 1},
        "distributed": {"strategy": strategy,
                        "deepspeed": {"zero_stage": stage, "offload_optimizer": offload}},
        "model": {"config": {"model_type": "gpt2", "n_layer": 1, "n_head": 2, "n_embd": 32, "n_positions": 64,
                             "vocab_size": 256, "bos_token_id": 0, "eos_token_id": 0,
                             "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}},
        "data": {"train": str(TEXT), "eval": str(TEXT), "seq_len": 64},
        "train": {"global_batch_size": 8, "micro_batch_size": 2, "max_steps": STEPS, "lr": 2e-3,
                  "warmup_steps": 2, "log_every": 1, **train},
        "checkpoint": {"every_steps": 4},
        "runs_dir": str(runs),
    }


def submit(tmp: Path, spec: dict, *args: str, env: dict | None = None) -> tuple[subprocess.CompletedProcess, Path]:
    path = tmp / "spec.yaml"
    path.write_text(yaml.safe_dump(spec))
    proc = subprocess.run([sys.executable, "-m", "hpcgpu", "submit", str(path), "--executor", "local", *args],
                          capture_output=True, text=True, timeout=400, env={**os.environ, **(env or {})})
    marker = "unfinished run " if "unfinished run " in proc.stderr else "run dir "
    run_dir = Path(proc.stderr.split(marker)[1].split()[0].rstrip(",")) if marker in proc.stderr else tmp
    return proc, run_dir


def final_eval(run_dir: Path) -> float:
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in recs if r["kind"] == "eval"][-1]


def weights(run_dir: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(run_dir / "model" / "model.safetensors"))


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("ddp")
    proc, run_dir = submit(tmp, doc(tmp / "runs", strategy="ddp"), "--new")
    assert proc.returncode == 0, proc.stderr[-2000:]
    return run_dir


@pytest.fixture(scope="module")
def zero_runs(tmp_path_factory) -> dict[str, Path]:
    """ZeRO-2, ZeRO-3, and both with the optimizer offloaded to the CPU: one uninterrupted run each."""
    out = {}
    for stage, offload in ((2, False), (3, False), (2, True), (3, True)):
        tmp = tmp_path_factory.mktemp(f"z{stage}{offload}")
        proc, run_dir = submit(tmp, doc(tmp / "runs", stage=stage, offload=offload), "--new")
        assert proc.returncode == 0, proc.stderr[-3000:]
        out[f"{stage}{'o' if offload else ''}"] = run_dir
    return out


@pytest.mark.parametrize("key", ["2", "3", "2o", "3o"])
def test_zero_trains_and_exports_a_plain_model(zero_runs, key, plain_model_vocab):
    run_dir = zero_runs[key]
    log = step_losses(run_dir)
    assert sorted(log) == list(range(1, STEPS + 1))
    assert log[1] == pytest.approx(5.545, abs=0.1)  # ~ln(256): weights initialised right under ZeRO-3 too
    assert log[STEPS] < log[1] - 0.3
    assert plain_model_vocab(run_dir / "model") == 256  # loads and runs without DeepSpeed
    assert final_eval(run_dir) < log[1] - 0.3  # ZeRO-3's ranks run the eval's forwards in step


def test_zero2_follows_the_ddp_loss_curve(zero_runs, ddp_run):
    """Same global batch, seed and data order: ZeRO-2 partitions optimizer state and gradients but
    computes the same update, so the curves agree to float round-off (tolerance 1e-4 relative)."""
    z, d = step_losses(zero_runs["2"]), step_losses(ddp_run)
    assert z.keys() == d.keys()
    for step in z:
        assert z[step] == pytest.approx(d[step], rel=1e-4), step
    assert final_eval(zero_runs["2"]) == pytest.approx(final_eval(ddp_run), rel=1e-4)


@pytest.mark.parametrize("stage", [2, 3])
def test_preempt_and_resume_reproduces_the_uninterrupted_run(tmp_path, zero_runs, stage):
    """Exactness: with DeepSpeed's own checkpoint (module, partitioned fp32 optimizer state,
    scheduler) plus our data position and RNG, every logged loss and the final weights are bitwise
    equal to the uninterrupted run on CPU."""
    spec = doc(tmp_path / "runs", stage=stage)
    first, run_dir = submit(tmp_path, spec, "--new", env={"HPCGPU_SIGNAL_AT": "5:1"})  # stops after 6
    assert first.returncode == 75, first.stderr[-3000:]
    assert (run_dir / "checkpoints" / "step-00000006" / "deepspeed").is_dir()
    if stage == 2:  # at another width: one line before any job, the run left as it was
        written = (run_dir / "spec.yaml").read_text()
        other, _ = submit(tmp_path, spec, "--gpus", "1")
        lines = [line for line in other.stderr.splitlines() if "resumes only at that width" in line]
        assert other.returncode == 2 and len(lines) == 1, other.stderr[-2000:]
        assert "DeepSpeed at 2 GPU(s)" in lines[0] and "not at 1" in lines[0], lines
        assert (run_dir / "spec.yaml").read_text() == written and len(list(run_dir.parent.iterdir())) == 1
    second, again = submit(tmp_path, spec)
    assert second.returncode == 0, second.stderr[-3000:]
    assert again == run_dir
    assert_resumed(run_dir)
    baseline = zero_runs[str(stage)]
    assert step_losses(run_dir) == step_losses(baseline)
    a, b = weights(run_dir), weights(baseline)
    assert a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a)


def test_user_json_merges_and_a_conflict_is_one_clear_error(tmp_path):
    cfg = tmp_path / "ds.json"
    cfg.write_text(json.dumps({"train_batch_size": 16, "zero_optimization": {"stage": 2}}))
    spec = doc(tmp_path / "runs")
    spec["distributed"]["deepspeed"]["config"] = str(cfg)
    proc, _ = submit(tmp_path, spec, "--new")
    assert proc.returncode == 2
    err = [line for line in (proc.stdout + proc.stderr).splitlines() if "train_batch_size" in line]
    assert err and "16" in err[0] and "8" in err[0]


def bf16_plan(spec, world: int = 2):  # type: ignore[no-untyped-def]
    """The run plan of `spec` on `world` CPU ranks, with bf16 autocast (as on a GPU that has it)."""
    from dataclasses import replace

    from hpcgpu.runtime.plan import plan_train

    plan = plan_train(spec, world, device_type="cpu", gpu_memory=None, bf16_supported=False)
    assert (plan.training.micro_batch, plan.training.accum) == (2, 2)
    return replace(plan, precision="bf16")


def test_generated_config_follows_the_global_batch_rule():
    from hpcgpu.runtime.strategies.deepspeed import generated_config, merged_config
    from hpcgpu.spec import spec_from_raw

    spec = spec_from_raw({**doc(Path("/tmp"), stage=3, offload=True), "runs_dir": "/tmp"})
    cfg = generated_config(spec, bf16_plan(spec))
    assert cfg["train_batch_size"] == 8 == spec.train.global_batch_size
    assert cfg["zero_optimization"]["stage"] == 3
    assert cfg["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    assert cfg["bf16"]["enabled"] and not cfg["fp16"]["enabled"]
    assert cfg["gradient_clipping"] == spec.train.grad_clip
    assert merged_config(spec, cfg) == cfg  # no user file: nothing changes


def test_auto_in_the_user_json_keeps_what_the_spec_derived(tmp_path):
    """"auto" is DeepSpeed's word for "fill it in": nested ones must not replace the spec's values
    (a literal "auto" stage would quietly become ZeRO-0)."""
    from hpcgpu.runtime.strategies.deepspeed import generated_config, merged_config
    from hpcgpu.spec import spec_from_raw

    user = tmp_path / "ds.json"
    user.write_text(json.dumps({"train_batch_size": "auto", "bf16": {"enabled": "auto"},
                                "zero_optimization": {"stage": "auto", "overlap_comm": False}}))
    raw = doc(Path("/tmp"), stage=3)
    raw["distributed"]["deepspeed"]["config"] = str(user)
    spec = spec_from_raw({**raw, "runs_dir": "/tmp"})
    cfg = generated_config(spec, bf16_plan(spec))
    merged = merged_config(spec, cfg)
    assert merged["zero_optimization"]["stage"] == 3 and merged["zero_optimization"]["overlap_comm"] is False
    assert merged["bf16"]["enabled"] is True and merged["train_batch_size"] == 8


@pytest.mark.parametrize("strategy", ["ddp", "deepspeed"])
def test_the_same_spec_scaled_down_to_one_gpu_runs(tmp_path, ddp_run, strategy):
    """`--gpus 1` of a ddp or ZeRO-2 spec trains alone (no DDP wrapper; DeepSpeed gets a one-rank
    group) and, with the same global batch, follows the 2-rank DDP loss curve."""
    proc, run_dir = submit(tmp_path, doc(tmp_path / "runs", strategy=strategy), "--new", "--gpus", "1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    one, two = step_losses(run_dir), step_losses(ddp_run)
    assert one.keys() == two.keys()
    for step in one:
        assert one[step] == pytest.approx(two[step], rel=1e-4), step


def test_lora_under_zero2_follows_ddp_and_resumes_from_a_checkpoint_without_the_base(tmp_path):
    """train.lora under DeepSpeed ZeRO-2: DDP's loss curve; a preempted run resumes from DeepSpeed's
    checkpoint, which holds the adapters only, and ends on DDP's curve."""
    import torch

    lora = {"lora": {"r": 4, "alpha": 8, "dropout": 0.0}}
    for folder in ("ddp", "z2"):
        (tmp_path / folder).mkdir()
    ddp, ddp_dir = submit(tmp_path / "ddp", doc(tmp_path / "ddp" / "runs", strategy="ddp", **lora), "--new")
    assert ddp.returncode == 0, ddp.stderr[-3000:]
    spec = doc(tmp_path / "z2" / "runs", **lora)
    first, run_dir = submit(tmp_path / "z2", spec, "--new", env={"HPCGPU_SIGNAL_AT": "5:1"})  # stops after 6
    assert first.returncode == 75, first.stderr[-3000:]
    (states,) = (run_dir / "checkpoints" / "step-00000006" / "deepspeed").rglob("*model_states.pt")
    module = torch.load(states, map_location="cpu", weights_only=False)["module"]
    # DeepSpeed keeps a frozen weight under its second name (the head tied to the embeddings), unlike our
    # DCP payload (runtime/strategies/base.py drops it): documented in docs/fine-tuning.md
    assert module and all("lora_" in k or k.endswith("lm_head.weight") for k in module), list(module)
    second, again = submit(tmp_path / "z2", spec)
    assert second.returncode == 0 and again == run_dir, second.stderr[-3000:]
    assert_resumed(run_dir)
    z, d = step_losses(run_dir), step_losses(ddp_dir)
    assert z.keys() == d.keys() and all(z[s] == pytest.approx(d[s], rel=1e-4) for s in z), (z, d)
    assert (run_dir / "model" / "adapter_config.json").is_file()
