"""HardwareProfile: this machine's facts, measurements and capability decisions.

Measured once and cached as JSON under cache_dir()/profiles/<fingerprint>/: host.json
(CPU, memory, device, compute) and one fs-<key>.json per filesystem (storage speed
belongs to the filesystem that holds the weights). Free memory is re-read on every load.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

from ..cachehome import cache_dir, read_json, write_json
from ..redact import redact
from .cache import profile_dir
from .probe import capabilities as caps
from .probe import measure
from .probe.devices import choose_device, device_memory, torch_accelerators
from .probe.filesystems import filesystem_of, weights_location
from .probe.machine import (
    BUSY_SHARE,
    collect_facts,
    cpu_snapshot,
    fingerprint,
    fingerprint_facts,
    memory_bound,
    others_cpu_share,
    usable_cores,
)
from .probe.runtime import METHOD as RUNTIME_METHOD
from .probe.runtime import measure_runtime, process_memory
from .probe.probefile import wait_written, write_ahead
from .probe.storage import measure_storage, own_file, probe_bytes
from .records import Capability, Measurement

Log = Callable[[str], None]


@dataclass
class HardwareProfile:
    """What this machine is and how fast it moves bytes; knobs and the cost model are computed from it."""

    fingerprint: str
    compute_device: str  # "cpu", "cuda:0", "xpu:0" or "mps", chosen by capability query
    cpu_cores: int
    ram_total: int
    ram_available: int  # live, re-read on load
    vram_total: int | None = None  # None without an accelerator
    vram_free: int | None = None  # live
    facts: dict = field(default_factory=dict)
    measurements: dict[str, Measurement] = field(default_factory=dict)
    capabilities: dict[str, Capability] = field(default_factory=dict)
    storage: dict = field(default_factory=dict)  # the filesystem the storage figures belong to
    measured_at: dict = field(default_factory=dict)
    from_cache: bool = field(default=False, compare=False)
    ram_bound: str = "machine"  # live: "cgroup" where a memory cgroup's limit, not the machine's RAM, is ram_total
    process_rss: int = 0  # live: this process's own resident memory, which ram_available already excludes

    @classmethod
    def load(
        cls, storage_path: Path | None = None, refresh: bool = False, *, log: Log | None = None
    ) -> "HardwareProfile":
        """The cached profile for this machine and the filesystem of `storage_path` (default: the cache dir),
        measuring whatever part is missing, or everything when `refresh`."""
        return cls._load(storage_path, refresh, log, measure=True)

    @classmethod
    def cached(cls, storage_path: Path | None = None) -> "HardwareProfile | None":
        """The profile if both its parts are cached already; never measures, never writes."""
        return cls._load(storage_path, False, None, measure=False)

    def computing_in(self, dtype: str, reason: str) -> "HardwareProfile":
        """This profile with DTYPE as its compute dtype (REASON: why), for a projection of a run that computes in it."""
        from dataclasses import replace

        return replace(
            self, capabilities={**self.capabilities, "compute_dtype": Capability("compute_dtype", dtype, None, reason)}
        )

    @staticmethod
    def write_storage_probe_ahead(storage_path: Path, refresh: bool = False) -> None:
        """Where the filesystem of STORAGE_PATH's weights is not profiled yet (or REFRESH), write its probe file now
        on a thread of its own (a first run: beside the imports); load() then times its reads as always."""
        location = weights_location(Path(storage_path))
        fs = filesystem_of(location)
        if not refresh and read_json(profile_dir(fingerprint(fingerprint_facts())) / f"{fs.key}.json") is not None:
            return
        if own_file(location, probe_bytes()) is not None:
            return  # the profile reads the model's own file: nothing to write
        try:  # the cache dir the run makes anyway, made now: the file goes there, never beside a model first
            cache_dir().mkdir(parents=True, exist_ok=True)
        except OSError:
            return  # the measurement writes its own file later, wherever it can
        write_ahead(_probe_directories(fs), probe_bytes())

    @staticmethod
    def host_cached() -> bool:
        """Whether this machine's own measurements (host.json) are cached, with the runtime's memory among them."""
        host = read_json(profile_dir(fingerprint(fingerprint_facts())) / "host.json") or {}
        return host.get("measurements", {}).get("runtime_rss", {}).get("method") == RUNTIME_METHOD

    @classmethod
    def _load(
        cls, storage_path: Path | None, refresh: bool, log: Log | None, measure: bool
    ) -> "HardwareProfile | None":
        log = log or logging.getLogger("rocketllm").info
        fp = fingerprint(fingerprint_facts())
        location = weights_location(Path(storage_path)) if storage_path is not None else cache_dir()
        fs = filesystem_of(location)
        where = profile_dir(fp)
        if refresh:
            (where / "kernels.json").unlink(missing_ok=True)  # the low-bit kernel probe (packed/probe.py) runs again
            (where / "unit-reads.json").unlink(missing_ok=True)  # and each set's own reads (probe/unitreads.py)
        host = None if refresh else read_json(where / "host.json")
        disk = None if refresh else read_json(where / f"{fs.key}.json")
        from_cache = host is not None and disk is not None
        if not measure and not from_cache:
            return None
        unsaved = []
        if host is None:
            host = _measure_host(log)
            unsaved += _save(where / "host.json", host)
        # cached before it was measured so
        elif measure and host.get("measurements", {}).get("runtime_rss", {}).get("method") != RUNTIME_METHOD:
            log("measuring the Python runtime's memory once (cached afterwards)")
            host = {**host, "measurements": {**host["measurements"], "runtime_rss": measure_runtime().to_dict()}}
            unsaved += _save(where / "host.json", host)
        if disk is None:
            disk = _measure_filesystem(fs, log, own_file(location, probe_bytes()) if storage_path else None)
            if disk.pop("cacheable"):
                unsaved += _save(where / f"{fs.key}.json", disk)
        if unsaved:
            log(
                redact(
                    f"warning: the profile was measured but not cached: cannot write {where} ({unsaved[0]}); every "
                    "command will measure again: set ROCKETLLM_CACHE to a writable directory"
                )
            )
        elif not from_cache:
            log(redact(f"profile cached in {where} (--refresh re-measures)"))
        ram_total, ram_available, ram_bound = memory_bound()
        own = process_memory()
        vram_total, vram_free = _guarded(lambda: device_memory(host["compute_device"]), lambda why: (None, None))
        return cls(
            fingerprint=fp,
            compute_device=host["compute_device"],
            cpu_cores=usable_cores(),
            ram_total=ram_total,
            ram_available=ram_available,
            ram_bound=ram_bound,
            process_rss=own,
            vram_total=vram_total if vram_total is not None else host.get("vram_total"),
            vram_free=vram_free,
            facts={**host["facts"], "device_reason": host["device_reason"], "accelerators": host["accelerators"]},
            measurements={
                k: Measurement.from_dict(v) for k, v in {**host["measurements"], **disk["measurements"]}.items()
            },
            capabilities={
                k: Capability.from_dict(v) for k, v in {**host["capabilities"], **disk["capabilities"]}.items()
            },
            storage={**disk["filesystem"], "directory": str(fs.directory)},
            measured_at={
                "host": host["measured_at"],
                "storage": disk["measured_at"],
                "host_others_cpu_share": host.get("others_cpu_share"),
                "storage_others_cpu_share": disk.get("others_cpu_share"),
            },
            from_cache=from_cache,
        )

    # -- convenience figures (bytes per second; None where unmeasured) ----------------------------
    def _bps(self, name: str) -> float | None:
        m = self.measurements.get(name)
        return m.value_bps if m else None

    @property
    def storage_read_bps(self) -> float | None:
        """Cold sequential read of the weights' filesystem, by the method direct_io picked."""
        return self._bps("storage_read_direct") if self.capability("direct_io") else self._bps("storage_read")

    @property
    def page_cache_read_bps(self) -> float | None:
        return self._bps("page_cache_read")

    @property
    def host_memory_bps(self) -> float | None:
        return self._bps("host_memory")

    @property
    def h2d_bps(self) -> float | None:
        """Host-to-device copies from pinned memory; None on the CPU."""
        return self._bps("h2d_pinned")

    @property
    def h2d_pageable_bps(self) -> float | None:
        return self._bps("h2d_pageable")

    @property
    def device_memory_bps(self) -> float | None:
        return self._bps("device_memory")

    @property
    def runtime_rss(self) -> int | None:
        """Anonymous memory of a Python that imported what a load imports (probe/runtime.py); None where unmeasured."""
        m = self.measurements.get("runtime_rss")
        return int(m.value) if m is not None and m.available and m.value else None

    @property
    def compute_dtype(self) -> str:
        return str(self.capability("compute_dtype") or "fp32")

    def matvec_bps(self, dtype: str | None = None) -> float | None:
        """Weight bytes per second a decode-shaped matmul consumes in `dtype` (default: the compute dtype)."""
        return self._bps(f"matvec_{dtype or self.compute_dtype}")

    def capability(self, name: str) -> object:
        cap = self.capabilities.get(name)
        return cap.value if cap else None

    @property
    def is_cpu(self) -> bool:
        return self.compute_device == "cpu"

    def tier_meaning(self) -> str:
        """What the three tiers are on this machine, in one line."""
        if self.is_cpu:
            return (
                "CPU device: 'device' = weights resident in process RAM; 'host' = the OS page cache holding shard "
                "files, served zero-copy through mmap (the same RAM); 'storage' = cold reads from disk"
            )
        return (
            f"{self.compute_device}: 'device' = weights resident in device memory; 'host' = host RAM "
            f"({'pinned' if self.capability('pin_memory') else 'pageable'}), copied to the device when a layer "
            f"runs; 'storage' = cold reads from disk"
        )

    # -- serialisation -----------------------------------------------------------------------------
    def to_dict(self) -> dict:
        return {
            "fingerprint": self.fingerprint,
            "compute_device": self.compute_device,
            "cpu_cores": self.cpu_cores,
            "ram_total": self.ram_total,
            "ram_available": self.ram_available,
            "ram_bound": self.ram_bound,
            "process_rss": self.process_rss,
            "vram_total": self.vram_total,
            "vram_free": self.vram_free,
            "facts": self.facts,
            "measurements": {k: m.to_dict() for k, m in self.measurements.items()},
            "capabilities": {k: c.to_dict() for k, c in self.capabilities.items()},
            "storage": self.storage,
            "measured_at": self.measured_at,
            "from_cache": self.from_cache,
        }

    @classmethod
    def from_dict(cls, doc: dict) -> "HardwareProfile":
        doc = dict(doc)
        doc["measurements"] = {k: Measurement.from_dict(v) for k, v in doc.get("measurements", {}).items()}
        doc["capabilities"] = {k: Capability.from_dict(v) for k, v in doc.get("capabilities", {}).items()}
        return cls(**doc)


