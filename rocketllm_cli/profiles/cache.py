"""Where measured profiles live: one small JSON file per (hardware fingerprint, part), written atomically."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

# Bumped when the stored layout changes; a file of another format is re-measured, never misread.
CACHE_FORMAT = 1


def cache_dir() -> Path:
    """ROCKETLLM_CACHE if set, else $XDG_CACHE_HOME/rocketllm or ~/.cache/rocketllm; created on demand."""
    explicit = os.environ.get("ROCKETLLM_CACHE")
    if explicit:
        path = Path(explicit).expanduser()
    else:
        xdg = os.environ.get("XDG_CACHE_HOME")
        base = Path(xdg).expanduser() if xdg and os.path.isabs(xdg) else Path.home() / ".cache"
        path = base / "rocketllm"
    path.mkdir(parents=True, exist_ok=True)
    return path


def profile_dir(fingerprint: str) -> Path:
    return cache_dir() / "profiles" / fingerprint


def read_json(path: Path) -> dict | None:
    """The stored document, or None when it is missing, unreadable, or of another cache format."""
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(doc, dict) or doc.get("cache_format") != CACHE_FORMAT:
        return None
    return doc


def write_json(path: Path, doc: dict) -> None:
    """Write via a temporary file and rename, so a concurrent reader sees the old file or the new one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".json", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump({**doc, "cache_format": CACHE_FORMAT}, f, indent=1)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
