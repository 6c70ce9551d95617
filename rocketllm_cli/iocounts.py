"""What this process really read from storage, as Linux counts it: standard library only, so that a measurement
process of another engine (bench/llamacpp_worker.py) counts its reads by the same rule as our ledger."""

from __future__ import annotations

import os
import threading

_held: tuple[int, int] | None = None  # (pid, fd of its /proc/<pid>/io): open once, read again at offset 0
_lock = threading.Lock()


def storage_read_bytes() -> int | None:
    """Bytes this process really fetched from storage (Linux /proc/self/io read_bytes); None without it.

    Asked three times a decode step (the ledger's pass, the streamer's token): opening the file each time cost ~40-130
    us a read inside a decode, a pread of the file kept open ~2 hot. The file is reopened in a forked child, whose own
    counts are another file."""
    global _held
    try:
        with _lock:
            pid = os.getpid()
            if _held is None or _held[0] != pid:
                if _held is not None:  # the parent's, inherited across fork: closed and forgotten before the open
                    os.close(_held[1])
                    _held = None
                _held = (pid, os.open(f"/proc/{pid}/io", os.O_RDONLY | os.O_CLOEXEC))
            text = b"\n" + os.pread(_held[1], 4096, 0)
    except OSError:
        return None
    start = text.find(b"\nread_bytes:")
    if start < 0:
        return None
    end = text.find(b"\n", start + 1)
    return int(text[start + len(b"\nread_bytes:") : end if end > 0 else None])
