"""task: infer on the host: how many GPUs one model copy spans, decided once before a job is made,
and whether its quantization can run.

infer.gpus_per_replica: auto becomes a number here and is written into the run's spec.yaml, so the
batch script (--ntasks-per-node = gpus / gpus_per_replica), the local executor and the job all read
one value. auto = the fewest GPUs of a node the weights fit on (gpu/estimate.py fewest_gpus_per_replica,
the rule `hpcgpu estimate` shows), from the model's config (config.json of the model dir, or
model.config: no torch) and the GPU memory: infer.max_memory's cap, else, for the local executor, the
smallest GPU it would use (NVML). A SLURM job's nodes are not visible from here: without a cap, auto is
1 and the job says so if the weights do not fit.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
from pathlib import Path
from typing import Any, Callable

from hpcgpu.errors import HpcgpuError, SpecError
from hpcgpu.gpu.busy import smallest_gpu
from hpcgpu.gpu.estimate import (config_weight_bytes, fewest_gpus_per_replica, fmt_bytes, parse_max_memory,
                                 spec_weights_format)
from hpcgpu.launch.local import local_gpus
from hpcgpu.spec import Spec

Say = Callable[[str], None]
WORTH_SPLITTING = 8 << 30  # weights from which submit says how auto could spread a copy (none fits a 16 GB card)


def resolve_gpus_per_replica(spec: Spec, *, local: bool, say: Say | None = None) -> Spec:
    """The spec with infer.gpus_per_replica a number (specs of other tasks, or with a number, as they are)."""
    if spec.task != "infer" or spec.infer.gpus_per_replica != "auto":
        return spec
    g = decide_gpus_per_replica(spec, local, say)
    return dataclasses.replace(spec, infer=dataclasses.replace(spec.infer, gpus_per_replica=g))


def decide_gpus_per_replica(spec: Spec, local: bool, say: Say | None) -> int:
    weights = config_weights(spec)
    cap = parse_max_memory(spec.infer.max_memory)
    total, what = (smallest_gpu(spec.resources.devices, os.environ.get("CUDA_VISIBLE_DEVICES"), spec.resources.gpus)
                   if local else (None, "the cluster's GPUs are not visible from here"))
    budget = cap.gpu_budget(total)
    if weights is None or budget is None:
        # worth a word only for a model that may not fit one GPU, where a GPU will run it
        if say and weights is not None and weights >= WORTH_SPLITTING and not (local and total is None):
            say(f"infer.gpus_per_replica: auto is 1 ({what}; {fmt_bytes(weights)} of weights): set "
                "infer.gpus_per_replica, or infer.max_memory to the GPUs' size, to spread a model over several")
        return 1
    gpus = spec.resources.gpus
    g = fewest_gpus_per_replica(weights, budget, gpus, cap.cpu)
    fmt = spec_weights_format(spec)
    if g is None:
        raise SpecError("infer.gpus_per_replica", f"auto: {fmt_bytes(weights)} of {fmt} weights do not fit on the "
                        f"{gpus} GPU(s) of a node ({fmt_bytes(budget)} usable each{', ' + what if total else ''}); "
                        "use model.quantization int8 or int4, more GPUs (resources.gpus), or offload to CPU "
                        "(infer.max_memory: 'auto,cpu=SIZE')")
    if say and g > 1:
        say(f"infer.gpus_per_replica: auto is {g}: {fmt_bytes(weights)} of {fmt} weights over {g} GPUs of "
            f"{fmt_bytes(budget)} usable each; {spec.resources.nodes * gpus // g} model copies")
    return g


def model_config_dict(spec: Spec) -> dict[str, Any] | None:
    """The model's config as a mapping, read without transformers (the text part of a multimodal one)."""
    if spec.model.config:
        return dict(spec.model.config)
    path = Path(spec.model.name_or_path or "", "config.json")
    try:
        cfg = json.loads(path.read_text())
    except (OSError, ValueError):
        return None  # a hub id, or no config: the host checks name what is missing
    return cfg.get("text_config") or cfg if isinstance(cfg, dict) else None


def config_weights(spec: Spec) -> int | None:
    cfg = model_config_dict(spec)
    if cfg is None:
        return None
    try:
        return config_weight_bytes(cfg, spec_weights_format(spec))
    except (HpcgpuError, TypeError, ValueError, KeyError):
        return None  # a config the analytic count does not know: no auto split


def quantization_problem(spec: Spec, *, local: bool) -> str | None:
    """model.quantization (infer, or QLoRA in train) needs bitsandbytes (the job runs this Python) and,
    here, a GPU."""
    q = spec.model.quantization
    if spec.task not in ("infer", "train") or q == "none":
        return None
    if importlib.util.find_spec("bitsandbytes") is None:
        return (f"model.quantization: {q} needs bitsandbytes, which this Python does not have: "
                "pip install 'hpcgpu[quant]' (Linux with an NVIDIA GPU), or use quantization: none")
    if local:
        if not local_gpus(spec):
            return (f"model.quantization: {q} runs on a GPU only (bitsandbytes), and the local executor has none "
                    "here; use quantization: none, or submit to SLURM")
    return None
