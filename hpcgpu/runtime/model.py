"""The model of a spec, for every built-in task: model.config (random weights, seeded) or
model.name_or_path (from_pretrained of a local dir, or a hub id from the local cache)."""
from __future__ import annotations

import contextlib
from typing import Any

import torch

from hpcgpu.errors import HpcgpuError
from hpcgpu.spec import Spec

SPEC_DTYPES: dict[str, torch.dtype | None] = {"auto": None, "float32": torch.float32, "bfloat16": torch.bfloat16,
                                              "float16": torch.float16}


def build_model(spec: Spec, seed: int, device: torch.device | None = None, *,
                dtype: torch.dtype | None = None, load_on_device: bool = False) -> torch.nn.Module:
    """The model with its initial weights; built on `device` (a GPU: no slow CPU init of big models).

    dtype: the weights' dtype, in place of model.dtype's (None: model.dtype; auto loads fp32).
    load_on_device: from_pretrained straight onto `device` too (the inference task; training moves
    the loaded model itself)."""
    from transformers import AutoModelForCausalLM

    dtype = dtype or SPEC_DTYPES[spec.model.dtype]
    torch.manual_seed(seed)  # identical initial weights on every rank and every restart
    if spec.model.name_or_path:
        kwargs = {}
        if load_on_device and device is not None and device.type == "cuda":
            kwargs["device_map"] = {"": str(device)}
        try:
            return AutoModelForCausalLM.from_pretrained(spec.model.name_or_path, dtype=dtype or torch.float32,
                                                        **kwargs)
        except torch.OutOfMemoryError:
            raise
        except (OSError, ValueError, KeyError, RuntimeError) as exc:
            raise cannot_load(spec, exc) from None
    config = config_of_spec(spec)
    with torch.device(device) if device is not None else contextlib.nullcontext():
        model = AutoModelForCausalLM.from_config(config)
    return model.to(dtype) if dtype else model


def cannot_load(spec: Spec, exc: BaseException) -> HpcgpuError:
    first = next((x.strip() for x in str(exc).splitlines() if x.strip()), type(exc).__name__)
    return HpcgpuError(f"model.name_or_path: cannot load {spec.model.name_or_path!r}: {first}")


def config_of_spec(spec: Spec) -> Any:
    """The transformers config model.config describes (no weights)."""
    from transformers import AutoConfig

    cfg = dict(spec.model.config or {})
    model_type = cfg.pop("model_type")
    try:
        return AutoConfig.for_model(model_type, **cfg)
    except (ValueError, TypeError) as exc:
        # transformers lists every model type it knows (12 KB): one short line instead
        raise HpcgpuError(f"model.config: {str(exc).split('. Should contain')[0]}") from None


def model_config(spec: Spec) -> Any:
    """The model's (text) config without its weights, from the model dir or model.config."""
    if spec.model.name_or_path:
        from transformers import AutoConfig

        try:
            config = AutoConfig.from_pretrained(spec.model.name_or_path)
        except (OSError, ValueError, KeyError) as exc:
            raise cannot_load(spec, exc) from None
    else:
        config = config_of_spec(spec)
    return config.get_text_config() if hasattr(config, "get_text_config") else config
