"""Placeholder until this command lands."""

from ..errors import RocketError

NAME = "profile"
HELP = "(not built yet)"


def run() -> None:
    raise RocketError("profile is not built yet")
