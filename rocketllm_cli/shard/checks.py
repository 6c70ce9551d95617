"""Checks around writing a shard set: room on the disk before, intact bytes after (`--verify`)."""

from __future__ import annotations

import errno
import hashlib
import shutil
from pathlib import Path

from ..checkpoint.manifest import Manifest
from ..errors import ShardError
from ..sizes import format_bytes

HEADROOM = 64 << 20  # free space left over after sharding, for everything else on the disk
DISK_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


def check_space(directory: Path, need: int) -> None:
    """Refuse up front when NEED bytes plus HEADROOM do not fit on DIRECTORY's disk."""
    free = free_bytes(directory)
    if free < need + HEADROOM:
        raise ShardError(
            f"not enough disk space for shards: need {format_bytes(need)} plus {format_bytes(HEADROOM)} headroom, "
            f"{format_bytes(free)} free at {directory}; free space, or put the shards on another disk (`rocketllm "
            f"shard --out DIR`, or ROCKETLLM_CACHE=DIR for every command)"
        )


def free_bytes(directory: Path) -> int:
    probe = directory
    while not probe.exists() and probe != probe.parent:  # the target may not exist yet
        probe = probe.parent
    return shutil.disk_usage(probe).free


def verify(directory: Path, log=print) -> list[str]:
    """Re-check every unit file against the manifest: sizes and sha256. Returns the problems found."""
    manifest = Manifest.load(directory)  # sizes and tensor bounds
    problems = []
    if manifest.indexed:  # its units are the file's own bytes: the file hashes to the set's source fingerprint
        from .identity import file_digest

        if file_digest(Path(manifest.indexes["path"])) != manifest.source.get("fingerprint"):
            problems.append(f"{manifest.indexes['path']}: checksum mismatch (contents changed)")
        return problems
    for u in manifest.units:
        digest = hashlib.sha256()
        with open(directory / u.file, "rb") as f:
            while chunk := f.read(16 << 20):
                digest.update(chunk)
        if digest.hexdigest() != u.sha256:
            problems.append(f"{u.file}: checksum mismatch (contents changed)")
    return problems
