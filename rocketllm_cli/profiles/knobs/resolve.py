"""Knobs: every tuning value as (name, value, formula, inputs, source), resolved flag/kwarg > env > derived."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Iterator

from ...checkpoint.modelfacts import ModelFacts
from ...errors import KnobError
from ...sizes import format_bytes
from ..hardware import HardwareProfile
from .derivation import Context
from .expression import evaluate
from .formulas import DERIVATIONS
from .shape import PassShape
from .table import KNOB_SPECS, KNOBS_BY_NAME

OVERRIDE_SOURCES = ("flag", "kwarg", "env")
BYTE_INPUTS = {"ram_total", "ram_available", "memory_available", "vram_free", "vram_total"}


@dataclass(frozen=True)
class Knob:
    """One tuning value. For a derived knob, `value == evaluate(formula, inputs)`; an override keeps the
    derivation it replaced in `derived_value`/`derived_formula` so the report can show both."""

    name: str
    value: object
    formula: str
    inputs: dict = field(default_factory=dict)
    source: str = "derived"  # measured | derived | default | flag | env | kwarg
    note: str = ""
    derived_value: object = None

    @property
    def overridden(self) -> bool:
        return self.source in OVERRIDE_SOURCES

    def display(self, value: object = ...) -> str:
        """The value in human units: sizes as GiB, booleans as on/off."""
        value = self.value if value is ... else value
        kind = KNOBS_BY_NAME[self.name].kind
        if value is None:
            return "n/a"
        if kind == "bytes":
            return format_bytes(value)
        if kind == "bool":
            return "on" if value else "off"
        return str(value)

    def to_dict(self) -> dict:
        return {**asdict(self), "overridden": self.overridden}


class Knobs(Mapping):
    """name -> Knob, iterated in the order of the knob table."""

    def __init__(self, knobs: dict[str, Knob]) -> None:
        self._knobs = {spec.name: knobs[spec.name] for spec in KNOB_SPECS}

    def __getitem__(self, name: str) -> Knob:
        return self._knobs[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._knobs)

    def __len__(self) -> int:
        return len(self._knobs)

    def value(self, name: str) -> object:
        return self._knobs[name].value

    def values_dict(self) -> dict[str, object]:
        return {name: k.value for name, k in self._knobs.items()}

    def to_dict(self) -> dict:
        return {name: k.to_dict() for name, k in self._knobs.items()}


def resolve_knobs(
    profile: HardwareProfile,
    model: ModelFacts | None = None,
    flags: dict[str, object] | None = None,
    kwargs: dict[str, object] | None = None,
    env: Mapping[str, str] | None = None,
    run_tokens: int | None = None,
    shape: PassShape | None = None,
) -> Knobs:
    """Every knob for this profile and model. Precedence: a CLI flag or Python keyword, then
    ROCKETLLM_<NAME> in `env` (default os.environ), then the derivation. Bad values raise KnobError.

    run_tokens: the most tokens of KV a one-shot run holds (every row's prompt and new tokens, and a margin): the KV
    cache is sized for them instead of for any request, and what that frees goes to the weights. Ignored where the
    memory would then hold fewer than run_tokens (the budgets' rounding on an edge of the plan).

    shape: the widths a forward pass fills per token (knobs/shape.py): each token of context then counts the
    activations of a pass over it beside its K and V. None: activations are not counted."""
    env = os.environ if env is None else env
    overrides = _overrides(flags or {}, kwargs or {}, env)
    values = {name: value for name, (value, _, _) in overrides.items()}
    context = Context(profile, model, values, set(overrides), run_tokens, shape)
    knobs: dict[str, Knob] = {}
    for name, derive in DERIVATIONS.items():
        d = derive(context)
        derived = evaluate(d.formula, d.inputs)
        if name in overrides:
            value, source, raw = overrides[name]
            shown = Knob(name, derived, d.formula).display()
            knobs[name] = Knob(
                name, value, f"{source} {raw}", {}, source, f"derived value would be {shown} = {d.formula}", derived
            )
        else:
            values[name] = derived
            knobs[name] = Knob(name, derived, d.formula, d.inputs, d.source, d.note)
    held = values.get("max_context")
    if run_tokens and "max_context" not in overrides and isinstance(held, int) and held < run_tokens:
        return resolve_knobs(profile, model, flags, kwargs, env, shape=shape)
    return Knobs(knobs)


def _overrides(flags: dict, kwargs: dict, env: Mapping[str, str]) -> dict[str, tuple[object, str, str]]:
    """name -> (parsed value, source, where it came from in words)."""
    for name in (*flags, *kwargs):
        if name not in KNOBS_BY_NAME:
            raise KnobError(f"unknown knob {name!r}; knobs are: {', '.join(KNOBS_BY_NAME)}")
    found: dict[str, tuple[object, str, str]] = {}
    for spec in KNOB_SPECS:
        if flags.get(spec.name) is not None:
            raw, source, where = flags[spec.name], "flag", spec.flag
        elif kwargs.get(spec.name) is not None:
            raw, source, where = kwargs[spec.name], "kwarg", f"keyword {spec.name}"
        elif env.get(spec.env, "").strip():
            raw, source, where = env[spec.env], "env", spec.env
        else:
            continue
        found[spec.name] = (spec.parse(raw, where), source, f"{where}={raw}")
    return found


def describe_input(name: str, value: object) -> str:
    """`name=raw` with human units alongside, so the printed raw numbers recompute the formula exactly."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return f"{name}={value!r}"
    if name.endswith("_bytes") or name in BYTE_INPUTS:
        return f"{name}={value} ({format_bytes(value)})"
    if name.endswith("_bps"):
        return f"{name}={value} ({value / 1e9:.2f} GB/s)"
    return f"{name}={value}"
