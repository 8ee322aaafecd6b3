"""Checks on this host before a job is made: what would fail in the job, found before its wait in the queue.

One place, run by the host's resolve step (hpcgpu/launch/resolve.py) for `hpcgpu validate`, `hpcgpu sbatch`,
`hpcgpu submit` (SLURM and local) and `hpcgpu queue`; SPEC_CHECKS below is the table of key -> check:
- the input files a spec names exist here and can be read (data.train, data.eval,
  distributed.deepspeed.config, a local model.name_or_path, infer.input; a hub id such as gpt2 is not
  a path); a data.train/data.eval folder is a complete prepared dataset (its manifest.json) or raw data
  the job reads (parquet/arrow files, Dataset.save_to_disk);
- the model's attention sizes (model.config, or a local model folder's config.json): the hidden size a
  multiple of the heads (n_embd/n_head, hidden_size/num_attention_heads), the heads a multiple of
  num_key_value_heads; task: infer, mode generate: infer.max_new_tokens below the model's positions
  (n_positions, max_position_embeddings), so that a prompt fits;
- task: infer: every row of infer.input is valid (hpcgpu/infer_inputs.py, the reader the job uses: the
  first bad row as file:line; rows with "messages" need a tokenizer with a chat template), a local model
  folder holds a config.json and a tokenizer, infer.max_memory is readable, model.quantization can run
  (bitsandbytes installed; the local executor has a GPU);
- task: train with data.format chat or prompt_completion: the first rows of a raw .jsonl data.train/eval
  have the fields the format needs (the job's own row reader, hpcgpu/data/sources.py: file:line), chat
  has a tokenizer with a chat template (a local model folder's; a hub id's is not looked at), and a
  prepared folder was prepared with the spec's data.format (its manifest; also checked for text);
- task: train with a train.lora.target_modules list: every name matches a linear layer of the model by
  peft's rule (a layer's path or its end) and nothing else (not a module holding layers), with a did you
  mean; not lm_head where the head is tied to the input embedding or under train.fused_loss; where the config
  (model.config, a local folder's config.json) is of a family whose layers are known (gpu/estimate.py
  linear_layers), the job's own line (runtime/lora.py check_targets, gpu/estimate.py target_modules_problem);
- task: infer with model.adapter: its adapter_config.json is there, names its base where model.name_or_path
  is absent (launch/resolve.py takes the base from it), and the base's layers have the shapes of the
  adapter's (adapter_model.safetensors' header), the job's own line (gpu/estimate.py adapter_shape_problem);
- model.config.model_type is a model type the installed transformers knows. The list comes from
  transformers' config mapping, asked in a subprocess (it imports torch) and cached on disk per
  transformers version, so these commands never import transformers or torch themselves; without
  transformers here the check is skipped;
- runs_dir can hold run dirs (no file in the way, a folder we may write);
- track.tensorboard / track.wandb: their package is installed in this Python (found, not imported);
  track.wandb.mode online: a W&B login (WANDB_API_KEY or a ~/.netrc entry; as env_passthrough: submit
  an error, sbatch a warning);
- the variables env_passthrough names are set in this shell (submit: an error; sbatch: a warning,
  since the script takes them from the shell that runs `sbatch` later).
Every problem is one line naming the key, exit 2.
"""
from __future__ import annotations

import functools
import importlib.util
import json
import os
import re
import shutil
from pathlib import Path
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence
from urllib.parse import urlparse

from hpcgpu.contract import launcher_owned
from hpcgpu.errors import HpcgpuError, SpecError
from hpcgpu.gpu.estimate import (adapter_shape_problem, linear_layers, not_an_adapter, parse_max_memory,
                                 read_adapter, target_modules_problem)
from hpcgpu.gpu.model_types import model_type_problem
from hpcgpu.infer_inputs import Row, read_rows, rows_fit_problem
from hpcgpu.launch.container import image_is_path, input_paths
from hpcgpu.launch.registry import file_system_type
from hpcgpu.launch.replicas import quantization_problem
from hpcgpu.spec import Spec
from hpcgpu.spec.load import export_drops, is_local_path
from hpcgpu.spec.schema import ENV_NAME_RE, looks_secret

Warn = Callable[[str], None]


# --- input files ----------------------------------------------------------------------------------

# the keys that may name a local input file, in the order they are checked
INPUT_KEYS = ("data.train", "data.eval", "distributed.deepspeed.config", "infer.input", "model.name_or_path")


def input_problem(key: str, value: str) -> str | None:
    """Why the job could not read this input, or None. Relative paths (a swept value) are from here."""
    path = Path(value).expanduser()
    hint = " (a local path; a hub id looks like gpt2 or org/name)" if key == "model.name_or_path" else ""
    try:
        is_dir = path.is_dir()
        path.stat()
    except FileNotFoundError:
        return f"{key}: file not found: {value}{hint}"
    except OSError as exc:
        return f"{key}: cannot read {value}: {exc.strerror or exc}"
    if key == "model.name_or_path" and not is_dir:
        return f"{key}: {value} is a file; from_pretrained needs the model's folder"
    if key == "distributed.deepspeed.config" and is_dir:
        return f"{key}: {value} is a folder, not a JSON file"
    if key == "infer.input" and is_dir:
        return f"{key}: {value} is a folder, not a .jsonl or .txt file"
    if not os.access(path, os.R_OK | (os.X_OK if is_dir else 0)):
        return f"{key}: cannot read {value}: permission denied"
    if key in ("data.train", "data.eval") and is_dir:
        return data_folder_problem(key, value)
    return None


