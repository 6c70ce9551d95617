"""Measured next to projected next to the physical limit, per row.

projected = the cost model (profiles.cost.project) on the bytes per tier the ledger measured:
            max(io, compute) with io = host bytes / page-cache bandwidth + storage bytes / storage bandwidth
            and compute = the weights' products: all bytes at the measured matvec bandwidth, a GGUF set's blocks each
            at the speed the native kernels measured for its type (profiles/probe/kernelrates.py).
limit     = max(io, compute floor): io of each weight byte once (the plan's unique bytes per tier: a tied
            embedding served twice counts once), and the compute floor is a *measured* per-token time of
            the same model: the p10 (fastest tenth of tokens) of the fastest resident run, ours or any
            baseline's (plain transformers, llama.cpp), or of the row itself where that is faster (on a CPU the
            host regime computes exactly as the resident one does, so either beats the other by noise: a median
            of another run is no floor, and put a host row at efficiency 1.72); for a resident row, the other
            engines' resident p10 or its own, when another engine ran, else the cost model's compute.
            efficiency = limit / measured median.
"""

from __future__ import annotations


def projection(profile, facts, tier_bytes: dict[str, int], kernel: str = "exact", compute_dtype: str = "") -> dict:
    """The cost model's projection on TIER_BYTES: the products on KERNEL's kernels, plus (given COMPUTE_DTYPE) the
    layers' own work as the probe measured it for the architecture (never this set's own bench figures: the
    projection is what was known before the run)."""
    from ..profiles import project
    from ..profiles.probe.decodecompute import with_layer_overhead
    from ..profiles.probe.kernelrates import with_kernel_rates
    from ..stream.layerprobe import measure

    facts = with_kernel_rates(profile, facts, kernel)
    products = project(profile, facts, tier_bytes).compute_seconds
    if compute_dtype:
        facts = with_layer_overhead(profile, facts, compute_dtype, kernel, measured=False, measure=measure)
    p = project(profile, facts, tier_bytes)
    return {
        "tiers": {
            t: {"bytes": c.bytes, "bandwidth_bps": c.bandwidth_bps, "bandwidth": c.bandwidth, "seconds": c.seconds}
            for t, c in p.tiers.items()
        },
        "io_seconds": p.io_seconds,
        "compute_seconds": p.compute_seconds,
        "products_seconds": products,  # the products alone: the physical floor where no engine's run is one
        # what the layers' own work (the probe's, layercost.py) adds to them: compute = products + this
        "layer_work_seconds": p.compute_seconds - products if p.compute_seconds is not None and products else 0.0,
        "compute_bandwidth": p.compute_bandwidth,
        "compute_bandwidth_bps": profile.matvec_bps() or profile.device_memory_bps,
        "lookup_bytes": facts.lookup_bytes,  # served by a tier, no product: tables a token looks rows up in
        "serial_seconds": p.serial_seconds,
        "overlapped_seconds": p.overlapped_seconds,
        "reason": p.reason,
    }


def projected_ms(proj: dict) -> float | None:
    best = proj["overlapped_seconds"] if proj["overlapped_seconds"] is not None else proj["serial_seconds"]
    return None if best is None else 1000 * best


def compute_floor(
    regime: str, fastest: dict[tuple[str, str], float], proj: dict, own: float | None = None
) -> tuple[float | None, str]:
    """(seconds, basis in words): the time a token needs with no bytes to wait for. `fastest`: each measured
    run's p10 seconds per token; `own`: the row's own p10.

    Any engine's resident run is a floor: llama.cpp computing a token of the same model in 7.7 ms proves this machine
    can, whatever our resident row does (the cost model's bf16 matvec figure put llama.cpp at efficiency 2.21 on a
    4-bit set, whose kernels it does not describe)."""
    engines = {name: s for (name, r), s in fastest.items() if r == "resident" and s is not None}
    others = [
        (s, f"compute = {_engine(name)} resident, p10 measured") for name, s in engines.items() if name != "rocketllm"
    ]
    if regime == "resident":
        if others:
            mine = [(own, "compute = this row's own p10, faster than the other engines'")] if own is not None else []
            return min(others + mine, key=lambda c: c[0])
        return _products(proj), "compute = the weights' products at measured speeds (no baseline ran)"
    candidates = others + [
        (s, basis)
        for s, basis in (
            (engines.get("rocketllm"), "compute = our resident regime, p10 measured"),
            (own, "compute = this row's own p10, faster than the resident runs'"),
        )
        if s is not None
    ]
    if engines:
        return min(candidates, key=lambda c: c[0])
    return _products(proj), "compute = the weights' products at measured speeds (resident regime did not run)"


