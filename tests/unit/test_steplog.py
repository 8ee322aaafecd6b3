"""StepLog's pending records (the GPU path's ordering and timing) with a fake timeline, on CPU."""
from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from hpcgpu.runtime.steplog import HostMarks, StepLog


class FakeMarks:
    """A GPU timeline by hand: mark n is at `at[n]` ms, done once `reached` passes it."""

    def __init__(self) -> None:
        self.at: list[float] = []
        self.reached = -1
        self.now = 0.0

    def mark(self) -> int:
        self.at.append(self.now)
        return len(self.at) - 1

    def done(self, mark: Any) -> bool:
        return mark <= self.reached

    def wait(self, mark: Any) -> None:
        self.reached = max(self.reached, mark)

    def elapsed_ms(self, start: Any, end: Any) -> float:
        assert self.done(end), "timed before its end was done"
        return self.at[end] - self.at[start]


class Metrics:
    def __init__(self) -> None:
        self.records: list[dict[str, Any]] = []

    def write(self, kind: str, **fields: Any) -> None:
        self.records.append({"kind": kind, **fields})


def trainer(step: int = 0, max_steps: int = 100) -> SimpleNamespace:
    return SimpleNamespace(device=torch.device("cpu"), tp=SimpleNamespace(tokens_per_step=10), step=step,
                           max_steps=max_steps, last_lr=0.0, tokens_seen=step * 10, flops_per_token=1.0, world=1)


def steplog(step: int = 0) -> tuple[StepLog, SimpleNamespace, FakeMarks, Metrics]:
    tr, marks, metrics = trainer(step), FakeMarks(), Metrics()
    return StepLog(tr, metrics, None, marks=marks), tr, marks, metrics  # type: ignore[arg-type]


def run_to(log: StepLog, tr: SimpleNamespace, marks: FakeMarks, step: int, ms_per_step: float = 10.0) -> None:
    """Steps up to `step`, each `ms_per_step` on the timeline; logs the last one (lr, tokens of that step)."""
    while tr.step < step:
        tr.step += 1
        tr.last_lr, tr.tokens_seen = tr.step / 1000, tr.step * 10
        marks.now += ms_per_step
    log.log(torch.tensor(float(tr.step)))


def test_in_order_only_complete_ones_at_poll_and_all_at_flush() -> None:
    log, tr, marks, metrics = steplog()
    run_to(log, tr, marks, 1)  # step 1 waits: written at once
    assert [r["step"] for r in metrics.records] == [1]
    for step in (5, 10, 15):
        run_to(log, tr, marks, step)
    assert [r["step"] for r in metrics.records] == [1], "nothing done yet: nothing written"
    marks.reached = 2  # the GPU passed step 5's mark (marks: 0 start, 1 step 1, 2 step 5, ...)
    log.poll()
    assert [r["step"] for r in metrics.records] == [1, 5]
    log.flush()
    recs = metrics.records
    assert [r["step"] for r in recs] == [1, 5, 10, 15]
    assert [(r["lr"], r["tokens"], r["loss"]) for r in recs] == [(s / 1000, s * 10, float(s)) for s in (1, 5, 10, 15)]
    assert [r["ms_per_step"] for r in recs] == pytest.approx([10.0] * 4)  # from the timeline, per step
    assert recs[1]["tokens_per_s"] == pytest.approx(1000.0)  # 10 tokens per 10 ms


def test_flush_without_wait_drops_what_is_not_done() -> None:
    log, tr, marks, metrics = steplog()
    run_to(log, tr, marks, 1)
    run_to(log, tr, marks, 5)
    run_to(log, tr, marks, 10)
    marks.reached = 2
    log.flush(wait=False)
    log.flush()
    assert [r["step"] for r in metrics.records] == [1, 5]


def test_excluded_time_leaves_its_own_interval(monkeypatch: pytest.MonkeyPatch) -> None:
    log, tr, marks, metrics = steplog()
    run_to(log, tr, marks, 1)
    run_to(log, tr, marks, 5)
    host_s = iter([7.0, 7.2])  # the host clock around the eval: 200 ms
    monkeypatch.setattr("hpcgpu.runtime.steplog.time", SimpleNamespace(perf_counter=lambda: next(host_s)))
    with log.not_step_time():
        marks.now += 200.0  # the eval, on the timeline between step 5's mark and step 10's
    run_to(log, tr, marks, 10)
    log.flush()
    assert [r["ms_per_step"] for r in metrics.records] == pytest.approx([10.0] * 3)


def test_first_interval_of_a_resumed_start_is_timed_from_construction() -> None:
    log, tr, marks, metrics = steplog(step=40)
    marks.now += 100.0  # start-up work on the timeline after the construction mark: part of the interval
    run_to(log, tr, marks, 50)
    log.flush()
    (r,) = metrics.records
    assert r["step"] == 50 and r["ms_per_step"] == pytest.approx(20.0) and r["tokens"] == 500


def test_last_step_waits() -> None:
    log, tr, marks, metrics = steplog()
    tr.max_steps = 10
    run_to(log, tr, marks, 5)
    run_to(log, tr, marks, 10)
    assert [r["step"] for r in metrics.records] == [5, 10]


def test_cpu_writes_at_once() -> None:
    log = StepLog(trainer(), Metrics(), None)  # type: ignore[arg-type]
    assert isinstance(log.marks, HostMarks)
    log.tr.step = 3
    log.log(torch.tensor(2.5))
    (r,) = log.metrics.records  # type: ignore[attr-defined]
    assert r["step"] == 3 and r["loss"] == 2.5 and r["ms_per_step"] > 0 and r["mfu"] is None