# the prepared-dataset files (hpcgpu/data/format.py's MANIFEST and TOKENS: that module imports numpy)
MANIFEST, TOKENS = "manifest.json", "tokens.bin"


def data_folder_problem(key: str, value: str) -> str | None:
    """A data.train/data.eval folder the job could not read, as the job tells (hpcgpu.data's
    open_training_data): one meant as a prepared dataset (tokens.bin) without its manifest, written last,
    is incomplete; any other folder is raw data and needs parquet/arrow files or Dataset.save_to_disk's
    state.json (hpcgpu/data/sources.py)."""
    path = Path(value).expanduser()
    if (path / MANIFEST).exists():
        return None  # prepared: its data.format is checked with the rows, the rest by the job's reader
    if (path / TOKENS).exists():
        return f"{key}: {value}: not a complete prepared dataset (no {MANIFEST}); run hpcgpu data prepare again"
    if (path / "state.json").is_file() or any(path.rglob("*.parquet")) or any(path.rglob("*.arrow")):
        return None
    return (f"{key}: {value}: a folder with no .parquet or .arrow files (and no state.json of "
            f"Dataset.save_to_disk), and not a prepared dataset (no {MANIFEST}); give a .txt, .jsonl, .parquet "
            "or .arrow file, such a folder, or one hpcgpu data prepare wrote")


def input_problems(spec: Spec) -> list[str]:
    """Problems with the spec's input files, one line each ('data.train: file not found: /x/t.txt')."""
    return [p for p in (input_problem(key, value) for key, value in input_paths(spec)) if p]


# --- task: infer ---------------------------------------------------------------------------------

# what AutoTokenizer.from_pretrained can build a tokenizer from; hpcgpu_tokenizer.json marks the
# byte-level tokenizer hpcgpu's trainer saves with a model trained without tokenizer files
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt",
                   "spiece.model", "sentencepiece.bpe.model", "hpcgpu_tokenizer.json")


def infer_model_problem(spec: Spec) -> str | None:
    """Why the infer task could not load a local model folder (that it exists was checked before)."""
    name = spec.model.name_or_path
    if spec.task != "infer" or not name or not is_local_path(name, Path.cwd()):
        return None
    folder = Path(name).expanduser()
    if not (folder / "config.json").is_file():
        return f"model.name_or_path: {name} has no config.json (not a folder save_pretrained() wrote)"
    if not any((folder / f).is_file() for f in TOKENIZER_FILES):
        return (f"model.name_or_path: {name} has no tokenizer (no tokenizer.json, tokenizer_config.json, "
                "vocab files or hpcgpu_tokenizer.json); task: infer needs one: save it into the folder")
    return None


def hub_cache(spec: Spec, environ: Mapping[str, str] | None = None) -> Path:
    """Where huggingface_hub keeps downloads for the job: HF_HUB_CACHE, else HF_HOME/hub, else
    $XDG_CACHE_HOME/huggingface/hub (the spec's env first, as the job sees it)."""
    env = {**(os.environ if environ is None else environ), **{k: str(v) for k, v in spec.env.items()}}
    if env.get("HF_HUB_CACHE"):
        return Path(env["HF_HUB_CACHE"]).expanduser()
    home = env.get("HF_HOME") or os.path.join(env.get("XDG_CACHE_HOME") or "~/.cache", "huggingface")
    return Path(home).expanduser() / "hub"


def hub_model_problem(spec: Spec, environ: Mapping[str, str] | None = None) -> str | None:
    """A hub id the train or infer task would not find: jobs load hub ids from the local cache only
    (runtime/tasks: HF_HUB_OFFLINE=1 unless set), so one that is not there is a mistake found here."""
    name = spec.model.name_or_path
    if spec.task not in ("train", "infer") or not name or is_local_path(name, Path.cwd()):
        return None
    if str(spec.env.get("HF_HUB_OFFLINE", "1")).lower() in ("0", "false", "no", "off"):
        return None  # the spec lets the job download
    cache = hub_cache(spec, environ)
    if any((cache / f"models--{name.replace('/', '--')}" / "snapshots").glob("*")):
        return None
    return (f"model.name_or_path: {name!r} is not a folder here, and as a hub id it is not in the Hugging Face "
            f"cache ({cache}); jobs load hub ids from the cache only: download it first (hf download {name}) "
            "or give the folder save_pretrained() wrote")


def has_chat_template(folder: Path) -> bool:
    """Whether the tokenizer saved in `folder` has a chat template (where transformers saves one)."""
    if (folder / "chat_template.jinja").is_file() or (folder / "chat_template.json").is_file() \
            or (folder / "additional_chat_templates").is_dir():
        return True
    try:
        config = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and bool(config.get("chat_template"))


