"""The spec reference (docs/spec.md) as Markdown, generated from the schema's own field help.

The same dataclass fields and metadata that the parser and `hpcgpu schema` read: every key with its
type, default, limits and help text. scripts/render_spec_docs.py writes the file and
tests/unit/test_docs.py fails when it is stale.
"""
from __future__ import annotations

import dataclasses
import typing
from typing import Any, Literal, Union, get_args, get_origin

from hpcgpu.spec.parse import section_fields
from hpcgpu.spec.schema import Spec

COMMAND = ".venv/bin/python scripts/render_spec_docs.py"

INTRO = f"""\
# Spec reference

<!-- Generated from hpcgpu/spec/schema.py by {COMMAND}; do not edit by hand. -->

Every key of an experiment spec (the YAML file you pass to `hpcgpu validate`, `sbatch`, `submit`,
`queue` and `run`), with its type, default and what it does. This page is generated from the same
field descriptions the parser and `hpcgpu schema` (the JSON Schema, for editor completion) read, so
it is always the spec the installed hpcgpu accepts. An unknown key is an error that names the closest
valid one, or the key another tool's name means (`train.learning_rate`: `lr`, `train.num_train_epochs`:
`epochs`; in another section by its full key, `train.max_seq_length`: `data.seq_len`); `hpcgpu
validate SPEC --full` prints a spec with every default filled in.

Keys are set in the file or with `--set key.path=value` (YAML-typed, repeatable); `--gpus` and
`--nodes` set `resources.gpus` and `resources.nodes`. How the keys are used: [running a spec](running.md),
[training](training.md), [data](data.md), [inference](inference.md), [your own code](your-code.md).
"""


def spec_reference() -> str:
    """docs/spec.md: the top-level keys, then one table per section (nested sections after their parent)."""
    out = [INTRO]
    fields = section_fields(Spec)
    hints = typing.get_type_hints(Spec)
    top = [(key, f) for key, f in fields.items() if not _section_type(hints[f.name])]
    out.append("## Top-level keys\n")
    out.append(_table(Spec, top, ""))
    for key, f in fields.items():
        cls = _section_type(hints[f.name])
        if cls is not None:
            out.extend(_section(cls, key, f))
    return "\n".join(out)


def missing_help() -> list[str]:
    """Dotted keys whose field has no help text (the reference would show them bare)."""
    out: list[str] = []

    def walk(cls: type, prefix: str) -> None:
        hints = typing.get_type_hints(cls)
        for key, f in section_fields(cls).items():
            path = f"{prefix}{key}"
            if not str(f.metadata.get("help", "")).strip():
                out.append(path)
            sub = _section_type(hints[f.name])
            if sub is not None:
                walk(sub, path + ".")

    walk(Spec, "")
    return out


def _section(cls: type, path: str, f: dataclasses.Field) -> list[str]:
    level = "#" * min(2 + path.count("."), 4)
    head = f"{level} `{path}`\n"
    about = _text(f.metadata.get("help", ""))
    doc = _text(cls.__doc__ or "") if cls.__doc__ and not cls.__doc__.startswith(cls.__name__ + "(") else ""
    lines = [head, _escape(about[:1].upper() + about[1:] + ("." if about and not about.endswith(".") else "")) + "\n"]
    if doc:
        lines.append(_escape(doc) + "\n")
    hints = typing.get_type_hints(cls)
    rows = list(section_fields(cls).items())
    lines.append(_table(cls, rows, path + "."))
    for key, sub in rows:
        sub_cls = _section_type(hints[sub.name])
        if sub_cls is not None:
            lines.extend(_section(sub_cls, f"{path}.{key}", sub))
    return lines


