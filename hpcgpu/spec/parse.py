"""Turn plain mappings into the typed Spec, with errors that name the key path and the file line."""
from __future__ import annotations

import dataclasses
import difflib
import functools
import re
import typing
from typing import Any, Literal, Union, get_args, get_origin

from hpcgpu.errors import SpecError


class LineMap:
    """Where each dotted key came from: a file line, or the --set flag that set it.

    `source` is the spec file; `files` names another file for keys a defaults file gave."""

    def __init__(self, source: str | None = None):
        self.source = source
        self.lines: dict[str, int] = {}
        self.files: dict[str, str] = {}
        self.flags: dict[str, str] = {}

    def error(self, path: str, message: str) -> SpecError:
        for flag_key, flag in self.flags.items():
            if path and flag_key.startswith(path + "."):
                return SpecError(path, message, source=flag)  # a section that only a flag created
        for prefix in _prefixes(path):
            if prefix in self.flags:
                return SpecError(path, message, source=self.flags[prefix])
            if prefix in self.lines:
                return SpecError(path, message, source=self.files.get(prefix, self.source), line=self.lines[prefix])
        return SpecError(path, message, source=self.source)


def _prefixes(path: str) -> list[str]:
    """a.b[1] -> a.b[1], a.b, a: a list item's line is its list's (items carry no line of their own)."""
    parts = path.split(".")
    out: list[str] = []
    for i in range(len(parts), 0, -1):
        prefix = ".".join(parts[:i])
        out += [prefix] + ([re.sub(r"(\[\d+\])+$", "", prefix)] if prefix.endswith("]") else [])
    return out


@functools.lru_cache(maxsize=None)
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def yaml_key(f: dataclasses.Field) -> str:
    return f.metadata.get("key", f.name)


def section_fields(cls: type) -> dict[str, dataclasses.Field]:
    """YAML key -> dataclass field of a spec section."""
    return {yaml_key(f): f for f in dataclasses.fields(cls)}


def parse_section(cls: type, raw: Any, path: str, lines: LineMap) -> Any:
    if not isinstance(raw, dict):
        raise lines.error(path or "(top level)", f"must be a mapping of keys, got {_kind(raw)}")
    fields = section_fields(cls)
    for key in raw:
        if key not in fields:
            raise lines.error(_join(path, str(key)), _unknown_key_message(str(key), list(fields), path))
    hints = _hints(cls)
    kwargs: dict[str, Any] = {}
    for key, f in fields.items():
        sub = _join(path, key)
        if key not in raw:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:  # type: ignore[misc]
                raise lines.error(sub, "is required")
            continue
        kwargs[f.name] = parse_value(hints[f.name], raw[key], sub, lines, f.metadata)
    return cls(**kwargs)


def _unknown_key_message(key: str, valid: list[str], section: str) -> str:
    return f"unknown key{_did_you_mean(key, valid, section)}; valid keys: {', '.join(valid)}"


def _did_you_mean(key: str, valid: list[str], section: str) -> str:
    if key in ACCUMULATION_NAMES:
        return (" (set the batch sizes: train.global_batch_size = train.micro_batch_size x accumulation steps "
                "x ranks)")
    meant = _meant(key, valid, section)
    return f" (did you mean {' or '.join(repr(k) for k in meant)}?)" if meant else ""


def _meant(key: str, valid: list[str], section: str) -> list[str]:
    """The keys another tool's name means under `section` (by their name where it is the section's
    own, else in full); else the section's closest key and those the name means elsewhere, in full
    (train.save_steps: max_steps or checkpoint.every_steps)."""
    keys = OTHER_TOOLS_NAMES.get(key, ())
    here = [k.rpartition(".")[2] if k.rpartition(".")[0] == section else k
            for k in keys if k.startswith(f"{section}.")]
    return here or difflib.get_close_matches(key, valid, n=1, cutoff=0.6) + list(keys)