def max_memory_problem(spec: Spec) -> str | None:
    """infer.max_memory must be one the job can read (the job's own parser)."""
    if spec.task != "infer" or spec.infer.max_memory == "auto":
        return None
    try:
        parse_max_memory(spec.infer.max_memory)
    except HpcgpuError as exc:
        return str(exc)
    return None


def infer_input_problem(spec: Spec) -> str | None:
    """The first bad row of infer.input as 'file:line: why', or None (the file was found before): a row
    the reader refuses, "messages" without a chat template, a row longer than the model's positions."""
    if spec.task != "infer" or not spec.infer.input:
        return None
    try:
        rows = input_rows(spec.infer.input, spec.infer.mode)
    except HpcgpuError as exc:
        return str(exc)
    return chat_rows_problem(spec, rows)


def input_rows(path: str, mode: str) -> list[Row]:
    """infer.input's rows, read once for the checks that look at them (again once the file changed)."""
    try:
        st = os.stat(path)
    except OSError:
        return read_rows(path, mode)  # the reader says what is wrong
    return _rows_of(path, mode, st.st_mtime_ns, st.st_size)


@functools.lru_cache(maxsize=4)
def _rows_of(path: str, mode: str, mtime_ns: int, size: int) -> list[Row]:
    return read_rows(path, mode)


def infer_lengths_problem(spec: Spec) -> str | None:
    """After the rows read and max_new_tokens fit the model at all: the rows' own lengths."""
    if spec.task != "infer" or not spec.infer.input:
        return None
    try:
        return rows_length_problem(spec, input_rows(spec.infer.input, spec.infer.mode))
    except HpcgpuError:
        return None  # infer.input's own check said it


def chat_rows_problem(spec: Spec, rows: list[Row]) -> str | None:
    """Rows with "messages" need a tokenizer with a chat template: the byte-level one (model.config, or a
    model hpcgpu trained without tokenizer files) has none; a hub id's is not looked at here."""
    chat = next((row for row in rows if row.messages is not None), None)
    name = spec.model.name_or_path
    if chat is None or (name and not is_local_path(name, Path.cwd())):
        return None
    folder = Path(name).expanduser() if name else None
    if folder is not None and not (folder / "hpcgpu_tokenizer.json").is_file() and has_chat_template(folder):
        return None
    whose = f"the tokenizer in {name}" if folder is not None else "the byte-level tokenizer of model.config"
    return (f"{spec.infer.input}:{chat.line}: \"messages\" need the tokenizer's chat template, and {whose} has "
            "none; give a \"prompt\" instead")


def rows_length_problem(spec: Spec, rows: list[Row]) -> str | None:
    """A prompt (score: text) longer than the model's positions, counted as the job tokenizes it: the
    byte-level tokenizer, or a local model folder's tokenizer.json through `tokenizers` (no torch);
    rows with "messages" (the chat template's text) are left to the job."""
    found = model_config_of(spec)
    limit = config_int(found[2], "max_position_embeddings", "n_positions") if found else None
    count = prompt_counter(spec)
    if limit is None or count is None:
        return None
    plain = [r for r in rows if r.messages is None]
    texts = [(r.text if spec.infer.mode == "score" else r.prompt) or "" for r in plain]
    lengths = [max(1, n) for n in count(texts)]  # the job starts an empty prompt from BOS (or EOS)
    return rows_fit_problem(plain, lengths, limit[1], spec.infer.mode, spec.infer.max_new_tokens,
                            str(spec.infer.input))


def prompt_counter(spec: Spec) -> Callable[[list[str]], list[int]] | None:
    """Token counts of texts as the job's tokenizer makes them (special tokens included), or None where
    the host cannot tell (a hub id, a folder without tokenizer.json)."""
    name = spec.model.name_or_path
    if not name or Path(name, "hpcgpu_tokenizer.json").expanduser().exists():
        return lambda texts: [len(t.encode("utf-8")) for t in texts]
    path = Path(name).expanduser() / "tokenizer.json"
    if not is_local_path(name, Path.cwd()) or not path.is_file():
        return None
    from tokenizers import Tokenizer  # Rust, no torch: a local model folder's tokenizer only

    try:
        tok = Tokenizer.from_file(str(path))
    except Exception:  # tokenizers raises bare Exceptions; the job's loader says what is wrong with it
        return None
    return lambda texts: [len(e.ids) for e in tok.encode_batch(texts, add_special_tokens=True)]


# --- task: train, data.format ------------------------------------------------------------------

# bytes of a raw .jsonl data.train/eval read here (the whole file up to this: ~2 s for 60 MB), with the
# reader the job and `data prepare` use, so that the messages are theirs
DATA_BYTES_CHECKED = 256 << 20


def prepared_formats_problem(spec: Spec) -> str | None:
    """task: train: a prepared data.train/data.eval folder of another data.format, or None."""
    if spec.task != "train":
        return None
    return next((p for p in (prepared_format_problem(value, spec.data.format)
                             for value in (spec.data.train, spec.data.eval) if value) if p), None)


