"""The knobs of reading streamed weights: IO workers, prefetch depth, direct or buffered reads, pinned memory;
from the set's own units read cold where they were measured (probe/unitreads.py)."""

from __future__ import annotations

from ..probe.storage import IN_FLIGHT, IN_FLIGHT_NOTE, in_flight_inputs
from .derivation import FALLBACK_DIRECT_IO, FALLBACK_PREFETCH_DEPTH, Context, Derivation


def _unit_reads(c: Context):
    """The set's own cold reads (UnitReads), where measured for this model."""
    if c.model is None or not c.model.unit_reads:
        return None
    from ..probe.unitreads import UnitReads

    return UnitReads.from_dict(c.model.unit_reads)


def _both_read(c: Context):
    """(the set's cold reads, the best O_DIRECT read, the best buffered one) where both methods were measured on it,
    else None."""
    reads = _unit_reads(c)
    if reads is None:
        return None
    direct, buffered = reads.best(True), reads.best(False)
    return None if direct is None or buffered is None else (reads, direct, buffered)


UNIT_READS_NOTE = (
    "this set's own units read cold, one pread per unit, each method at its cheapest reads in flight "
    "(profiles/probe/unitreads.py)"
)


def io_workers(c: Context) -> Derivation:
    both = _both_read(c)
    if both is not None:
        reads, direct, buffered = both
        return Derivation(
            "unit_in_flight_direct if direct_io else unit_in_flight_buffered",
            {
                "direct_io": int(bool(c.values["direct_io"])),
                "unit_in_flight_direct": direct.in_flight,
                "unit_in_flight_buffered": buffered.in_flight,
                "unit_bytes": reads.unit_bytes,
            },
            "measured",
            UNIT_READS_NOTE,
        )
    kind = str(c.profile.capability("storage_kind") or "unknown")
    return Derivation(
        IN_FLIGHT, in_flight_inputs(kind, c.profile.cpu_cores, c.values["direct_io"]), note=IN_FLIGHT_NOTE
    )


def prefetch_depth(c: Context) -> Derivation:
    # whole bytes per second, as printed: a figure under 1 B/s is no measurement to divide by
    storage = round(c.profile.storage_read_bps or 0)
    compute = round(c.profile.matvec_bps(c.values["compute_dtype"]) or c.profile.device_memory_bps or 0)
    if storage <= 0 or compute <= 0:
        return Derivation.default(
            repr(FALLBACK_PREFETCH_DEPTH), "storage or compute bandwidth unmeasured: double buffering"
        )
    inputs = {"max_depth": 4, "compute_read_bps": compute, "storage_read_bps": storage}
    # Units that compute in the time one unit is read: that many reads in flight keep the reader ahead.
    formula = "max(1, min(max_depth, ceil(compute_read_bps / storage_read_bps)))"
    if c.model is None:
        return Derivation(formula, inputs, note="no model: not limited by buffer memory (missing largest_unit_bytes)")
    inputs.update(
        buffer_share=0.25,
        memory_available=c.device_free,
        reserve_bytes=c.values["reserve_bytes"],
        kv_cache_bytes=c.values["kv_cache_bytes"],
        largest_unit_bytes=c.model.largest_unit_bytes,
        **c.runtime(),
    )
    free = "memory_available - reserve_bytes - kv_cache_bytes" + (
        " - runtime_bytes" if "runtime_bytes" in inputs else ""
    )
    buffers = f"floor(buffer_share * ({free}) / largest_unit_bytes) - 2"
    reads = _unit_reads(c)
    chosen = reads.best(bool(c.values["direct_io"])) if reads is not None else None
    if chosen is not None:
        # The set's units measured: read ahead at least the reads in flight that served them cheapest, at the
        # bandwidth they were read at.
        inputs.update(storage_read_bps=round(chosen.bps), io_workers=c.values["io_workers"])
        formula = (
            f"max(1, min(max(max_depth, io_workers), max(io_workers, ceil(compute_read_bps / "
            f"storage_read_bps)), {buffers}))"
        )
        return Derivation(
            formula,
            inputs,
            "measured",
            note="storage_read_bps: this set's units read cold; buffers limited to a quarter of free memory",
        )
    formula = f"max(1, min(max_depth, ceil(compute_read_bps / storage_read_bps), {buffers}))"
    return Derivation(formula, inputs, note="buffers limited to a quarter of free memory")


def direct_io(c: Context) -> Derivation:
    both = _both_read(c)
    if both is not None:
        reads, direct, buffered = both
        # Seconds per GB, CPU time counted where reads share the CPU with compute (read_cost's rule).
        return Derivation(
            "unit_direct_s_per_gb <= unit_buffered_s_per_gb",
            {
                "unit_direct_s_per_gb": round(direct.cost(reads.cpu_shared) * 1e9, 4),
                "unit_buffered_s_per_gb": round(buffered.cost(reads.cpu_shared) * 1e9, 4),
                "cpu_shared": reads.cpu_shared,
                "unit_bytes": reads.unit_bytes,
            },
            "measured",
            note=UNIT_READS_NOTE + "; O_DIRECT wins ties",
        )
    direct, buffered = c.profile.measurements.get("storage_read_direct"), c.profile.measurements.get("storage_read")
    if all(m and m.available and m.bytes_moved > 0 and m.seconds > 0 for m in (direct, buffered)):
        # Cost per byte: wall time plus, where compute shares the CPU, the CPU time the read itself uses.
        shared = 1 if c.profile.compute_device == "cpu" else 0
        inputs = {
            "direct_seconds": direct.seconds,
            "direct_cpu_seconds": direct.cpu_seconds,
            "direct_bytes": direct.bytes_moved,
            "buffered_seconds": buffered.seconds,
            "buffered_cpu_seconds": buffered.cpu_seconds,
            "buffered_bytes": buffered.bytes_moved,
            "cpu_shared": shared,
        }
        return Derivation(
            "(direct_seconds + cpu_shared * direct_cpu_seconds) / direct_bytes <= (buffered_seconds + cpu_shared * "
            "buffered_cpu_seconds) / buffered_bytes",
            inputs,
            "measured",
            note="O_DIRECT wins ties: it skips the page-cache copy and never evicts the resident set",
        )
    cap = c.profile.capabilities.get("direct_io")
    return Derivation.default(repr(FALLBACK_DIRECT_IO), cap.reason if cap else "storage was not measured")


def pin_memory(c: Context) -> Derivation:
    pinned = c.profile.measurements.get("h2d_pinned")
    return Derivation(
        "device_kind == 'cuda' and pinned_copy_measured",
        {
            "device_kind": c.profile.compute_device.split(":")[0],
            "pinned_copy_measured": bool(pinned and pinned.available),
        },
    )
