"""`hpcgpu schema`: the JSON Schema of the spec."""
from __future__ import annotations

import json

import click

from hpcgpu.spec.jsonschema import json_schema


@click.command()
def schema() -> None:
    """Print the JSON Schema of the spec (point your editor's YAML plugin at it)."""
    click.echo(json.dumps(json_schema(), indent=2, default=str))
