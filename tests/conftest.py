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


@pytest.fixture(autouse=True, scope="session")
def _no_user_defaults(tmp_path_factory: pytest.TempPathFactory) -> None:
    """No test reads the developer's ~/.config/hpcgpu/defaults.yaml: the user's defaults file is looked
    for in an empty folder (tests of defaults files write one there or set their own)."""
    import os

    os.environ["XDG_CONFIG_HOME"] = str(tmp_path_factory.mktemp("config"))
    os.environ.pop("HPCGPU_NO_DEFAULTS", None)


@pytest.fixture
def plain_model_vocab() -> Callable[[Path], int]:
    """plain_model_vocab(model_dir) -> the vocab size of its logits, loaded and run in a fresh
    process that never imports DeepSpeed (an exported model must not need it)."""
    import subprocess
    import sys

    def check(model_dir: Path) -> int:
        code = ("import sys, torch; from transformers import AutoModelForCausalLM; "
                f"m = AutoModelForCausalLM.from_pretrained({str(model_dir)!r}); "
                "print(m(input_ids=torch.zeros(1, 8, dtype=torch.long)).logits.shape[-1]); "
                "assert 'deepspeed' not in sys.modules")
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr[-2000:]
        return int(proc.stdout.strip())

    return check
