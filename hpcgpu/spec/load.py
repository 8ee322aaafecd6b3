"""Load a spec: YAML (with line numbers) -> overrides -> typed Spec -> cross-field checks."""
from __future__ import annotations

import copy
import dataclasses
import os
import re
import typing
from pathlib import Path
from typing import Any, Iterable

import yaml

from hpcgpu.contract import launcher_owned
from hpcgpu.errors import SpecError
from hpcgpu.spec.derive import batch_split
from hpcgpu.spec.parse import LineMap, parse_section, section_fields, to_plain
from hpcgpu.spec.schema import ENV_NAME_RE, SBATCH_OPT_RE, Spec, looks_secret

# a Hugging Face hub id: `gpt2` or `org/name`; anything else in model.name_or_path is a local path
HUB_ID_RE = r"[A-Za-z0-9][A-Za-z0-9_.-]*(/[A-Za-z0-9][A-Za-z0-9_.-]*)?"


class _LineLoader(yaml.SafeLoader):
    """SafeLoader that remembers the line of every mapping key, by dotted path."""

    def __init__(self, stream: Any):
        super().__init__(stream)
        self.key_lines: dict[int, dict[str, int]] = {}
        self.duplicates: dict[int, tuple[str, int]] = {}  # mapping id -> (first repeated key, its line)
        self.plain_text: dict[int, dict[str, str]] = {}  # mapping id -> {key: an unquoted scalar's source text}


def _construct_mapping(loader: _LineLoader, node: yaml.MappingNode) -> dict:
    loader.flatten_mapping(node)
    out: dict = {}
    lines: dict[str, int] = {}
    for key_node, value_node in node.value:
        key = loader.construct_object(key_node, deep=True)
        if not isinstance(key, (str, int, float, bool)):
            raise SpecError("", f"line {key_node.start_mark.line + 1}: mapping keys must be plain words")
        if key in out:
            loader.duplicates.setdefault(id(out), (str(key), key_node.start_mark.line + 1))
            continue
        out[key] = loader.construct_object(value_node, deep=True)
        lines[str(key)] = key_node.start_mark.line + 1
        if isinstance(value_node, yaml.ScalarNode) and value_node.style is None:
            loader.plain_text.setdefault(id(out), {})[str(key)] = value_node.value
    loader.key_lines[id(out)] = lines
    return out


def _env_as_written(data: Any, plain_text: dict[int, dict[str, str]]) -> None:
    """env: values are strings as written: YAML 1.1 would make `yes` true, `010` 8 and `0x10` 16, and the
    ranks would see NCCL_IB_DISABLE=true where the spec said yes."""
    env = data.get("env") if isinstance(data, dict) else None
    if not isinstance(env, dict):
        return
    written = plain_text.get(id(env), {})
    for name, value in env.items():
        if isinstance(value, (bool, int, float)) and str(name) in written:
            env[name] = written[str(name)]


_LineLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def read_yaml(text: str, source: str) -> tuple[Any, LineMap]:
    lines = LineMap(source)
    loader = _LineLoader(text)
    try:
        data = loader.get_single_data()
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark
        where = f":{mark.line + 1}" if mark else ""
        raise SpecError("", f"not valid YAML: {exc.problem}", source=f"{source}{where}") from None
    except yaml.YAMLError as exc:
        raise SpecError("", f"not valid YAML: {exc}", source=source) from None
    finally:
        loader.dispose()
    _collect_lines(data, "", loader.key_lines, lines.lines)
    _reject_duplicates(data, "", loader.duplicates, source)
    _env_as_written(data, loader.plain_text)
    return data, lines


def _reject_duplicates(data: Any, path: str, dups: dict[int, tuple[str, int]], source: str) -> None:
    if not isinstance(data, dict):
        return
    if id(data) in dups:
        key, line = dups[id(data)]
        raise SpecError(f"{path}.{key}" if path else key, "key given twice", source=source, line=line)
    for key, value in data.items():
        _reject_duplicates(value, f"{path}.{key}" if path else str(key), dups, source)


