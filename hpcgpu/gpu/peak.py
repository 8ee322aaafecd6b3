"""Peak dense bf16 tensor FLOP/s by GPU model, for MFU. Vendor datasheet numbers (no sparsity)."""
from __future__ import annotations

# (substring of the device name, peak FLOP/s); the first match wins, so specific names come first
PEAK_BF16: list[tuple[str, float]] = [
    ("H200", 989e12),
    ("H100 PCIe", 756e12),
    ("H100 NVL", 835e12),
    ("H100", 989e12),
    ("GH200", 989e12),
    ("B200", 2250e12),
    ("A100", 312e12),
    ("A800", 312e12),
    ("L40S", 362e12),
    ("L40", 181e12),
    ("A6000", 155e12),
    ("A40", 150e12),
    ("A10", 125e12),
    ("L4", 121e12),
    ("RTX 4090", 165e12),
    ("RTX 3090", 71e12),
    ("V100", 125e12),  # fp16 tensor cores; V100 has no bf16
    ("T4", 65e12),
]


def peak_flops(device_name: str) -> float | None:
    for key, flops in PEAK_BF16:
        if key.lower() in device_name.lower():
            return flops
    return None
