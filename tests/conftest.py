"""Shared helpers for the test suite (unit tests need neither SLURM nor CUDA)."""
from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Callable

import pytest

REPO = Path(__file__).resolve().parent.parent
CONFIGS = REPO / "configs"
GOLDEN = REPO / "tests" / "golden"


@pytest.fixture
def write_spec(tmp_path: Path) -> Callable[..., Path]:
    """write_spec(text, name="s.yaml") -> path of a spec file in a fresh folder (text is dedented)."""

    def write(text: str, name: str = "s.yaml") -> Path:
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
        return path

    return write


@pytest.fixture(autouse=True, scope="session")
def _private_job_registry(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Jobs the tests submit go to a registry of their own, never the user's ~/.local/state one.

    XDG_STATE_HOME (not HPCGPU_REGISTRY) because helpers that build a clean job environment drop
    HPCGPU_* variables; tests that need their own registry set HPCGPU_REGISTRY, which wins.
    """
    import os

    os.environ["XDG_STATE_HOME"] = str(tmp_path_factory.mktemp("state"))
    os.environ.pop("HPCGPU_REGISTRY", None)