def _collect_lines(data: Any, path: str, key_lines: dict[int, dict[str, int]], out: dict[str, int]) -> None:
    if isinstance(data, dict):
        for key, line in key_lines.get(id(data), {}).items():
            sub = f"{path}.{key}" if path else key
            out[sub] = line
            _collect_lines(data.get(key if key in data else _orig_key(data, key)), sub, key_lines, out)


def _orig_key(data: dict, key: str) -> Any:
    return next((k for k in data if str(k) == key), key)


def parse_override(item: str) -> tuple[str, Any]:
    """`a.b=c` -> ("a.b", yaml-typed c)."""
    if "=" not in item:
        raise SpecError("", f"--set {item!r}: expected KEY=VALUE, e.g. --set train.lr=1e-4")
    key, _, text = item.partition("=")
    key = key.strip()
    if not re.match(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z0-9_-]+)*$", key):
        raise SpecError("", f"--set {item!r}: the key must be dotted words like train.lr")
    if re.fullmatch(r"\s*(\d+-)?\d+(:\d+)+\s*", text):
        return key, text.strip()  # 10:00:00 is a time, not YAML 1.1's base-60 integer 36000
    try:
        value = yaml.safe_load(text) if text.strip() else ""
    except yaml.YAMLError:
        value = text  # an unparseable value is taken as the literal string
    if key.startswith("env.") and isinstance(value, (bool, int, float)):
        return key, text.strip()  # an environment value as written (`yes` stays yes), as in the spec file
    return key, value


def apply_overrides(raw: dict, overrides: Iterable[str], lines: LineMap) -> dict:
    out = copy.deepcopy(raw)
    for item in overrides:
        key, value = parse_override(item)
        set_dotted(out, key, value, lines)
        lines.flags[key] = f"--set {item}"
    return out


def set_dotted(raw: dict, key: str, value: Any, lines: LineMap) -> None:
    node = raw
    parts = key.split(".")
    for i, part in enumerate(parts[:-1]):
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            raise lines.error(".".join(parts[: i + 1]), f"is {child!r}, not a mapping: cannot set {key}")
        node = child
    node[parts[-1]] = value


def load_spec(
    path: str | os.PathLike,
    overrides: Iterable[str] = (),
    gpus: int | None = None,
    nodes: int | None = None,
    *,
    need_data: bool = True,
) -> Spec:
    """Read, override and validate a spec file.

    need_data=False skips only the data.train requirement of task: train: `hpcgpu estimate` needs the
    model, the batch and data.seq_len, not the text (validate, sbatch, submit and run keep it)."""
    p = Path(path)
    try:
        text = p.read_text()
    except FileNotFoundError:
        raise SpecError("", "spec file not found", source=str(path)) from None
    except (IsADirectoryError, PermissionError, UnicodeDecodeError) as exc:
        raise SpecError("", f"cannot read the spec: {exc.__class__.__name__}", source=str(path)) from None
    if not text.strip():
        raise SpecError("", "the spec file is empty; it needs at least `name:`", source=str(path))
    raw, lines = read_yaml(text, str(path))
    if raw is None:
        raise SpecError("", "the spec file has no keys (only comments?); it needs at least `name:`", source=str(path))
    spec = spec_from_raw(raw, lines, overrides, gpus=gpus, nodes=nodes, need_data=need_data)
    return resolve_paths(spec, p.resolve().parent)


def resolve_paths(spec: Spec, base: Path) -> Spec:
    """Input files named in a spec are relative to the spec's folder; the resolved spec holds them absolute.

    runs_dir and data.cache_dir stay relative to where the command runs, like any output folder a tool
    writes, and are made absolute from there (the job may start elsewhere).
    """
    def absolute(value: str | None) -> str | None:
        if not value:
            return value
        expanded = os.path.expanduser(value)
        if os.path.isabs(expanded):
            return expanded
        return str((base / expanded).resolve())

    name_or_path = spec.model.name_or_path
    if name_or_path and is_local_path(name_or_path, base):
        name_or_path = absolute(name_or_path)  # else a hub id such as gpt2 or org/name stays as written
    cache_dir = str(Path(spec.data.cache_dir).expanduser().resolve()) if spec.data.cache_dir else None
    data = dataclasses.replace(spec.data, train=absolute(spec.data.train), eval=absolute(spec.data.eval),
                               cache_dir=cache_dir)
    model = dataclasses.replace(spec.model, name_or_path=name_or_path)
    ds = dataclasses.replace(spec.distributed.deepspeed, config=absolute(spec.distributed.deepspeed.config))
    dist = dataclasses.replace(spec.distributed, deepspeed=ds)
    infer = dataclasses.replace(spec.infer, input=absolute(spec.infer.input))
    runs_dir = str(Path(spec.runs_dir).expanduser().resolve())
    return dataclasses.replace(spec, data=data, model=model, distributed=dist, infer=infer, runs_dir=runs_dir)


