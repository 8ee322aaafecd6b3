"""The model of a spec, for every built-in task: model.config (random weights, seeded) or
model.name_or_path (from_pretrained of a local dir, or a hub id from the local cache)."""
from __future__ import annotations

import contextlib
from typing import Any

import torch

from hpcgpu.errors import HpcgpuError
from hpcgpu.gpu.estimate import WEIGHTS_SHARE, MaxMemory
from hpcgpu.spec import Spec
from hpcgpu.spec.load import is_local_path

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
            return name_its_loss(AutoModelForCausalLM.from_pretrained(
                spec.model.name_or_path, dtype=dtype or torch.float32, **kwargs))
        except torch.OutOfMemoryError:
            raise
        except load_errors() as exc:
            raise cannot_load(spec, exc) from None
    config = config_of_spec(spec)
    with torch.device(device) if device is not None else contextlib.nullcontext():
        model = name_its_loss(AutoModelForCausalLM.from_config(config))
    return model.to(dtype) if dtype else model


def name_its_loss(model: Any) -> Any:
    """A causal LM whose class name does not say its loss (GPT2LMHeadModel) makes transformers warn in
    every forward with labels, and under torch.compile that warning is a graph break: the forward
    compiles as two graphs with a return to Python between them, every step. Naming the loss it
    uses anyway (ForCausalLM) makes it one graph, with the same numbers."""
    if getattr(model, "loss_type", "") is None:
        model.loss_type = "ForCausalLM"
    return model


def load_errors() -> tuple[type[BaseException], ...]:
    """What from_pretrained raises for a model folder that does not load: a missing or bad file, and
    weights that do not read (a truncated download: safetensors' error, or torch's unpickling)."""
    import pickle

    from safetensors import SafetensorError

    return (OSError, ValueError, KeyError, RuntimeError, ImportError, EOFError, pickle.UnpicklingError,
            SafetensorError)


def cannot_load(spec: Spec, exc: BaseException) -> HpcgpuError:
    first = next((x.strip() for x in str(exc).splitlines() if x.strip()), type(exc).__name__)
    return HpcgpuError(not_in_cache(spec.model.name_or_path)
                       or f"model.name_or_path: cannot load {spec.model.name_or_path!r}: {first}")


def not_in_cache(name: str | None) -> str | None:
    """The error for a hub id this node's Hugging Face cache lacks (the job does not download:
    runtime/tasks sets HF_HUB_OFFLINE=1 unless the spec's env says otherwise); None for a folder."""
    import os

    if not name or is_local_path(name) or os.path.isdir(name):
        return None
    from huggingface_hub import try_to_load_from_cache

    if isinstance(try_to_load_from_cache(name, "config.json"), str):
        return None  # cached: the error is something else
    return (f"model.name_or_path: {name!r} is not a folder, and as a hub id it is not in this node's Hugging Face "
            "cache; jobs load hub ids from the cache only (HF_HUB_OFFLINE=0 in env: lets them download)")


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


# ---------------------------------------------------------------- task: infer on GPUs

def load_for_inference(spec: Spec, device: torch.device, dtype: torch.dtype, cap: MaxMemory) -> torch.nn.Module:
    """The inference model in eval mode: on `device` whole (one GPU, a CPU rank), or placed by
    accelerate's planner over the replica's GPUs (gpus_per_replica > 1, a max_memory cap, CPU
    offload) with int8/int4 weights where model.quantization says so. The replica's GPUs are all
    this process sees (runtime/env.py bind_gpu_group). cap: infer.max_memory, read. With
    model.adapter: the trained LoRA adapter on that base, merged into unquantized weights."""
    if spec.model.adapter and not spec.model.name_or_path:  # the host names the base; the job never guesses it
        raise HpcgpuError("model.adapter: the spec names no base (model.name_or_path); hpcgpu submit, sbatch and "
                          "queue write the one its adapter_config.json names into the run's spec.yaml")
    model = load_base_for_inference(spec, device, dtype, cap)
    if not spec.model.adapter:
        return model
    from hpcgpu.runtime.lora import load_adapter

    return load_adapter(model, spec.model.adapter, merge=spec.model.quantization == "none",
                        base_name=str(spec.model.name_or_path)).eval()


def load_base_for_inference(spec: Spec, device: torch.device, dtype: torch.dtype, cap: MaxMemory) -> torch.nn.Module:
    q = spec.model.quantization
    if device.type != "cuda":
        if q != "none":
            raise HpcgpuError(f"model.quantization: {q} runs on a GPU only (bitsandbytes), and this rank has none; "
                              "use quantization: none")
        return build_model(spec, spec.train.seed, device, dtype=dtype).to(device).eval()
    placed = spec.gpus_per_task > 1 or cap.cpu or cap.gpu is not None or q != "none"
    if not placed:
        return build_model(spec, spec.train.seed, device, dtype=dtype, load_on_device=True).to(device).eval()
    max_memory = replica_max_memory(cap.gpu, cap.cpu)
    spread = spec.gpus_per_task > 1 or bool(cap.cpu)
    device_map: Any = "auto" if spread else {"": 0}
    if not spec.model.name_or_path:  # model.config: random weights, built here, then placed
        from accelerate import dispatch_model, infer_auto_device_map

        model = build_model(spec, spec.train.seed, None, dtype=dtype)
        if spread:
            device_map = infer_auto_device_map(model, max_memory=max_memory,
                                               no_split_module_classes=getattr(model, "_no_split_modules", None))
        return dispatch_model(model, device_map=device_map).eval()
    kwargs: dict[str, Any] = dict(device_map=device_map, max_memory=max_memory, dtype=dtype)
    if q != "none":
        kwargs["quantization_config"] = bnb_config(q, dtype)
    from transformers import AutoModelForCausalLM

    try:
        return AutoModelForCausalLM.from_pretrained(spec.model.name_or_path, **kwargs).eval()
    except torch.OutOfMemoryError:
        raise
    except load_errors() as exc:
        raise cannot_load(spec, exc) from None


