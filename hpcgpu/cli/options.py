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


class Renamed(click.Option):
    """An option whose first name is its name now: the later ones, its spellings that shipped before,
    still work, and --help shows the first only."""

    def get_help_record(self, ctx: click.Context) -> tuple[str, str] | None:
        shipped, self.opts = self.opts, self.opts[:1]
        try:
            return super().get_help_record(ctx)
        finally:
            self.opts = shipped


def busy_options(defaults: str) -> Callable[[F], F]:
    """--busy-memory-pct and --busy-util-pct (resources.busy's keys; hw's first spellings still work);
    `defaults`: where the value comes from without them."""
    memory = click.option("--busy-memory-pct", "--busy-memory", "busy_memory_pct", cls=Renamed,
                          type=click.FloatRange(0, 100), default=None, metavar="PCT",
                          help=f"A GPU with more than this % of its memory used is busy [{defaults}.memory_pct, 10].")
    util = click.option("--busy-util-pct", "--busy-util", "busy_util_pct", cls=Renamed,
                        type=click.FloatRange(0, 100), default=None, metavar="PCT",
                        help=f"A GPU with more than this % utilization is busy [{defaults}.util_pct, 10].")
    return lambda f: memory(util(f))
