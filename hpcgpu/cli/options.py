"""Options shared by several commands, defined once."""
from __future__ import annotations

from typing import Any, Callable

import click

from hpcgpu.spec import Spec, load_spec

F = Callable[..., Any]

spec_argument = click.argument("spec_file", metavar="SPEC", type=click.Path(dir_okay=False))
set_option = click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE",
                          help="Override a spec key (YAML-typed value); repeatable.")
gpus_option = click.option("--gpus", type=click.IntRange(min=1), default=None,
                           help="GPUs per node (overrides resources.gpus).")
nodes_option = click.option("--nodes", type=click.IntRange(min=1), default=None,
                            help="Nodes (overrides resources.nodes).")


def spec_options(f: F) -> F:
    """SPEC plus --set/--gpus/--nodes: the spec as every host-side command reads it."""
    for deco in reversed((spec_argument, set_option, gpus_option, nodes_option)):
        f = deco(f)
    return f


def read_spec(spec_file: str, overrides: tuple[str, ...] = (), gpus: int | None = None,
              nodes: int | None = None) -> Spec:
    return load_spec(spec_file, overrides, gpus=gpus, nodes=nodes, defaults=True)


ignore_busy_option = click.option(
    "--ignore-busy", is_flag=True,
    help="Use GPUs that other processes are using, too (local executor and queue).")
