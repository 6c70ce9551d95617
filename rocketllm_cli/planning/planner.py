"""rocketllm plan: whole configurations of a model on a machine, ranked by projected tokens per second.

Enumerated: weight format (as stored, or requantised where the model allows it: formats.py) x compute dtype (each
the profile measured a matvec for) x KV dtype (the compute dtype, int4) x residency (derived, all resident, all in the
host tier, all from storage) x context (derived, or the shortest asked for: a shorter KV cache leaves memory to the
weights) x speculation (derived, off) x hosts (one, or pipeline stages over 2, 4 ... N).

Each candidate is `resolve_knobs` with that candidate's flags: what `generate` would run with them. Its projection is
the cost model's (`cost.project` on `cost.plan_tier_bytes`, the figures `doctor --model` prints; stages: the stage
planner's `plan_stages`), its memory per tier the knobs' own terms (max_context's room after weights, buffers and
reserve: projection.py). A candidate whose context does not fit its memory is dropped, so every row runs.
Ranked by tokens per second compared at three significant digits, then by fewer changes from the defaults, fewer
hosts and less memory; the defaults' own row is resolved once more with no flag at all, and the first row says why it
differs.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

from ..dtypes import ITEMSIZE
from ..errors import RocketError
from ..profiles.cost import plan_tier_bytes
from ..profiles.hardware import HardwareProfile
from ..profiles.knobs.resolve import Knobs, resolve_knobs
from ..profiles.probe.decodecompute import with_layer_overhead
from ..profiles.probe.kernelrates import with_kernel_rates
from ..sizes import format_bytes
from ..stream.layerprobe import measure as measure_layers
from .formats import ModelSource, WeightFormat, with_measured_decode
from .projection import (
    engine_dtype,
    kv_dtype_of,
    positions_per_pass,
    projection,
    row_memory,
    tokens_per_pass,
)
from .request import PlanRequest, meets, unmet, why_defaults_differ
from .rows import Row
from .whatif import capped

RESIDENCIES = ("auto", "resident", "host", "storage")
SIGNIFICANT = 3  # tokens/s closer than this many significant digits rank as equal: the projection is no finer


class PlanError(RocketError):
    """A request no configuration meets; the message names the nearest feasible row."""


@dataclass
class Plan:
    source: ModelSource
    profile: HardwareProfile
    request: PlanRequest
    rows: list[Row]
    default: Row | None
    left_out: dict[str, int]
    hardware: list[str] = field(default_factory=list)  # what-if lines
    seconds: float = 0.0


def make_plan(
    source: ModelSource, profile: HardwareProfile, request: PlanRequest, hardware: list[str] | None = None
) -> Plan:
    """Every configuration of SOURCE on PROFILE that runs and meets REQUEST, best first. PlanError where none does."""
    started = time.perf_counter()
    source = with_measured_decode(source, profile)
    default = _row(profile, source.formats()[0], None, "auto", None, "auto", 1, {}, explicit=False, default=True)
    # the defaults' KV does not fit what is left: every row says why
    default = default if isinstance(default, Row) else None
    rows, left_out = _enumerate(source, profile, request)
    if default is not None and not meets(default, request):
        left_out["the defaults' own row: " + unmet(default, request)] = 1
    elif default is not None:
        rows = [default, *rows]
    rows = _ranked(rows)
    if not rows:
        raise PlanError(_nearest(source, profile, request))
    if default is not None:
        default = next((r for r in rows if r.key() == default.key()), default)
        default.default = True
        if rows[0] is not default:
            rows[0].why = why_defaults_differ(rows[0], default, request)
    return Plan(source, profile, request, rows, default, left_out, hardware or [], time.perf_counter() - started)


# each row as the knobs derive its speculation, then (where that is on) its twin with speculation off: the flag
# resolved like any other, so the twin's projection is its own (one token a pass, no drafts to verify)
SPECULATION_TWINS = ({}, {"speculate": "off"})


def _enumerate(source: ModelSource, profile: HardwareProfile, request: PlanRequest) -> tuple[list[Row], dict[str, int]]:
    budget = profile
    base = resolve_knobs(profile, source.facts, env={})
    if request.max_memory is not None:
        budget = capped(profile, request.max_memory, int(base.value("reserve_bytes")))
    floor = request.min_context or _context_floor(base, source.facts)
    tokens = [floor * request.batch] if request.batch > 1 else [None, floor]
    rows, left_out = [], {}
    for fmt in source.formats():
        knobs = resolve_knobs(budget, fmt.facts, env={})
        default_dtype = engine_dtype(budget, fmt.facts, knobs)
        for dtype in _dtypes(budget, default_dtype):
            for kv in _kv_dtypes(fmt):
                for residency in RESIDENCIES:
                    for wanted in tokens:
                        for extra in SPECULATION_TWINS:
                            row = _row(
                                budget,
                                fmt,
                                dtype if dtype != default_dtype else None,
                                kv,
                                wanted,
                                residency,
                                request.batch,
                                extra,
                                explicit=request.max_memory is not None,
                            )
                            if not _keep(row, request, floor, rows, left_out) or row.speculate == "off":
                                break  # left out, or its speculation-off twin is itself
                for hosts in _host_counts(request.hosts):
                    from .stagerows import stage_row

                    for extra in SPECULATION_TWINS:
                        row = stage_row(
                            budget,
                            source,
                            fmt,
                            dtype if dtype != default_dtype else None,
                            kv,
                            floor,
                            request,
                            hosts,
                            extra,
                        )
                        if not _keep(row, request, floor, rows, left_out) or row.speculate == "off":
                            break
    return rows, left_out


def _keep(row: Row | str, request: PlanRequest, floor: int, rows: list[Row], left_out: dict[str, int]) -> bool:
    """Add ROW to ROWS where it runs and meets REQUEST (True), else count why it is left out (False)."""
    if isinstance(row, str):
        left_out[row] = left_out.get(row, 0) + 1
    elif row.context is not None and row.context < floor:
        why = f"context under {floor} tokens" + (" (--min-context)" if request.min_context else "")
        left_out[why] = left_out.get(why, 0) + 1
    elif not meets(row, request):
        why = unmet(row, request)
        left_out[why] = left_out.get(why, 0) + 1
    else:
        rows.append(row)
        return True
    return False


def _row(
    profile: HardwareProfile,
    fmt: WeightFormat,
    dtype: str | None,
    kv: str,
    tokens: int | None,
    residency: str,
    batch: int,
    extra: dict,
    explicit: bool,
    default: bool = False,
) -> Row | str:
    """One candidate: its knobs, memory, fit and projection; a string saying why it cannot run."""
    facts, total = fmt.facts, fmt.facts.total_bytes
    flags = dict(extra)
    if dtype:
        flags["compute_dtype"] = dtype
    if kv != "auto":
        flags["kv_cache_dtype"] = kv
    flags.update(
        {
            "resident": {"device_cache_bytes": total, "host_cache_bytes": 0},
            "host": {"device_cache_bytes": 0, "host_cache_bytes": total},
            "storage": {"device_cache_bytes": 0, "host_cache_bytes": 0},
        }.get(residency, {})
    )
    if tokens is not None:
        if tokens > batch * facts.max_positions:
            return f"context over the model's {facts.max_positions} positions"
        flags["max_context"] = tokens
    knobs = resolve_knobs(profile, facts, flags=flags, env={})
    memory = row_memory(profile, facts, knobs, tokens)
    if memory is None:
        return "does not fit memory"
    if explicit and residency == "auto":  # a capped plan: this machine would derive more; spell out what fits the cap
        flags.update(
            device_cache_bytes=int(knobs.value("device_cache_bytes")),
            host_cache_bytes=int(knobs.value("host_cache_bytes")),
        )
        flags.setdefault("max_context", memory["tokens"])
    compute = engine_dtype(profile, facts, knobs)
    tiers = plan_tier_bytes(facts, knobs)
    # keyed as bench records it and doctor reads it: the compute dtype, and the kernel where it is not exact
    kernel, dtype_knob = str(knobs.value("kernel")), str(knobs.value("compute_dtype"))
    recorded = fmt.decode.get(dtype_knob if kernel == "exact" else f"{dtype_knob}-{kernel}")
    measured = (
        replace(facts, decode_compute=recorded)
        if recorded
        else with_layer_overhead(
            profile,
            with_kernel_rates(profile, facts, kernel),
            str(knobs.value("compute_dtype")),
            kernel,
            measure=measure_layers,
        )
    )
    speculate = str(knobs.value("speculate"))
    tps, formula, inputs, note = projection(
        profile,
        measured,
        tiers,
        compute,
        batch,
        tokens_per_pass(speculate, fmt.speculation),
        positions_per_pass(speculate, fmt.speculation, batch),
        str(knobs.value("kernel")),
    )
    context = memory["tokens"] // batch if memory["tokens"] is not None else None
    notes = [note] if note else []
    if facts.dtype in ITEMSIZE and compute != facts.dtype and not getattr(facts, "gguf_blocks", False):
        notes.append(
            f"the set holds {facts.dtype}, computed in {compute}: each use of a streamed unit converts it "
            f"(not in the projection)"
        )
    return Row(
        fmt,
        compute,
        kv_dtype_of(profile, facts, knobs),
        residency,
        context,
        batch,
        speculate,
        1,
        flags,
        tps,
        formula,
        inputs,
        memory,
        tiers,
        notes=notes,
        default=default,
    )


def _dtypes(profile: HardwareProfile, default: str) -> list[str]:
    """The default, the profile's decision, fp32 (runs everywhere) and on an accelerator its half types: each with a
    measured matvec (fp16 on a CPU is slow: engine_compute_dtype never picks it there)."""
    wanted = [default, profile.compute_dtype, "fp32"] + ([] if profile.is_cpu else ["bf16", "fp16"])
    return [d for d in dict.fromkeys(wanted) if d == default or profile.matvec_bps(d)]


def _kv_dtypes(fmt: WeightFormat) -> list[str]:
    """auto, and int4 where every layer keeps full attention and the head dimension is even (stream/kvcache.py)."""
    f = fmt.facts
    int4 = (
        f.kv_head_dim > 0 and f.kv_head_dim % 2 == 0 and not f.kv_window_values and f.kv_growing_layers >= f.num_layers
    )
    return ["auto", "int4"] if int4 else ["auto"]


def _host_counts(hosts: int) -> list[int]:
    counts, n = [], 2
    while n < hosts:
        counts.append(n)
        n *= 2
    return counts + [hosts] if hosts > 1 else []


def _context_floor(knobs: Knobs, facts) -> int:
    """The shortest context a row may hold when none is asked for: the one the KV cache's own derivation keeps at least
    (its min_context input), within the model's positions."""
    least = knobs["kv_cache_bytes"].inputs.get("min_context", 2048)
    return max(1, min(int(least), facts.max_positions))