def _products(proj: dict) -> float | None:
    return proj.get("products_seconds", proj["compute_seconds"])


def _engine(name: str) -> str:
    return {"transformers": "plain transformers"}.get(name, name)


def limit(
    regime: str,
    fastest: dict,
    proj: dict,
    unique: dict | None,
    own: float | None = None,
    storage_bps: float | None = None,
) -> tuple[float | None, str]:
    """Overlap-aware physical limit in seconds per token, and how it was formed. `storage_bps`: storage bytes at this
    bandwidth instead of the profile's (disk_now's figure)."""
    floor, basis = compute_floor(regime, fastest, proj, own)
    io = proj["io_seconds"]
    if unique is not None and io is not None:
        bandwidth = {t: proj["tiers"][t]["bandwidth_bps"] for t in ("host", "storage")}
        if storage_bps:
            bandwidth["storage"] = storage_bps
        io = sum(unique.get(t, 0) / bandwidth[t] for t in ("host", "storage") if unique.get(t))
    if floor is None or io is None:
        return None, "unavailable: " + (proj["reason"] or "no compute figure")
    bound = "io" if io > floor else "compute"
    return max(io, floor), f"max(io {1000 * io:.1f} ms, {basis} {1000 * floor:.1f} ms): {bound}-bound"


def finish_rows(rows: list[dict], profile, facts) -> None:
    """Fill projected/limit/efficiency into every measured row, and speed-ups of ours over each baseline."""
    measured = {(r["name"], r["regime"]): r["ms_per_token"]["median"] / 1000 for r in rows if r["status"] == "measured"}
    fastest = {(r["name"], r["regime"]): r["ms_per_token"]["p10"] / 1000 for r in rows if r["status"] == "measured"}
    ours = {r["regime"]: r for r in rows if r["name"] == "rocketllm" and r["status"] == "measured"}
    for row in rows:
        if row["status"] != "measured":
            continue
        same = ours.get(row["regime"]) or row  # baselines are judged on the bytes our plan for the same budget serves
        tier_bytes = same.get("bytes_per_token") or {}
        proj = (
            projection(
                profile,
                facts,
                tier_bytes,
                str((same.get("knobs") or {}).get("kernel") or "exact"),
                str((same.get("knobs") or {}).get("compute_dtype") or ""),
            )
            if tier_bytes
            else None
        )
        row["projection"] = proj
        row["projected_ms"] = round(projected_ms(proj), 2) if proj and projected_ms(proj) is not None else None
        own = fastest[(row["name"], row["regime"])]
        bound, how = (
            limit(row["regime"], fastest, proj, same.get("unique_bytes_per_tier"), own)
            if proj
            else (None, "no bytes per tier")
        )
        row["limit_ms"] = round(1000 * bound, 2) if bound is not None else None
        row["limit_basis"] = how
        row["efficiency"] = round(bound / measured[(row["name"], row["regime"])], 3) if bound else None
        disk = same.get("disk_now")
        if proj and disk and (same.get("unique_bytes_per_tier") or {}).get("storage"):
            # The same limit with storage at what the disk gave the run's own units just after it: a shared disk's
            # bandwidth moves within the hour, so both are printed (the column keeps the profile's, comparable).
            now, _ = limit(row["regime"], fastest, proj, same.get("unique_bytes_per_tier"), own, disk["bps"])
            if now:
                row["disk_now_limit_ms"] = round(1000 * now, 2)
                row["disk_now_efficiency"] = round(now / measured[(row["name"], row["regime"])], 3)
    for regime, row in ours.items():
        row["speedup"] = {
            r["name"]: round(r["ms_per_token"]["median"] / row["ms_per_token"]["median"], 2)
            for r in rows
            if r["regime"] == regime and r["name"] != "rocketllm" and r["status"] == "measured"
        }
