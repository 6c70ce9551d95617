"""CLI options defined once: shared Annotated aliases, the knob flags every command can take, and how help shows
them."""

from __future__ import annotations

import functools
import inspect
from pathlib import Path
from typing import Annotated, Optional

import typer
from typer.core import TyperArgument, TyperCommand, TyperGroup, TyperOption

from .errors import UsageError
from .output import StdoutClosed, stdout_closed
from .profiles.knobs.table import KNOB_SPECS

JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON document on stdout instead of text.")]
RefreshOpt = Annotated[
    bool, typer.Option("--refresh", help="Re-measure the hardware instead of using the cached profile.")
]
ModelPathOpt = Annotated[
    Optional[Path],
    typer.Option("--model", help="Model or shard directory (or .gguf file); storage is measured where it lives."),
]


def api_key_option(use: str):
    """The --api-key option (and ROCKETLLM_API_KEY) of a command, USE saying what the key is for there."""
    return typer.Option(
        "--api-key",
        envvar="ROCKETLLM_API_KEY",
        show_envvar=True,
        show_default=False,
        help=f"{use}; prefer the environment variable, which other users cannot read from the process list.",
    )


ModelArg = Annotated[
    Optional[str],
    typer.Argument(
        help="Model directory, .gguf file, hub id, or shard directory (or give it as --model).", show_default=False
    ),
]
ModelOpt = Annotated[
    Optional[str],
    typer.Option(
        "--model",
        metavar="MODEL",
        help="MODEL as an option, as llama-server and vLLM spell it; give it once, here or as the argument.",
        show_default=False,
    ),
]

# Short enough for an 80-column panel title; the variables get the help's last paragraph (KNOB_ENV_HINT).
KNOB_PANEL = "Knobs (derived from the measured hardware unless set)"
KNOB_ENV_HINT = (
    "Every knob can also be set as ROCKETLLM_<NAME> in the environment (e.g. ROCKETLLM_PREFETCH_DEPTH=2); "
    "a flag wins over the variable."
)
_KNOB_METAVARS = {
    "bytes": "BYTES",
    "int": "INTEGER",
    "bool": "BOOLEAN",
    "choice": "CHOICE",
    "path": "PATH",
    "stages": "COUNTS",
}  # the help lists the choices


def pick_model(positional: str | None, option: str | None, required: bool = True) -> str | None:
    """MODEL given once: as the argument, or as --model (the spelling llama-server and vLLM users type)."""
    if positional is not None and option is not None:
        raise UsageError(
            f"MODEL given twice ({positional} and --model {option}); give it once, as the argument or as --model"
        )
    if required and positional is None and option is None:
        raise UsageError("no MODEL: give it as the first argument or as --model")
    return option if positional is None else positional


def with_knob_options(func):
    """Add one --<knob-name> option per knob to a command; they reach it as `knob_flags` (name -> raw text)."""
    # eval_str resolves string annotations and keeps typer's Annotated metadata as written; typing.get_type_hints
    # would, on Python 3.10, wrap every parameter defaulting to None in Optional[...] and hide that metadata.
    sig = inspect.signature(func, eval_str=True)
    params = [p for p in sig.parameters.values() if p.name != "knob_flags"]
    for spec in KNOB_SPECS:
        # No square brackets: help is rich markup, which takes them for tags and drops them.
        option = typer.Option(
            spec.flag,
            *spec.flags,
            help=f"{spec.help} Accepts {spec.accepted()}.",
            rich_help_panel=KNOB_PANEL,
            show_default=False,
            metavar=_KNOB_METAVARS[spec.kind],
        )
        params.append(
            inspect.Parameter(
                f"knob_{spec.name}",
                inspect.Parameter.KEYWORD_ONLY,
                default=None,
                annotation=Annotated[Optional[str], option],
            )
        )

    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        flags = {
            spec.name: kwargs.pop(f"knob_{spec.name}")
            for spec in KNOB_SPECS
            if kwargs.get(f"knob_{spec.name}") is not None
        }
        for spec in KNOB_SPECS:
            kwargs.pop(f"knob_{spec.name}", None)
        return func(*args, knob_flags=flags, **kwargs)

    wrapper.knob_options = True  # app.py gives such commands KnobHelpCommand
    wrapper.__signature__ = sig.replace(parameters=params)
    wrapper.__annotations__ = {**func.__annotations__, **{p.name: p.annotation for p in params}}
    return wrapper


def validate_knob_flags(flags: dict) -> None:
    """Parse every knob flag and ROCKETLLM_<KNOB> variable now, so a bad value fails before any work."""
    import os

    from .profiles.knobs.table import KNOBS_BY_NAME

    for name, raw in flags.items():
        spec = KNOBS_BY_NAME[name]
        spec.parse(raw, origin="/".join((spec.flag, *spec.flags)))
    for spec in KNOB_SPECS:
        if spec.env in os.environ:
            spec.parse(os.environ[spec.env], origin=spec.env)


DERIVED_AT_START = "Default: derived at start from the measured hardware profile (none is cached yet)"


