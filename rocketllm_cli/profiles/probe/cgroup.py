"""This process's own cgroup limits (v1 and v2): memory and CPU quota.

A container, `systemd-run -p MemoryMax=` or a memory cgroup made for a benchmark limits the group the
process is in, not the root: the group comes from /proc/self/cgroup and its mount from /proc/self/mountinfo.
Limits nest, so the effective one is the tightest along the path from the group up to the root.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

NO_LIMIT = 1 << 60  # cgroup v1 writes "no limit" as a huge page-rounded number


@dataclass(frozen=True)
class MemoryLimit:
    limit: int  # bytes the group may charge, page cache included
    available: int  # limit - usage + reclaimable page cache (clean, not mapped), in the tightest group


def memory_limit(root: str = "/") -> MemoryLimit | None:
    """The tightest memory limit over this process's cgroup and its ancestors; None when there is none."""
    best: MemoryLimit | None = None
    for directory, v2 in _group_dirs("memory", root):
        # Reclaimable: the group's file pages that are neither mapped (a process's libraries, in use) nor waiting to be
        # written; the active ones too (shards just written, a file read twice), as the machine's MemAvailable counts
        # them.
        stat = os.path.join(directory, "memory.stat")
        if v2:
            limit = _int(_read(os.path.join(directory, "memory.max")))
            usage = _int(_read(os.path.join(directory, "memory.current")))
            clean = sum(_stat(stat, k) for k in ("active_file", "inactive_file")) - sum(
                _stat(stat, k) for k in ("file_mapped", "file_dirty", "file_writeback")
            )
            reclaimable = max(_stat(stat, "inactive_file") - _stat(stat, "file_dirty"), clean, 0)
        else:
            limit = _int(_read(os.path.join(directory, "memory.limit_in_bytes")))
            usage = _int(_read(os.path.join(directory, "memory.usage_in_bytes")))
            clean = sum(_stat(stat, f"total_{k}", k) for k in ("active_file", "inactive_file")) - sum(
                _stat(stat, f"total_{k}", k) for k in ("mapped_file", "dirty", "writeback")
            )
            reclaimable = max(
                _stat(stat, "total_inactive_file", "inactive_file") - _stat(stat, "total_dirty", "dirty"), clean, 0
            )
        if limit is None or limit >= NO_LIMIT:
            continue
        available = max(0, limit - (usage or 0) + reclaimable)
        if best is None or limit < best.limit:
            best = MemoryLimit(limit, min(available, limit))
    return best


def cpu_quota(root: str = "/") -> int | None:
    """CPUs the tightest CPU quota over this process's cgroup and its ancestors allows (rounded up); None if
    unlimited."""
    best = None
    for directory, v2 in _group_dirs("cpu", root):
        if v2:
            quota, _, period = _read(os.path.join(directory, "cpu.max")).partition(" ")
            q, p = _int(quota), _int(period)
        else:
            q, p = (
                _int(_read(os.path.join(directory, "cpu.cfs_quota_us"))),
                _int(_read(os.path.join(directory, "cpu.cfs_period_us"))),
            )
        if q and q > 0 and p:
            cpus = -(-q // p)
            best = cpus if best is None else min(best, cpus)
    return best


def _group_dirs(controller: str, root: str) -> list[tuple[str, bool]]:
    """Directories of this process's group for `controller` and of each ancestor, innermost first; (path, is_v2)."""
    mounts = _mounts(root)
    out: list[tuple[str, bool]] = []
    for line in _read(os.path.join(root, "proc/self/cgroup")).splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        v2 = controllers == ""
        key = "" if v2 else controller
        if not v2 and controller not in controllers.split(","):
            continue
        mount = mounts.get(key)
        if mount is None:
            continue
        point, mount_root = mount
        if mount_root != "/" and path.startswith(mount_root):
            path = path[len(mount_root) :] or "/"  # the mount shows a subtree: paths are relative to its root
        rel = path.strip("/")
        while True:
            out.append(
                (os.path.join(root, point.lstrip("/"), rel) if rel else os.path.join(root, point.lstrip("/")), v2)
            )
            if not rel:
                break
            rel = rel.rpartition("/")[0]
    return out


def _mounts(root: str) -> dict[str, tuple[str, str]]:
    """controller ('' for the v2 hierarchy) -> (mount point, root of the mount) from mountinfo."""
    found: dict[str, tuple[str, str]] = {}
    for line in _read(os.path.join(root, "proc/self/mountinfo")).splitlines():
        left, sep, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if not sep or len(fields) < 5 or len(tail) < 3:
            continue
        mount_root, point, fstype, options = fields[3], fields[4], tail[0], tail[2]
        if fstype == "cgroup2":
            found.setdefault("", (point, mount_root))
        elif fstype == "cgroup":
            for option in options.split(","):
                found.setdefault(option, (point, mount_root))
    return found


def _stat(path: str, *keys: str) -> int:
    for line in _read(path).splitlines():
        key, _, value = line.partition(" ")
        if key in keys and value.strip().isdigit():
            return int(value)
    return 0


def _int(text: str) -> int | None:
    text = text.strip()
    return int(text) if text.isdigit() else None


def _read(path: str) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()
    except OSError:
        return ""
