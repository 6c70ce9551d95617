"""CLI options defined once: shared Annotated aliases and the knob flags every command can take."""

from __future__ import annotations

import functools
import inspect
import typing
from pathlib import Path
from typing import Annotated, Optional

import typer
from typer.core import TyperCommand

from .profiles.knobs.table import KNOB_SPECS

JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON document on stdout instead of text.")]
RefreshOpt = Annotated[bool, typer.Option("--refresh", help="Re-measure the hardware instead of using the cached profile.")]
ModelPathOpt = Annotated[
    Optional[Path],
    typer.Option("--model", help="Model or shard directory (or .gguf file); storage is measured where it lives."),
]

KNOB_PANEL = "Knobs (derived from the measured hardware unless set; ROCKETLLM_<NAME> also sets them)"


def with_knob_options(func):
    """Add one --<knob-name> option per knob to a command; they reach it as `knob_flags` (name -> raw text)."""
    sig = inspect.signature(func)
    hints = typing.get_type_hints(func, include_extras=True)  # resolves string annotations, keeps typer's metadata
    params = [p.replace(annotation=hints.get(p.name, p.annotation)) for p in sig.parameters.values() if p.name != "knob_flags"]
    for spec in KNOB_SPECS:
        # No square brackets: help is rich markup, which takes them for tags and drops them.
        option = typer.Option(spec.flag, *spec.flags, help=f"{spec.help} Accepts {spec.accepted()}.", rich_help_panel=KNOB_PANEL, show_default=False)
        params.append(
            inspect.Parameter(f"knob_{spec.name}", inspect.Parameter.KEYWORD_ONLY, default=None, annotation=Annotated[Optional[str], option])
        )

    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        flags = {spec.name: kwargs.pop(f"knob_{spec.name}") for spec in KNOB_SPECS if kwargs.get(f"knob_{spec.name}") is not None}
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


class KnobHelpCommand(TyperCommand):
    """Fills each knob's help with the value derived on this machine, only when help is shown (never measures)."""

    def format_help(self, ctx, formatter) -> None:
        derived = derived_defaults()
        from .profiles.knobs.table import KNOBS_BY_NAME

        for param in self.params:
            name = (param.name or "").removeprefix("knob_")
            spec = KNOBS_BY_NAME.get(name) if (param.name or "").startswith("knob_") else None
            if spec is not None:
                param.help = f"{spec.help} Accepts {spec.accepted()}. {derived.get(name, DERIVED_AT_START)}."
        super().format_help(ctx, formatter)


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
        elif knob.value is None:
            out[name] = "Default: derived at start from the model"
        elif knob.note.startswith(("no model", "needs a model")):
            out[name] = f"Default on this machine: {knob.display()} before the model's size is known (derived again for the model at start)"
        else:
            out[name] = f"Default on this machine: {knob.display()}"
    return out