# Other tools' names (Hugging Face's Trainer and PEFT, Lightning, nanoGPT, DeepSpeed, accelerate, vLLM,
# SLURM) for this schema's keys, which difflib does not find: name -> the full keys it may mean
# (max_length is data.seq_len in a data section, infer.max_new_tokens in an infer one)
OTHER_TOOLS_NAMES: dict[str, tuple[str, ...]] = {
    **dict.fromkeys(("learning_rate", "base_lr", "peak_lr"), ("train.lr",)),
    "min_lr": ("train.min_lr_ratio",),
    "batch_size": ("train.global_batch_size", "train.micro_batch_size", "infer.batch_size"),
    **dict.fromkeys(("train_batch_size", "total_batch_size", "effective_batch_size"), ("train.global_batch_size",)),
    **dict.fromkeys(("per_device_train_batch_size", "train_micro_batch_size_per_gpu", "batch_size_per_gpu",
                     "micro_batch"), ("train.micro_batch_size",)),
    **dict.fromkeys(("num_epochs", "num_train_epochs", "max_epochs", "n_epochs"), ("train.epochs",)),
    **dict.fromkeys(("max_iters", "num_steps", "total_steps", "train_steps", "max_train_steps", "num_training_steps",
                     "iterations"), ("train.max_steps",)),
    "wd": ("train.weight_decay",),
    **dict.fromkeys(("warmup", "warmup_iters", "num_warmup_steps", "lr_warmup_steps"), ("train.warmup_steps",)),
    **dict.fromkeys(("max_grad_norm", "gradient_clip_val", "gradient_clipping", "clip_grad_norm", "clip_grad",
                     "grad_norm_clip"), ("train.grad_clip",)),
    "random_seed": ("train.seed", "infer.seed"),
    **dict.fromkeys(("mixed_precision", "fp16", "bf16", "amp"), ("train.precision",)),
    "activation_checkpointing": ("train.gradient_checkpointing",),
    "torch_compile": ("train.compile",),
    **dict.fromkeys(("logging_steps", "log_interval", "log_every_n_steps", "log_freq"), ("train.log_every",)),
    **dict.fromkeys(("eval_steps", "eval_interval", "val_check_interval", "eval_freq"), ("train.eval_every",)),
    "eval_iters": ("train.eval_batches",),
    **dict.fromkeys(("lora_r", "lora_rank", "rank"), ("train.lora.r",)),
    "lora_alpha": ("train.lora.alpha",),
    "lora_dropout": ("train.lora.dropout",),
    **dict.fromkeys(("lora_target_modules", "target"), ("train.lora.target_modules",)),
    "merge_adapter": ("train.merge",),
    **dict.fromkeys(("save_steps", "save_every", "save_interval", "every_n_train_steps"), ("checkpoint.every_steps",)),
    **dict.fromkeys(("save_total_limit", "keep_last", "max_to_keep", "save_top_k"), ("checkpoint.keep",)),
    **dict.fromkeys(("dataset", "dataset_path", "data_path", "train_file", "train_data", "train_path"),
                    ("data.train",)),
    **dict.fromkeys(("validation_file", "eval_file", "valid_file", "val_data", "eval_data", "validation_data"),
                    ("data.eval",)),
    **dict.fromkeys(("max_seq_length", "max_seq_len", "seq_length", "sequence_length", "block_size",
                     "context_length"), ("data.seq_len",)),
    "max_length": ("data.seq_len", "infer.max_new_tokens"),
    **dict.fromkeys(("dataset_text_field", "text_column"), ("data.text_field",)),
    **dict.fromkeys(("model_name", "model_name_or_path", "pretrained_model_name_or_path", "model_id", "model_path"),
                    ("model.name_or_path",)),
    "torch_dtype": ("model.dtype",),
    **dict.fromkeys(("load_in_4bit", "load_in_8bit", "quantize"), ("model.quantization",)),
    **dict.fromkeys(("adapter_path", "adapter_name_or_path", "peft_model_id", "lora_path"), ("model.adapter",)),
    "max_tokens": ("infer.max_new_tokens",),
    **dict.fromkeys(("input_file", "prompts", "prompts_file"), ("infer.input",)),
    **dict.fromkeys(("stop_sequences", "stop_strings"), ("infer.stop",)),
    **dict.fromkeys(("gpus_per_node", "num_gpus", "ngpus", "n_gpus"), ("resources.gpus",)),
    **dict.fromkeys(("num_nodes", "nnodes", "n_nodes"), ("resources.nodes",)),
    "cpus_per_task": ("resources.cpus_per_gpu",),
    **dict.fromkeys(("mem", "memory"), ("resources.mem_per_gpu",)),
    **dict.fromkeys(("time_limit", "walltime"), ("resources.time",)),
    "queue": ("slurm.partition",),
}
ACCUMULATION_NAMES = frozenset(("gradient_accumulation_steps", "accumulate_grad_batches", "grad_accum",
                                "gradient_accumulation", "accumulation_steps"))


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _kind(value: Any) -> str:
    if value is None:
        return "nothing (null)"
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "a list",
            dict: "a mapping"}.get(type(value), type(value).__name__) + f" ({value!r})"[:60]


