"""LoRA adapters through peft (train.lora): the one place a model gets them, loads them, merges them,
and the base model's identity a run records and checks on resume."""
from __future__ import annotations

import hashlib
import json
import warnings
from pathlib import Path
from typing import Any

import torch

from hpcgpu.contract import folder_written_whole
from hpcgpu.errors import HpcgpuError
from hpcgpu.gpu.estimate import (LinearLayers, adapter_shape_problem, config_hidden, not_an_adapter, read_adapter,
                                 target_modules_problem)
from hpcgpu.spec import Spec
from hpcgpu.spec.schema import Lora

AUTO_TARGETS = "all-linear"  # peft's: every linear layer of the blocks, not the output head
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt")
EDGE_BYTES = 1 << 20  # a weights file is known by its size and its first and last MiB, not read whole


def add_adapters(model: Any, lora: Lora, fused_loss: bool = False) -> Any:
    """The model with LoRA adapters on lora.target_modules (peft's PeftModel); only they train."""
    from peft import LoraConfig, get_peft_model

    from transformers.pytorch_utils import Conv1D

    targets: Any = AUTO_TARGETS if lora.target_modules == "auto" else list(lora.target_modules)
    if targets != AUTO_TARGETS:
        check_targets(model, targets, fused_loss)
    # GPT-2's Conv1D stores its weight transposed: peft sets this itself for such layers, with a warning
    transposed = any(isinstance(m, Conv1D) for m in model.modules())
    config = LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout, target_modules=targets,
                        fan_in_fan_out=transposed, task_type="CAUSAL_LM")
    with warnings.catch_warnings():  # peft asks transformers a deprecated name (is_gradient_checkpointing)
        warnings.filterwarnings("ignore", category=FutureWarning, message=".*is_gradient_checkpointing.*")
        return get_peft_model(model, config)


def model_layers(model: torch.nn.Module) -> LinearLayers:
    """The layers LoRA can adapt (nn.Linear, GPT-2's Conv1D, whose weight is fan in x fan out) by path, as
    peft finds them, and whether the head is the input embedding's weight: what the host reads from the
    config (gpu/estimate.py linear_layers)."""
    from transformers.pytorch_utils import Conv1D

    paths: dict[str, tuple[int, int]] = {}
    for name, module in model.named_modules():
        if isinstance(module, Conv1D):
            paths[name] = (module.weight.shape[0], module.weight.shape[1])
        elif isinstance(module, torch.nn.Linear) and name:
            paths[name] = (module.in_features, module.out_features)
    head, embedding = model.get_output_embeddings(), model.get_input_embeddings()
    tied = head is not None and embedding is not None and head.weight is embedding.weight
    config = model.config.get_text_config()
    return LinearLayers(config.model_type, config_hidden(config), paths, tied)


def check_targets(model: torch.nn.Module, targets: list[str], fused_loss: bool = False) -> None:
    """The job's check of target_modules, for what the host could not read first (a hub id's model, a
    family outside LINEAR_NAMES): launch/checks.py refuses the same names in the same line."""
    problem = target_modules_problem(targets, model_layers(model), fused_loss)
    if problem:
        raise HpcgpuError(problem)


def trainable_count(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def prepare_quantized(model: Any) -> Any:
    """peft's preparation of a k-bit base for training (QLoRA): norms in fp32, the input embeddings'
    output requiring grad. Gradient checkpointing is left to the plan (non-reentrant, as for every run)."""
    from peft import prepare_model_for_kbit_training

    return prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)


def base_identity(spec: Spec) -> dict[str, Any]:
    """What the adapters were trained on: a model folder's path and a digest of its config and weight
    files (names, sizes, first and last MiB), or model.config's digest and the seed of its weights."""
    if not spec.model.name_or_path:
        text = json.dumps(spec.model.config, sort_keys=True)
        return {"config_sha256": hashlib.sha256(text.encode()).hexdigest()[:16], "seed": spec.train.seed}
    folder = Path(spec.model.name_or_path)
    if not folder.is_dir():  # a hub id: its cached snapshot is what from_pretrained reads
        from huggingface_hub import snapshot_download

        folder = Path(snapshot_download(spec.model.name_or_path, local_files_only=True))
    digest = hashlib.sha256()
    for path in sorted(folder.iterdir()):
        if path.name == "config.json" or path.name.endswith(".index.json"):
            digest.update(path.name.encode() + path.read_bytes())
        elif path.suffix in WEIGHT_SUFFIXES:
            digest.update(f"{path.name}:{path.stat().st_size}".encode())
            with open(path, "rb") as f:
                digest.update(f.read(EDGE_BYTES))
                f.seek(max(0, path.stat().st_size - EDGE_BYTES))
                digest.update(f.read(EDGE_BYTES))
    return {"name_or_path": str(spec.model.name_or_path), "sha256": digest.hexdigest()[:16]}


def adapter_settings(spec: Spec) -> dict[str, Any] | None:
    """The plan's record of the adapters: their settings and the base's identity; None without lora."""
    lora = spec.train.lora
    if lora is None:
        return None
    return {"r": lora.r, "alpha": lora.alpha, "dropout": lora.dropout, "target_modules": lora.target_modules,
            "quantization": spec.model.quantization, "base": base_identity(spec)}


def load_adapter(base: Any, adapter: str, merge: bool, base_name: str) -> Any:
    """A trained adapter folder on its base (task: infer's model.adapter; base_name: model.name_or_path):
    merged into the weights where `merge` (unquantized bases), else peft's model running the adapters
    beside the frozen base. An adapter trained on a base of other shapes is refused first, in the host's
    line (launch/checks.py adapter_problem)."""
    from peft import PeftModel

    found = read_adapter(adapter)
    if found is None:
        raise HpcgpuError(not_an_adapter(adapter))
    problem = adapter_shape_problem(found, model_layers(base), base_name)
    if problem:
        raise HpcgpuError(problem)
    model = PeftModel.from_pretrained(base, adapter)
    return model.merge_and_unload() if merge else model


def write_merged(spec: Spec, peft_model: Any, adapter_dir: Path, out: Path, tokenizer: Any = None) -> None:
    """merged/: the base with the adapters merged in, in the base's own dtype, with the run's tokenizer
    (a model `task: infer` takes as it is). A saved base is loaded again from its folder (never merged
    from 4-bit weights); a model.config base is this run's, in memory."""
    if spec.model.name_or_path:
        from transformers import AutoModelForCausalLM

        base = AutoModelForCausalLM.from_pretrained(spec.model.name_or_path, dtype="auto")
        merged = load_adapter(base, str(adapter_dir), merge=True, base_name=spec.model.name_or_path)
    else:
        merged = peft_model.merge_and_unload()
    with folder_written_whole(out) as tmp:
        merged.save_pretrained(tmp, safe_serialization=True)
        if hasattr(tokenizer, "save_pretrained"):
            tokenizer.save_pretrained(tmp)
