"""Package namespaces whose names load their modules on first use, so that importing a package stays cheap."""

from __future__ import annotations

from importlib import import_module


def exports(package: str, homes: dict[str, str]):
    """The module-level `__getattr__` of PACKAGE: each name in HOMES is imported from its home module (".sub" or
    "sub" relative to PACKAGE, "..x" above it) when first asked for; any other name is an AttributeError."""

    def __getattr__(name: str):
        home = homes.get(name)
        if home is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(import_module(home if home.startswith(".") else f".{home}", package), name)

    return __getattr__
