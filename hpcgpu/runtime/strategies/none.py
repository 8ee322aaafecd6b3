"""`distributed.strategy: none`: one rank, the model bare (the base class's plain torch)."""
from __future__ import annotations

from hpcgpu.runtime.strategies.base import Strategy


class OneRank(Strategy):
    name = "none"
