"""Storage and page-cache bandwidth of one filesystem, measured on the weights' own file or a probe file.

Order matters: the file is warm (just written, or read just before), then evicted with POSIX_FADV_DONTNEED and read
cold (buffered, with readahead), then evicted again and read with O_DIRECT. /proc/self/io `read_bytes` witnesses
that a cold read really reached the device. The weights' own file (own_file) is read where a cold read of it can be
forced, and left evicted; else a probe file (probefile.py) is written, measured and always deleted.
"""

from __future__ import annotations

import mmap
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ...sizes import ALIGN, format_bytes, parse_bytes
from ..records import Capability, Measurement
from .filesystems import Filesystem
from .machine import usable_cores
from .probefile import free_bytes, remove, take_written, written

DEFAULT_PROBE_BYTES = 256 * 1024**2  # ~1 s of writing and reading on a 2-core VM disk
CHUNK = 16 * 1024**2  # buffered reads: large, so syscall cost vanishes
MIN_PROBE_BYTES = 1024**2  # below this, timer resolution and readahead dominate the figure
OWN_FLOOR = 64 * 1024**2  # a weights file this large (or the probe's size) is read instead of a probe file


def probe_bytes() -> int:
    """Size of the probe file: ROCKETLLM_PROBE_BYTES (tests make it small) or the default, 4096-aligned."""
    raw = os.environ.get("ROCKETLLM_PROBE_BYTES")
    size = parse_bytes(raw) if raw else DEFAULT_PROBE_BYTES
    return max(MIN_PROBE_BYTES, size // ALIGN * ALIGN)


def own_file(location: Path, size: int) -> Path | None:
    """The weights' own file, which the probe reads in place of writing one of SIZE bytes: LOCATION where it is a
    file (a GGUF, or the file a set indexes in place), else the largest file in it (a shard set's units); None where
    that is smaller than min(SIZE, OWN_FLOOR) or there is none. Writing the probe file took 2.4-3.5 s of a first
    run on a VM disk that writes at ~75 MB/s; reading the model's own bytes measures the very file it streams."""
    try:
        if location.is_file():
            found = location
        else:
            found = max((p for p in location.iterdir() if p.is_file()), key=lambda p: p.stat().st_size, default=None)
        return found if found is not None and found.stat().st_size >= min(size, OWN_FLOOR) else None
    except OSError:
        return None


def measure_storage(
    fs: Filesystem,
    size: int,
    log=lambda message: None,
    directories: list[Path] | None = None,
    own: Path | None = None,
) -> tuple[dict[str, Measurement], dict[str, Capability], bool]:
    """page_cache_read, storage_read (cold, buffered) and storage_read_direct, the I/O capabilities,
    and whether the result may be cached (not when no probe file could be written: a later run may succeed).
    OWN (own_file's): the first SIZE bytes of that file are read instead, where a cold read of them can be forced;
    else a probe file is written as always."""
    caps = {"storage_kind": Capability("storage_kind", fs.kind, None, fs.kind_reason)}
    found = _measure_own(own, size, fs, caps, log) if own is not None else None
    if found is not None:
        return (*found, True)
    free = free_bytes(fs.directory)
    if free is not None and free < 2 * size:
        size = max(0, free // 4 // ALIGN * ALIGN)
    if size < MIN_PROBE_BYTES:
        why = f"only {format_bytes(free)} free on this filesystem: too little for a meaningful probe file"
        return _all_unavailable(why), {**caps, **_io_caps_unknown(why)}, False
    directories = list(directories or [fs.directory])
    path, error = take_written(directories, size) or written(directories, size)
    if path is None:
        why = f"cannot write a {format_bytes(size)} probe file on this filesystem ({error.strerror or error})"
        return _all_unavailable(why), {**caps, **_io_caps_unknown(why)}, False
    try:
        return (*_measure_file(path, size, fs, caps, log), True)
    finally:
        remove(path)


def _measure_own(
    path: Path, size: int, fs: Filesystem, caps: dict, log
) -> tuple[dict[str, Measurement], dict[str, Capability]] | None:
    """The measurement on the first SIZE bytes of the weights' own file, or None where its cold read did not reach
    the device (pages not written back yet cannot be evicted) or it could not be read. Those bytes are left evicted:
    the load reads them from storage, as it would have."""
    try:
        size = min(size, path.stat().st_size // ALIGN * ALIGN)
        _buffered_read(path, size)  # in the page cache, as a just-written probe file is
        out, decided = _measure_file(path, size, fs, dict(caps), log, own=True)
    except OSError:
        return None
    return (out, decided) if out["storage_read"].available else None


def _measure_file(
    path: Path, size: int, fs: Filesystem, caps: dict, log, own: bool = False
) -> tuple[dict[str, Measurement], dict[str, Capability]]:
    what = f"the first {format_bytes(size)} of {path.name}" if own else f"{format_bytes(size)} probe file"
    log(f"measuring storage: {what} on {fs.mount_point} ({fs.fstype}, {fs.kind})")
    out: dict[str, Measurement] = {}
    warm = min((_buffered_read(path, size) for _ in range(2)), key=lambda r: r[1])
    out["page_cache_read"] = Measurement(
        "page_cache_read",
        size / warm[1],
        f"read() of {'the weights file, read just before,' if own else 'a just-written file'} into a reused 16 MiB "
        "buffer, best of 2",
        size,
        warm[1],
    )

    evicted = evict_file(path, 0, size)
    io_before = _io_read_bytes()
    n, seconds, cpu = _unit_reads(path, size, fs.kind, direct=False)
    delta = None if io_before is None else _io_read_bytes() - io_before
    cold_ok, witness = _cold_verdict(fs, size, delta, seconds, warm[1], evicted)
    method = (
        f"{unit_reads_method(fs.kind, False)} after posix_fadvise(DONTNEED), each unit evicted after its read; "
        f"{witness}"
    )
    out["storage_read"] = Measurement(
        "storage_read",
        n / seconds if cold_ok else None,
        method,
        n,
        seconds,
        cold_ok,
        "" if cold_ok else witness,
        cpu_seconds=round(cpu, 4),
    )
    can_evict = cold_ok and evicted is None and fs.kind != "tmpfs"
    caps["fadvise_dontneed"] = Capability(
        "fadvise_dontneed",
        can_evict,
        None if can_evict else "none: streamed units stay in the page cache until the kernel evicts them",
        witness,
    )

    direct = _direct_read(path, size, fs.kind)
    out["storage_read_direct"] = direct
    if direct.available and out["storage_read"].available:
        buffered = out["storage_read"]
        faster = direct_io_wins(direct, buffered, cpu_shared=True)
        caps["direct_io"] = Capability(
            "direct_io",
            faster,
            None if faster else "buffered reads + POSIX_FADV_DONTNEED",
            f"O_DIRECT {direct.value / 1e9:.2f} GB/s using {direct.cpu_seconds / direct.seconds:.2f} cores vs buffered "
            f"cold "
            f"{buffered.value / 1e9:.2f} GB/s using {buffered.cpu_seconds / buffered.seconds:.2f} cores "
            "(cost per byte = 1/bandwidth + CPU seconds per byte, since reads share the cores with compute)",
        )
    else:
        why = direct.reason or out["storage_read"].reason
        caps["direct_io"] = Capability("direct_io", False, "buffered reads + POSIX_FADV_DONTNEED", why)
    return out, caps


def direct_io_wins(direct: Measurement, buffered: Measurement, cpu_shared: bool) -> bool:
    """O_DIRECT or buffered+evict, by cost per byte: wall time, plus the CPU time the read steals when compute
    runs on the same cores (a buffered read copies every byte out of the page cache; O_DIRECT lets the device DMA)."""
    return read_cost(direct, cpu_shared) <= read_cost(buffered, cpu_shared)


def read_cost(m: Measurement, cpu_shared: bool) -> float:
    """Seconds per byte of a cold read."""
    return (m.seconds + (m.cpu_seconds if cpu_shared else 0.0)) / max(1, m.bytes_moved)


def _buffered_read(path: Path, size: int) -> tuple[int, float]:
    """(bytes, seconds) of reading the file's first SIZE bytes."""
    buf = memoryview(bytearray(CHUNK))
    total = 0
    with open(path, "rb", buffering=0) as f:
        start = time.perf_counter()
        while total < size and (n := f.readinto(buf[: min(CHUNK, size - total)])):
            total += n
        return total, max(time.perf_counter() - start, 1e-9)


UNIT = 16 * 1024**2
# Requests worth keeping in flight per storage kind: NVMe and network filesystems gain from deep queues,
# one disk head does not, a virtual disk's medium is unknown (measured: 1 or 2 in flight similar here).
PARALLEL_READS = {"nvme": 4, "ssd": 2, "network": 4, "rotational": 1, "tmpfs": 1, "overlay": 2, "unknown": 2}
# Unit reads in flight: the io_workers knob's formula, and the probe reads the same way.
IN_FLIGHT = "max(1, min(parallel_reads, cpu_cores // (2 - direct_io)))"
IN_FLIGHT_NOTE = (
    "buffered reads copy through the page cache and compete with compute: at most half the cores; "
    "O_DIRECT reads are DMA and cost almost no CPU"
)


def in_flight_inputs(kind: str, cpu_cores: int, direct: bool) -> dict:
    """The inputs of IN_FLIGHT for a storage kind (an unlisted kind counts as unknown)."""
    return {
        "storage_kind": kind,
        "parallel_reads": PARALLEL_READS.get(kind, PARALLEL_READS["unknown"]),
        "cpu_cores": cpu_cores,
        "direct_io": int(bool(direct)),
    }


def in_flight(kind: str, direct: bool) -> int:
    """Unit reads the engine keeps in flight with this method on this machine, as the io_workers knob derives it."""
    # Imported here, not at the top: the knob formulas import this module.
    from ..knobs.expression import evaluate

    return evaluate(IN_FLIGHT, in_flight_inputs(kind, usable_cores(), direct))


def unit_reads_method(kind: str, direct: bool) -> str:
    return (
        f"{'O_DIRECT: ' if direct else ''}one open + one pread per 16 MiB unit, {in_flight(kind, direct)} in "
        f"flight "
        "(as the engine streams shard files with its IO workers)"
    )


def _unit_reads(path: Path, size: int, kind: str, direct: bool) -> tuple[int, float, float]:
    """Read the file the way the engine reads shards: one request per unit, `in_flight(kind, direct)` at a time.

    Returns (bytes, seconds, process CPU seconds)."""
    workers = in_flight(kind, direct)
    offsets = list(range(0, size, UNIT))

    def worker(k: int) -> int:
        buf = mmap.mmap(-1, UNIT)  # page-aligned, as O_DIRECT needs
        total = 0
        for offset in offsets[k::workers]:
            fd = os.open(path, os.O_RDONLY | (os.O_DIRECT if direct else 0))
            try:
                total += os.preadv(fd, [memoryview(buf)[: min(UNIT, size - offset)]], offset)
                if not direct:
                    os.posix_fadvise(fd, offset, UNIT, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
        return total

    start, cpu = time.perf_counter(), time.process_time()
    with ThreadPoolExecutor(workers) as pool:
        total = sum(pool.map(worker, range(workers)))
    return total, max(time.perf_counter() - start, 1e-9), time.process_time() - cpu


def _direct_read(path: Path, size: int, kind: str) -> Measurement:
    name = "storage_read_direct"
    if not hasattr(os, "O_DIRECT"):
        return Measurement.unavailable(name, "O_DIRECT", "this OS has no O_DIRECT")
    evict_file(path, 0, size)
    try:
        n, seconds, cpu = _unit_reads(path, size, kind, direct=True)
    except OSError as exc:
        return Measurement.unavailable(name, "O_DIRECT", f"O_DIRECT read refused or failed: {exc.strerror or exc}")
    return Measurement(name, n / seconds, unit_reads_method(kind, True), n, seconds, cpu_seconds=round(cpu, 4))


def _cold_verdict(
    fs: Filesystem, size: int, delta: int | None, cold_s: float, warm_s: float, evict_error: str | None
) -> tuple[bool, str]:
    """(did the read reach the device, the witness in words)."""
    if fs.kind == "tmpfs":
        return True, "tmpfs keeps files in RAM: no eviction possible, this read is the storage speed"
    if evict_error:
        return False, f"posix_fadvise unusable ({evict_error}): a cold read cannot be forced"
    if delta is not None:
        verdict = delta >= 0.9 * size
        return verdict, (
            f"/proc/self/io read_bytes rose by {format_bytes(delta)} of {format_bytes(size)}: eviction "
            f"{'verified' if verdict else 'did not work'}"
        )
    verdict = cold_s > warm_s / 0.7
    return verdict, (
        f"/proc/self/io unreadable; eviction judged by time (cold {cold_s:.3f}s vs warm {warm_s:.3f}s): "
        f"{'evicted' if verdict else 'not evicted'}"
    )


def evict_file(path: Path, offset: int = 0, length: int = 0) -> str | None:
    """Drop the file's clean pages (those of [offset, offset + length), length 0: to the end) from the page cache;
    returns why not, or None."""
    if not hasattr(os, "posix_fadvise"):
        return "no os.posix_fadvise on this OS"
    fd = os.open(path, os.O_RDONLY)
    try:
        evict_range(fd, offset, length)
        return None
    except OSError as exc:
        return exc.strerror or str(exc)
    finally:
        os.close(fd)


FOLIO_BYTES = 2 << 20  # the largest page-cache folio (a PMD on x86-64 and arm64 with 4 KiB pages)


def evict_range(fd: int, offset: int, length: int) -> None:
    """POSIX_FADV_DONTNEED on [offset, offset + length) widened to whole FOLIO_BYTES (length 0: the whole file).

    The kernel drops only folios wholly inside the range, and a file read with large readahead (another process's
    `cat`, a copy) sits in folios of up to 2 MiB: a window of a larger file (an indexed set's unit) evicted exactly
    kept two thirds of SmolLM2's pages cached. What the widening also drops is a neighbour's clean unmapped pages:
    a streamed unit read again anyway, never a mapped host-tier page."""
    if length:
        start = offset // FOLIO_BYTES * FOLIO_BYTES
        length = -(-(offset + length) // FOLIO_BYTES) * FOLIO_BYTES - start
        offset = start
    os.posix_fadvise(fd, offset, length, os.POSIX_FADV_DONTNEED)


def window_advice(fd: int, base: int, nbytes: int) -> None:
    """A buffered read of a window inside a larger file reads that window and no more: the kernel's readahead would
    run on into the neighbouring windows, which the engine reads in another order (a GGUF lists blk.10 after blk.1)
    or keeps elsewhere, fetching bytes twice or serving them from the page cache unseen. So no readahead on this
    descriptor, and the window itself asked for at once (one large read ahead of the copies)."""
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
    os.posix_fadvise(fd, base, nbytes, os.POSIX_FADV_WILLNEED)


def _io_read_bytes() -> int | None:
    try:
        with open("/proc/self/io", encoding="ascii") as f:
            for line in f:
                if line.startswith("read_bytes:"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return None


def _all_unavailable(why: str) -> dict[str, Measurement]:
    return {
        name: Measurement.unavailable(name, "probe file", why)
        for name in ("page_cache_read", "storage_read", "storage_read_direct")
    }


def _io_caps_unknown(why: str) -> dict[str, Capability]:
    return {
        "direct_io": Capability("direct_io", False, "buffered reads + POSIX_FADV_DONTNEED", why),
        "fadvise_dontneed": Capability(
            "fadvise_dontneed", False, "none: streamed units stay in the page cache until the kernel evicts them", why
        ),
    }