def data_rows_problem(spec: Spec, key: str) -> str | None:
    """task: train: the first bad row of data.train or data.eval (`key`) for data.format, or None."""
    value = spec.data.train if key == "data.train" else spec.data.eval
    if spec.task != "train" or not value:
        return None
    return example_rows_problem(key, value, spec.data.format, spec.data.text_field)


def untrained_rows_problem(spec: Spec, key: str, here: Here) -> str | None:
    """task: train, chat/prompt_completion: no row of data.train/data.eval (`key`) with a trainable token;
    some without one are a note (hpcgpu/data/trainable.py: the job's rule and line)."""
    value = spec.data.train if key == "data.train" else spec.data.eval
    if spec.task != "train" or spec.data.format == "text" or not value:
        return None
    from hpcgpu.data.trainable import untrained_problem  # hpcgpu.data imports numpy

    return untrained_problem(key, value, spec.data.format, here.note)


def chat_data_problem(spec: Spec) -> str | None:
    """task: train, data.format chat: the tokenizer needs a chat template."""
    if spec.task != "train" or spec.data.format != "chat":
        return None
    return chat_template_problem(spec)


def prepared_format_problem(value: str, data_format: str) -> str | None:
    """A prepared folder (one with a manifest) must have been prepared with data.format."""
    manifest_path = Path(value).expanduser() / MANIFEST
    if not manifest_path.is_file():
        return None
    try:
        manifest = json.loads(manifest_path.read_text())
    except (OSError, ValueError):
        return None  # the job's reader says what is wrong with it
    prepared = (manifest.get("data_format") if isinstance(manifest, dict) else None) or "text"
    if prepared == data_format:
        return None
    from hpcgpu.data import format_mismatch  # hpcgpu.data imports numpy: only for a prepared folder

    return format_mismatch(value, prepared, data_format)


def example_rows_problem(key: str, value: str, data_format: str, text_field: str = "text") -> str | None:
    """The first bad row of a raw .jsonl input (its first DATA_BYTES_CHECKED): a text row without its
    text field, a chat/prompt_completion row of another shape, a line that is no JSON or no UTF-8."""
    path = Path(value).expanduser()
    if path.is_dir() or (data_format == "text" and path.suffix != ".jsonl"):
        return None
    from hpcgpu.data.sources import EXAMPLE_SHAPES, example_row, jsonl_text  # hpcgpu.data imports numpy

    if path.suffix != ".jsonl":
        return (f"{key}: data.format {data_format} reads a .jsonl file, one {EXAMPLE_SHAPES[data_format]} "
                f"a line, not {path.name}")
    read = ((lambda raw, n: jsonl_text(raw, text_field, path, n)) if data_format == "text" else
            (lambda raw, n: example_row(raw, data_format, value, n)))
    try:
        with open(path, "rb") as fh:
            seen = 0
            for n, raw in enumerate(fh, 1):
                read(raw, n)
                seen += len(raw)
                if seen >= DATA_BYTES_CHECKED:
                    break
    except HpcgpuError as exc:
        return str(exc)
    return None


def chat_template_problem(spec: Spec) -> str | None:
    """data.format chat needs the tokenizer's chat template: the byte-level one (model.config, or a model
    hpcgpu trained without tokenizer files) has none; a hub id's is not looked at here."""
    name = spec.model.name_or_path
    if name and not is_local_path(name, Path.cwd()):
        return None
    folder = Path(name).expanduser() if name else None
    if folder is not None and not (folder / "hpcgpu_tokenizer.json").is_file() and has_chat_template(folder):
        return None
    whose = f"the tokenizer in {name}" if folder is not None else "the byte-level tokenizer of model.config"
    return (f"data.format: chat needs the tokenizer's chat template, and {whose} has none; save one with "
            "the tokenizer or use data.format: prompt_completion")


# --- the model's shape ---------------------------------------------------------------------------

def model_config_of(spec: Spec) -> tuple[str, str, dict[str, Any]] | None:
    """(where, prefix, config): the model's (text) config as the job builds it, read without transformers:
    a local model folder's config.json (the job loads model.name_or_path first), else model.config; the
    text_config of a multimodal one (the job's get_text_config). None for a hub id, or a folder without
    a readable config.json (the input and infer checks name that)."""
    name = spec.model.name_or_path
    if name:
        if not is_local_path(name, Path.cwd()):
            return None
        path = Path(name).expanduser() / "config.json"
        try:
            cfg = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None
        where = f"model.name_or_path: {path}"
    else:
        cfg, where = spec.model.config, "model.config"
    if not isinstance(cfg, dict):
        return None
    if isinstance(cfg.get("text_config"), dict):
        return where, "text_config.", cfg["text_config"]
    return where, "", cfg


def config_int(cfg: Mapping[str, Any], *keys: str) -> tuple[str, int] | None:
    """The first of `keys` the config sets to a positive whole number, as (key, value)."""
    for key in keys:
        value = cfg.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return key, value
    return None