class _PlainHelp:
    """Help as a person reads it: MODEL [PROMPT] and TEXT, INTEGER, BYTES (or nothing for a flag) where Typer
    writes {model} and <str>, <bool>; a reader of stdout that goes away ends the help quietly."""

    def get_params(self, ctx):
        params = super().get_params(ctx)
        for param in params:
            # Typer builds its parameter objects from the signature and has no hook for their class.
            if type(param) is TyperArgument:
                param.metavar = param.metavar or (param.name or "").upper()
                param.__class__ = _PlainArgument
                if hasattr(param, "type"):  # Typer 0.29 has none and asks display_type_rich instead
                    param.type = _untyped(param.type)
            elif type(param) is TyperOption:
                param.__class__ = _PlainOption
        return params

    def format_help(self, ctx, formatter) -> None:
        # Typer reads help as rich markup, so `pip install -e '.[vision]'` would lose `[vision]` and a
        # hand-written `[default: 16]` would vanish: every text is shown as written.
        self.help, self.epilog = _as_written(self.help), _as_written(self.epilog)
        for param in self.params:
            if getattr(param, "help", None):
                param.help = _as_written(param.help)
        try:
            super().format_help(ctx, formatter)
        except BrokenPipeError:
            raise stdout_closed() from None
        except SystemExit:  # rich's own answer to a broken pipe: stdout already at /dev/null, then exit 1
            raise StdoutClosed() from None


class _Written(str):
    """Help text already escaped for rich markup (so a second help in one process does not escape it twice)."""


def _as_written(text: str | None) -> str | None:
    if not text or isinstance(text, _Written):
        return text
    from rich.markup import escape

    return _Written(escape(text))


_TYPE_NAMES = {"str": "TEXT", "int": "INTEGER", "float": "FLOAT", "path": "PATH"}  # click's names for them


@functools.cache
def _untyped_class(cls: type) -> type:
    return type(f"Untyped{cls.__name__}", (cls,), {"get_metavar": lambda self, param, ctx=None: ""})


def _untyped(param_type):
    """The argument's type, converting as before, naming no type in help: an argument's name says what it is (Typer
    before 0.29 asks the type for the help column; 0.29 asks the parameter, display_type_rich below)."""
    import copy

    quiet = copy.copy(param_type)
    quiet.__class__ = _untyped_class(type(param_type))
    return quiet


class _PlainArgument(TyperArgument):
    def display_type_rich(self, ctx) -> None:
        return None  # the name says it

    def get_usage_pieces(self, ctx) -> list[str]:
        name = self.metavar or ""
        if name.startswith("[") and name.endswith("]"):  # spelled out by the command
            return [name]
        return [(name if self.required else f"[{name}]") + ("..." if self.nargs != 1 else "")]


class _PlainOption(TyperOption):
    def display_type_rich(self, ctx) -> str | None:  # Typer 0.29's help column
        if self.metavar is not None:
            return self.metavar
        if self.is_flag:
            return None
        bare = self.bare_type().removeprefix("list[").removesuffix("]")  # a repeatable option names one value
        return _TYPE_NAMES.get(bare.lower(), bare.upper())

    def make_metavar(self, ctx, *args, **kwargs) -> str:  # the help column before 0.29, and click's usage errors
        if self.metavar is not None:
            return self.metavar
        if self.is_flag:
            return ""
        bare = str(getattr(self.type, "name", "") or "text")  # a repeatable option names one value: its type's
        return _TYPE_NAMES.get(bare.lower(), bare.upper())


class PlainCommand(_PlainHelp, TyperCommand):
    """A command whose help shows plain metavars."""


class PlainGroup(_PlainHelp, TyperGroup):
    """A group (the root, `cache`) whose help shows plain metavars."""


class KnobHelpCommand(PlainCommand):
    """Fills each knob's help with the value derived on this machine, only when help is shown (never measures)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.epilog = self.epilog or KNOB_ENV_HINT

    def format_help(self, ctx, formatter) -> None:
        derived = derived_defaults()
        from .profiles.knobs.table import KNOBS_BY_NAME

        for param in self.params:
            name = (param.name or "").removeprefix("knob_")
            spec = KNOBS_BY_NAME.get(name) if (param.name or "").startswith("knob_") else None
            if spec is not None:
                param.help = f"{spec.help} Accepts {spec.accepted()}. {derived.get(name, DERIVED_AT_START)}."
        super().format_help(ctx, formatter)


LIVE_INPUTS = {"memory_available", "ram_available", "vram_free"}  # measured when a command starts, not cached


def derived_defaults() -> dict[str, str]:
    """knob -> how its default reads on this machine now, from the cached profile; empty without one."""
    try:
        from .profiles import HardwareProfile, resolve_knobs

        profile = HardwareProfile.cached()
        if profile is None:
            return {}
        knobs = resolve_knobs(profile, None)
    except Exception:  # noqa: BLE001 - help must show even when the cache or a variable is bad
        return {}
    out = {}
    for name, knob in knobs.items():
        if knob.overridden:
            out[name] = f"Now: {knob.display()}, set by {knob.formula}"
        elif name == "prefix_cache":
            out[name] = "Default: auto, which turns it on only when every weight is resident"
        elif name == "speculate":
            out[name] = (
                "Default: auto, which turns it on only when layers stream (prompt lookup, or draft with --draft-model)"
            )
        elif name == "draft_model":
            out[name] = "Default: none"
        elif knob.value is None:
            out[name] = "Default: derived at start from the model"
        elif LIVE_INPUTS & set(getattr(knob, "inputs", {}) or {}):
            # from the memory free when the command starts: a figure that differs from one run to the next
            model = knob.note.startswith(("no model", "needs a model"))
            out[name] = (
                f"Default: derived at start from the memory free then{', and from the model' if model else ''} "
                f"({knob.display()} now{', before a model' if model else ''})"
            )
        elif knob.note.startswith(("no model", "needs a model")):
            out[name] = (
                f"Default on this machine: {knob.display()} before the model's size is known (derived again "
                f"for the model at start)"
            )
        else:
            out[name] = f"Default on this machine: {knob.display()}"
    return out
