"""Reads of a shard set's own units, measured: the read method and the reads in flight a streamed model gets.

The storage probe reads one large file in 16 MiB units. A small model's units are 2-7 MiB, where a disk's time per
request, not its bandwidth, sets what one read at a time delivers; whether O_DIRECT or buffered reads cost less
can differ there too. So where a model streams from storage, its first load reads a sample of its own streamed
units cold, the way the engine does (one open and one pread per unit, k at a time, k in IN_FLIGHTS), with both
methods, and keeps the answer beside the hardware profile (`profile --refresh` measures again):

    cost per byte = (wall seconds + cpu_shared * process CPU seconds) / bytes     (storage.read_cost's rule)

The cheapest (method, k) sets direct_io and io_workers, and prefetch_depth keeps at least k reads ahead.
"""

from __future__ import annotations

import hashlib
import mmap
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ...sizes import round_up
from .storage import evict_file, evict_range, window_advice

IN_FLIGHTS = (1, 2, 4, 8)
SAMPLE_BYTES = 64 * 1024**2  # read per method and count in flight: enough units that a request's latency averages out
BUFFER_SHARE = 0.25  # the probe's buffers (one per read in flight) take at most this share of available memory
REPEATS = 2  # each configuration read this often, interleaved with the others; its fastest read counts
CLOSE = 0.05  # a configuration within 5% of the cheapest that keeps fewer reads in flight wins
FILE = "unit-reads.json"


@dataclass
class UnitReadRow:
    direct: bool
    in_flight: int
    bytes: int
    seconds: float
    cpu_seconds: float

    def cost(self, cpu_shared: int) -> float:
        return (self.seconds + cpu_shared * self.cpu_seconds) / max(self.bytes, 1)

    @property
    def bps(self) -> float:
        return self.bytes / max(self.seconds, 1e-9)


@dataclass
class UnitReads:
    """What reading the set's units cold cost, each method and count in flight, and the cheapest."""

    unit_bytes: int  # the sample's median unit
    units: int  # units in the sample
    cpu_shared: int  # 1 where reads and compute share the CPU
    rows: list[UnitReadRow] = field(default_factory=list)

    def best(self, direct: bool | None = None) -> UnitReadRow | None:
        """The cheapest row (of one method, if given); a row within CLOSE of it with fewer reads in flight wins."""
        rows = [r for r in self.rows if direct is None or r.direct == direct]
        if not rows:
            return None
        low = min(r.cost(self.cpu_shared) for r in rows)
        near = [r for r in rows if r.cost(self.cpu_shared) <= low * (1 + CLOSE)]
        return min(near, key=lambda r: (r.in_flight, r.cost(self.cpu_shared)))

    def chosen(self) -> UnitReadRow | None:
        """The read the knobs pick by default: O_DIRECT where its best costs no more than buffered's best
        (direct_io), at that method's best count in flight (io_workers)."""
        direct, buffered = self.best(True), self.best(False)
        if direct is None or buffered is None:
            return direct or buffered
        return direct if direct.cost(self.cpu_shared) <= buffered.cost(self.cpu_shared) else buffered

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "UnitReads":
        return cls(int(d["unit_bytes"]), int(d["units"]), int(d["cpu_shared"]), [UnitReadRow(**r) for r in d["rows"]])

    def summary(self) -> str:
        from ...sizes import format_bytes

        cells = ", ".join(
            f"{'O_DIRECT' if r.direct else 'buffered'} x{r.in_flight} {r.bps / 1e9:.2f} GB/s" for r in self.rows
        )
        return f"{self.units} units of ~{format_bytes(self.unit_bytes)} read cold: {cells}"


def sample_units(manifest) -> list:
    """Decoder-layer units in the order a pass reads them, from the first, until SAMPLE_BYTES: what streams on every
    token (an embedding or head may stay resident; experts stage elsewhere; resident kinds are read once). A set
    without layer units samples its other streamed kinds."""
    from ...tiers import RESIDENT_KINDS

    return first_layers(
        [u for u in manifest.units if u.kind not in RESIDENT_KINDS and u.kind != "expert"], SAMPLE_BYTES
    )


def first_layers(units: list, budget: int) -> list:
    """The decoder-layer units among UNITS (all of them where none is a layer), in order, until BUDGET bytes."""
    picked, total = [], 0
    for unit in [u for u in units if u.kind == "layer"] or units:
        picked.append(unit)
        total += unit.bytes
        if total >= budget:
            break
    return picked


