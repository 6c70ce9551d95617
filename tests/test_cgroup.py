"""The memory and CPU limits are read from this process's own cgroup and its ancestors, v1 and v2, never the root's
alone."""

from __future__ import annotations

from pathlib import Path

from rocketllm_cli.profiles.probe.cgroup import cpu_quota, memory_limit

GIB = 1024**3


def _write(root: Path, rel: str, text: str) -> None:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def _v1(root: Path, group: str) -> None:
    _write(root, "proc/self/cgroup", f"5:cpu,cpuacct:{group}\n4:memory:{group}\n0::/\n")
    _write(
        root,
        "proc/self/mountinfo",
        "30 25 0:26 / /sys/fs/cgroup/memory rw,relatime shared:9 - cgroup cgroup rw,memory\n"
        "31 25 0:27 / /sys/fs/cgroup/cpu,cpuacct rw,relatime shared:10 - cgroup cgroup rw,cpu,cpuacct\n",
    )
    # the root group has no limit: reading it alone is what made a capped run see the whole machine
    _write(root, "sys/fs/cgroup/memory/memory.limit_in_bytes", str(9223372036854771712))
    _write(root, "sys/fs/cgroup/memory/memory.usage_in_bytes", str(10 * GIB))


def test_v1_reads_the_processs_own_group(tmp_path):
    _v1(tmp_path, "/bench/run-1")
    _write(tmp_path, "sys/fs/cgroup/memory/bench/run-1/memory.limit_in_bytes", str(2 * GIB))
    _write(tmp_path, "sys/fs/cgroup/memory/bench/run-1/memory.usage_in_bytes", str(GIB))
    _write(tmp_path, "sys/fs/cgroup/memory/bench/run-1/memory.stat", "cache 100\ntotal_inactive_file 268435456\n")
    got = memory_limit(str(tmp_path))
    assert got is not None and got.limit == 2 * GIB
    assert got.available == GIB + 268435456  # limit - usage + reclaimable page cache


def test_v1_the_tightest_ancestor_wins(tmp_path):
    _v1(tmp_path, "/outer/inner")
    _write(tmp_path, "sys/fs/cgroup/memory/outer/memory.limit_in_bytes", str(GIB))
    _write(tmp_path, "sys/fs/cgroup/memory/outer/memory.usage_in_bytes", str(GIB // 4))
    _write(tmp_path, "sys/fs/cgroup/memory/outer/inner/memory.limit_in_bytes", str(4 * GIB))
    got = memory_limit(str(tmp_path))
    assert got is not None and (got.limit, got.available) == (GIB, 3 * GIB // 4)


def test_v2_group_and_cpu_max(tmp_path):
    _write(tmp_path, "proc/self/cgroup", "0::/user.slice/run-7.scope\n")
    _write(tmp_path, "proc/self/mountinfo", "28 25 0:25 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw,nsdelegate\n")
    _write(tmp_path, "sys/fs/cgroup/memory.max", "max\n")
    _write(tmp_path, "sys/fs/cgroup/user.slice/memory.max", "max\n")
    _write(tmp_path, "sys/fs/cgroup/user.slice/run-7.scope/memory.max", f"{3 * GIB}\n")
    _write(tmp_path, "sys/fs/cgroup/user.slice/run-7.scope/memory.current", f"{GIB}\n")
    _write(tmp_path, "sys/fs/cgroup/user.slice/run-7.scope/memory.stat", "anon 1\ninactive_file 1024\n")
    _write(tmp_path, "sys/fs/cgroup/user.slice/run-7.scope/cpu.max", "150000 100000\n")
    got = memory_limit(str(tmp_path))
    assert got is not None and (got.limit, got.available) == (3 * GIB, 2 * GIB + 1024)
    assert cpu_quota(str(tmp_path)) == 2  # 1.5 CPUs round up


def test_a_namespaced_mount_root_is_stripped(tmp_path):
    # a container sees its own subtree mounted at /sys/fs/cgroup/memory, with the host path in /proc/self/cgroup
    _write(tmp_path, "proc/self/cgroup", "4:memory:/docker/abc\n")
    _write(
        tmp_path, "proc/self/mountinfo", "30 25 0:26 /docker/abc /sys/fs/cgroup/memory ro - cgroup cgroup rw,memory\n"
    )
    _write(tmp_path, "sys/fs/cgroup/memory/memory.limit_in_bytes", str(GIB))
    got = memory_limit(str(tmp_path))
    assert got is not None and got.limit == GIB


def test_no_cgroup_means_no_limit(tmp_path):
    assert memory_limit(str(tmp_path)) is None and cpu_quota(str(tmp_path)) is None


def test_v1_counts_clean_page_cache_active_or_not_and_leaves_mapped_and_dirty_pages(tmp_path):
    """Shards just written are active file pages the kernel reclaims as readily as inactive ones; a process's mapped
    libraries and pages waiting to be written are not free."""
    _v1(tmp_path, "/bench/run-2")
    _write(tmp_path, "sys/fs/cgroup/memory/bench/run-2/memory.limit_in_bytes", str(2 * GIB))
    _write(tmp_path, "sys/fs/cgroup/memory/bench/run-2/memory.usage_in_bytes", str(GIB + GIB // 2))
    _write(
        tmp_path,
        "sys/fs/cgroup/memory/bench/run-2/memory.stat",
        f"total_active_file {GIB // 2}\ntotal_inactive_file {GIB // 4}\ntotal_mapped_file {GIB // 8}\ntotal_dirty "
        f"{GIB // 8}\n"
        "total_writeback 0\n",
    )
    got = memory_limit(str(tmp_path))
    assert got is not None and got.available == GIB // 2 + (GIB // 2 + GIB // 4 - GIB // 8 - GIB // 8)
