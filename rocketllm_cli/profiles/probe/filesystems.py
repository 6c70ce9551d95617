"""Which filesystem holds a path, and what kind of storage is under it.

Storage bandwidth belongs to a filesystem, not to the machine, so measurements are
keyed by `Filesystem.key` (mount point, type, source device, st_dev).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

NETWORK_FS = {
    "nfs",
    "nfs4",
    "cifs",
    "smb3",
    "smbfs",
    "ceph",
    "glusterfs",
    "lustre",
    "gpfs",
    "beegfs",
    "9p",
    "virtiofs",
    "fuse.sshfs",
    "fuse.s3fs",
    "afs",
}
MEMORY_FS = {"tmpfs", "ramfs"}
INDEXED_MANIFEST_MAX = 16 << 20  # bytes: an indexed set has no experts, and its manifest is far smaller
STORAGE_KINDS = ("nvme", "ssd", "rotational", "network", "tmpfs", "overlay", "unknown")


@dataclass(frozen=True)
class Filesystem:
    directory: Path  # the existing directory probed (the path itself, or its nearest existing parent)
    mount_point: str
    fstype: str
    source: str
    st_dev: str  # "major:minor"
    kind: str  # one of STORAGE_KINDS
    kind_reason: str

    @property
    def key(self) -> str:
        ident = f"{self.mount_point}\0{self.fstype}\0{self.source}\0{self.st_dev}"
        return "fs-" + hashlib.sha256(ident.encode()).hexdigest()[:12]


def filesystem_of(path: Path) -> Filesystem:
    directory = existing_directory(path)
    real = os.path.realpath(directory)
    st = os.stat(real)
    mount_point, fstype, source = _mount_of(real)
    kind, reason = _storage_kind(fstype, source, st.st_dev)
    return Filesystem(
        directory, mount_point, fstype, source, f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}", kind, reason
    )


def weights_location(path: Path) -> Path:
    """Where the weights behind PATH are read from: PATH, but for a shard set that indexes a file in place
    (shard/indexing.py), that file, whose filesystem the set streams from."""
    manifest = Path(path) / "manifest.json"
    try:
        if manifest.stat().st_size > INDEXED_MANIFEST_MAX:  # routed experts' sets: never indexed
            return Path(path)
        indexed = (json.loads(manifest.read_text(encoding="utf-8")).get("indexes") or {}).get("path")
    except (OSError, ValueError, AttributeError):
        return Path(path)
    return Path(indexed) if isinstance(indexed, str) else Path(path)


def existing_directory(path: Path) -> Path:
    """The directory a probe file would go in: the path if it is a directory, else its nearest existing parent."""
    path = Path(path).expanduser().absolute()
    while not path.is_dir():
        if path.parent == path:
            break
        path = path.parent
    return path


def _mount_of(real: str) -> tuple[str, str, str]:
    best = ("/", "unknown", "unknown")
    try:
        with open("/proc/self/mounts", encoding="utf-8", errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return best
    for line in lines:  # later mounts shadow earlier ones at the same point, so keep the last longest match
        fields = line.split()
        if len(fields) < 3:
            continue
        source, point, fstype = (_unescape(x) for x in fields[:3])
        if (real == point or real.startswith(point.rstrip("/") + "/")) and len(point) >= len(best[0]):
            best = (point, fstype, source)
    return best


def _unescape(field: str) -> str:
    return field.replace("\\040", " ").replace("\\011", "\t").replace("\\012", "\n").replace("\\134", "\\")


def _storage_kind(fstype: str, source: str, st_dev: int) -> tuple[str, str]:
    if fstype in MEMORY_FS:
        return "tmpfs", f"filesystem type {fstype}: files live in RAM"
    if fstype == "overlay":
        return "overlay", "overlay filesystem (container layer): the medium below is not visible"
    if fstype in NETWORK_FS or fstype.startswith("fuse."):
        return "network", f"filesystem type {fstype}"
    block = _block_device(st_dev, source)
    if block is None:
        return "unknown", f"filesystem type {fstype} on {source}: no block device found in /sys"
    return _block_kind(block, fstype)


def _block_device(st_dev: int, source: str) -> str | None:
    """Name of the whole-disk block device under /sys/block for a filesystem, or None."""
    candidates = [f"/sys/dev/block/{os.major(st_dev)}:{os.minor(st_dev)}"]
    if source.startswith("/dev/"):
        try:
            rdev = os.stat(source).st_rdev
            candidates.append(f"/sys/dev/block/{os.major(rdev)}:{os.minor(rdev)}")
        except OSError:
            pass
    for link in candidates:
        if os.path.exists(link):
            real = os.path.realpath(link)
            if not os.path.exists(os.path.join(real, "queue")):  # a partition: the disk is its parent
                real = os.path.dirname(real)
            return os.path.basename(real)
    return None


def _block_kind(name: str, fstype: str) -> tuple[str, str]:
    slaves = _listdir(f"/sys/block/{name}/slaves")
    if slaves:  # device-mapper / md: as slow as its slowest member
        kinds = [_block_kind(os.path.basename(os.path.realpath(f"/sys/class/block/{s}")), fstype)[0] for s in slaves]
        for kind in ("rotational", "unknown", "network", "ssd", "nvme"):
            if kind in kinds:
                return kind, f"{name} over {', '.join(slaves)}: slowest member is {kind}"
    rotational = _read(f"/sys/block/{name}/queue/rotational")
    if name.startswith("nvme"):
        return "nvme", f"{fstype} on NVMe device {name}"
    if name.startswith(("vd", "xvd")) or "virtio" in os.path.realpath(f"/sys/block/{name}/device/driver"):
        return "unknown", (
            f"{fstype} on virtual disk {name} (rotational={rotational or '?'} is the hypervisor's "
            f"default, not the medium)"
        )
    if name.startswith(("loop", "zram", "ram")):
        return "unknown", f"{fstype} on {name}: a virtual block device"
    if rotational == "0":
        return "ssd", f"{fstype} on {name}: /sys/block/{name}/queue/rotational=0"
    if rotational == "1":
        return "rotational", f"{fstype} on {name}: /sys/block/{name}/queue/rotational=1"
    return "unknown", f"{fstype} on {name}: rotational flag unreadable"


def _listdir(path: str) -> list[str]:
    try:
        return sorted(os.listdir(path))
    except OSError:
        return []


def _read(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read().strip()
    except OSError:
        return ""
