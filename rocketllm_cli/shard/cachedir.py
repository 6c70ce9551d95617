"""The shard sets in the cache: list them with their state and size on disk, mark one used, remove them.

A set's NAME is its directory under <cache>/shards/. Beside it the sharder keeps `.NAME.partial` (an
interrupted run, resumed by the next one), `.NAME.old` (a set being replaced) and `.NAME.lock` (flocked
while sharding). torch is imported only to read manifests (`list_sets`), so `rm` and `path` start fast.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from ..cachehome import cache_dir
from ..dtypes import NAMES as DTYPES
from ..errors import ShardError
from ..profiles.cache import profile_dir
from .target import SHARDS, beside, shards_root

LEFTOVERS = ("partial", "old")
# <name>-<fingerprint>-<dtype>: what a set is of, when no manifest says so (a partial or damaged set).
_DEFAULT_NAME = re.compile(rf"^(?P<model>.+)-[0-9a-f]+-(?P<dtype>{'|'.join(DTYPES)})$")
_LAYER_FILE = re.compile(r"^\d{4}-layer\.\d+\.safetensors$")


def cache_origin() -> str:
    """What chose cache_dir(): "ROCKETLLM_CACHE", or "default" ($XDG_CACHE_HOME/rocketllm or ~/.cache/rocketllm)."""
    return "ROCKETLLM_CACHE" if os.environ.get("ROCKETLLM_CACHE") else "default"


@dataclass
class CachedSet:
    """One shard set in the cache, as `rocketllm cache ls` shows it."""

    name: str
    path: Path  # the set's directory; of a set that is only leftovers, the leftover
    bytes: int  # on disk: the set and its leftovers, by allocated blocks
    last_used: float | None  # epoch seconds: the last load, or when it was sharded
    state: str = "complete"  # complete | damaged | partial (an interrupted run) | leftover (an interrupted removal)
    model: str | None = None
    source_kind: str | None = None  # gguf | safetensors | bin
    dtype: str | None = None
    units: int | None = None  # of a partial set: the units written so far
    layers: int | None = None
    experts: int | None = None
    leftovers: list[str] = field(default_factory=list)
    problem: str | None = None  # why a damaged set does not load
    indexes: str | None = None  # the file a set indexes in place (its weights are that file's bytes, not counted here)

    def to_dict(self) -> dict:
        used = datetime.fromtimestamp(self.last_used, timezone.utc).isoformat() if self.last_used is not None else None
        return {**{k: v for k, v in vars(self).items() if k != "last_used"}, "path": str(self.path), "last_used": used}


def mark_used(directory: Path) -> None:
    """Record that a set was just loaded, for `cache ls`: its directory's mtime becomes now.

    The mtime rather than a file: nothing is added to the set, it costs one syscall, and sharding (which writes
    the directory) counts as a use. Only sets in the cache: a user's --out directory is theirs (its mtime may
    mean something to their backup or build tools) and nothing lists it.
    """
    try:
        directory = Path(directory)
        if directory.resolve().parent == shards_root().resolve() and not directory.name.startswith("."):
            os.utime(directory)
    except OSError:
        pass  # a read-only or shared cache: loading must not fail over a timestamp


def list_sets() -> list[CachedSet]:
    """Every shard set in the cache, leftovers of interrupted runs included, by name."""
    root = shards_root()
    return [_describe(root, name, pieces) for name, pieces in sorted(_scan(root).items())]


def find(names: list[str] | None) -> dict[str, list[Path]]:
    """{name: what it has on disk} for NAMES (None: every set); an unknown or path-like name is an error."""
    root = shards_root()
    found = _scan(root)
    if names is None:
        return dict(sorted(found.items()))
    for name in names:
        _check_name(root, name)
        if name not in found:
            raise ShardError(f"no shard set named {name!r} in the cache; `rocketllm cache ls` lists the names")
    return {name: found[name] for name in dict.fromkeys(names)}


def remove(names: list[str]) -> dict[str, int]:
    """Delete each named set with its leftovers; {name: bytes freed}. Refuses, deleting nothing, while any
    of them is being sharded: the sharder's own lock is taken first, so the two never meet."""
    root = shards_root()
    for name in names:
        _check_name(root, name)
    freed: dict[str, int] = {}
    with _locked(root, names):
        found = _scan(root)  # again under the lock: a sharder may have finished a set meanwhile
        for name in names:
            pieces = found.get(name, [])
            freed[name] = sum(disk_bytes(p) for p in pieces)
            _delete(root, name, pieces)
    return freed


def disk_bytes(path: Path) -> int:
    """What the files below PATH take on disk: allocated blocks, so a sparse or compressed file counts as stored."""
    total = 0
    for where, _, files in os.walk(path):
        for f in files:
            try:
                st = os.lstat(os.path.join(where, f))
            except OSError:
                continue  # removed while we walked
            total += st.st_blocks * 512 if hasattr(st, "st_blocks") else st.st_size
    return total


def profiles_usage() -> dict:
    """The measured profiles: how many documents, for how many machines, and their size."""
    root = profile_dir("-").parent  # profile_dir keys one directory per hardware fingerprint under this one
    docs = [p for p in root.glob("*/*.json") if not p.name.startswith(".")] if root.is_dir() else []
    return {"path": str(root), "count": len(docs), "machines": len({p.parent for p in docs}), "bytes": disk_bytes(root)}


