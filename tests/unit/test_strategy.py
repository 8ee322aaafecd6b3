"""runtime/strategy.py: the DDP arguments each loop gets from distributed.ddp."""
from __future__ import annotations

from hpcgpu.runtime.strategy import ddp_options
from hpcgpu.spec import spec_from_raw


def spec_of(ddp: dict | None = None):  # type: ignore[no-untyped-def]
    return spec_from_raw({"name": "s", "task": "train", "model": {"config": {"model_type": "gpt2"}},
                          "data": {"train": __file__}, "distributed": {"strategy": "ddp", "ddp": ddp or {}}})


def test_the_compiled_train_loop_gets_large_buckets_and_every_other_loop_torchs() -> None:
    # a compiled model is split into a graph per bucket: fewer, larger buckets launch fewer graphs
    assert ddp_options(spec_of(), own_loop=True, compiled=True)["bucket_cap_mb"] == 100
    assert ddp_options(spec_of(), own_loop=True, compiled=False)["bucket_cap_mb"] == 25
    assert ddp_options(spec_of())["bucket_cap_mb"] == 25  # ctx.prepare: the user's loop, compiled or not
    assert ddp_options(None)["bucket_cap_mb"] == 25


def test_a_bucket_size_given_in_the_spec_is_passed_as_written() -> None:
    assert ddp_options(spec_of({"bucket_cap_mb": 7}), own_loop=True, compiled=True)["bucket_cap_mb"] == 7