# model types whose attention transformers (5.24) refuses to build when the hidden size is not a multiple
# of the heads; qwen2, mistral, mixtral, qwen3, gemma, olmo, starcoder2 and granite build and run
HEAD_DIM_FROM_HIDDEN = frozenset({"gpt2", "llama", "gpt_neox", "falcon", "gptj", "bloom", "opt"})


def attention_problem(spec: Spec) -> str | None:
    """Attention sizes that do not divide, which transformers refuses when it builds the model
    (HEAD_DIM_FROM_HIDDEN): the hidden size over the heads (gpt2's n_embd/n_head, hidden_size/
    num_attention_heads of the others), the query heads over the key/value heads (num_key_value_heads,
    where set). A config that sets head_dim sizes its heads itself (qwen3, gemma, mistral save one):
    its hidden size is not checked."""
    found = model_config_of(spec)
    if found is None:
        return None
    where, prefix, cfg = found
    hidden = config_int(cfg, "n_embd", "hidden_size")
    heads = config_int(cfg, "n_head", "num_attention_heads")
    own_head_dim = hidden is not None and hidden[0] == "hidden_size" and config_int(cfg, "head_dim") is not None
    refused = cfg.get("model_type") in HEAD_DIM_FROM_HIDDEN  # others (qwen2, mistral, ...) build and run
    if hidden and heads and hidden[1] % heads[1] and refused and not own_head_dim:
        return (f"{where}: {prefix}{hidden[0]} {hidden[1]} is not divisible by {prefix}{heads[0]} {heads[1]}; "
                f"make {hidden[0]} a multiple of {heads[0]}")
    kv = config_int(cfg, "num_key_value_heads")
    if heads and kv and heads[1] % kv[1]:
        return (f"{where}: {prefix}{heads[0]} {heads[1]} is not divisible by {prefix}{kv[0]} {kv[1]}; "
                f"make {heads[0]} a multiple of {kv[0]}")
    return None


def positions_problem(spec: Spec) -> str | None:
    """task: infer, mode generate: every row is its prompt (a token at least) + max_new_tokens, inside the
    model's positions (the job checks each row: runtime/tasks/infer.py check_rows_fit)."""
    if spec.task != "infer" or spec.infer.mode != "generate":
        return None
    found = model_config_of(spec)
    positions = found and config_int(found[2], "n_positions", "max_position_embeddings")
    if not positions or spec.infer.max_new_tokens < positions[1]:
        return None
    where, prefix, _ = found
    return (f"infer.max_new_tokens: {spec.infer.max_new_tokens} leaves no room for a prompt in the model's "
            f"{positions[1]} positions ({prefix}{positions[0]}, {where}); lower it to leave room for the "
            "longest prompt")


# --- runs_dir -------------------------------------------------------------------------------------

def runs_dir_problem(spec: Spec) -> str | None:
    """Why run dirs could not be made under runs_dir, as far as can be told without writing."""
    target = Path(spec.runs_dir).expanduser().absolute() / spec.name
    writable_dir = None
    for path in reversed([target, *target.parents]):
        try:
            if not path.exists():
                break
        except OSError as exc:
            return f"{spec.runs_dir}: cannot look at {path}: {exc.strerror or exc}"
        if not path.is_dir():
            return f"{spec.runs_dir}: {path} is a file, not a folder"
        writable_dir = path
    if writable_dir is None:
        return None
    if not os.access(writable_dir, os.W_OK | os.X_OK):
        return f"{spec.runs_dir}: cannot write in {writable_dir} (permission denied)"
    try:
        if os.statvfs(writable_dir).f_flag & os.ST_RDONLY:  # a read-only mount: root cannot write either
            return f"{spec.runs_dir}: {writable_dir} is on a read-only filesystem"
    except OSError:
        pass
    kind = file_system_type(writable_dir)
    if kind in KERNEL_FS:  # writable to root by its mode bits, but no folder can be made there
        return f"{spec.runs_dir}: {writable_dir} is on the kernel's {kind} filesystem, which holds no run dirs"
    return None


KERNEL_FS = frozenset({"proc", "sysfs", "cgroup", "cgroup2", "debugfs", "tracefs", "securityfs", "devpts",
                       "mqueue", "pstore", "bpf", "configfs", "fusectl", "binfmt_misc", "hugetlbfs"})


# --- env_passthrough ------------------------------------------------------------------------------

def passthrough_problem(names: list[str], slurm: bool, environ: Mapping[str, str] | None = None,
                        when: str = "before submitting") -> str | None:
    """Why the job would not get these env_passthrough variables from this shell, or None."""
    env = os.environ if environ is None else environ
    missing = [name for name in names if name not in env]
    if missing:
        one = len(missing) == 1
        return (f"{', '.join(missing)} {'is' if one else 'are'} not set in this shell; export "
                f"{'it' if one else 'them'} {when} (the job takes the value from that environment)")
    sbatch_export = env.get("SBATCH_EXPORT")
    if slurm and sbatch_export is not None:
        dropped = export_drops(sbatch_export, names)
        if dropped:
            return (f"SBATCH_EXPORT={sbatch_export} in this shell keeps {', '.join(dropped)} from the job; "
                    "unset SBATCH_EXPORT or set it to ALL")
    return None


