"""The Typer app: registers every command in one place and maps errors to exit codes."""

from __future__ import annotations

import functools
from typing import Annotated, Optional

import typer

from . import __version__
from .errors import ParameterError, RocketError
from .options import KnobHelpCommand, PlainCommand, PlainGroup
from .output import StdoutClosed, report, write_stderr, write_stdout

app = typer.Typer(
    cls=PlainGroup,
    name="rocketllm",
    help="Run language models larger than memory by streaming them layer by layer.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _guarded(func):
    """Run a command; any exception becomes one line on stderr and a non-zero exit (see errors.py)."""

    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        from .output import quiet_libraries

        try:
            quiet_libraries()  # before the command imports them: our progress and messages only
            return func(*args, **kwargs)
        except (typer.Exit, typer.Abort, StdoutClosed):  # StdoutClosed: main exits 0
            raise
        except ParameterError as exc:  # the library names its keywords; a CLI user typed flags
            raise typer.Exit(report(RocketError(exc.spelled(flag_of)))) from None
        except BaseException as exc:  # noqa: BLE001 - the one place that maps every error
            raise typer.Exit(report(exc)) from None

    return wrapper


def flag_of(param: str) -> str:
    """The CLI flag of a library keyword: a knob's own flag (compute_dtype is --dtype), else --the-name."""
    from .profiles.knobs.table import KNOBS_BY_NAME

    spec = KNOBS_BY_NAME.get(param)
    return (spec.flags[0] if spec.flags else spec.flag) if spec is not None else "--" + param.replace("_", "-")


def _version(value: bool) -> None:
    if value:
        write_stdout(f"rocketllm {__version__}\n")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        Optional[bool], typer.Option("--version", callback=_version, is_eager=True, help="Print the version and exit.")
    ] = None,
) -> None:
    """Run language models larger than memory by streaming them layer by layer.

    Every tuning value is derived from a measured HardwareProfile of this machine;
    `rocketllm profile` prints each with its formula.
    """


def _register() -> None:
    from .commands import bench, cache, doctor, generate, plan, profile, ps, serve, shard, stop

    for module in (doctor, profile, plan, shard, generate, serve, bench, ps, stop):
        # Commands with knob flags show each knob's value derived on this machine in their help.
        cls = KnobHelpCommand if getattr(module.run, "knob_options", False) else PlainCommand
        app.command(
            name=module.NAME, help=module.HELP, no_args_is_help=getattr(module, "NO_ARGS_IS_HELP", False), cls=cls
        )(_guarded(module.run))
    # A command of subcommands: a Typer app of its own, each subcommand guarded like a command.
    group = typer.Typer(cls=PlainGroup, name=cache.NAME, help=cache.HELP, no_args_is_help=True)
    for name, (run, text) in cache.SUBCOMMANDS.items():
        group.command(name=name, help=text, cls=PlainCommand)(_guarded(run))
    app.add_typer(group)


_register()


def main() -> None:
    """Console entry point: usage errors become one line too (exit 2), like every other error; a reader of
    stdout that goes away (`| head`) ends the command quietly with exit 0."""
    import sys

    try:
        code = app(standalone_mode=False)
    except StdoutClosed:
        code = 0
    except typer.Abort:
        write_stderr("error: interrupted")
        code = 130
    except typer.TyperException as exc:  # Typer's usage errors: bad option, missing argument, unknown command
        if type(exc).__name__ == "NoArgsIsHelpError":
            exc.show()  # a bare command asks for its help
        else:
            where = f"; see '{exc.ctx.command_path} --help'" if getattr(exc, "ctx", None) else ""
            write_stderr(f"error: {' '.join(exc.format_message().split()).rstrip('.')}{where}")
        code = getattr(exc, "exit_code", 2)
    # The interpreter's last full collection walks every object the libraries made: 0.8 s after a SmolLM2 run here,
    # between the answer and the prompt coming back. Frozen, they are left to the process's end (atexit still runs).
    import gc

    gc.freeze()
    sys.exit(code if isinstance(code, int) else 0)
