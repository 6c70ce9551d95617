"""A GGUF's identity is its content: the same file copied elsewhere (or renamed) finds the set and the warm server
sharded from the first one. sha256 of the whole file, computed once per (path, size, modification time, inode) and
remembered in the cache (fingerprints.json), so later runs pay a stat; torch-free.

    content_fingerprint(Path("model.gguf"))   # 16 hex digits; ~0.15 s per 250 MB the first time (SHA-NI), then a stat
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

MEMO = "fingerprints.json"
CHUNK = 8 << 20  # bytes hashed per read
KEPT = 256  # remembered files; the oldest are forgotten first


def known_fingerprint(path: Path) -> str | None:
    """The file's content hash where an earlier run took it and the file is unchanged since; None otherwise (never
    reads the file: a header-only caller, `plan`, pays no hash of a 40 GB file)."""
    from ..cachehome import cache_dir, read_json

    path = Path(path)
    try:
        st = path.stat()
    except OSError:
        return None
    found = ((read_json(cache_dir() / MEMO) or {}).get("files") or {}).get(
        f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}|{st.st_ino}"
    )
    return str(found) if found else None


def content_fingerprint(path: Path) -> str:
    """The file's content hash (16 hex digits), from the memo when the file is unchanged since it was taken."""
    from ..cachehome import cache_dir, read_json, write_json

    path = Path(path)
    st = path.stat()
    key = f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}|{st.st_ino}"
    memo_path = cache_dir() / MEMO
    memo = read_json(memo_path) or {}
    known = memo.get("files", {})
    if key in known:
        return str(known[key])
    digest = file_digest(path)
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
