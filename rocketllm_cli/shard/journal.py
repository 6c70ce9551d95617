"""The journal of a partial shard set: which units an interrupted run finished, so a rerun resumes after them.

One fsynced JSON line per finished unit: {"fingerprint": ..., "dtype": "bf16", "unit": <UnitRecord as a dict>}.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict
from pathlib import Path

from ..checkpoint.manifest import MANIFEST, Manifest
from ..checkpoint.unitrecords import TensorRecord, UnitRecord
from ..errors import ShardError

JOURNAL = "journal.jsonl"


def append(partial: Path, fingerprint: str, dtype: str, record: UnitRecord) -> None:
    """Record one finished unit, durably: a kill after this returns keeps the unit."""
    with open(partial / JOURNAL, "a") as f:
        f.write(json.dumps({"fingerprint": fingerprint, "dtype": dtype, "unit": asdict(record)}) + "\n")
        f.flush()
        os.fsync(f.fileno())


def resumable(partial: Path, fingerprint: str, dtype: str) -> dict[str, UnitRecord]:
    """`dtype`: the set's key (its dtype and packing, Manifest.key). Units an interrupted run finished, whose files are
    intact: from its journal, or from its manifest when it
    stopped between writing that and the rename."""
    if not partial.is_dir():
        return {}
    done = _read(partial, fingerprint, dtype)
    if not done and (partial / MANIFEST).is_file():
        try:
            manifest = Manifest.load(partial)
        except ShardError:
            manifest = None
        if manifest is not None and manifest.source.get("fingerprint") == fingerprint and manifest.key == dtype:
            done = {u.name: u for u in manifest.units}
    return {name: r for name, r in done.items() if _file_ok(partial / r.file, r.bytes)}


def _read(partial: Path, fingerprint: str, dtype: str) -> dict[str, UnitRecord]:
    done: dict[str, UnitRecord] = {}
    path = partial / JOURNAL
    if not path.is_file():
        return done
    for line in path.read_text().splitlines():
        try:
            doc = json.loads(line)
            if doc["fingerprint"] != fingerprint or doc["dtype"] != dtype:
                return {}
            u = doc["unit"]
            done[u["name"]] = UnitRecord(**{**u, "tensors": [TensorRecord(**t) for t in u["tensors"]]})
        except (ValueError, KeyError, TypeError):
            break  # a torn last line from an interrupted write: everything before it stands
    return done


def _file_ok(path: Path, size: int) -> bool:
    try:
        return path.stat().st_size == size
    except OSError:
        return False
