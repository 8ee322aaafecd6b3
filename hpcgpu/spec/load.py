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
    defaults: bool = False,
) -> Spec:
    """Read, override and validate a spec file.

    need_data=False skips only the data.train requirement of task: train: `hpcgpu estimate` needs the
    model, the batch and data.seq_len, not the text (validate, sbatch, submit and run keep it).
    defaults=True merges the user's and the project's defaults files under the spec (`defaults_files`):
    the host commands that read a user's spec ask for it; a run dir's spec.yaml is already merged and
    is read without them, so a requeue runs what was submitted whatever the files say by then."""
    p = Path(path)
    raw, lines = read_layers(p, defaults=defaults)
    spec = spec_from_raw(raw, lines, overrides, gpus=gpus, nodes=nodes, need_data=need_data)
    return resolve_paths(spec, p.resolve().parent)


def read_spec_file(p: Path) -> tuple[dict, LineMap]:
    """The spec file's keys and their lines."""
    try:
        text = p.read_text()
    except FileNotFoundError:
        raise SpecError("", "spec file not found", source=str(p)) from None
    except (IsADirectoryError, PermissionError, UnicodeDecodeError) as exc:
        raise SpecError("", f"cannot read the spec: {exc.__class__.__name__}", source=str(p)) from None
    if not text.strip():
        raise SpecError("", "the spec file is empty; it needs at least `name:`", source=str(p))
    raw, lines = read_yaml(text, str(p))
    if raw is None:
        raise SpecError("", "the spec file has no keys (only comments?); it needs at least `name:`", source=str(p))
    return raw, lines


# Defaults files: spec keys a project or a user gives every spec (partition, account, slurm.setup, ...)
NO_DEFAULTS_ENV = "HPCGPU_NO_DEFAULTS"  # set (to anything but 0) to read neither file
PROJECT_DEFAULTS = "hpcgpu.yaml"
# keys naming files or folders: relative in a defaults file means relative to that file's folder
DEFAULTS_PATH_KEYS = ("runs_dir", "data.train", "data.eval", "data.cache_dir", "model.name_or_path",
                      "model.adapter", "infer.input", "distributed.deepspeed.config")


def defaults_files(spec_path: Path) -> list[Path]:
    """The defaults files under a spec, weakest first: the user's, then the project's."""
    if os.environ.get(NO_DEFAULTS_ENV, "") not in ("", "0"):
        return []
    files = [user_defaults_file(), project_defaults_file(spec_path)]
    return [f for f in files if f is not None and f.is_file()]


def user_defaults_file() -> Path | None:
    config = os.environ.get("XDG_CONFIG_HOME", "")
    try:
        base = Path(config) if os.path.isabs(config) else Path.home() / ".config"  # XDG: a relative one is ignored
    except RuntimeError:  # no home to look in
        return None
    return base / "hpcgpu" / "defaults.yaml"


def project_defaults_file(spec_path: Path) -> Path | None:
    """The nearest hpcgpu.yaml from the spec's folder up, below the user's home (a file in home or above
    it is not one project's) and up to the filesystem root."""
    spec_path = spec_path.resolve()
    try:
        home: Path | None = Path.home().resolve()
    except RuntimeError:
        home = None
    for folder in spec_path.parents:
        if folder == home:
            return None
        candidate = folder / PROJECT_DEFAULTS
        if candidate.is_file() and candidate != spec_path:
            return candidate
    return None


def read_layers(spec_path: Path, *, defaults: bool) -> tuple[dict, LineMap]:
    """The spec's keys over the defaults files' (deep-merged mappings, lists replaced), each key's line
    kept with the file it came from, so that every later error names the right file."""
    raw, lines = read_spec_file(spec_path)
    files = defaults_files(spec_path) if defaults else []
    if not files:
        return raw, lines
    merged: dict = {}
    merged_lines = LineMap(lines.source)
    for file in files:
        merge_layer(merged, *read_defaults_file(file), "", merged_lines)
    merge_layer(merged, raw, lines, "", merged_lines)
    return merged, merged_lines


def read_defaults_file(path: Path) -> tuple[dict, LineMap]:
    shown = _home_short(path)
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise SpecError("", f"cannot read this defaults file: {exc.__class__.__name__} (or set "
                        f"{NO_DEFAULTS_ENV}=1 to read no defaults files)", source=shown) from None
    data, lines = read_yaml(text, shown)
    if data is None:
        return {}, lines  # empty, or only comments
    if not isinstance(data, dict):
        raise SpecError("", f"a defaults file holds spec keys (slurm:, resources:, ...), got {type(data).__name__}",
                        source=shown)
    _rebase_paths(data, path.resolve().parent)
    return data, lines


def _home_short(path: Path) -> str:
    """~/.config/hpcgpu/defaults.yaml rather than the whole path, in messages."""
    try:
        homes = [Path.home(), Path.home().resolve()]
    except RuntimeError:
        return str(path)
    for home in homes:
        if path.is_relative_to(home):
            return "~/" + str(path.relative_to(home))
    return str(path)


