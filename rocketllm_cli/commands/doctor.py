"""Placeholder until this command lands."""

from ..errors import RocketError

NAME = "doctor"
HELP = "(not built yet)"


def run() -> None:
    raise RocketError("doctor is not built yet")
