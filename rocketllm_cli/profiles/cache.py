"""Where measured profiles live: one small JSON file per (hardware fingerprint, part) under the cache directory."""

from __future__ import annotations

from pathlib import Path

from ..cachehome import cache_dir


def profile_dir(fingerprint: str) -> Path:
    return cache_dir() / "profiles" / fingerprint