def _rebase_paths(data: dict, base: Path) -> None:
    for key in DEFAULTS_PATH_KEYS:
        *parents, last = key.split(".")
        node: Any = data
        for part in parents:
            node = node.get(part) if isinstance(node, dict) else None
        value = node.get(last) if isinstance(node, dict) else None
        if not isinstance(value, str) or not value:
            continue
        if key == "model.name_or_path" and not is_local_path(value, base):
            continue  # a hub id
        expanded = os.path.expanduser(value)
        node[last] = expanded if os.path.isabs(expanded) else str((base / expanded).resolve())


def merge_layer(into: dict, layer: dict, layer_lines: LineMap, path: str, lines: LineMap) -> None:
    """Merge one file's keys into `into`: a mapping over a mapping merges key by key; anything else
    replaces what was there, and the replaced keys' lines go with it."""
    for key, value in layer.items():
        sub = f"{path}.{key}" if path else str(key)
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            merge_layer(into[key], value, layer_lines, sub, lines)
        else:
            into[key] = value
            for gone in [k for k in lines.lines if k.startswith(sub + ".")]:
                del lines.lines[gone]
                lines.files.pop(gone, None)
            for below in [k for k in layer_lines.lines if k.startswith(sub + ".")]:
                lines.lines[below] = layer_lines.lines[below]
                lines.files[below] = layer_lines.source or ""
        if sub in layer_lines.lines:
            lines.lines[sub] = layer_lines.lines[sub]
            lines.files[sub] = layer_lines.source or ""


def spec_sources(path: str | os.PathLike, overrides: Iterable[str] = (), gpus: int | None = None,
                 nodes: int | None = None) -> dict[str, str]:
    """Where each value set anywhere came from (file:line or the flag), by dotted key; a key not listed
    is its default. The spec is read as load_spec(defaults=True) reads it."""
    raw, lines = read_layers(Path(path), defaults=True)
    apply_flags(raw, lines, overrides, gpus, nodes)
    out = {key: f"{lines.files.get(key, lines.source)}:{line}" for key, line in lines.lines.items()
           if not any(other.startswith(key + ".") for other in lines.lines)}
    for key, flag in lines.flags.items():
        for covered in [k for k in out if k == key or k.startswith(key + ".")]:
            del out[covered]
        out[key] = flag
    return dict(sorted(out.items()))


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
    raw = apply_flags(raw, lines, overrides, gpus, nodes)
    spec = parse_section(Spec, raw, "", lines)
    check_spec(spec, lines, need_data=need_data)
    return spec


def apply_flags(raw: dict, lines: LineMap, overrides: Iterable[str], gpus: int | None, nodes: int | None) -> dict:
    """--set, then --gpus/--nodes, over the spec's keys (a copy)."""
    raw = apply_overrides(raw, overrides, lines)
    for flag, key, value in (("--gpus", "resources.gpus", gpus), ("--nodes", "resources.nodes", nodes)):
        if value is not None:
            set_dotted(raw, key, value, lines)
            lines.flags[key] = f"{flag} {value}"
    return raw


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
    if not (spec.model.name_or_path or spec.model.config or spec.model.adapter):
        raise lines.error("model", "task: infer needs model.name_or_path (a local model dir), model.config or "
                          "model.adapter")
    if spec.model.adapter and spec.model.config is not None and not spec.model.name_or_path:
        raise lines.error("model.adapter", "goes on the saved base it was trained on, not on model.config: drop "
                          "model.config (the base is then the one its adapter_config.json names) or give "
                          "model.name_or_path")
    if need_data and not spec.infer.input:
        raise lines.error("infer.input", "task: infer needs an input file (.jsonl or .txt)")
    if spec.model.quantization != "none" and not (spec.model.name_or_path or spec.model.adapter):
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
    if t.lora is not None and isinstance(t.lora.target_modules, list):
        _check_target_names(t.lora.target_modules, lines)
    if t.max_steps is not None and t.epochs is not None:
        raise lines.error("train.epochs", f"give train.max_steps ({t.max_steps}) or train.epochs ({t.epochs}), "
                          "not both")
    if t.early_stopping is None:
        return
    if not spec.data.eval:
        raise lines.error("train.early_stopping", "needs data.eval: the eval loss it watches comes from it")
    if not t.eval_every:
        raise lines.error("train.early_stopping", "needs train.eval_every (evals during training, e.g. 100)")


def _check_target_names(names: list[str], lines: LineMap) -> None:
    """train.lora.target_modules names layers as peft reads a list: a layer's name or the end of its path.
    peft reads a string as a regular expression instead; here a string is the one name (schema.Lora)."""
    key = "train.lora.target_modules"
    if not names:
        raise lines.error(key, "an empty list adapts nothing: name layers, or use auto")
    for name in names:
        if not re.fullmatch(r"[A-Za-z0-9_]+(\.[A-Za-z0-9_]+)*", name):
            raise lines.error(key, f"{name!r} is not a layer name or dotted path (c_attn, attn.c_attn): layers are "
                              "named, not matched by a regular expression; list the names, or use auto for every "
                              "linear layer")


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
