"""Every test here needs CUDA: marked `gpu` and skipped where CUDA is absent (CI never has a GPU).

`@pytest.mark.two_gpus` additionally skips on a machine with a single GPU.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

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



@pytest.fixture(scope="session")
def work_root(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str, str], Path]:
    """work_root(env_var, name): a test module's working folder: $env_var where set (a GPU session keeps
    finished runs there and reuses them on its next call), else a fresh temporary one."""
    def folder(env_var: str, name: str) -> Path:
        given = os.environ.get(env_var)
        if given:
            Path(given).mkdir(parents=True, exist_ok=True)
            return Path(given)
        return tmp_path_factory.mktemp(name)

    return folder
