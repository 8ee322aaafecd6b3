"""runtime/strategy.py: the DDP arguments each loop gets from distributed.ddp."""
from __future__ import annotations

from hpcgpu.runtime.strategy import ddp_options
from hpcgpu.spec import spec_from_raw


def spec_of(ddp: dict | None = None):  # type: ignore[no-untyped-def]
    return spec_from_raw({"name": "s", "task": "train", "model": {"config": {"model_type": "gpt2"}},
                          "data": {"train": __file__}, "distributed": {"strategy": "ddp", "ddp": ddp or {}}})


def test_a_compiled_model_gets_large_buckets_and_any_other_torchs() -> None:
    # a compiled model is split into a graph per bucket: fewer, larger buckets launch fewer graphs
    assert ddp_options(spec_of(), own_loop=True, compiled=True)["bucket_cap_mb"] == 100
    assert ddp_options(spec_of(), compiled=True)["bucket_cap_mb"] == 100  # ctx.prepare of a compiled model
    assert ddp_options(spec_of(), own_loop=True, compiled=False)["bucket_cap_mb"] == 25
    assert ddp_options(spec_of())["bucket_cap_mb"] == 25
    assert ddp_options(None)["bucket_cap_mb"] == 25


def test_ctx_prepare_sees_a_model_compiled_either_way() -> None:
    import torch

    from hpcgpu.runtime.engine import is_compiled

    assert not is_compiled(torch.nn.Linear(2, 2))
    assert is_compiled(torch.compile(torch.nn.Linear(2, 2)))  # compiles lazily: nothing runs here
    in_place = torch.nn.Linear(2, 2)
    in_place.compile()
    assert is_compiled(in_place)


def test_a_bucket_size_given_in_the_spec_is_passed_as_written() -> None:
    assert ddp_options(spec_of({"bucket_cap_mb": 7}), own_loop=True, compiled=True)["bucket_cap_mb"] == 7
