"""hpcgpu: one experiment spec, one entrypoint, from a laptop to a SLURM GPU cluster.

This module never imports torch: `hpcgpu --help` and the host-side commands must stay fast.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:  # pragma: no cover
    from hpcgpu.runtime.context import Context


def init(spec: Any = None) -> "Context":
    """Set up the distributed job from the environment and return its context.

    Works the same under SLURM, torchrun, the local executor or a plain `python script.py`.
    """
    from hpcgpu.runtime.context import init as _init

    return _init(spec)


__all__ = ["__version__", "init"]
