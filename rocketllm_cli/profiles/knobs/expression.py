"""A knob formula's value: the readable expression every knob prints, evaluated on its inputs in a closed namespace
(min, max, floor, ceil and arithmetic only)."""

from __future__ import annotations

from math import ceil, floor

NAMESPACE = {"min": min, "max": max, "floor": floor, "ceil": ceil, "__builtins__": {}}


def evaluate(formula: str, inputs: dict) -> object:
    """The value of a knob formula for the given inputs (only min/max/floor/ceil and arithmetic)."""
    return eval(formula, dict(NAMESPACE), dict(inputs))  # noqa: S307 - our own formulas, a closed namespace