# --- track: trackers -----------------------------------------------------------------------------

Finder = Callable[[str], Any]  # importlib.util.find_spec: None where the module cannot be imported
WANDB_HOST = "api.wandb.ai"


def wandb_enabled(spec: Spec) -> bool:
    return spec.track.wandb is not None and spec.track.wandb.mode != "disabled"


def tracker_package_problem(spec: Spec, find: Finder = importlib.util.find_spec) -> str | None:
    """The trackers the spec enables need their packages in this Python (the job runs it); looked up
    with find_spec, never imported here."""
    return tensorboard_package_problem(spec, find) or wandb_package_problem(spec, find)


def tensorboard_package_problem(spec: Spec, find: Finder = importlib.util.find_spec) -> str | None:
    if spec.track.tensorboard and find("tensorboard") is None:
        return ("track.tensorboard: true needs the tensorboard package, which this Python does not have: "
                "pip install 'hpcgpu[tensorboard]', or set track.tensorboard: false")
    return None


def wandb_package_problem(spec: Spec, find: Finder = importlib.util.find_spec) -> str | None:
    if wandb_enabled(spec) and find("wandb") is None:
        return ("track.wandb needs the wandb package, which this Python does not have: pip install "
                "'hpcgpu[wandb]', or leave track.wandb out")
    return None


def wandb_login_problem(spec: Spec, environ: Mapping[str, str] | None = None) -> str | None:
    """track.wandb.mode: online needs a login the job can use: WANDB_API_KEY in this environment
    (passed to the job), or a ~/.netrc entry for the W&B host (`wandb login` writes it; $NETRC too)."""
    if spec.track.wandb is None or spec.track.wandb.mode != "online":
        return None
    env = os.environ if environ is None else environ
    if env.get("WANDB_API_KEY"):
        return None
    host = urlparse(env.get("WANDB_BASE_URL") or f"https://{WANDB_HOST}").hostname or WANDB_HOST
    netrc = Path(env.get("NETRC") or Path(env.get("HOME") or Path.home()) / ".netrc").expanduser()
    if netrc_has_machine(netrc, host):
        return None
    return (f"track.wandb.mode: online needs a W&B login: run `wandb login` (it writes ~/.netrc) or export "
            f"WANDB_API_KEY (and list it in env_passthrough); or use mode: offline and `wandb sync` the run later")


def netrc_has_machine(path: Path, host: str) -> bool:
    """Whether a netrc file has a `machine HOST` entry (read as words, as netrc files are)."""
    try:
        words = path.read_text(errors="replace").split()
    except OSError:
        return False
    return any(word == "machine" and nxt == host for word, nxt in zip(words, words[1:]))


# --- container: (launch/container.py) ---------------------------------------------------------

# what a shell would read as more than a word (the image is quoted where written: a value like this is a mistake)
SHELL_SPECIAL = re.compile(r"[\s;&|<>$`\\\"'(){}*?!\[\]]")


def container_image_problem(spec: Spec) -> str | None:
    """container.image: a word with no shell metacharacters; an image file that exists here."""
    c = spec.container
    if c is None:
        return None
    if not c.image or SHELL_SPECIAL.search(c.image):
        return f"{c.image!r} is not an image name: no spaces or shell characters ($ ; & | ` quotes ...)"
    if image_is_path(c) and not Path(c.image).expanduser().exists():
        return f"image file not found: {c.image}"
    return None


def container_runtime_problem(spec: Spec, here: Here) -> str | None:
    """container.runtime: the local executor runs the runtime itself (pyxis needs SLURM's srun)."""
    c = spec.container
    if c is None or here.slurm:
        return None
    if c.runtime == "pyxis":
        return "pyxis runs only through SLURM's srun; the local executor takes apptainer or singularity"
    if shutil.which(c.runtime, path=(here.environ or os.environ).get("PATH")) is None:
        return f"{c.runtime} is not on PATH here (the local executor runs each rank through it)"
    return None


def container_mounts_problem(spec: Spec) -> str | None:
    """container.mounts: each SRC:DST[:ro|rw] with a SRC that exists (the shape is the schema's)."""
    for mount in spec.container.mounts if spec.container else []:
        source, _, rest = mount.partition(":")
        if not rest.startswith("/") or not Path(source).expanduser().exists():
            return f"{mount!r}: SRC:DST with an existing SRC folder or file and an absolute DST"
    return None


def container_env_problem(spec: Spec) -> str | None:
    """container.env: what env: may hold (launch/container.py writes it into job.sbatch too)."""
    for name, value in spec.container.env.items() if spec.container else []:
        if not re.match(ENV_NAME_RE, name) or launcher_owned(name):
            return f"{name}: not a name container.env may set (a shell's variable name, not one the launcher sets)"
        if looks_secret(name) and value:
            return f"{name} looks like a secret, written into spec.yaml and job.sbatch: use env_passthrough"
    return None


# --- all together: a table of spec key -> check ------------------------------------------------