def is_local_path(name_or_path: str, base: Path | None = None) -> bool:
    """model.name_or_path names a local folder (not a hub id like gpt2 or org/name): it is absolute,
    starts with `.` or `~`, is not shaped like a hub id, or exists relative to `base` (the spec's folder)."""
    if name_or_path.startswith((".", "~")) or os.path.isabs(name_or_path):
        return True
    if not re.fullmatch(HUB_ID_RE, name_or_path):
        return True
    return base is not None and (base / name_or_path).exists()


def export_drops(export: str, names: Iterable[str]) -> list[str]:
    """Which of `names` sbatch's `--export=VALUE` (or SBATCH_EXPORT) keeps from the job.

    ALL (alone or first: `ALL,A=1`) passes the submitter's environment; NONE/NIL pass none of it; a
    plain list passes only the names it lists (`NAME=value` sets a value instead of passing one)."""
    items = [item.strip() for item in export.split(",") if item.strip()]
    if any(item.upper() == "ALL" for item in items):
        return []
    listed = {item for item in items if "=" not in item}
    return [name for name in names if name not in listed]


def spec_from_raw(raw: Any, lines: LineMap | None = None, overrides: Iterable[str] = (),
                  gpus: int | None = None, nodes: int | None = None, *, need_data: bool = True) -> Spec:
    lines = lines or LineMap()
    if not isinstance(raw, dict):
        raise lines.error("", f"the spec must be a mapping of keys (name:, task:, ...), got {type(raw).__name__}")
    raw = apply_overrides(raw, overrides, lines)
    for flag, key, value in (("--gpus", "resources.gpus", gpus), ("--nodes", "resources.nodes", nodes)):
        if value is not None:
            set_dotted(raw, key, value, lines)
            lines.flags[key] = f"{flag} {value}"
    spec = parse_section(Spec, raw, "", lines)
    check_spec(spec, lines, need_data=need_data)
    return spec


def check_spec(spec: Spec, lines: LineMap, *, need_data: bool = True) -> None:
    """Checks that span several keys."""
    _check_task_needs(spec, lines, need_data=need_data)
    ds = spec.distributed.deepspeed
    if ds.offload_params and ds.zero_stage != 3:
        raise lines.error("distributed.deepspeed.offload_params", "needs zero_stage: 3")
    _check_env(spec, lines)
    _check_slurm_extra(spec, lines)
    _check_batch(spec, lines)
    _check_train_keys(spec, lines)
    _check_fsdp(spec, lines)
    _check_fused_lora(spec, lines)


def _check_task_needs(spec: Spec, lines: LineMap, *, need_data: bool) -> None:
    """What each task cannot run without."""
    if spec.task == "infer":
        _check_infer(spec, lines, need_data=need_data)
    if spec.task == "train":
        if not (spec.model.name_or_path or spec.model.config):
            raise lines.error("model", "task: train needs model.name_or_path or model.config")
        if need_data and not spec.data.train:
            raise lines.error("data.train", "task: train needs a training text file")
    if spec.task == "command" and not spec.command:
        raise lines.error("command", "task: command needs `command: [program, args...]`")
    if spec.task == "callable" and not spec.entry:
        raise lines.error("entry", "task: callable needs `entry: pkg.module:function`")
    if spec.model.config is not None and "model_type" not in spec.model.config:
        raise lines.error("model.config", "needs model_type (e.g. gpt2, llama)")
    if spec.model.adapter and spec.task != "infer":
        raise lines.error("model.adapter", "is for task: infer (a train run with train.lora trains its own)")
    if spec.train.lora is not None and spec.task != "train":
        raise lines.error("train.lora", "is for task: train (task: infer takes a trained adapter as model.adapter)")


