"""Placeholder until this command lands."""

from ..errors import RocketError

NAME = "shard"
HELP = "(not built yet)"


def run() -> None:
    raise RocketError("shard is not built yet")