def _ranked(rows: list[Row]) -> list[Row]:
    unique: dict[tuple, Row] = {}
    for row in rows:
        held = unique.get(row.key())
        if held is None or (len(row.flags), not row.default) < (len(held.flags), not held.default):
            unique[row.key()] = row
    ordered = sorted(
        unique.values(),
        key=lambda r: (
            r.tokens_per_s is None,
            -float(f"{r.tokens_per_s or 0:.{SIGNIFICANT}g}"),
            not r.default,
            len(r.flags),
            r.hosts,
            r.memory["used"],
        ),
    )
    for i, row in enumerate(ordered, 1):
        row.rank = i
    return ordered


def _nearest(source: ModelSource, profile: HardwareProfile, request: PlanRequest) -> str:
    """The one line for a request beyond every row: what was asked, what the rows reach, and the nearest one."""
    asked = [
        text
        for text, given in (
            (f"--min-context {request.min_context}", request.min_context is not None),
            (f"--max-memory {format_bytes(request.max_memory or 0)}", request.max_memory is not None),
            (f"--quality {request.quality}", request.quality is not None),
            (f"--batch {request.batch}", request.batch > 1),
        )
        if given
    ]
    loose = PlanRequest(hosts=request.hosts, link_bps=request.link_bps, link_latency_s=request.link_latency_s)
    rows, _ = _enumerate(source, profile, loose)
    rows = _ranked(rows)
    if not rows:
        free = profile.vram_free if profile.vram_free is not None else profile.ram_available
        reserve = resolve_knobs(profile, source.facts, env={}).value("reserve_bytes")
        return (
            f"no configuration of {source.name} fits this machine's memory ({format_bytes(free)} free on "
            f"{profile.compute_device}, less a {format_bytes(reserve)} reserve): not even every layer streamed "
            f"from storage "
            "with the shortest context"
        )
    if not asked:
        return f"no configuration of {source.name} runs here; nearest: {rows[0].short()}"

    def miss(row: Row) -> float:
        gaps = [0.0]
        if request.min_context:
            gaps.append(max(0.0, (request.min_context - (row.context or 0)) / request.min_context))
        if request.max_memory:
            gaps.append(max(0.0, (row.memory["used"] - request.max_memory) / request.max_memory))
        if request.quality is not None:
            gaps.append(
                1.0
                if row.format.kl is None
                else max(0.0, row.format.kl - request.quality) / max(request.quality, 1e-12)
            )
        if request.batch > 1:
            gaps.append((request.batch - row.batch) / request.batch)
        return max(gaps)

    nearest = min(rows, key=lambda r: (miss(r), r.rank))
    limit = (
        ", the model's own limit" if request.min_context and request.min_context > source.facts.max_positions else ""
    )
    reach = [f"at most {max(r.context or 0 for r in rows)} tokens of context{limit}"] if request.min_context else []
    reach += [f"at least {format_bytes(min(r.memory['used'] for r in rows))} of memory"] if request.max_memory else []
    reach += (
        ["no format with a measured KL"]
        if request.quality is not None and all(r.format.kl is None for r in rows)
        else []
    )
    return (
        f"no configuration meets {' '.join(asked)} ({', '.join(reach) or 'the rows miss it'}); nearest: "
        f"{nearest.short()}"
    )
