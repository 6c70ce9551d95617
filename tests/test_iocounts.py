"""/proc/self/io's read_bytes, read through a file kept open: the same count a fresh open gives, storage reads seen,
and a forked child counting its own reads rather than its parent's."""

from __future__ import annotations

import os

import pytest

from rocketllm_cli.iocounts import storage_read_bytes

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/io"), reason="needs Linux's /proc/self/io")


def _fresh() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("read_bytes:"))


def test_the_kept_file_counts_what_a_fresh_open_counts_and_sees_a_cold_read(tmp_path):
    path = tmp_path / "cold.bin"
    path.write_bytes(os.urandom(4 << 20))
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        before = storage_read_bytes()
        assert before == _fresh()
        os.pread(fd, 4 << 20, 0)
        after = storage_read_bytes()
    finally:
        os.close(fd)
    assert after == _fresh()
    if after == before:
        pytest.skip("this filesystem kept the pages (no cold read to see)")
    assert after - before >= 4 << 20


def test_a_forked_child_counts_its_own_reads():
    storage_read_bytes()  # the parent's file is open before the fork
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its count, and a fresh open's, side by side
        os.close(read)
        os.write(write, f"{storage_read_bytes()} {_fresh()}".encode())
        os._exit(0)
    os.close(write)
    got = os.read(read, 100).decode().split()
    os.close(read)
    os.waitpid(pid, 0)
    assert got[0] == got[1]