def load_quantized(spec: Spec, device: torch.device, precision: str) -> torch.nn.Module:
    """QLoRA's frozen base: model.name_or_path in 4 (NF4) or 8 bits on this rank's GPU, computing in the
    training precision (bf16 unless the plan says otherwise)."""
    if device.type != "cuda":
        raise HpcgpuError(f"model.quantization: {spec.model.quantization} (QLoRA) runs on a GPU only "
                          "(bitsandbytes), and this rank has none; use quantization: none")
    compute = {"fp16": torch.float16, "fp32": torch.float32}.get(precision, torch.bfloat16)
    from transformers import AutoModelForCausalLM

    try:
        model = AutoModelForCausalLM.from_pretrained(
            spec.model.name_or_path, dtype=compute, device_map={"": str(device)},
            quantization_config=bnb_config(spec.model.quantization, compute))
    except torch.OutOfMemoryError:
        raise
    except load_errors() as exc:
        raise cannot_load(spec, exc) from None
    return name_its_loss(model)


def replica_max_memory(gpu_cap: int | None, cpu_bytes: int) -> dict[Any, int]:
    """accelerate's max_memory for this replica's GPUs: the cap, else WEIGHTS_SHARE of each GPU's free
    memory (the memory model's split rule: the rest holds a batch's KV cache and activations)."""
    out: dict[Any, int] = {}
    for i in range(torch.cuda.device_count()):
        free = int(torch.cuda.mem_get_info(i)[0])
        out[i] = min(gpu_cap, free) if gpu_cap is not None else int(free * WEIGHTS_SHARE)
    if cpu_bytes:
        out["cpu"] = cpu_bytes
    return out


def bnb_config(quantization: str, compute_dtype: torch.dtype) -> Any:
    try:
        import bitsandbytes  # noqa: F401  (transformers names a missing one less plainly)
        from transformers import BitsAndBytesConfig
    except ImportError as exc:
        raise HpcgpuError(f"model.quantization: {quantization} needs bitsandbytes ({exc}): "
                          "pip install 'hpcgpu[quant]'") from None
    if quantization == "int8":
        return BitsAndBytesConfig(load_in_8bit=True)
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=compute_dtype,
                              bnb_4bit_use_double_quant=False)


def placement(model: torch.nn.Module) -> list[str]:
    """Where the model's parts are: one line per device, the layers as ranges, and the memory each
    GPU holds ("cuda:0: model.embed_tokens, layers 0-15 | 3.1 GiB allocated")."""
    device_map = getattr(model, "hf_device_map", None)
    if not device_map:  # one device: transformers keeps no map
        first = next(model.parameters(), None)
        if first is None or first.device.type != "cuda":
            return []
        device_map = {"": first.device.index or 0}
    by_device: dict[str, list[str]] = {}
    for name, where in device_map.items():
        key = f"cuda:{where}" if isinstance(where, int) else str(where)
        by_device.setdefault(key, []).append(name)
    lines = []
    for where, names in by_device.items():
        mem = ""
        if where.startswith("cuda:"):
            mem = f" | {torch.cuda.memory_allocated(int(where[5:])) / 2 ** 30:.2f} GiB allocated"
        lines.append(f"{where}: {compact_names(names)}{mem}")
    return lines


def compact_names(names: list[str]) -> str:
    """['model.embed', 'model.layers.0', 'model.layers.1', 'model.layers.2', 'lm_head'] ->
    'model.embed, model.layers.0-2, lm_head'."""
    import re

    out: list[str] = []
    run: tuple[str, int, int] | None = None
    for name in names:
        m = re.fullmatch(r"(.*\.)(\d+)", name)
        if m and run and run[0] == m.group(1) and int(m.group(2)) == run[2] + 1:
            run = (run[0], run[1], int(m.group(2)))
            continue
        if run:
            out.append(f"{run[0]}{run[1]}" + (f"-{run[2]}" if run[2] != run[1] else ""))
            run = None
        if m:
            run = (m.group(1), int(m.group(2)), int(m.group(2)))
        else:
            out.append(name or "(whole model)")
    if run:
        out.append(f"{run[0]}{run[1]}" + (f"-{run[2]}" if run[2] != run[1] else ""))
    return ", ".join(out)

