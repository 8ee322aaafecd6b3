"""The training strategies by name, and the one choice of a run's: `strategy_for`.

runtime/plan.py decides the name (TrainPlan.strategy); this registry maps it to its class, one
module each (base.py holds the interface). A new strategy is a module here with a `Strategy`
subclass, its entry in STRATEGIES below, and its name in spec/schema.py's `Distributed.strategy`
(plus plan.py's decision, where `auto` should pick it).
"""
from __future__ import annotations

import torch

from hpcgpu.runtime.plan import RunPlan
from hpcgpu.runtime.strategies.base import Strategy
from hpcgpu.runtime.strategies.ddp import DDP
from hpcgpu.runtime.strategies.deepspeed import DeepSpeed
from hpcgpu.runtime.strategies.fsdp import FSDP
from hpcgpu.runtime.strategies.none import OneRank
from hpcgpu.spec import Spec

STRATEGIES: dict[str, type[Strategy]] = {cls.name: cls for cls in (
    OneRank,
    DDP,
    FSDP,
    DeepSpeed,
)}


def strategy_for(plan: RunPlan, spec: Spec | None, device: torch.device) -> Strategy:
    """The strategy of the run plan, for one model on this rank's device."""
    return STRATEGIES[plan.training.strategy](plan, spec, device)


def lone_rank_group(name: str) -> bool:
    """Whether a job of one rank needs a process group under the strategy `name` (auto: not yet known)."""
    cls = STRATEGIES.get(name)
    return cls is not None and cls.lone_rank_group
