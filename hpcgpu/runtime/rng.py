"""Every random number generator's state under fixed keys, for checkpoints: the train task's and the
user's own code's (ctx.save / ctx.resume) resume draws exactly where they stopped."""
from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


def rng_state(device: torch.device) -> dict[str, Any]:
    state: dict[str, Any] = {"python": random.getstate(), "numpy": np.random.get_state(),
                             "torch": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict[str, Any], device: torch.device) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)
