"""Every test here needs CUDA: marked `gpu` and skipped where CUDA is absent (CI never has a GPU).

`@pytest.mark.two_gpus` additionally skips on a machine with a single GPU.
"""
from __future__ import annotations

import pytest


def _gpu_count() -> int:
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    here = str(config.rootpath / "tests" / "gpu")
    count: int | None = None
    for item in items:
        if not str(item.path).startswith(here):
            continue
        count = _gpu_count() if count is None else count
        item.add_marker(pytest.mark.gpu)
        if count == 0:
            item.add_marker(pytest.mark.skip(reason="needs CUDA GPUs"))
        elif count < 2 and item.get_closest_marker("two_gpus"):
            item.add_marker(pytest.mark.skip(reason="needs 2 GPUs"))
