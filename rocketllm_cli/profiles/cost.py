"""The cost model: seconds per decode token = sum over tiers of bytes served from it / its measured bandwidth.

Tiers: 'device' (weights resident on the compute device, read at device memory speed),
'host' (on the CPU the page cache, at page-cache read speed; on a GPU host RAM, at the
host-to-device copy speed), 'storage' (cold reads of the weights' filesystem).
A tier with bytes but no measurement makes the total unavailable; nothing is guessed.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

from ..checkpoint.modelfacts import ModelFacts
from ..tiers import TIERS
from .hardware import HardwareProfile

if TYPE_CHECKING:  # an annotation only: knobs/running.py projects through this module, and resolve imports it
    from .knobs.resolve import Knobs


@dataclass(frozen=True)
class TierCost:
    tier: str
    bytes: int  # served from this tier per decode token
    bandwidth_bps: float | None
    bandwidth: str  # which measurement, in words
    seconds: float | None
    available: bool
    reason: str = ""


@dataclass(frozen=True)
class Projection:
    """Projected seconds per decode token: `serial_seconds` (tiers one after another) and
    `overlapped_seconds` = max(io, compute), the floor that prefetching can reach."""

    model: str
    tiers: dict[str, TierCost]
    serial_seconds: float | None
    io_seconds: float | None  # host + storage tiers
    compute_seconds: float | None  # every weight byte read by the forward pass
    compute_bandwidth: str
    overlapped_seconds: float | None
    reason: str = ""

    @property
    def available(self) -> bool:
        return self.serial_seconds is not None

    @property
    def tokens_per_second(self) -> float | None:
        best = self.overlapped_seconds or self.serial_seconds
        return 1.0 / best if best else None

    def to_dict(self) -> dict:
        doc = asdict(self)
        doc["tokens_per_second"] = self.tokens_per_second
        return doc


def plan_tier_bytes(model: ModelFacts, knobs: Knobs) -> dict[str, int]:
    """The default residency split per decode token: the device tier takes what device_cache_bytes allows,
    the host tier the next host_cache_bytes, storage the rest. A dense model reads every weight per token;
    a mixture-of-experts token reads its active bytes, split across the tiers in the same shares."""
    device = min(model.total_bytes, int(knobs.value("device_cache_bytes") or 0))
    host = min(model.total_bytes - device, int(knobs.value("host_cache_bytes") or 0))
    split = {"device": device, "host": host, "storage": model.total_bytes - device - host}
    if model.bytes_per_token == model.total_bytes or not model.total_bytes:
        return split
    share = model.bytes_per_token / model.total_bytes
    return {tier: int(b * share) for tier, b in split.items()}


def project(profile: HardwareProfile, model: ModelFacts, tier_bytes: dict[str, int]) -> Projection:
    tiers = {tier: _tier(profile, tier, int(tier_bytes.get(tier, 0))) for tier in TIERS}
    own = own_reads(model)
    if own is not None and tiers["storage"].bytes:
        bps, what = own
        n = tiers["storage"].bytes
        tiers["storage"] = TierCost("storage", n, bps, what, n / bps, True)
    missing = [t.tier for t in tiers.values() if not t.available]
    serial = None if missing else sum(t.seconds for t in tiers.values())
    io = None if {"host", "storage"} & set(missing) else tiers["host"].seconds + tiers["storage"].seconds
    total = sum(tiers[t].bytes for t in TIERS)
    rate = profile.matvec_bps()
    if rate:
        how = f"decode-shaped matvec in {profile.compute_dtype}, measured ({rate / 1e9:.2f} GB/s of weights)"
    else:
        rate = profile.device_memory_bps
        how = (
            f"device memory copy speed ({rate / 1e9:.2f} GB/s)"
            if rate
            else ("unavailable: neither matvec nor device memory measured")
        )
    # a table a token only looks rows up in is no product: its bytes are served (a tier holds it), not multiplied
    products = max(0, total - model.lookup_bytes)
    compute = products / rate if rate else None
    if products < total:
        how += f"; the {model.lookup_bytes / 2**20:.1f} MiB embedding table is looked up by rows, not multiplied"
    kernels = model.kernel_rates
    if kernels and total and profile.is_cpu and not model.decode_compute:
        compute, how = _on_kernels(model, kernels, total, rate, how, products)
    overhead = model.layer_overhead
    if kernels and compute is not None and not overhead and not model.decode_compute and model.num_layers:
        # a small model's token is as much its layers' own work as its products (SmolLM2: 10 of 18 ms, 2 cores)
        how += (
            "; the layers' own work beside the products is not measured on this machine yet (`rocketllm bench` of "
            "any set measures it), so this is a floor"
        )
    if overhead and compute is not None and not model.decode_compute:
        outside = float(overhead.get("token_seconds") or 0.0)
        compute += model.num_layers * float(overhead["seconds"]) + outside
        how += f"; plus {model.num_layers} layers x {1000 * float(overhead['seconds']):.3f} ms of per-layer work"
        if overhead.get("source") == "probe":
            how += (
                f" and {1000 * outside:.3f} ms a token outside the layers, measured here on {overhead['architecture']} "
                "models of the set's widths, of one layer and of two (no set of it benched here yet)"
            )
        else:
            of = (
                f"{overhead['architecture']} sets"
                if overhead.get("architecture", "any") != "any"
                else ("sets of any architecture")
            )
            how += (
                f", the median of what bench measured beyond the products for {of} on this machine "
                f"({', '.join(overhead['sets'])})"
            )
    measured = model.decode_compute
    if measured and total:
        floor = f"; the matvec floor alone: {1000 * compute:.1f} ms" if compute else ""
        compute = float(measured["seconds"])
        threads = f", {measured['threads']} compute threads" if measured.get("threads") else ""
        how = (
            f"this set's resident decode, measured by `rocketllm bench` ({measured.get('measured_at', '?')}{threads}): "
            f"layers' own work and kernels included{floor}"
        )
    overlapped = max(io, compute) if io is not None and compute is not None else None
    reason = f"unmeasured tier(s): {', '.join(missing)}" if missing else ""
    return Projection(model.name, tiers, serial, io, compute, how, overlapped, reason)


def _on_kernels(
    model: ModelFacts, kernels: dict, total: int, rate: float | None, how: str, products: int
) -> tuple[float | None, str]:
    """Seconds of compute for TOTAL weight bytes of a GGUF set, PRODUCTS of them multiplied: each block product's bytes
    at the rate the native kernels measured for its type and shape here (probe/kernelrates.py), the rest (float
    tensors, types without a kernel) at RATE, the dense matvec's. The floor still: a layer's own work beside its
    products is left out."""
    from .probe.kernelrates import block_shapes_of, describe, type_rates

    # the tiers' bytes: one token's, or a batch's
    share = total / model.bytes_per_token if model.bytes_per_token else 1.0
    blocks = {t: {shape: int(b * share) for shape, b in shapes.items()} for t, shapes in block_shapes_of(model).items()}
    timed = type_rates(kernels, blocks)
    rest = max(0, products - sum(b for b, _ in timed.values()))
    if rest and not rate:
        return None, how
    seconds = sum(s for _, s in timed.values()) + (rest / rate if rest else 0.0)
    words = describe(kernels, blocks) + (f"; the other {rest / 2**20:.1f} MiB: {how}" if rest else "")
    return seconds, words


def own_reads(model: ModelFacts) -> tuple[float, str] | None:
    """(B/s, words) of the set's own units read cold the way the knobs read them by default (probe/unitreads.py:
    O_DIRECT or buffered, that many in flight), where measured: a 56 MiB unit read one at a time with O_DIRECT moved
    1.32 GB/s where the storage probe's file read 1.67 (2 cores, under a 1.2 GiB cap)."""
    if not getattr(model, "unit_reads", None):
        return None
    from .probe.unitreads import UnitReads

    try:
        row = UnitReads.from_dict(model.unit_reads).chosen()
    except (KeyError, TypeError, ValueError):
        return None
    if row is None or row.seconds <= 0 or row.bytes <= 0:
        return None
    how = "O_DIRECT" if row.direct else "buffered"
    return row.bps, f"this set's own units read cold, {how} x{row.in_flight} (as the read knobs choose)"