def _check_env(spec: Spec, lines: LineMap) -> None:
    """env: names a shell takes, no literal secrets (they would be written into spec.yaml and job.sbatch)."""
    for name, value in spec.env.items():
        if not re.match(ENV_NAME_RE, name):
            raise lines.error(f"env.{name}", "is not a valid environment variable name")
        if launcher_owned(name):
            fix = "choose GPUs with resources.devices" if name == "CUDA_VISIBLE_DEVICES" else "remove it"
            raise lines.error(f"env.{name}", f"is set for every rank by the launcher (srun, the local executor, "
                              f"hpcgpu run); a value here would break the job: {fix}")
        if looks_secret(name) and value != "":
            raise lines.error(f"env.{name}", f"looks like a secret, and env: values are written into spec.yaml and "
                              f"job.sbatch where others may read them: list {name} in env_passthrough: instead "
                              "(the job takes it from the shell you submit from)")
    for name in spec.env_passthrough:
        if name in spec.env:
            raise lines.error("env_passthrough", f"{name} is also given a value in env:; keep one of the two")


def _check_slurm_extra(spec: Spec, lines: LineMap) -> None:
    """slurm.extra: sbatch option names, one-line values, and no --export that drops env_passthrough."""
    export = spec.slurm.extra.get("export")
    if spec.env_passthrough and export is not None and export is not False:
        dropped = export_drops(str(export), spec.env_passthrough)
        if dropped:
            raise lines.error("slurm.extra.export", f"{export!r} keeps env_passthrough's {', '.join(dropped)} "
                              "from the job; drop it, or use ALL (or list those names)")
    for opt, value in spec.slurm.extra.items():
        if not re.match(SBATCH_OPT_RE, opt):
            raise lines.error(f"slurm.extra.{opt}", "is not an sbatch option name (like mail-type)")
        if isinstance(value, str) and re.search(r"[\x00-\x1f]", value):
            raise lines.error(f"slurm.extra.{opt}", "must be one line without control characters")
    _check_sweep(spec, lines)


def _check_infer(spec: Spec, lines: LineMap, *, need_data: bool = True) -> None:
    if not (spec.model.name_or_path or spec.model.config):
        raise lines.error("model", "task: infer needs model.name_or_path (a local model dir) or model.config")
    if spec.model.adapter and not spec.model.name_or_path:
        raise lines.error("model.adapter", "an adapter goes on its base: give model.name_or_path, the base it "
                          "was trained on")
    if need_data and not spec.infer.input:
        raise lines.error("infer.input", "task: infer needs an input file (.jsonl or .txt)")
    if spec.model.quantization != "none" and not spec.model.name_or_path:
        raise lines.error("model.quantization", "int8/int4 weights are quantized as a saved model loads: give "
                          "model.name_or_path (a folder save_pretrained wrote), or use quantization: none")
    if "" in spec.infer.stop:  # "" is found at the start of every completion: each would come back empty
        raise lines.error(f"infer.stop[{spec.infer.stop.index('')}]",
                          "an empty stop string would end every completion at once; remove it")
    g, gpus = spec.infer.gpus_per_replica, spec.resources.gpus
    if isinstance(g, int) and gpus % g:
        raise lines.error("infer.gpus_per_replica", f"{g} does not divide the {gpus} GPUs per node "
                          "(resources.gpus): a model copy spans GPUs of one node, and every GPU serves one")


def _check_batch(spec: Spec, lines: LineMap) -> None:
    """The spec's own numbers (nodes x gpus), checked early by the rule the job's run plan applies to
    the real world size (spec/derive.py batch_split)."""
    t = spec.train
    if spec.task != "train":
        return
    try:
        batch_split(t.global_batch_size, spec.world_size, None if t.micro_batch_size == "auto" else t.micro_batch_size)
    except SpecError as exc:
        raise lines.error(exc.path, exc.message) from None


