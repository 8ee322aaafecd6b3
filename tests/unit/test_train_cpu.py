"""task: train on CPU ranks through the local executor (real processes, gloo, DDP).

One 2-rank run is shared by several tests; the others start their own small runs. Each run is a
tiny GPT-2 (1 layer, 32 wide, bytes as tokens, no dropout) for a few seconds.
"""
from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path

import pytest

from conftest import EVAL_TEXT, only_run_dir, submit, submit_all, train_records, train_spec, write_spec_file

pytestmark = pytest.mark.slow

STEPS = 12
DDP_OPTIONS = {"bucket_cap_mb": 1, "gradient_as_bucket_view": True, "static_graph": True}


def losses(run_dir: Path) -> list[float]:
    recs = train_records(run_dir)
    assert [r["step"] for r in recs] == list(range(1, len(recs) + 1)), "one train record per step (log_every 1)"
    return [r["loss"] for r in recs]


def run_train(folder: Path, spec: dict, *args: str) -> Path:
    path = write_spec_file(folder, spec)
    proc = submit(path, *args)
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    return only_run_dir(folder / "runs", spec["name"])


def succeeded(job: tuple[subprocess.CompletedProcess, Path], name: str) -> Path:
    proc, folder = job
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    return only_run_dir(folder / "runs", name)


@pytest.fixture(scope="module")
def jobs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[subprocess.CompletedProcess, Path]]:
    """Every independent run of this module, started together (the runs are mostly start-up time).

    ddp:     the reference, 2 CPU ranks, global batch 8 = micro 2 x accum 2 x 2 ranks, 12 steps
    one:     the same spec with --gpus 1 (micro 2 x accum 4)
    micro4/micro1: 1 rank, 8 steps, micro batch 4 vs 1
    nodata/smallvocab: bad inputs
    """
    specs = {
        "ddp": (train_spec("ddp", train={"max_steps": STEPS}), ()),
        "one": (train_spec("ddp", train={"max_steps": STEPS}), ("--gpus", "1")),
        "ddpopts": (train_spec("ddp", train={"max_steps": STEPS, "micro_batch_size": 4},
                               distributed={"ddp": DDP_OPTIONS}), ()),
        "staticaccum": (train_spec("ddp", train={"max_steps": 2}, distributed={"ddp": {"static_graph": True}}), ()),
        "micro4": (train_spec("micro4", resources={"gpus": 1}, train={"max_steps": 8, "micro_batch_size": 4}), ()),
        "micro1": (train_spec("micro1", resources={"gpus": 1}, train={"max_steps": 8, "micro_batch_size": 1}), ()),
        "smallvocab": (train_spec("smallvocab", resources={"gpus": 1}, model={"config": {"vocab_size": 100}}), ()),
    }
    nodata = tmp_path_factory.mktemp("nodata")
    specs["nodata"] = (train_spec("nodata", resources={"gpus": 1}, data={"train": str(nodata / "missing.txt")}), ())
    folders = {key: nodata if key == "nodata" else tmp_path_factory.mktemp(key) for key in specs}
    paths = {key: (write_spec_file(folders[key], spec), args) for key, (spec, args) in specs.items()}
    results = submit_all(paths, timeout=240)
    return {key: (results[key], folders[key]) for key in specs}


@pytest.fixture(scope="module")
def ddp_run(jobs: dict) -> Path:
    return succeeded(jobs["ddp"], "ddp")


def test_two_rank_training_lowers_the_loss(ddp_run: Path) -> None:
    recs = train_records(ddp_run)
    assert [r["step"] for r in recs] == list(range(1, STEPS + 1))
    for r in recs:
        assert math.isfinite(r["loss"]) and r["lr"] > 0 and r["ms_per_step"] > 0 and r["tokens_per_s"] > 0
        assert r["tokens"] == r["step"] * 8 * 64
    first, last = recs[0]["loss"], recs[-1]["loss"]
    assert first > 5.0  # about ln(256) = 5.55 for a random byte model
    assert last < first - 0.6, f"loss {first:.3f} -> {last:.3f}: not learning"


