"""distributed.strategy: fsdp (PyTorch FSDP2) on CPU ranks (gloo): the DDP loss curve, a final model
from_pretrained loads, sharded checkpoints that resume exactly at the same width and on the same curve at
another; ctx.prepare shards a user's model; what fsdp cannot run with is one line before anything starts."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader

from conftest import TINY_GPT2, job_env, merge, only_run_dir, step_losses, submit, submit_all, train_spec, write_spec_file
from resumes import assert_resumed

STEPS = 8
TWO_BLOCKS = {**TINY_GPT2, "n_layer": 2}  # sharded block by block: two blocks and the root


def fsdp_spec(strategy: str = "fsdp", **more: object) -> dict:
    return merge(train_spec("shard", model={"config": TWO_BLOCKS}, train={"max_steps": STEPS},
                            distributed={"strategy": strategy}), more)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The same spec under ddp and fsdp at 2 ranks, run to the end side by side; `fsdp-kept` keeps the
    gathered weights until the backward and recomputes each block's activations."""
    root = tmp_path_factory.mktemp("fsdp")
    specs = {"ddp": fsdp_spec("ddp"), "fsdp": fsdp_spec(),
             "fsdp-kept": fsdp_spec(distributed={"fsdp": {"reshard_after_forward": False}},
                                    train={"gradient_checkpointing": True})}
    jobs = {name: (write_spec_file(root / name, spec), ()) for name, spec in specs.items()}
    done = submit_all(jobs)
    for name, proc in done.items():
        assert proc.returncode == 0, (name, proc.stderr[-3000:])
    return {name: only_run_dir(root / name / "runs", "shard") for name in jobs}


def test_two_fsdp_ranks_follow_the_ddp_curve_and_leave_a_model_that_loads(uninterrupted: dict[str, Path]) -> None:
    fsdp, ddp = uninterrupted["fsdp"], uninterrupted["ddp"]
    assert json.loads((fsdp / "plan.json").read_text())["train"]["strategy"] == "fsdp"
    got, want = step_losses(fsdp), step_losses(ddp)
    assert got.keys() == want.keys() == set(range(1, STEPS + 1))
    for step in want:  # one fp32 arithmetic; a reduce-scatter sums the gradients in another grouping
        assert got[step] == pytest.approx(want[step], rel=1e-5), (step, got, want)
    from transformers import AutoModelForCausalLM

    ids = torch.arange(40).reshape(2, 20) % 256
    with torch.no_grad():
        sharded = AutoModelForCausalLM.from_pretrained(fsdp / "model").eval()(ids).logits
        whole = AutoModelForCausalLM.from_pretrained(ddp / "model").eval()(ids).logits
    assert torch.allclose(sharded, whole, atol=1e-4), (sharded - whole).abs().max()


def test_fsdp_without_resharding_and_with_checkpointing_follows_the_same_curve(uninterrupted: dict[str, Path]) -> None:
    run = uninterrupted["fsdp-kept"]
    plan = json.loads((run / "plan.json").read_text())["train"]
    assert plan["strategy"] == "fsdp" and plan["gradient_checkpointing"] is True, plan
    got, want = step_losses(run), step_losses(uninterrupted["ddp"])
    assert got.keys() == want.keys() == set(range(1, STEPS + 1))
    for step in want:  # a recomputed forward is the same arithmetic; only the reduce's grouping differs
        assert got[step] == pytest.approx(want[step], rel=1e-5), (step, got, want)


@pytest.mark.parametrize("after", [2, 1])
def test_a_stopped_fsdp_run_resumes_from_its_shards(tmp_path: Path, uninterrupted: dict[str, Path], after: int) -> None:
    """Stopped after step 4 at 2 ranks: each rank wrote its own shard; resumed at 2 ranks the run is the
    uninterrupted one exactly, at 1 rank (DCP reshards) the same curve."""
    spec = write_spec_file(tmp_path, fsdp_spec())
    stopped = submit(spec, "--gpus", "2", env=job_env(HPCGPU_SIGNAL_AT="3"))
    assert stopped.returncode == 75, stopped.stderr[-3000:]
    run_dir = only_run_dir(tmp_path / "runs", "shard")
    (step_dir,) = (run_dir / "checkpoints").glob("step-*")
    (meta,) = step_dir.rglob(".metadata")
    saved = FileSystemReader(str(meta.parent)).read_metadata().state_dict_metadata
    chunks = {key: len(m.chunks) for key, m in saved.items() if key.startswith("model.") and hasattr(m, "chunks")}
    assert chunks and all(n == 2 for n in chunks.values()), chunks  # every weight in two shards, one per rank
    again = submit(spec, "--gpus", str(after))
    assert again.returncode == 0, again.stderr[-3000:]
    if after == 1:
        assert "from step 4 at 1 GPUs (it ran at 2; the global batch stays 8)" in again.stderr, again.stderr[-2000:]
    assert_resumed(run_dir)
    got, want = step_losses(run_dir), step_losses(uninterrupted["fsdp"])
    assert got.keys() == want.keys()
    for step in want:
        if after == 2:
            assert got[step] == want[step], (step, got, want)
        else:
            assert got[step] == pytest.approx(want[step], rel=1e-5), (step, got, want)