def _save(path: Path, doc: dict) -> list[str]:
    """Cache one part of the profile; [] when written, else [why not] (a read-only or full cache)."""
    try:
        write_json(path, doc)
    except OSError as exc:
        return [exc.strerror or str(exc)]
    return []


def _measure_host(log: Log) -> dict:
    wait_written()  # a probe file written ahead has landed: its copies and fsync do not share the timed work
    start, busy = time.perf_counter(), cpu_snapshot()
    log("measuring this machine once (memory, compute; cached afterwards)")
    facts = collect_facts()
    device, device_reason = choose_device()
    # Two buffers of at most an eighth of the free memory each: measuring inside a small memory limit (a first run
    # under a 1.2 GiB cgroup, after sharding) must not be what exceeds it.
    free = memory_bound()[1]
    found: dict[str, Measurement] = {
        "host_memory": measure.host_memory(max(measure.MIN_COPY_BYTES, min(measure.COPY_BYTES, free // 8)))
    }
    found["device_memory"] = measure.device_memory(device, found["host_memory"])
    found.update(measure.host_to_device(device))
    found.update(measure.compute(device))
    found["runtime_rss"] = measure_runtime()
    decided = {
        "compute_dtype": _guarded(
            lambda: caps.compute_dtype(device, facts["cpu"]["isa"], found),
            lambda why: Capability("compute_dtype", "fp32", "fp32", f"dtype query failed ({why})"),
        )
    }
    decided["pin_memory"] = caps.pin_memory(device, found)
    decided["non_blocking"] = caps.non_blocking(device, decided["pin_memory"])
    decided["sdpa"] = caps.sdpa(device)
    log(f"compute device: {device} ({device_reason})")
    _log_decisions(decided, log)
    return {
        "facts": facts,
        "compute_device": device,
        "device_reason": device_reason,
        "accelerators": _guarded(lambda: torch_accelerators(device), lambda why: [{"name": f"unavailable: {why}"}]),
        "vram_total": _guarded(lambda: device_memory(device)[0], lambda why: None),
        "measurements": {k: m.to_dict() for k, m in found.items()},
        "capabilities": {k: c.to_dict() for k, c in decided.items()},
        "measured_at": _now(),
        "seconds": round(time.perf_counter() - start, 3),
        "others_cpu_share": _contention(busy, log),
    }


def _contention(before, log: Log) -> float | None:
    """Other processes' share of the CPUs while measuring: a busy machine measures low, and the figure is cached."""
    share = others_cpu_share(before, cpu_snapshot())
    if share is not None and share >= BUSY_SHARE:
        log(
            f"warning: other processes used {share:.0%} of the CPUs while measuring; figures may be low (--refresh "
            f"when idle)"
        )
    return share


def _guarded(call, fallback):
    """A device query that raises (a driver that claims a device it cannot use) degrades to its fallback."""
    try:
        return call()
    except Exception as exc:  # noqa: BLE001
        return fallback(f"{type(exc).__name__}: {' '.join(str(exc).split())[:160]}")


def _probe_directories(fs) -> list[Path]:
    """Where the probe file goes: the cache dir when it shares the filesystem (never litter a model directory), else
    beside the weights."""
    return [cache_dir(), fs.directory] if filesystem_of(cache_dir()).key == fs.key else [fs.directory]


def _measure_filesystem(fs, log: Log, own: Path | None) -> dict:
    """The filesystem's measurements: on OWN (the weights' own file, storage.own_file's) where given, else on a probe
    file."""
    start, busy = time.perf_counter(), cpu_snapshot()
    directories = _probe_directories(fs)
    found, decided, cacheable = measure_storage(
        fs, probe_bytes(), lambda message: log(redact(message)), directories, own
    )
    _log_decisions(decided, log)
    return {
        "filesystem": {
            "mount_point": fs.mount_point,
            "fstype": fs.fstype,
            "source": fs.source,
            "kind": fs.kind,
            "key": fs.key,
        },
        "measurements": {k: m.to_dict() for k, m in found.items()},
        "capabilities": {k: c.to_dict() for k, c in decided.items()},
        "measured_at": _now(),
        "seconds": round(time.perf_counter() - start, 3),
        "cacheable": cacheable,
        "others_cpu_share": _contention(busy, log),
    }


def _log_decisions(decided: dict[str, Capability], log: Log) -> None:
    for cap in decided.values():
        taken = f"; fallback: {cap.fallback_taken}" if cap.fallback_taken else ""
        log(redact(f"decided {cap.name} = {cap.value}{taken} ({cap.reason})"))


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")
