"""train.gc_every: during the loop Python's automatic collection is off and every rank collects at the
same steps; afterwards it is automatic again; 0 leaves it automatic throughout."""
from __future__ import annotations

import gc
from typing import Any

import pytest

from hpcgpu.runtime.collector import StepCollector


@pytest.fixture
def collections() -> Any:
    seen: list[int] = []

    def count(phase: str, info: dict) -> None:
        if phase == "start":
            seen.append(info["generation"])

    gc.callbacks.append(count)
    yield seen
    gc.callbacks.remove(count)
    gc.enable()


def churn() -> None:
    """Allocations enough to start an automatic collection many times over (cycles: gen 0 fills up)."""
    for _ in range(20_000):
        a: list = []
        a.append(a)


def test_the_loop_collects_at_its_steps_only_and_leaves_gc_automatic_after(collections: list[int]) -> None:
    c = StepCollector(3)
    c.start()
    assert not gc.isenabled() and collections == [1]  # one collection as the loop starts
    for step in range(1, 8):
        churn()
        c.after_step(step)
    assert collections == [1, 1, 1]  # steps 3 and 6: nothing in between, however much was allocated
    c.close()
    assert gc.isenabled()
    churn()
    assert len(collections) > 3  # automatic again


def test_zero_leaves_python_in_charge(collections: list[int]) -> None:
    c = StepCollector(0)
    c.start()
    assert gc.isenabled()
    churn()
    c.after_step(50)
    c.close()
    assert collections and all(g == 0 for g in collections[:3])  # Python's own (young) collections