@dataclass(frozen=True)
class Here:
    """Where the job will run, as the checks need it."""

    slurm: bool = True
    environ: Mapping[str, str] | None = None
    # run dirs of jobs still to run (submit --after): a problem about a path in one is not one yet
    pending: tuple[str, ...] = ()
    note: Warn | None = None  # where a check says what is not an error (validate, sbatch, submit print it)


Problem = Callable[[Spec, Here], "str | None"]


@dataclass(frozen=True)
class HostCheck:
    """One check of one spec key. `shared` says what the tasks of a sweep share for it (they are read
    once per value: a sweep over train.lr reads its data rows once); None checks every task."""

    key: str
    problem: Problem
    shared: Callable[[Spec], object] | None = None


def key_error(key: str, problem: str) -> SpecError:
    """The error naming `key`. A problem text reads alone too (`hpcgpu data prepare` prints one), so it
    may start with its key already: SpecError puts it there once."""
    return SpecError(key, problem.removeprefix(f"{key}: "))


def input_check(key: str) -> HostCheck:
    """The input file a key names exists here and can be read (a hub id is no file)."""
    def problem(spec: Spec, _: Here) -> str | None:
        value = dict(input_paths(spec)).get(key)
        return input_problem(key, value) if value else None

    return HostCheck(key, problem, lambda spec: dict(input_paths(spec)).get(key))


def _model(spec: Spec) -> object:
    return repr((spec.model.name_or_path, spec.model.config))


def _data(spec: Spec) -> object:
    return repr((spec.task, spec.data.train, spec.data.eval, spec.data.format, spec.model.name_or_path))


def _folder_attention(spec: Spec, _: Here) -> str | None:
    return attention_problem(spec) if spec.model.name_or_path else None


def _config_attention(spec: Spec, _: Here) -> str | None:
    return None if spec.model.name_or_path else attention_problem(spec)


def adapter_base(folder: str) -> str | None:
    """The base model.adapter was trained on, as its adapter_config.json names it (base_model_name_or_path):
    a hub id, or a folder here (made absolute); None where it names none, or a folder that is not here."""
    adapter = read_adapter(folder)
    base = adapter.base if adapter else None
    if base is None or not is_local_path(base, Path.cwd()):
        return base
    path = Path(base).expanduser()
    return str(path.resolve()) if path.is_dir() else None


def adapter_problem(spec: Spec, pending: tuple[str, ...] = ()) -> str | None:
    """model.adapter: a folder peft wrote (a train run's model/ with train.lora), on a base (model.name_or_path,
    else the one its adapter_config.json names: launch/resolve.py filled it in) whose layers have the shapes
    the adapter was trained on, where the base's config is here (the job's own line: runtime/lora.py
    load_adapter). pending: run dirs of jobs still to run (an adapter one of them writes is not there yet)."""
    if not spec.model.adapter:
        return None
    if not spec.model.name_or_path and any(root in spec.model.adapter for root in pending):
        return ("model.adapter: an earlier job (--after) writes it, so there is no adapter_config.json yet to name "
                "its base: give model.name_or_path, the base")
    adapter = read_adapter(spec.model.adapter)
    if adapter is None:
        return not_an_adapter(spec.model.adapter)
    if not spec.model.name_or_path:
        named = f"names its base {adapter.base}, which is not here" if adapter.base else "names no base model"
        return (f"model.adapter: {spec.model.adapter}'s adapter_config.json {named} (base_model_name_or_path); "
                "give model.name_or_path, the base it was trained on")
    found = model_config_of(spec)
    layers = linear_layers(found[2]) if found and not found[1] else None
    return adapter_shape_problem(adapter, layers, spec.model.name_or_path) if layers else None


def lora_targets_problem(spec: Spec) -> str | None:
    """train.lora.target_modules naming what is not a linear layer of the model: the job's own line
    (runtime/lora.py check_targets), here where the config tells the layers for certain (a family
    LINEAR_NAMES knows, from model.config or a local folder's config.json); for a hub id or another
    family only what the names alone tell (lm_head under train.fused_loss), the rest left to the job."""
    lora = spec.train.lora if spec.task == "train" else None
    if lora is None or not isinstance(lora.target_modules, list):
        return None
    found = model_config_of(spec)
    layers = linear_layers(found[2]) if found and not found[1] else None  # not a multimodal model's text part
    return target_modules_problem(lora.target_modules, layers, spec.train.fused_loss)


def _infer(check: Callable[[Spec], str | None]) -> Problem:
    return lambda spec, _: check(spec) if spec.task == "infer" else None


