"""The built-in train task's features: gradient checkpointing, train.epochs, early stopping, the
out-of-memory fallback of micro_batch_size: auto (CPU ranks; the OOM is the HPCGPU_OOM_AT_MICRO drill)
and train.profile.

The runs are started together (submit_all); each is the tiny GPT-2 of conftest for a few steps.
"""
from __future__ import annotations

import json
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest

from conftest import EVAL_TEXT, only_run_dir, submit, submit_all, train_records, train_spec, \
    write_spec_file
from resumes import assert_resumed
from hpcgpu.errors import HpcgpuError
from hpcgpu.gpu.estimate import DDP, GiB, activation_bytes, dims_from_config, estimate, with_checkpointing
from hpcgpu.gpu.recommend import recommend
from hpcgpu.runtime.plan import halved_micro, is_oom_successor, plan_train
from hpcgpu.spec import spec_from_raw

GPT2 = {"model_type": "gpt2"}
STEPS = 4


# ---------------------------------------------------------------- pure: estimate, plan, spec checks

def test_checkpointing_lowers_the_activation_figure_by_the_stated_formula() -> None:
    d = dims_from_config(GPT2, 1024)
    s, b, h, layers, vocab = 1024, 8, 768, 12, 50257
    full, ckpt = activation_bytes(d, b), activation_bytes(d, b, with_checkpointing(DDP))
    # every layer's fp32 input + one layer's activations (34 sbh compiled) + the logits
    assert ckpt == layers * s * b * h * 4 + s * b * h * 34 + b * s * vocab * 10
    assert ckpt < full
    assert estimate(d, with_checkpointing(DDP), b, 1).total < estimate(d, DDP, b, 1).total


def test_auto_tries_checkpointing_before_the_next_strategy() -> None:
    xl = dims_from_config({"model_type": "gpt2", "n_layer": 48, "n_embd": 1600, "n_head": 25}, 1024)
    # DDP's states (1.56B x 22 B = 32 GiB) fit 48 GiB; micro 8 does not without checkpointing, does with it
    plain = recommend(xl, 48 * GiB, world=4, global_batch=64, micro=8)
    assert not plain.fits
    rec = recommend(xl, 48 * GiB, world=4, global_batch=64, micro=8, checkpointing="auto")
    assert (rec.strategy, rec.zero_stage, rec.checkpointing, rec.fits) == ("ddp", None, True, True)
    assert "ddp needs" in rec.reason and "+ gradient checkpointing" in rec.summary()
    # with an auto micro batch a smaller micro batch without checkpointing comes first
    free = recommend(xl, 48 * GiB, world=4, global_batch=64, checkpointing="auto")
    assert (free.strategy, free.checkpointing, free.micro_batch) == ("ddp", False, 4)


def tiny_raw(**train) -> dict:  # type: ignore[no-untyped-def]
    return train_spec("feat", resources={"gpus": 2, "cpus_per_gpu": 1}, train=train)