def other_usage() -> dict[str, int]:
    """Everything else in the cache (bench copies, synthetic checkpoints): {top-level directory: bytes}."""
    skip = {SHARDS, profile_dir("-").parent.name}
    return {p.name: disk_bytes(p) for p in sorted(cache_dir().iterdir()) if p.is_dir() and p.name not in skip}


def _scan(root: Path) -> dict[str, list[Path]]:
    """{name: [the set's directory if present, then its leftovers]}. Symbolic links are left alone: what they
    point at is not the cache's to measure or delete."""
    found: dict[str, list[Path]] = {}
    if not root.is_dir():
        return found
    for entry in sorted(root.iterdir()):
        if entry.is_symlink() or not entry.is_dir():
            continue  # lock files, and anything that is not a set
        if not entry.name.startswith("."):
            found.setdefault(entry.name, []).insert(0, entry)
            continue
        for kind in LEFTOVERS:
            if entry.name.endswith(f".{kind}") and len(entry.name) > len(kind) + 2:
                found.setdefault(entry.name[1 : -len(kind) - 1], []).append(entry)
    return found


def _describe(root: Path, name: str, pieces: list[Path]) -> CachedSet:
    final = root / name
    guess = _DEFAULT_NAME.match(name)
    shown = final if final in pieces else next((p for p in pieces if p.name.endswith(".partial")), pieces[0])
    entry = CachedSet(
        name=name,
        path=shown,
        bytes=sum(disk_bytes(p) for p in pieces),
        last_used=_last_used(final, pieces),
        model=guess and guess["model"],
        dtype=guess and guess["dtype"],
        leftovers=[p.name for p in pieces if p != final],
    )
    if final in pieces:
        _read_manifest(entry, final)
    elif beside(root / name, "partial") in pieces:
        files = [f.name for f in beside(root / name, "partial").iterdir()]
        entry.state = "partial"
        # finished units: a unit being written ends in .tmp
        entry.units = sum(f.endswith(".safetensors") for f in files)
        entry.layers = sum(_LAYER_FILE.match(f) is not None for f in files)
    else:
        entry.state = "leftover"
    return entry


def _read_manifest(entry: CachedSet, final: Path) -> None:
    """Fill ENTRY from the set's manifest, checked as a load checks it; a set that would not load is damaged."""
    from ..checkpoint.manifest import MANIFEST, Manifest

    try:
        manifest = Manifest.load(final)
    except (ShardError, OSError) as exc:
        entry.state, entry.problem = "damaged", " ".join(str(exc).split())
        try:  # what it was of, if the manifest still says
            source = json.loads((final / MANIFEST).read_text(encoding="utf-8"))["source"]
            entry.model, entry.source_kind = source.get("name", entry.model), source.get("kind")
        except Exception:  # noqa: BLE001 - unreadable in any way: the directory name is all there is
            pass
        return
    entry.model, entry.source_kind = manifest.source.get("name"), manifest.source.get("kind")
    entry.dtype, entry.units = manifest.dtype, len(manifest.units)
    entry.layers, entry.experts = len(manifest.layers), len(manifest.experts)
    entry.indexes = manifest.indexes.get("path")


def _last_used(final: Path, pieces: list[Path]) -> float | None:
    """The set's own mtime (see mark_used); of leftovers alone, when they were last written."""
    times = []
    for piece in [final] if final in pieces else pieces:
        try:
            times.append(piece.stat().st_mtime)
        except OSError:
            pass  # removed while we looked
    return max(times, default=None)


def _check_name(root: Path, name: str) -> None:
    """A NAME is one entry of `cache ls`; anything that could reach outside <cache>/shards is refused."""
    path_like = not name or name.startswith(".") or any(c in name for c in "/\\\0")
    if path_like or (root / name).resolve().parent != root.resolve():
        raise ShardError(f"bad shard set name {name!r}: give a NAME that `rocketllm cache ls` lists, not a path")


@contextmanager
def _locked(root: Path, names: list[str]):
    """Hold the sharder's lock (sharder._exclusive) of every name, without waiting.

    The lock files stay afterwards, as the sharder leaves them after a failure: a sharder already waiting on
    one would otherwise hold a deleted file while a newcomer locks a new one, and the two would write at once.
    """
    with ExitStack() as stack:
        for name in names:
            lock = stack.enter_context(open(beside(root / name, "lock"), "a"))
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise ShardError(
                    f"{name} is being sharded by another process; nothing removed, try again when it finishes"
                ) from None
        yield


def _delete(root: Path, name: str, pieces: list[Path]) -> None:
    final, old = root / name, beside(root / name, "old")
    for piece in pieces:  # checked once more, resolved: nothing outside the cache is ever deleted
        if piece.is_symlink() or piece.resolve().parent != root.resolve():
            raise ShardError(f"{piece} is not inside {root}; nothing removed from it")
    if final in pieces:
        if old.exists():
            shutil.rmtree(old)
        os.rename(final, old)  # the set vanishes at once: no load ever sees it half deleted
    for kind in LEFTOVERS:
        if beside(root / name, kind).exists():
            shutil.rmtree(beside(root / name, kind))