USER_LOOP = """
import torch, hpcgpu
ctx = hpcgpu.init()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ModuleList([torch.nn.Linear(16, 16)]), torch.nn.Linear(16, 1))
model.forward = lambda x: model[2](model[1][0](model[0](x)))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
model, opt = ctx.prepare(model, opt)
x = torch.randn(4, 8, generator=torch.Generator().manual_seed(ctx.rank))
seen = []
for _ in range(5):
    loss = model(x).pow(2).mean()
    ctx.backward(loss)
    ctx.step()
    seen.append(float(loss))
kinds = sorted({type(p).__name__ for p in model.parameters()})
print("RESULT", ctx.rank, kinds, seen[-1] < seen[0], flush=True)
"""


def test_ctx_prepare_shards_a_users_model_and_its_optimizer_steps_the_shards(tmp_path: Path) -> None:
    script = tmp_path / "loop.py"
    script.write_text(USER_LOOP)
    doc = {"name": "own", "task": "command", "command": [sys.executable, str(script)],
           "resources": {"gpus": 2, "cpus_per_gpu": 1}, "distributed": {"strategy": "fsdp"},
           "train": {"precision": "fp32"}}
    proc = submit(write_spec_file(tmp_path, doc))
    assert proc.returncode == 0, proc.stderr[-3000:]
    logs = "".join(p.read_text() for p in only_run_dir(tmp_path / "runs", "own").glob("logs/*"))
    results = sorted(line.split("RESULT ", 1)[1] for line in logs.splitlines() if "RESULT " in line)
    # every parameter a shard (DTensor), and the optimizer made before ctx.prepare steps them: the loss falls
    assert results == ["0 ['DTensor'] True", "1 ['DTensor'] True"], proc.stderr[-3000:]


@pytest.mark.parametrize("more, key", [
    ({"train": {"precision": "fp16"}}, "train.precision"),
    ({"train": {"fused_loss": True}}, "train.fused_loss"),
    ({"train": {"compile": True, "compile_mode": "reduce-overhead"}}, "train.compile_mode"),
    ({"train": {"lora": {"r": 4}}}, "train.lora"),
])
def test_what_fsdp_cannot_run_with_is_one_line(tmp_path: Path, more: dict, key: str) -> None:
    spec = write_spec_file(tmp_path, fsdp_spec(**more))
    proc = subprocess.run([sys.executable, "-m", "hpcgpu", "validate", str(spec)], capture_output=True, text=True,
                          timeout=60, env=job_env())
    assert proc.returncode == 2 and key in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert not (tmp_path / "runs").exists()


def test_blocks_are_the_models_own_unit_and_cpu_offload_needs_gpus() -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    from hpcgpu.errors import HpcgpuError
    from hpcgpu.runtime.strategies.fsdp import fsdp_kwargs, transformer_blocks
    from hpcgpu.spec.schema import Fsdp

    gpt2 = AutoModelForCausalLM.from_config(AutoConfig.for_model(**TWO_BLOCKS))
    assert [type(b).__name__ for b in transformer_blocks(gpt2)] == ["GPT2Block", "GPT2Block"]
    mine = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ModuleList(torch.nn.Linear(2, 2) for _ in range(3)))
    assert len(transformer_blocks(mine)) == 3  # a model of yours: each entry of its ModuleLists
    with pytest.raises(HpcgpuError, match="distributed.fsdp.cpu_offload: the ranks run on CPUs already"):
        fsdp_kwargs(Fsdp(cpu_offload=True), "fp32", torch.device("cpu"))
