"""Where a shard set goes and how it gets there: the default place, one writer per target, whether a set already
there is reused, written again or refused, and the swap that puts a finished set in place.

Beside a target `out` live its hidden siblings: `.out.partial` (the set being written), `.out.lock` (held by the
writer) and `.out.old` (a replaced set, until it is deleted).
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
from contextlib import contextmanager
from pathlib import Path

from ..checkpoint import stfile
from ..checkpoint.manifest import MANIFEST, UNIT_FILE, Manifest, set_key
from ..dtypes import NAMES as DTYPES
from ..errors import ShardError
from .journal import JOURNAL
from .quantconfig import declares_packed
from .source import Located
from .tokenizers import TOKENIZER_FILES

SHARDS = "shards"  # <cache>/shards/<name>-<fingerprint>-<dtype>


def shards_root() -> Path:
    """Where shard sets go unless --out says otherwise (ROCKETLLM_CACHE moves it)."""
    from ..cachehome import cache_dir

    return cache_dir() / SHARDS


def default_out(located: Located, dtype: str) -> Path:
    """Beside the model cache, keyed by the source's fingerprint, so generate finds and reuses it."""
    safe = re.sub(r"[^A-Za-z0-9._-]+", "-", located.name)[:64] or "model"
    return shards_root() / f"{safe}-{located.fingerprint()}-{dtype}"


EARLIER_GGUF_SET = (
    "a set of {name} made by an earlier version is at {path} (Q4 blocks converted to int4, Q8_0 re-scaled per row, "
    "Q5_0, Q6_K and others stored as floats); this version keeps every block type as the file stores it, so it shards "
    "again (`rocketllm cache rm` removes the old set)"
)


def find_existing(located: Located, dtype: str, packing: str = "auto", log=None) -> tuple[Manifest, Path] | None:
    """A complete shard set of this source in the default place (any dtype for 'auto'), without reading weights.

    packing auto finds a set that kept a GGUF's or a pre-quantized checkpoint's low-bit weights ("-packed"), or a
    float set of any other source; a set with int4 codes in another CPU's order is not this machine's (its key
    names the order)."""
    from .packing import key_here

    dtypes = list(DTYPES) if dtype == "auto" else [dtype]
    if packing == "auto":
        # a GGUF's "packed" sets are an earlier version's (Q4 as int4, Q8_0 re-scaled per row): found to be said so
        modes = (
            ["blocks", "packed"] if located.kind == "gguf" else ["packed"] if declares_packed(located.path) else [""]
        )
    else:
        modes = ["" if packing == "none" else packing]
    legacy = located.legacy_fingerprint()
    for key in (key_here(dt, mode) for dt in dtypes for mode in modes):
        for final in _candidates(located, key):
            if (final / MANIFEST).is_file():
                try:
                    manifest = Manifest.load(final)
                except ShardError:
                    continue  # damaged: shard() says so and writes it again
                recorded = manifest.source.get("fingerprint")
                if (
                    located.kind == "gguf"
                    and manifest.packing == "packed"
                    and recorded in (located.fingerprint(), legacy)
                ):
                    if log is not None:  # packed the older way: made again, once, in the content-named place
                        log("note: " + EARLIER_GGUF_SET.format(name=located.path.name, path=final))
                    continue
                if recorded in (located.fingerprint(), legacy):
                    _drop_replaced(final)
                    return manifest, final
    return None


def _candidates(located: Located, key: str) -> list[Path]:
    """Where a set of this source with this key may be: its own name, the same content under another file name (a
    GGUF copied or renamed), and the name an older version gave it (size and modification time)."""
    own = default_out(located, key)
    found = [own]
    if located.kind == "gguf":
        found += sorted(p for p in shards_root().glob(f"*-{located.fingerprint()}-{key}") if p != own)
        found.append(
            shards_root() / own.name.replace(f"-{located.fingerprint()}-", f"-{located.legacy_fingerprint()}-")
        )
    return found


def partial_of(final: Path) -> Path:
    """The hidden directory a set for FINAL is written into before it is renamed into place."""
    return beside(final, "partial")