def _tier(profile: HardwareProfile, tier: str, nbytes: int) -> TierCost:
    bps, what, why = tier_bandwidth(profile, tier)
    if nbytes == 0:
        return TierCost(tier, 0, bps, what, 0.0, True, "nothing served from this tier")
    if not bps:
        return TierCost(tier, nbytes, None, what, None, False, why)
    return TierCost(tier, nbytes, bps, what, nbytes / bps, True)


def tier_bandwidth(profile: HardwareProfile, tier: str) -> tuple[float | None, str, str]:
    """(bytes per second, measurement in words, why unavailable)."""
    m = profile.measurements
    if tier == "device":
        name = "device_memory"
        what = (
            "host memory copy (the CPU's device memory is RAM)"
            if profile.is_cpu
            else (f"{profile.compute_device} memory copy")
        )
    elif tier == "host" and profile.is_cpu:
        name, what = "page_cache_read", "page-cache read() (a zero-copy mmap path pays about memory speed instead)"
    elif tier == "host":
        pinned = m.get("h2d_pinned")
        name = "h2d_pinned" if pinned is not None and pinned.available else "h2d_pageable"
        what = f"host-to-device copy, {'pinned' if name == 'h2d_pinned' else 'pageable'}"
    else:
        name = "storage_read_direct" if profile.capability("direct_io") else "storage_read"
        what = (
            f"cold {'O_DIRECT' if name.endswith('direct') else 'buffered'} read of "
            f"{profile.storage.get('mount_point', '?')} ({profile.storage.get('kind', '?')})"
        )
    found = m.get(name)
    if found is None:
        return None, what, f"{name} was not measured"
    return found.value_bps, what, found.reason