def test_the_start_up_is_broken_down_once_up_to_the_first_step(ddp_run: Path) -> None:
    recs = [json.loads(line) for line in (ddp_run / "metrics.jsonl").read_text().splitlines()]
    (start,) = [r for r in recs if r["kind"] == "startup"]
    phases = {k: v for k, v in start.items() if k.endswith("_s") and k != "total_s"}
    assert list(phases) == ["interpreter_and_imports_s", "process_group_s", "data_s", "plan_s", "model_s",
                            "resume_s", "first_step_s"]
    assert all(v >= 0 for v in phases.values()) and start["total_s"] == pytest.approx(sum(phases.values()))
    assert phases["interpreter_and_imports_s"] > 0  # python and torch load before hpcgpu's code runs
    # measured from the process's own start, and done before step 1's record is written
    first = train_records(ddp_run)[0]
    assert start["step"] == 1 and start["process_start"] + start["total_s"] <= first["time"] + 0.01
    assert "start-up: " in (ddp_run / "logs" / "rank-0.log").read_text()


def test_run_dir_holds_logs_of_every_rank(ddp_run: Path) -> None:
    rank0 = (ddp_run / "logs" / "rank-0.log").read_text()
    assert (ddp_run / "logs" / "rank-1.log").exists()
    assert f"step {STEPS:>6}/{STEPS}" in rank0  # rank 0 logs every step
    assert "Traceback" not in rank0


def test_saved_model_loads_with_transformers_and_is_the_trained_one(ddp_run: Path) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(ddp_run / "model").eval()
    data = torch.tensor(list(EVAL_TEXT.read_bytes()[: 4 * 64])).reshape(4, 64)
    with torch.no_grad():
        out = model(input_ids=data, labels=data)
    assert out.logits.shape == (4, 64, 256)
    config = AutoConfig.from_pretrained(ddp_run / "model")
    torch.manual_seed(1)
    fresh = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        fresh_loss = fresh(input_ids=data, labels=data).loss.item()
    assert out.loss.item() < fresh_loss - 0.5  # the weights saved are the trained ones


def test_logged_lr_is_the_lr_the_step_used(ddp_run: Path) -> None:
    recs = train_records(ddp_run)
    assert recs[0]["lr"] == pytest.approx(1.5e-3)  # warmup: (0 + 1) / 2 of lr
    assert recs[1]["lr"] == pytest.approx(3.0e-3)


def test_one_and_two_ranks_follow_the_same_loss_curve(ddp_run: Path, jobs: dict) -> None:
    a, b = losses(ddp_run), losses(succeeded(jobs["one"], "ddp"))
    assert len(a) == len(b) == STEPS
    for step, (x, y) in enumerate(zip(a, b), 1):
        assert y == pytest.approx(x, rel=1e-4), f"step {step}: 2 ranks {x} vs 1 rank {y}"


def test_ddp_options_reach_the_wrapper_and_keep_the_loss_curve(ddp_run: Path, jobs: dict) -> None:
    run = succeeded(jobs["ddpopts"], "ddp")
    assert "DDP buckets 1 MiB, gradient_as_bucket_view, static_graph" in (run / "logs" / "rank-0.log").read_text()
    default = (ddp_run / "logs" / "rank-0.log").read_text()
    # auto: the train task's own loop takes gradients as bucket views (ctx.prepare does not: test_prepare)
    assert "DDP buckets 25 MiB, gradient_as_bucket_view" in default and "static_graph" not in default
    assert losses(run) == pytest.approx(losses(ddp_run), rel=1e-4)  # micro 4 x accum 1 vs micro 2 x accum 2


def test_static_graph_with_accumulation_is_one_clear_error(jobs: dict) -> None:
    proc, _ = jobs["staticaccum"]
    assert_one_line_error(proc, "distributed.ddp.static_graph: true does not work with gradient accumulation")


def test_micro_batch_size_does_not_change_the_loss_curve(jobs: dict) -> None:
    m4, m1 = losses(succeeded(jobs["micro4"], "micro4")), losses(succeeded(jobs["micro1"], "micro1"))
    assert len(m4) == len(m1) == 8
    for step, (x, y) in enumerate(zip(m4, m1), 1):
        assert y == pytest.approx(x, rel=1e-4), f"step {step}: micro 4 {x} vs micro 1 {y}"


def test_fine_tune_from_a_saved_model(ddp_run: Path, tmp_path: Path) -> None:
    spec = train_spec("finetune", resources={"gpus": 1}, train={"max_steps": 2})
    spec["model"] = {"name_or_path": str(ddp_run / "model")}
    tuned = losses(run_train(tmp_path, spec))
    fresh = losses(ddp_run)
    assert tuned[0] < fresh[0] - 0.6, f"initial loss {tuned[0]:.3f} from the saved model vs {fresh[0]:.3f} fresh"
    assert tuned[0] < fresh[-1] + 0.2  # it starts about where the first run ended


