"""JSON Schema of the spec, generated from the same dataclasses the parser reads (for editors)."""
from __future__ import annotations

import dataclasses
import typing
from typing import Any, Literal, Union, get_args, get_origin

from hpcgpu.spec.parse import section_fields
from hpcgpu.spec.schema import Spec


def json_schema() -> dict[str, Any]:
    schema = _object_schema(Spec)
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["title"] = "hpcgpu experiment spec"
    return schema


def _object_schema(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    props: dict[str, Any] = {}
    required: list[str] = []
    for key, f in section_fields(cls).items():
        prop = _type_schema(hints[f.name], f.metadata)
        if f.metadata.get("help"):
            prop["description"] = f.metadata["help"]
        if f.default is not dataclasses.MISSING:
            prop["default"] = f.default
        elif f.default_factory is dataclasses.MISSING:  # type: ignore[misc]
            required.append(key)
        props[key] = prop
    out: dict[str, Any] = {"type": "object", "properties": props, "additionalProperties": False}
    if required:
        out["required"] = required
    return out


def _type_schema(tp: Any, meta: Any = None) -> dict[str, Any]:
    meta = meta or {}
    origin = get_origin(tp)
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return _object_schema(tp)
    if origin is Union:
        options = [_type_schema(a, meta) for a in get_args(tp)]
        return {"anyOf": options}
    if origin is Literal:
        return {"enum": list(get_args(tp))}
    if origin is list:
        item_meta = {k: meta[k] for k in ("pattern", "fmt") if k in meta}  # a list's pattern is each item's
        return {"type": "array", "items": _type_schema(get_args(tp)[0], item_meta)}
    if origin is dict:
        return {"type": "object", "additionalProperties": _type_schema(get_args(tp)[1])}
    if tp is type(None):
        return {"type": "null"}
    simple = {bool: "boolean", int: "integer", float: "number", str: "string"}.get(tp)
    if simple is None:
        return {}
    out: dict[str, Any] = {"type": simple}
    if "pattern" in meta and tp is str:
        out["pattern"] = meta["pattern"]
    if "min" in meta and tp in (int, float):
        out["minimum"] = meta["min"]
    if "max" in meta and tp in (int, float):
        out["maximum"] = meta["max"]
    return out
