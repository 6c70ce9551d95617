"""A GGUF's identity is its content: the same file copied elsewhere (or renamed) finds the set and the warm server
sharded from the first one. sha256 of the whole file, computed once per (path, size, modification time, inode) and
remembered in the cache (fingerprints.json), so later runs pay a stat; torch-free.

    content_fingerprint(Path("model.gguf"))   # 16 hex digits; ~0.15 s per 250 MB the first time (SHA-NI), then a stat

A first contact with a large file pays that hash (a 1.64 GB file read cold: about 3 s here) before its set is found or
indexed: `hash_in_background` starts it on a thread of its own as a command begins (hashlib and the reads leave the
GIL), so it runs beside the imports of torch and transformers, and `content_fingerprint` then waits for it.
"""

from __future__ import annotations

import hashlib
import os
import threading
from concurrent.futures import Future
from pathlib import Path

MEMO = "fingerprints.json"
CHUNK = 8 << 20  # bytes hashed per read
KEPT = 256  # remembered files; the oldest are forgotten first

_lock = threading.Lock()
_hashing: dict[str, Future] = {}  # memo key -> the background hash of that file state


def hash_in_background(path) -> None:
    """Begin the content hash of a GGUF at PATH on a daemon thread, where the memo does not have it yet; a later
    content_fingerprint of the same file waits for it rather than hashing again. Anything odd: nothing started."""
    path = Path(str(path)).expanduser()
    if path.suffix != ".gguf" or known_fingerprint(path) is not None:
        return
    try:
        key = _key(path)
    except OSError:
        return
    with _lock:
        if key in _hashing:
            return
        future: Future = Future()
        _hashing[key] = future

    def run() -> None:
        try:
            future.set_result(file_digest(path))
        except BaseException as exc:  # noqa: BLE001 - handed to the waiter, which hashes again or says why
            future.set_exception(exc)

    threading.Thread(target=run, name="rocketllm-fingerprint", daemon=True).start()


def hashing(path) -> bool:
    """Whether a background hash of the file at PATH, as it is now, is under way (hash_in_background)."""
    try:
        key = _key(Path(path))
    except OSError:
        return False
    with _lock:
        return key in _hashing


def _key(path: Path) -> str:
    st = path.stat()
    return f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}|{st.st_ino}"


def known_fingerprint(path: Path) -> str | None:
    """The file's content hash where an earlier run took it and the file is unchanged since; None otherwise (never
    reads the file: a header-only caller, `plan`, pays no hash of a 40 GB file)."""
    from ..cachehome import cache_dir, read_json

    path = Path(path)
    try:
        key = _key(path)
    except OSError:
        return None
    found = ((read_json(cache_dir() / MEMO) or {}).get("files") or {}).get(key)
    return str(found) if found else None


def content_fingerprint(path: Path) -> str:
    """The file's content hash (16 hex digits), from the memo when the file is unchanged since it was taken."""
    from ..cachehome import cache_dir, read_json, write_json

    path = Path(path)
    key = _key(path)
    memo_path = cache_dir() / MEMO
    memo = read_json(memo_path) or {}
    known = memo.get("files", {})
    if key in known:
        return str(known[key])
    with _lock:
        started = _hashing.pop(key, None)
    try:
        digest = started.result() if started is not None else file_digest(path)
    except OSError:
        digest = file_digest(path)  # the background read failed: this one's error, if any, is the one to say
    known = {k: v for k, v in known.items() if not k.startswith(f"{path.resolve()}|")}  # this path's older states
    known[key] = digest
    try:
        write_json(memo_path, {"files": dict(list(known.items())[-KEPT:])})
    except OSError:
        pass  # a read-only cache: the hash is taken again next time
    return digest


def file_digest(path: Path) -> str:
    """The content hash a GGUF's sets are named by, taken now (`shard --verify` of a set indexing it)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        try:
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
        except (AttributeError, OSError):
            pass
        while block := f.read(CHUNK):
            h.update(block)
    return h.hexdigest()[:16]