@contextmanager
def exclusive(final: Path, log):
    """One sharder per target at a time: a second process waits, then finds the finished set and reuses it.

    The lock file is removed after a successful run only: a waiter still holding the old file then
    re-checks and finds the complete set; after a failure it stays, so no two writers ever meet.
    """
    lock_path = beside(final, "lock")
    while True:
        with open(lock_path, "a") as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                log(f"another rocketllm is sharding into {lock_path.parent}; waiting for it")
                fcntl.flock(lock, fcntl.LOCK_EX)
            if not _same_file(lock, lock_path):
                continue  # the holder finished and removed the file we waited on: lock the current one
            yield
            lock_path.unlink(missing_ok=True)
            return


def _same_file(opened, path: Path) -> bool:
    try:
        return os.fstat(opened.fileno()).st_ino == os.stat(path).st_ino
    except OSError:
        return False


def reusable(final: Path, fingerprint: str, dtype: str, ours: bool, log) -> Manifest | None:
    """The complete set at FINAL, or None when there is none or it is a damaged set of this source to write again.

    `dtype`: the set's key, its dtype and packing (Manifest.key).
    `ours`: FINAL is the default location, named after this source's fingerprint and dtype.
    """
    if not final.exists():
        return None
    if not (final / MANIFEST).is_file():
        if final.is_dir() and not any(final.iterdir()):
            final.rmdir()
            return None
        if final.is_dir() and (ours or _only_shard_files(final)):
            log(f"{final}: no {MANIFEST}; sharding it again")
            return None
        raise ShardError(f"{final} exists and is not a shard directory; choose another --out or remove it")
    try:
        manifest = Manifest.load(final)
    except ShardError as exc:
        recorded = _recorded_as(final, fingerprint, dtype)
        if not (ours or recorded or (recorded is None and _only_shard_files(final))):
            what = "that is not of this model and dtype" if recorded is False else "mixed with other files"
            raise ShardError(f"{final} holds a damaged shard set {what}; choose another --out or remove it") from None
        log(f"{final}: {str(exc).split('; re-run')[0]}; sharding it again")
        return None
    if manifest.source.get("fingerprint") != fingerprint or manifest.key != dtype:
        raise ShardError(f"{final} holds shards of another source or dtype; choose another --out or remove it")
    _drop_replaced(final)
    return manifest


def swap_in(partial: Path, final: Path) -> None:
    """Rename the finished set at PARTIAL to FINAL. A set already at FINAL (a damaged one of this source, judged
    ours to replace by reusable) is moved aside first and deleted after: swap, never delete first."""
    _fsync_dir(partial)
    old = beside(final, "old")
    if final.exists():
        shutil.rmtree(old, ignore_errors=True)
        os.rename(final, old)
    os.rename(partial, final)
    _fsync_dir(final.parent)
    shutil.rmtree(old, ignore_errors=True)


def beside(final: Path, role: str) -> Path:
    """The hidden sibling of a set: .NAME.partial (being written), .NAME.old (being replaced), .NAME.lock."""
    return final.parent / f".{final.name}.{role}"


def _drop_replaced(final: Path) -> None:
    """Remove what is left of a set this one replaced, when a run stopped before deleting it (it can be as big as the
    set)."""
    old = beside(final, "old")
    if old.exists():
        shutil.rmtree(old, ignore_errors=True)


def _only_shard_files(directory: Path) -> bool:
    """A shard set that lost its manifest: unit files (by their own headers) and the files sharding copies, nothing
    else."""
    known = {"config.json", MANIFEST, MANIFEST + ".tmp", JOURNAL, *TOKENIZER_FILES}
    units = 0
    for f in directory.iterdir():
        if UNIT_FILE.match(f.name) and f.is_file():
            try:
                if "unit" not in stfile.read_header(f).metadata:
                    return False
            except ShardError:
                pass  # a damaged unit file is still one of ours by its name
            units += 1
        elif f.name not in known or not f.is_file():
            return False
    return units > 0


def _recorded_as(directory: Path, fingerprint: str, dtype: str) -> bool | None:
    """Whether a (possibly damaged) manifest still names this source and dtype; None when it cannot be read."""
    try:
        doc = json.loads((directory / MANIFEST).read_text(encoding="utf-8"))
        key = set_key(doc["dtype"], doc.get("packing", ""), doc.get("int4_layout", ""))
        return doc["source"]["fingerprint"] == fingerprint and key == dtype
    except Exception:  # noqa: BLE001 - unreadable in any way
        return None


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
