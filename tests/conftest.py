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