def parse_value(tp: Any, value: Any, path: str, lines: LineMap, meta: Any = None) -> Any:
    meta = meta or {}
    origin = get_origin(tp)
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return parse_section(tp, {} if value is None else value, path, lines)
    if origin is Union:
        return _parse_union(tp, value, path, lines, meta)
    if origin is Literal:
        choices = get_args(tp)
        if value not in choices or isinstance(value, bool) != any(isinstance(c, bool) for c in choices if c == value):
            raise lines.error(path, f"must be one of {', '.join(map(str, choices))}; got {value!r}")
        return value
    if origin is list:
        if not isinstance(value, list):
            raise lines.error(path, f"must be a list, got {_kind(value)}")
        (item,) = get_args(tp)
        # a list's pattern is each item's (env_passthrough: [HF_TOKEN, ...])
        item_meta = {k: meta[k] for k in ("pattern", "fmt") if k in meta}
        return [parse_value(item, v, f"{path}[{i}]", lines, item_meta) for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise lines.error(path, f"must be a mapping, got {_kind(value)}")
        _, item = get_args(tp)
        if item is str:  # env: {OMP_NUM_THREADS: 1, DEBUG: true} means the strings "1" and "true"
            value = {k: (str(v).lower() if isinstance(v, bool) else str(v)) if isinstance(v, (int, float)) else v
                     for k, v in value.items()}
        return {str(k): parse_value(item, v, _join(path, str(k)), lines) for k, v in value.items()}
    return _parse_scalar(tp, value, path, lines, meta)


def _parse_union(tp: Any, value: Any, path: str, lines: LineMap, meta: Any) -> Any:
    args = [a for a in get_args(tp) if a is not type(None)]
    if value is None:
        if type(None) in get_args(tp):
            return None
        raise lines.error(path, "must not be empty")
    if len(args) == 1:  # Optional[X]: X's own error, which names a nested section's key (train.profile.steps)
        return parse_value(args[0], value, path, lines, meta)
    errors: list[str] = []
    for arg in args:
        try:
            return parse_value(arg, value, path, lines, meta)
        except SpecError as exc:
            errors.append(exc.message)
    wanted = [_describe(arg, meta) for arg in args]
    if all(wanted):  # scalars and choices: what each takes, in one list (an integer >= 1 or auto)
        items = [item for one in wanted for item in one]  # type: ignore[union-attr]
        shown = str(value).lower() if isinstance(value, bool) else repr(value)
        raise lines.error(path, f"must be {_or_list(items)}; got {shown}")
    raise lines.error(path, " or ".join(dict.fromkeys(errors)))


def _describe(tp: Any, meta: Any) -> list[str] | None:
    """What a scalar or Literal type takes, in words, for a union's message; None for anything else."""
    if get_origin(tp) is Literal:
        return [str(c).lower() if isinstance(c, bool) else str(c) for c in get_args(tp)]
    if tp is bool:
        return ["true", "false"]
    if tp in (int, float):
        low, high = meta.get("min"), meta.get("max")
        word = "an integer" if tp is int else "a number"
        if low is not None and high is not None:
            return [f"{word} from {low:g} to {high:g}"]
        return [word + (f" >= {low:g}" if low is not None else "") + (f" <= {high:g}" if high is not None else "")]
    if tp is str and "check" not in meta:
        return [meta["fmt"] if "pattern" in meta else "a string"]
    return None


def _or_list(items: list[str]) -> str:
    """a, b or c"""
    items = list(dict.fromkeys(items))
    return items[0] if len(items) == 1 else f"{', '.join(items[:-1])} or {items[-1]}"


def _parse_scalar(tp: Any, value: Any, path: str, lines: LineMap, meta: Any) -> Any:
    if tp is Any:
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise lines.error(path, f"must be true or false, got {_kind(value)}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise lines.error(path, f"must be an integer, got {_kind(value)}")
    elif tp is float:
        value = float(value) if isinstance(value, str) and re.fullmatch(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+", value) else value  # YAML 1.1 reads 1e-4 as a string
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise lines.error(path, f"must be a number, got {_kind(value)}")
        value = float(value)
    elif tp is str:
        was_number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if was_number and "pattern" in meta:
            value = str(value)  # "32" for a size, partition "123": YAML typed them as numbers
        if not isinstance(value, str):
            raise lines.error(path, f"must be a string, got {_kind(value)}")
        if "pattern" in meta and not re.match(meta["pattern"], value):
            hint = " (YAML read the unquoted value as a number: put it in quotes)" if was_number else ""
            raise lines.error(path, f"must be {meta['fmt']}; got {value!r}{hint}")
        problem = meta["check"](value) if "check" in meta else None
        if problem:
            raise lines.error(path, problem)
        return value
    if "min" in meta and value < meta["min"]:
        raise lines.error(path, f"must be >= {meta['min']}, got {value}")
    if "max" in meta and value > meta["max"]:
        raise lines.error(path, f"must be <= {meta['max']}, got {value}")
    return value


def to_plain(obj: Any) -> Any:
    """A spec (or section) as plain YAML-able data, with the YAML key names."""
    if dataclasses.is_dataclass(obj):
        return {yaml_key(f): to_plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, list):
        return [to_plain(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_plain(v) for k, v in obj.items()}
    return obj
