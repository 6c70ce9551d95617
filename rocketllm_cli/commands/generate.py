"""Placeholder until this command lands."""

from ..errors import RocketError

NAME = "generate"
HELP = "(not built yet)"


def run() -> None:
    raise RocketError("generate is not built yet")