def _check_train_keys(spec: Spec, lines: LineMap) -> None:
    """How long to train is said once (max_steps or epochs); early stopping watches an eval loss, so it
    needs eval data and evals during training."""
    t = spec.train
    if spec.task != "train":
        return
    if spec.model.quantization != "none" and t.lora is None:  # full training of quantized weights: no
        raise lines.error("model.quantization", "a train spec trains quantized weights only through adapters: "
                          "add train.lora (QLoRA: the base frozen in 4/8 bits), or use quantization: none")
    if spec.model.quantization != "none" and not spec.model.name_or_path:
        raise lines.error("model.quantization", "QLoRA quantizes a saved base as it loads: give model.name_or_path "
                          "(a folder save_pretrained wrote), or use quantization: none")
    if t.merge and t.lora is None:
        raise lines.error("train.merge", "merges LoRA adapters into the base: it needs train.lora")
    if t.lora is not None and isinstance(t.lora.target_modules, list) and not t.lora.target_modules:
        raise lines.error("train.lora.target_modules", "an empty list adapts nothing: name layers, or use auto")
    if t.max_steps is not None and t.epochs is not None:
        raise lines.error("train.epochs", f"give train.max_steps ({t.max_steps}) or train.epochs ({t.epochs}), "
                          "not both")
    if t.early_stopping is None:
        return
    if not spec.data.eval:
        raise lines.error("train.early_stopping", "needs data.eval: the eval loss it watches comes from it")
    if not t.eval_every:
        raise lines.error("train.early_stopping", "needs train.eval_every (evals during training, e.g. 100)")


def _check_fsdp(spec: Spec, lines: LineMap) -> None:
    """What distributed.strategy: fsdp does not run with, each with the key to change."""
    if spec.distributed.strategy != "fsdp":
        return
    t = spec.train
    if t.lora is not None:
        raise lines.error("train.lora", "trains under DDP or DeepSpeed ZeRO-1/2, not distributed.strategy: fsdp")
    if t.fused_loss:
        raise lines.error("train.fused_loss", "reads the output layer's weight outside the model's forward, where "
                          "distributed.strategy: fsdp holds only its shard; set it to false")
    if t.precision == "fp16":
        raise lines.error("train.precision", "distributed.strategy: fsdp trains in bf16 or fp32 (fp16's loss scale "
                          "would need one overflow check over every shard); use bf16")
    if t.compile is not False and t.compile_mode in ("reduce-overhead", "max-autotune"):
        raise lines.error("train.compile_mode", f"{t.compile_mode} captures CUDA graphs, which the collectives "
                          "distributed.strategy: fsdp runs between blocks break; use default or "
                          "max-autotune-no-cudagraphs")


def _check_fused_lora(spec: Spec, lines: LineMap) -> None:
    """train.fused_loss computes the loss from the output layer's own weight, skipping its forward: an
    adapter on that layer would never train."""
    lora = spec.train.lora
    if not spec.train.fused_loss or lora is None or not isinstance(lora.target_modules, list):
        return
    if any(str(name).split(".")[-1] == "lm_head" for name in lora.target_modules):
        raise lines.error("train.lora.target_modules", "names lm_head, whose forward train.fused_loss skips (its "
                          "adapter would not train); drop lm_head or set train.fused_loss: false")


def _check_sweep(spec: Spec, lines: LineMap) -> None:
    for key, values in spec.sweep.items():
        if not isinstance(values, list) or not values:
            raise lines.error(f"sweep.{key}", "needs a non-empty list of values")
        section: Any = Spec
        for part in key.split("."):
            if not (isinstance(section, type) and dataclasses.is_dataclass(section)):
                break  # below a free-form mapping (model.config.n_layer): any key goes
            fields = section_fields(section)
            if part not in fields:
                raise lines.error(f"sweep.{key}", f"no spec key '{key}' to sweep; "
                                  f"valid keys here: {', '.join(fields)}")
            section = typing.get_type_hints(section)[fields[part].name]


def spec_to_dict(spec: Spec) -> dict:
    return to_plain(spec)


def dump_spec(spec: Spec) -> str:
    return yaml.safe_dump(spec_to_dict(spec), sort_keys=False, default_flow_style=False, width=100)