def test_epochs_derive_the_step_count_in_the_plan() -> None:
    raw = tiny_raw(epochs=3, max_steps=None)
    plan = plan_train(spec_from_raw(raw), 2, device_type="cpu", gpu_memory=None, bf16_supported=False,
                      num_sequences=433).training
    assert (plan.max_steps, plan.epochs, plan.steps_per_epoch) == (3 * (433 // 8), 3, 54)
    assert plan_train(spec_from_raw(tiny_raw()), 2, device_type="cpu", gpu_memory=None,
                      bf16_supported=False).training.max_steps == 12


@pytest.mark.parametrize("train,data,needle", [
    ({"epochs": 2, "max_steps": 10}, {}, "train.epochs: give train.max_steps (10) or train.epochs (2), not both"),
    ({"early_stopping": {"patience": 2}, "eval_every": 2}, {}, "train.early_stopping: needs data.eval"),
    ({"early_stopping": {"patience": 2}}, {"eval": str(EVAL_TEXT)}, "needs train.eval_every"),
])
def test_spec_checks_are_one_error(train: dict, data: dict, needle: str) -> None:
    with pytest.raises(HpcgpuError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        spec_from_raw(train_spec("bad", train=train, data=data))


def test_a_quantized_model_in_a_train_spec_is_one_error_not_ignored() -> None:
    raw = train_spec("q")
    raw["model"]["quantization"] = "int8"
    with pytest.raises(HpcgpuError, match="model.quantization: a train spec trains quantized weights only through "
                                          "adapters: add train.lora"):
        spec_from_raw(raw)


def test_halving_keeps_the_global_batch_and_a_resume_prefers_the_halved_plan() -> None:
    plan = plan_train(spec_from_raw(tiny_raw(micro_batch_size="auto")), 2, device_type="cpu", gpu_memory=None,
                      bf16_supported=False)
    assert (plan.training.micro_batch, plan.training.accum) == (4, 1)
    half = halved_micro(plan, "out of memory")
    assert half is not None
    t = half.training
    assert (t.micro_batch, t.accum, t.oom_halvings, t.batch_per_rank) == (2, 2, 1, 4)
    assert is_oom_successor(half, plan) and not is_oom_successor(plan, half)
    assert not is_oom_successor(replace(half, world_size=4), plan)
    one = halved_micro(halved_micro(half, "again"), "once more")  # type: ignore[arg-type]
    assert one is None or one.training.micro_batch == 1
    three = replace(plan, train=replace(plan.training, batch_per_rank=6, micro_batch=3, accum=2))
    assert halved_micro(three, "x").training.micro_batch == 1  # type: ignore[union-attr]  # divides 6


# ---------------------------------------------------------------- jobs (CPU ranks)

def ranks2(name: str, **train) -> dict:  # type: ignore[no-untyped-def]
    return train_spec(name, train={"max_steps": STEPS, **train})


EARLY = {"max_steps": 20, "eval_every": 2, "eval_batches": 2, "early_stopping": {"patience": 2, "min_delta": 10.0}}


def early_spec(name: str, env: dict | None = None) -> dict:
    # min_delta 10: no eval can improve on the first one, so the run stops at the third eval (step 6),
    # with the step-2 model the best, while training went on with lr > 0 (the weights moved)
    spec = train_spec(name, resources={"gpus": 1}, data={"eval": str(EVAL_TEXT)}, train=EARLY,
                      checkpoint={"every_steps": 1, "keep": 1})
    return {**spec, "env": env} if env else spec


@pytest.fixture(scope="module")
def jobs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[subprocess.CompletedProcess, Path]]:
    """ref: 2 ranks, micro 2 x accum 2; gc: the same with gradient checkpointing; oom: micro auto (4 on
    CPU) with the drill failing any micro batch above 2; oomfixed: micro 4 fixed under the same drill;
    epochs: 1 rank, 2 epochs of 433 // 96 = 4 steps; early: early stopping, preempted at step 4 (an
    eval step: the eval there still counts); profile: 2 ranks profiling steps 2-3; profilelate: a
    window beyond its 3 steps."""
    drill = {"HPCGPU_OOM_AT_MICRO": "2"}
    specs = {
        "ref": ranks2("ref", gradient_checkpointing=False),
        "gc": ranks2("gc", gradient_checkpointing=True),
        "oom": {**ranks2("oom", micro_batch_size="auto"), "env": drill},
        "oomfixed": {**ranks2("oomfixed", micro_batch_size=4), "env": drill},
        "epochs": train_spec("epochs", resources={"gpus": 1}, checkpoint={"every_steps": 4},
                             train={"max_steps": None, "epochs": 2, "global_batch_size": 96, "micro_batch_size": 8}),
        "early": early_spec("early", env={"HPCGPU_SIGNAL_AT": "3"}),  # stops after step 4
        "profile": ranks2("profile", profile={"start_step": 2, "steps": 2}),
        "profilelate": train_spec("profilelate", resources={"gpus": 1},
                                  train={"max_steps": 3, "profile": {"start_step": 5, "steps": 2}}),
    }
    folders = {key: tmp_path_factory.mktemp(key) for key in specs}
    paths = {key: (write_spec_file(folders[key], spec), ()) for key, spec in specs.items()}
    results = submit_all(paths, timeout=300)
    return {key: (results[key], folders[key]) for key in specs}


def finished(job: tuple[subprocess.CompletedProcess, Path], name: str) -> Path:
    proc, folder = job
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}"
    return only_run_dir(folder / "runs", name)


def losses(run_dir: Path) -> list[float]:
    return [r["loss"] for r in train_records(run_dir)]


def records(run_dir: Path, kind: str) -> list[dict]:
    return [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if r["kind"] == kind]


def plan_of(run_dir: Path) -> dict:
    return json.loads((run_dir / "plan.json").read_text())["train"]


@pytest.mark.slow
def test_gradient_checkpointing_gives_the_same_losses_and_is_recorded(jobs: dict) -> None:
    ref, gc = finished(jobs["ref"], "ref"), finished(jobs["gc"], "gc")
    assert plan_of(gc)["gradient_checkpointing"] is True and plan_of(ref)["gradient_checkpointing"] is False
    assert len(losses(gc)) == STEPS
    assert losses(gc) == pytest.approx(losses(ref), rel=1e-5)
    assert "gradient checkpointing" in (gc / "logs" / "rank-0.log").read_text()


@pytest.mark.slow
def test_epochs_stop_at_the_derived_step_count(jobs: dict) -> None:
    import torch

    run = finished(jobs["epochs"], "epochs")
    plan = plan_of(run)
    assert (plan["max_steps"], plan["epochs"], plan["steps_per_epoch"]) == (8, 2, 433 // 96)
    recs = train_records(run)
    assert [r["step"] for r in recs] == list(range(1, 9)) and {r["max_steps"] for r in recs} == {8}
    assert "step      8/8" in (run / "logs" / "rank-0.log").read_text()
    # the end of the first epoch: 4 global batches taken, the remainder (433 - 384) skipped next
    state = torch.load(run / "checkpoints" / "step-00000004" / "rank-0.pt", weights_only=False)
    assert state["trainer"]["data"] == {"epoch": 0, "offset": 384}


def dcp_model(path: Path, tmp: Path) -> dict:
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(str(path), str(tmp / "best.pt"))
    return torch.load(tmp / "best.pt", weights_only=False)["model"]


@pytest.mark.slow
def test_early_stopping_stops_keeps_the_best_apart_and_survives_a_resume(jobs: dict, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    proc, folder = jobs["early"]
    assert proc.returncode == 75, proc.stdout[-2000:] + proc.stderr[-2000:]  # the preemption drill at step 4
    again = submit(folder / "early.yaml")
    run = finished((again, folder), "early")
    assert [r["step"] for r in records(run, "resume")] == [4]
    assert_resumed(run)
    assert [r["step"] for r in records(run, "eval")] == [2, 4, 6]  # no final eval after the stop
    stop = records(run, "early_stop")
    assert len(stop) == 1 and (stop[0]["step"], stop[0]["best_step"]) == (6, 2)
    assert train_records(run)[-1]["step"] == 6
    end = records(run, "end")[-1]
    assert end["early_stopped"] is True and end["best_step"] == 2
    assert "early stopping at step 6 of 20" in (run / "logs" / "rank-0.log").read_text()
    ckpts = run / "checkpoints"
    # keep 1: best is not rotated out (the stop at step 6 is a finish: no checkpoint there)
    assert sorted(p.name for p in ckpts.iterdir()) == ["best", "step-00000005"]
    marker = json.loads((ckpts / "best" / "COMPLETE").read_text())
    assert marker["step"] == 2 and marker["eval_loss"] == pytest.approx(records(run, "eval")[0]["loss"])
    best, final = dcp_model(ckpts / "best", tmp_path), load_file(str(run / "model" / "model.safetensors"))
    last = dcp_model(ckpts / "step-00000005", tmp_path)
    for key, value in final.items():
        assert value.equal(best[key]), key
    assert any(not final[k].equal(last[k]) for k in final)  # training went on after the best


@pytest.mark.slow
def test_out_of_memory_halves_the_micro_batch_records_it_and_keeps_the_curve(jobs: dict) -> None:
    ref, oom = finished(jobs["ref"], "ref"), finished(jobs["oom"], "oom")
    plan = plan_of(oom)
    assert (plan["micro_batch"], plan["accum"], plan["global_batch"], plan["oom_halvings"]) == (2, 2, 8, 1)
    assert [(r["micro_batch"], r["previous_micro_batch"]) for r in records(oom, "oom")] == [(2, 4)]
    log = (oom / "logs" / "rank-0.log").read_text()
    assert "out of memory in the first step on rank(s) 0, 1 at micro batch 4: micro batch 2 x accum 2" in log
    assert [r["step"] for r in train_records(oom)] == list(range(1, STEPS + 1))
    assert all(r["tokens"] == r["step"] * 8 * 64 for r in train_records(oom))
    assert losses(oom) == pytest.approx(losses(ref), rel=1e-5)  # as if started at micro 2


@pytest.mark.slow
def test_a_fixed_micro_batch_that_runs_out_of_memory_is_one_line(jobs: dict) -> None:
    proc, _ = jobs["oomfixed"]
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    errors = [line for line in out.splitlines() if "train.micro_batch_size: 4 does not fit in GPU memory" in line]
    assert len(errors) == 1 and errors[0].startswith("hpcgpu: error:"), out[-3000:]
    assert "on rank(s) 0, 1" in errors[0]  # both ranks agreed: neither waits for the other
    assert "`hpcgpu estimate` puts ddp at micro batch 4 at" in errors[0]


@pytest.mark.slow
def test_profile_writes_a_trace_and_a_summary_per_rank(jobs: dict) -> None:
    run = finished(jobs["profile"], "profile")
    for rank in (0, 1):
        trace = json.loads((run / "profile" / f"rank{rank}.trace.json").read_text())
        assert isinstance(trace["traceEvents"], list) and trace["traceEvents"]
        summary = (run / "profile" / f"rank{rank}.txt").read_text()
        assert summary.startswith(f"profile of steps 2-3 on rank {rank} (cpu") and "window: 2 step(s)" in summary
        assert "aten::" in summary  # the top ops
    assert [r["step"] for r in train_records(run)] == list(range(1, STEPS + 1))
    log = (run / "logs" / "rank-0.log").read_text()
    assert f"profile of steps 2-3: {run / 'profile' / 'rank0.txt'}, " in log


@pytest.mark.slow
def test_a_profile_window_beyond_the_run_is_one_warning_and_no_profile(jobs: dict) -> None:
    run = finished(jobs["profilelate"], "profilelate")
    assert (run / "FINISHED").exists() and not (run / "profile").exists()
    log = (run / "logs" / "rank-0.log").read_text()
    assert log.count("train.profile: steps 5-6 lie beyond this run's 3 steps; nothing is profiled") == 1
