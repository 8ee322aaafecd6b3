"""The experiment spec: schema, YAML loading, `--set` overrides, validation, JSON Schema.

Imports nothing else of hpcgpu but errors, and nothing heavy.
"""
from hpcgpu.spec.load import dump_spec, load_spec, parse_override, spec_from_raw, spec_to_dict
from hpcgpu.spec.schema import Spec

__all__ = ["Spec", "dump_spec", "load_spec", "parse_override", "spec_from_raw", "spec_to_dict"]
