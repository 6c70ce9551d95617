"""What this process really read from storage, as Linux counts it: standard library only, so that a measurement
process of another engine (bench/llamacpp_worker.py) counts its reads by the same rule as our ledger."""

from __future__ import annotations


def storage_read_bytes() -> int | None:
    """Bytes this process really fetched from storage (Linux /proc/self/io read_bytes); None without it."""
    try:
        with open("/proc/self/io") as f:
            for line in f:
                if line.startswith("read_bytes:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None