def assert_one_line_error(proc, needle: str) -> None:  # type: ignore[no-untyped-def]
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, f"exit {proc.returncode}\n{out}"
    assert "Traceback" not in out, out
    lines = [line for line in out.splitlines() if needle in line]
    assert len(lines) == 1 and lines[0].startswith("hpcgpu: error:"), out


def test_missing_data_file_exits_2_with_one_line(jobs: dict) -> None:
    proc, folder = jobs["nodata"]
    assert_one_line_error(proc, "data.train: file not found")
    assert str(folder / "missing.txt") in proc.stdout + proc.stderr


def test_vocab_too_small_for_byte_tokenizer_exits_2_with_one_line(jobs: dict) -> None:
    assert_one_line_error(jobs["smallvocab"][0], "vocab_size 100")


def test_a_gpt2_model_compiles_as_one_graph_with_the_same_loss(tmp_path: Path) -> None:
    """GPT2LMHeadModel's class name does not say its loss: transformers warns in its forward, which
    torch.compile turns into a graph break every step. The model hpcgpu builds names it: one graph,
    the same loss as the model transformers builds."""
    import torch
    import torch._dynamo
    from transformers import AutoModelForCausalLM

    from hpcgpu.runtime.model import build_model, config_of_spec
    from hpcgpu.spec import load_spec

    spec = load_spec(write_spec_file(tmp_path, train_spec("gpt2-graph")))
    x = torch.randint(0, 256, (2, 16))
    model = build_model(spec, 0)
    plain = AutoModelForCausalLM.from_config(config_of_spec(spec))
    plain.load_state_dict(model.state_dict())
    explained = torch._dynamo.explain(model)(input_ids=x, labels=x)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons
    assert torch._dynamo.explain(plain)(input_ids=x, labels=x).graph_break_count == 1  # what it fixes
    assert torch.equal(model(input_ids=x, labels=x).loss, plain(input_ids=x, labels=x).loss)


def test_the_step_loss_comes_from_the_logits_through_a_loss_compiled_apart(tmp_path: Path) -> None:
    """The compiled step runs the model without labels (one graph, no break) and its loss as a graph of
    its own (a hand-written loop ran 2% faster so on an H100 than with the loss compiled into the
    model's graph): the same loss as the model's own, compiled or not."""
    import torch
    import torch._dynamo

    from hpcgpu.runtime.model import build_model
    from hpcgpu.runtime.tasks.train import logits_loss
    from hpcgpu.spec import load_spec

    spec = load_spec(write_spec_file(tmp_path, train_spec("gpt2-loss")))
    x = torch.randint(0, 256, (2, 16))
    model = build_model(spec, 0)
    explained = torch._dynamo.explain(model)(input_ids=x)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons
    want = model(input_ids=x, labels=x).loss
    for compiled in (False, True):
        got = logits_loss(compiled)(model(input_ids=x).logits, x)
        assert got.item() == pytest.approx(want.item(), rel=1e-5)


def test_a_mixture_of_experts_model_keeps_its_router_loss_in_the_step_loss() -> None:
    """A forward without labels returns the router's load-balancing loss apart: the step adds it as
    Hugging Face does with labels (router_aux_loss_coef x aux_loss), so MoE training is unchanged."""
    import torch
    from transformers import MixtralConfig, MixtralForCausalLM

    from hpcgpu.runtime.tasks.train import logits_loss, model_loss

    torch.manual_seed(0)
    cfg = MixtralConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, vocab_size=128,
                        output_router_logits=True, router_aux_loss_coef=0.5)
    model = MixtralForCausalLM(cfg)
    x = torch.randint(0, 128, (2, 16))
    want = model(input_ids=x, labels=x).loss
    out = model(input_ids=x)
    assert out.aux_loss is not None and out.aux_loss.item() > 0
    got = model_loss(out, x, logits_loss(False), cfg.router_aux_loss_coef)
    assert got.item() == pytest.approx(want.item(), rel=1e-5)
    assert model_loss(out, x, logits_loss(False), 0.0).item() < got.item()
