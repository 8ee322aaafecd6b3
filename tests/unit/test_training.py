"""runtime/training.py: ctx.prepare and task: train build the same wrap from the same plan path, and
every task leaves through runtime/stop.py's one stop record."""
from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
import torch

from hpcgpu.contract import ENV_SIGNAL_AT, EXIT_STOPPED
from hpcgpu.runtime.context import Context
from hpcgpu.runtime.env import DistEnv
from hpcgpu.runtime.metrics import MetricsWriter
from hpcgpu.runtime.plan import plan_own_loop, plan_train
from hpcgpu.runtime.stop import StopNote, inject_signal, stop_job
from hpcgpu.runtime.strategies import strategy_for
from hpcgpu.runtime.training import Training
from test_prepare import one_rank_group, spec_of  # noqa: F401 (one_rank_group: a fixture)


@pytest.mark.parametrize("strategy", ["auto", "ddp", "none"])
def test_the_users_loop_plans_strategy_precision_and_batch_as_the_train_task(strategy: str) -> None:
    world = 1 if strategy == "none" else 2
    spec = spec_of(distributed={"strategy": strategy}, train={"global_batch_size": 12, "max_steps": 3})
    own = plan_own_loop(spec, world, device_type="cpu", bf16_supported=False)
    task = plan_train(spec, world, device_type="cpu", gpu_memory=None, bf16_supported=False)
    assert (own.training.strategy, own.precision, own.training.batch_per_rank) == \
        (task.training.strategy, task.precision, task.training.batch_per_rank)
    assert (own.training.micro_batch, own.training.accum) == (own.training.batch_per_rank, 1)  # ctx.step steps


def test_ctx_prepare_and_the_trainers_training_wrap_alike(tmp_path: Path, one_rank_group: None) -> None:
    """The same spec gives the same DDP wrap; only gradient_as_bucket_view (auto) follows who drives."""
    spec = spec_of(distributed={"ddp": {"bucket_cap_mb": 7, "find_unused_parameters": True}})
    env = DistEnv(rank=0, local_rank=0, world_size=2, local_world_size=2)
    ctx = Context(env=env, spec=spec, run_dir=tmp_path, device=torch.device("cpu"))
    net = torch.nn.Linear(3, 2)
    users, _ = ctx.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
    assert isinstance(ctx.training, Training) and ctx.plan is ctx.training.plan
    module = torch.nn.Linear(3, 2)
    cpu = torch.device("cpu")
    trainers = Training(spec, ctx.plan, cpu, module, torch.optim.SGD(module.parameters(), lr=0.1),
                        strategy=strategy_for(ctx.plan, spec, cpu), own_loop=True).wrap()
    for ddp in (users, trainers):
        assert (ddp.bucket_bytes_cap, ddp.find_unused_parameters) == (7 * 2**20, True)
    assert (users.gradient_as_bucket_view, trainers.gradient_as_bucket_view) == (False, True)


def test_the_one_stop_writes_one_record_and_returns_75(tmp_path: Path) -> None:
    spec = spec_of()
    metrics = MetricsWriter(tmp_path / "metrics.jsonl")
    note = StopNote({"step": 4}, "stopped at step 4 with a checkpoint", {"saved": True})
    assert stop_job(spec, DistEnv(), tmp_path, signal.SIGUSR1, note, metrics) == EXIT_STOPPED
    metrics.close()
    [record] = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    record.pop("time")
    assert list(record.items()) == [("kind", "stop"), ("step", 4), ("reason", "preempted"),
                                    ("restart_count", 0), ("saved", True)]


def test_the_signal_drill_fires_only_armed_at_its_count(monkeypatch: pytest.MonkeyPatch) -> None:
    sent: list[int] = []
    monkeypatch.setattr(os, "kill", lambda pid, signum: sent.append(signum))
    monkeypatch.setenv(ENV_SIGNAL_AT, "3:1")
    spec = spec_of()
    inject_signal(spec, 1, 2)
    inject_signal(spec, 0, 3)  # another rank
    inject_signal(spec, 1, 3, armed=False)  # where a resumed run must go on
    assert sent == []
    inject_signal(spec, 1, 3)
    assert len(sent) == 1