def measure(
    directory: Path, units: list, cpu_shared: int, direct_ok: bool, in_flights: tuple[int, ...] = IN_FLIGHTS
) -> UnitReads | None:
    """Read `units` of the set in `directory` cold with each method and count in flight. None when fewer than two
    units stream or a read fails (the storage probe's figures stand then)."""
    if len(units) < 2:
        return None
    sizes = sorted(u.bytes for u in units)
    biggest = round_up(sizes[-1])
    paths = [(directory / u.file, u.bytes, u.start) for u in units]
    configs = [(d, k) for d in ((True, False) if direct_ok else (False,)) for k in in_flights]
    best: dict[tuple[bool, int], UnitReadRow] = {}
    buffers = [mmap.mmap(-1, biggest) for _ in range(max(in_flights))]  # page-aligned, as O_DIRECT needs
    try:
        for _ in range(REPEATS):
            for direct, k in configs:
                try:
                    row = _read_all(paths, direct, k, buffers)
                except OSError:
                    return None
                kept = best.get((direct, k))
                if kept is None or row.seconds < kept.seconds:
                    best[(direct, k)] = row
    finally:
        for b in buffers:
            b.close()
    return UnitReads(sizes[len(sizes) // 2], len(units), cpu_shared, [best[c] for c in configs])


def _read_all(paths: list[tuple[Path, int, int]], direct: bool, k: int, buffers: list) -> UnitReadRow:
    for path, size, at in paths:
        evict_file(path, max(at, 0), size if at >= 0 else 0)
    queue = list(range(len(paths)))

    def worker(slot: int) -> int:
        view, done = memoryview(buffers[slot]), 0
        for i in queue[slot::k]:
            path, size, at = paths[i]  # at -1: the unit is a file; else its window starts there
            base = max(at, 0)
            fd = os.open(path, os.O_RDONLY | (os.O_DIRECT if direct else 0))
            try:
                if at >= 0 and not direct:
                    window_advice(fd, base, size)  # as the engine reads a window: exactly it
                want = round_up(size) if direct else size
                got = 0
                while got < size:
                    n = os.preadv(fd, [view[got:want]], base + got)
                    if n <= 0:
                        break
                    got += n
                done += got
                if not direct:
                    evict_range(fd, base, size if at >= 0 else 0)  # as the engine does after a buffered read
            finally:
                os.close(fd)
        return done

    start, cpu = time.perf_counter(), time.process_time()
    with ThreadPoolExecutor(k, thread_name_prefix="rocketllm-probe") as pool:
        total = sum(pool.map(worker, range(k)))
    return UnitReadRow(
        direct, k, total, round(max(time.perf_counter() - start, 1e-9), 6), round(time.process_time() - cpu, 6)
    )


def set_key(directory: Path, manifest) -> str:
    """Which set a stored answer belongs to: its path and its manifest's key (a set rewritten in place is new)."""
    text = f"{Path(directory).resolve()}\0{manifest.key}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def load_or_measure(profile, directory: Path, manifest, log=None) -> UnitReads | None:
    """The stored answer for this set on this machine, else measured now and stored. None where nothing streams
    from a file the probe can evict (the storage probe's figures stand)."""
    from ...cachehome import read_json, write_json
    from ..cache import profile_dir

    where = profile_dir(profile.fingerprint) / FILE
    key = set_key(directory, manifest)
    stored = read_json(where) or {}
    entry = stored.get(key)
    if isinstance(entry, dict):
        try:
            return UnitReads.from_dict(entry)
        except (KeyError, TypeError, ValueError):
            pass  # unreadable: measured again
    units = sample_units(manifest)
    if len(units) < 2 or not hasattr(os, "posix_fadvise"):
        return None
    probed = profile.measurements.get("storage_read_direct")  # O_DIRECT worked on this filesystem
    direct_ok = hasattr(os, "O_DIRECT") and bool(probed and probed.available)
    biggest = max(u.bytes for u in units)
    room = BUFFER_SHARE * (profile.ram_available or 0)
    in_flights = tuple(k for k in IN_FLIGHTS if k == 1 or k * biggest <= room)
    started = time.perf_counter()
    result = measure(Path(directory), units, 1 if profile.compute_device == "cpu" else 0, direct_ok, in_flights)
    if result is None:
        return None
    if log:
        log(f"measured this set's own reads once ({time.perf_counter() - started:.1f} s): {result.summary()}")
    stored.pop("cache_format", None)
    stored[key] = result.to_dict()
    try:
        write_json(where, stored)
    except OSError:
        pass  # a read-only cache: the answer stays this process's
    return result


def reads_from_storage(knobs, facts) -> bool:
    """Some unit is read from storage on each use: the device and host caches together hold less than the model."""
    return int(knobs["device_cache_bytes"].value) + int(knobs["host_cache_bytes"].value) < facts.total_bytes


READ_KNOBS = ("direct_io", "io_workers", "prefetch_depth")  # what a set's own reads derive


def with_own_reads(profile, facts, path, knobs, resolve, log=None, *, manifest=None, always: bool = False):
    """(facts, knobs) with the set's own reads attached and `resolve(facts)` run again, where PATH is a shard set
    that `knobs` stream from storage (or `always`: the doctor's report shows them for any set) and not every read
    knob is set by hand; else (facts, knobs) unchanged. `manifest`: the set's, where the caller has it loaded."""
    from dataclasses import replace

    from ...checkpoint.manifest import Manifest

    directory = Path(path) if path is not None else None
    if (
        directory is None
        or not (directory / "manifest.json").is_file()
        or not (always or reads_from_storage(knobs, facts))
    ):
        return facts, knobs
    if all(knobs[n].overridden for n in READ_KNOBS):
        return facts, knobs
    reads = load_or_measure(profile, directory, manifest or Manifest.load(directory), log)
    if reads is None:
        return facts, knobs
    measured = replace(facts, unit_reads=reads.to_dict())
    return measured, resolve(measured)
