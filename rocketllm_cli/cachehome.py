"""The cache directory every command reads and writes (profiles, shard sets, the native build, records), and its
small JSON files written atomically. A base module: nothing here imports the rest of the package."""

from __future__ import annotations

import json
import os
from pathlib import Path

# Bumped when the stored layout changes; a file of another format is re-measured, never misread.
CACHE_FORMAT = 1


def cache_root() -> Path:
    """ROCKETLLM_CACHE if set, else $XDG_CACHE_HOME/rocketllm or ~/.cache/rocketllm; never created here."""
    explicit = os.environ.get("ROCKETLLM_CACHE")
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg and os.path.isabs(xdg) else Path.home() / ".cache"
    return base / "rocketllm"


def cache_dir() -> Path:
    """cache_root(), created on demand. A directory that cannot be created (a read-only disk) is still returned:
    what reads the cache finds nothing, and what writes there fails naming it (errors.describe)."""
    path = cache_root()
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError:
        pass
    return path


def unwritable(directory: Path) -> str | None:
    """Why nothing can be written in `directory` (created if missing), or None when a file can be: the reason as
    the system gives it. Root writes through mode bits, so this creates a file rather than asking access()."""
    import tempfile  # here, not at the top: the warm client's start-up reads this module

    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".write-probe-", dir=directory)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        return exc.strerror or str(exc)
    return None


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
    import tempfile

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
