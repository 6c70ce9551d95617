"""What a decode token of one shard set costs to compute on this machine, as `bench` measured it resident.

The cost model's compute term is every weight byte at the measured matvec bandwidth: a floor that leaves out what
a real pass adds per layer (attention, norms, the framework's own calls) and what a packed kernel runs at. `bench`
measures the whole of it in the resident regime (nothing to read: compute alone); the figure is kept beside the
profile, per set and compute dtype, so `doctor --model SET` projects every regime from it rather than from the floor.
One small JSON file, written atomically; a read-only cache keeps the answer in this process only.
"""

from __future__ import annotations

import time
from pathlib import Path

FILE = "decode-compute.json"


def _key(directory: Path, manifest, compute_dtype: str) -> str:
    from .unitreads import set_key

    return f"{set_key(directory, manifest)}-{compute_dtype}"


def record(profile, directory: Path, manifest, compute_dtype: str, ms: dict, threads: int | None) -> None:
    """Keep a resident decode measurement of the set (`ms`: bench's median/p10/p90 in milliseconds)."""
    from ..cache import profile_dir, read_json, write_json

    where = profile_dir(profile.fingerprint) / FILE
    stored = read_json(where) or {}
    stored.pop("cache_format", None)
    stored[_key(directory, manifest, compute_dtype)] = {
        "seconds": ms["median"] / 1000, "p10_seconds": ms["p10"] / 1000, "tokens": ms.get("n"), "threads": threads,
        "compute_dtype": compute_dtype, "measured_at": time.strftime("%Y-%m-%d %H:%M", time.gmtime()) + " UTC",
    }
    try:
        write_json(where, stored)
    except OSError:
        pass  # a read-only cache: doctor projects from the matvec floor, and says so


def lookup(profile, directory: Path, manifest, compute_dtype: str) -> dict | None:
    """The stored measurement for this set and compute dtype on this machine, or None."""
    from ..cache import profile_dir, read_json

    entry = (read_json(profile_dir(profile.fingerprint) / FILE) or {}).get(_key(directory, manifest, compute_dtype))
    if not isinstance(entry, dict) or not isinstance(entry.get("seconds"), (int, float)) or entry["seconds"] <= 0:
        return None
    return entry
