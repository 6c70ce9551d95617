"""Config files read with one line naming what is wrong: config.json as a JSON object, and the dtype it declares."""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import ModelError


def read_config(path: Path) -> dict:
    return read_json_object(path, f"{path.parent.name}/{path.name}")


def read_json_object(path: Path, shown: str | None = None) -> dict:
    """The JSON object in PATH; ModelError naming it (as SHOWN, else its file name) where it is unreadable or not
    one."""
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        raise ModelError(f"{shown or path.name} is unreadable or not JSON") from None
    if not isinstance(doc, dict):
        raise ModelError(f"{shown or path.name} is not a JSON object")
    return doc


def config_dtype(config: dict) -> str:
    text = config.get("text_config") or config
    return str(text.get("torch_dtype") or text.get("dtype") or config.get("torch_dtype") or config.get("dtype") or "")