# in this order: the first problem found is the one reported
SPEC_CHECKS: tuple[HostCheck, ...] = (
    HostCheck("model.quantization", lambda spec, here: quantization_problem(spec, local=not here.slurm)),
    HostCheck("container.image", lambda spec, _: container_image_problem(spec)),
    HostCheck("container.runtime", container_runtime_problem),
    HostCheck("container.mounts", lambda spec, _: container_mounts_problem(spec)),
    HostCheck("container.env", lambda spec, _: container_env_problem(spec)),
    *(input_check(key) for key in INPUT_KEYS),
    HostCheck("model.name_or_path", lambda spec, here: hub_model_problem(spec, here.environ)),
    HostCheck("model.config.model_type", lambda spec, _: model_type_problem(spec)),
    HostCheck("model.name_or_path", _folder_attention, _model),
    HostCheck("model.config", _config_attention, _model),
    HostCheck("train.lora.target_modules", lambda spec, _: lora_targets_problem(spec),
              lambda spec: repr((spec.task, spec.model.name_or_path, spec.model.config, spec.train.lora,
                                 spec.train.fused_loss))),
    HostCheck("track.tensorboard", lambda spec, _: tensorboard_package_problem(spec)),
    HostCheck("track.wandb", lambda spec, _: wandb_package_problem(spec)),
    HostCheck("data.format", lambda spec, _: prepared_formats_problem(spec), _data),
    HostCheck("data.train", lambda spec, _: data_rows_problem(spec, "data.train"), _data),
    HostCheck("data.eval", lambda spec, _: data_rows_problem(spec, "data.eval"), _data),
    *(HostCheck(key, lambda spec, here, key=key: untrained_rows_problem(spec, key, here), _data)
      for key in ("data.train", "data.eval")),
    HostCheck("data.format", lambda spec, _: chat_data_problem(spec), _data),
    HostCheck("model.name_or_path", _infer(infer_model_problem), lambda spec: (spec.task, spec.model.name_or_path)),
    HostCheck("model.adapter", lambda spec, here: adapter_problem(spec, here.pending)),
    HostCheck("infer.max_memory", _infer(max_memory_problem), lambda spec: (spec.task, spec.infer.max_memory)),
    HostCheck("infer.input", _infer(infer_input_problem), lambda spec: (spec.task, spec.infer.mode, spec.infer.input)),
    HostCheck("infer.max_new_tokens", lambda spec, _: positions_problem(spec)),
    HostCheck("infer.input", _infer(infer_lengths_problem),
              lambda spec: repr((spec.task, spec.infer.mode, spec.infer.input, spec.infer.max_new_tokens,
                                 spec.model.name_or_path, spec.model.config))),
)


def check_specs(specs: Sequence[Spec], here: Here) -> None:
    """Raise the first problem of SPEC_CHECKS over the specs (a sweep's tasks), naming its key."""
    seen: set[tuple[int, object]] = set()
    for spec in specs:
        for n, check in enumerate(SPEC_CHECKS):
            if check.shared is not None:
                if (n, check.shared(spec)) in seen:
                    continue
                seen.add((n, check.shared(spec)))
            problem = check.problem(spec, here)
            if problem and not any(root in problem for root in here.pending):
                raise key_error(check.key, problem)


def check_runs_dirs(specs: Sequence[Spec]) -> None:
    """Every runs_dir can hold run dirs."""
    for runs_dir in dict.fromkeys(one.runs_dir for one in specs):
        problem = runs_dir_problem(next(one for one in specs if one.runs_dir == runs_dir))
        if problem:
            raise SpecError("runs_dir", f"{problem}; set runs_dir to a folder you can write")


def warn_untracked(specs: Sequence[Spec], warn: Warn | None) -> None:
    """track: on a command or callable task is ignored: say so (not an error: it harms nothing)."""
    untracked = next((one.task for one in specs if one.task in ("command", "callable")
                      and (one.track.tensorboard or wandb_enabled(one))), None)
    if untracked and warn:
        warn(f"warning: track: task: {untracked} has no trackers (your program logs its own); it is ignored")


def check_from_shell(specs: Sequence[Spec], passthrough: str, here: Here, warn: Warn | None, when: str) -> None:
    """What the job takes from this shell: a W&B login, the env_passthrough variables.
    passthrough: "error" (submit), "warn" (sbatch, --dry-run) or "skip" (validate)."""
    login = next((p for p in (wandb_login_problem(one, here.environ) for one in specs) if p), None)
    if login and passthrough == "error":
        raise key_error("track.wandb.mode", login)
    if login and passthrough == "warn" and warn:
        warn(f"warning: {login}")
    names = list(dict.fromkeys(name for one in specs for name in one.env_passthrough))
    if passthrough == "skip" or not names:
        return
    problem = passthrough_problem(names, here.slurm, here.environ, when)
    if problem and passthrough == "error":
        raise SpecError("env_passthrough", problem)
    if problem and warn:
        warn(f"warning: env_passthrough: {problem}")


def check_host(specs: Spec | Sequence[Spec], passthrough: str = "skip", slurm: bool = True,
               warn: Warn | None = None, environ: Mapping[str, str] | None = None,
               when: str = "before submitting", pending: tuple[str, ...] = ()) -> None:
    """Raise a one-line SpecError, naming its key, for the first problem found here.

    specs: one spec, or every task of a sweep (hpcgpu/launch/resolve.py expands it).
    passthrough: "error" (submit), "warn" (sbatch, --dry-run) or "skip" (validate); `when` tells the
    user when the variables must be set.
    """
    specs = [specs] if isinstance(specs, Spec) else list(specs)
    here = Here(slurm, environ, pending, warn)
    check_specs(specs, here)
    check_runs_dirs(specs)
    warn_untracked(specs, warn)
    check_from_shell(specs, passthrough, here, warn, when)
