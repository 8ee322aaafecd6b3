"""The run plan's precision on a rank's device: the autocast dtype and fp16's GradScaler."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from hpcgpu.runtime.plan import RunPlan

AMP_DTYPES: dict[str, torch.dtype | None] = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": None}


@dataclass(frozen=True)
class Precision:
    """The plan's precision on this device: the autocast dtype (None: fp32, no autocast)."""

    dtype: torch.dtype | None
    device_type: str

    @classmethod
    def of(cls, plan: RunPlan, device: torch.device) -> "Precision":
        return cls(AMP_DTYPES[plan.precision], device.type)

    def autocast(self) -> contextlib.AbstractContextManager:
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device_type, dtype=self.dtype)

    def scaler(self, enabled: bool = True) -> torch.amp.GradScaler:
        """fp16's loss scaler (a pass-through otherwise); enabled=False where the strategy scales itself."""
        return torch.amp.GradScaler(self.device_type, enabled=enabled and self.dtype == torch.float16)
