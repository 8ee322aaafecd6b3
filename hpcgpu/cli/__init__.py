"""The `hpcgpu` command. Subcommands load lazily so `hpcgpu --help` never imports torch."""
from __future__ import annotations

import importlib
import os
import sys
import traceback
from typing import Any

import click

from hpcgpu import __version__
from hpcgpu.contract import ENV_DEBUG
from hpcgpu.errors import HpcgpuError

# name -> (module:attribute, one-line help shown by `hpcgpu --help` without importing the module)
COMMANDS: dict[str, tuple[str, str]] = {
    "validate": ("hpcgpu.cli.validate:validate", "Check a spec and print its resolved summary."),
    "sbatch": ("hpcgpu.cli.sbatch:sbatch", "Write a readable sbatch script for a spec."),
    "submit": ("hpcgpu.cli.submit:submit", "Submit a spec to SLURM or run it with the local executor."),
    "status": ("hpcgpu.cli.jobs:status", "State, progress and nodes of a job (or of all active jobs)."),
    "list": ("hpcgpu.cli.jobs:list_jobs", "Recent jobs from the registry, newest first."),
    "logs": ("hpcgpu.cli.jobs:logs", "Print (or follow) a job's output."),
    "cancel": ("hpcgpu.cli.jobs:cancel", "Cancel a job, an array task or a local job."),
    "queue": ("hpcgpu.cli.queue:queue", "Run the jobs of a queue file over the free GPUs of this machine."),
    "run": ("hpcgpu.cli.run:run", "The in-job entrypoint (one process per GPU)."),
    "schema": ("hpcgpu.cli.schema:schema", "Print the JSON Schema of the spec (for editors)."),
    "hw": ("hpcgpu.cli.hw:hw", "GPUs (busy or free), CPUs and RAM here; recommended settings for a spec."),
    "estimate": ("hpcgpu.cli.estimate:estimate_cmd", "GPU memory per rank for a spec under each strategy; what fits."),
    "report": ("hpcgpu.cli.report:report", "PNG and summary of a run: loss, tokens/s, GPU utilization/memory/power."),
    "data": ("hpcgpu.cli.data:data", "Tokenize training data once into memory-mapped prepared datasets."),
    "registry": ("hpcgpu.cli.registry:registry", "The job registry: rebuild its rows from run dirs."),
    "doctor": ("hpcgpu.cli.doctor:doctor", "Health of this machine or of a SLURM allocation's nodes and GPUs."),
}


class LazyGroup(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return list(COMMANDS)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name not in COMMANDS:
            return None
        module, _, attr = COMMANDS[name][0].partition(":")
        return getattr(importlib.import_module(module), attr)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        with formatter.section("Commands"):
            formatter.write_dl([(name, short) for name, (_, short) in COMMANDS.items()])


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="hpcgpu")
@click.option("--debug", is_flag=True, envvar=ENV_DEBUG, help="Show tracebacks for errors.")
@click.pass_context
def cli(ctx: click.Context, debug: bool) -> None:
    """hpcgpu: one experiment spec, from a laptop to a SLURM GPU cluster.

    \b
      hpcgpu submit exp.yaml --gpus 4            to the cluster
      hpcgpu submit exp.yaml --executor local    the same job here
      hpcgpu sbatch exp.yaml -o job.sbatch       a file to sbatch by hand
    """
    ctx.obj = {"debug": debug}


def main(argv: list[str] | None = None) -> Any:
    """Console entry point: the one place errors become a line on stderr and an exit code."""
    args = sys.argv[1:] if argv is None else argv
    debug = "--debug" in args or os.environ.get(ENV_DEBUG, "") not in ("", "0")
    try:
        rv = cli.main(args=args, prog_name="hpcgpu", standalone_mode=False)
    except click.exceptions.Abort:
        click.echo("hpcgpu: aborted", err=True)
        sys.exit(130)
    except click.exceptions.NoArgsIsHelpError as exc:  # `hpcgpu data`: the group's help, as git does
        exc.show()
        sys.exit(exc.exit_code)
    except click.UsageError as exc:
        click.echo(f"hpcgpu: error: {usage_error_line(exc)}", err=True)
        sys.exit(exc.exit_code)
    except click.ClickException as exc:
        exc.show()
        sys.exit(exc.exit_code)
    except HpcgpuError as exc:
        if debug:
            traceback.print_exc()
        click.echo(f"hpcgpu: error: {exc}", err=True)
        sys.exit(exc.exit_code)
    except KeyboardInterrupt:
        click.echo("hpcgpu: interrupted", err=True)
        sys.exit(130)
    sys.exit(rv if isinstance(rv, int) else 0)


def usage_error_line(exc: click.UsageError, hint: str | None = None) -> str:
    """A bad flag or argument as click finds it, in the words of our own usage errors: one line, the
    flag first; then `hint`, else the usage line where something is missing, the help command where a
    name is unknown."""
    command = exc.ctx.command_path if exc.ctx else "hpcgpu"
    if isinstance(exc, click.MissingParameter) and exc.param is not None:
        usage = exc.ctx.get_usage().removeprefix("Usage: ") if exc.ctx else command
        return f"missing {param_name(exc.param)} ({hint or 'usage: ' + usage})"
    if isinstance(exc, click.BadParameter) and exc.param is not None:
        return f"{param_name(exc.param)}: {exc.message.rstrip('.')}"
    if isinstance(exc, click.NoSuchOption):
        if exc.possibilities:
            return f"no such option {exc.option_name} (did you mean {' or '.join(exc.possibilities)}?)"
        message = f"no such option {exc.option_name}"
    else:
        message = exc.format_message().rstrip(".")
        message = message[:1].lower() + message[1:]
        if isinstance(exc, click.BadOptionUsage) and hint is None:  # it names the flag, not its command
            return message
    return f"{message} ({hint or f'see {command} --help'})"


def param_name(param: click.Parameter) -> str:
    """--flag (its first, current name) or ARGUMENT."""
    return param.opts[0] if isinstance(param, click.Option) else param.human_readable_name