def _table(cls: type, rows: list[tuple[str, dataclasses.Field]], prefix: str) -> str:
    hints = typing.get_type_hints(cls)
    out = ["| key | type | default | description |", "|---|---|---|---|"]
    for key, f in rows:
        tp = hints[f.name]
        sub = _section_type(tp)
        if sub is not None:
            anchor = f"{prefix}{key}"
            kind = "section" + (", optional" if _optional(tp) else "")
            default = "absent" if _optional(tp) else "(its keys' defaults)"
            help_ = _text(f.metadata.get("help", "")) + f"; see [`{anchor}`](#{_anchor(anchor)})"
            out.append(f"| `{prefix}{key}` | {kind} | {default} | {_cell(help_)} |")
            continue
        help_ = _text(f.metadata.get("help", ""))
        limits = _limits(f.metadata)
        if limits:
            help_ = f"{help_} ({limits})" if help_ else limits
        out.append(f"| `{prefix}{key}` | {_cell(_type_name(tp))} | {_cell(_default(f))} | {_cell(help_)} |")
    return "\n".join(out) + "\n"


def _section_type(tp: Any) -> type | None:
    """The dataclass a field holds (directly or as Optional), or None for a plain value."""
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return tp
    if get_origin(tp) is Union:
        args = [a for a in get_args(tp) if a is not type(None)]
        if len(args) == 1 and isinstance(args[0], type) and dataclasses.is_dataclass(args[0]):
            return args[0]
    return None


def _optional(tp: Any) -> bool:
    return get_origin(tp) is Union and type(None) in get_args(tp)


def _type_name(tp: Any) -> str:
    origin = get_origin(tp)
    if origin is Literal:
        return " \\| ".join(str(a) for a in get_args(tp))
    if origin is Union:
        args = [a for a in get_args(tp) if a is not type(None)]
        name = " \\| ".join(_type_name(a) for a in args)
        return name + (" (or null)" if len(args) < len(get_args(tp)) else "")
    if origin is list:
        return f"list of {_type_name(get_args(tp)[0])}"
    if origin is dict:
        return f"mapping of {_type_name(get_args(tp)[0])} to {_type_name(get_args(tp)[1])}"
    if tp is Any:
        return "any"
    return {bool: "bool", int: "int", float: "float", str: "string"}.get(tp, getattr(tp, "__name__", str(tp)))


def _default(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        value = f.default
    elif f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        value = f.default_factory()  # type: ignore[misc]
    else:
        return "required"
    if value is None:
        return "none"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, (list, dict)) and not value:
        return "`[]`" if isinstance(value, list) else "`{}`"
    return f"`{value}`"


def _limits(meta: Any) -> str:
    parts = []
    if "min" in meta and "max" in meta:
        parts.append(f"{_num(meta['min'])} to {_num(meta['max'])}")
    elif "min" in meta:
        parts.append(f"at least {_num(meta['min'])}")
    elif "max" in meta:
        parts.append(f"at most {_num(meta['max'])}")
    if "fmt" in meta and meta.get("fmt") != meta.get("pattern"):
        parts.append(f"format: {meta['fmt']}")
    elif "pattern" in meta:
        parts.append(f"pattern `{meta['pattern']}`")
    return "; ".join(parts)


def _num(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else str(value)


def _text(text: str) -> str:
    return " ".join(str(text).split())


def _cell(text: str) -> str:
    """A table cell: pipes escaped (they would split the cell), then as a paragraph."""
    return _escape(text.replace("\\|", "|").replace("|", "\\|"))


def _escape(text: str) -> str:
    """Markdown outside `code` spans: `<` and `*` escaped (an HTML tag such as `<run dir>` would
    vanish, `*_TOKEN, *_KEY` would turn italic)."""
    parts = text.split("`")
    for i in range(0, len(parts), 2):  # even parts are outside code spans
        parts[i] = parts[i].replace("<", "&lt;").replace("*", "\\*")
    return "`".join(parts)


def _anchor(path: str) -> str:
    """GitHub's heading anchor for `` `a.b` ``: lower case, punctuation but '-' and '_' dropped."""
    return "".join(c for c in path.lower() if c.isalnum() or c in "-_ ").replace(" ", "-")
