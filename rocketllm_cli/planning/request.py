"""What a user asks `rocketllm plan` for (constraints and what-if settings), whether a row meets it and, where it
does not, why; and why the row ranked first differs from what the defaults pick."""

from __future__ import annotations

from dataclasses import dataclass

from ..sizes import format_bytes
from .rows import Row


@dataclass(frozen=True)
class PlanRequest:
    min_context: int | None = None  # tokens each sequence must hold
    max_memory: int | None = None  # bytes the run may take (RAM, and VRAM on a GPU machine)
    batch: int = 1  # sequences per pass
    quality: float | None = None  # KL bound (nats per token) against the unquantised weights
    hosts: int = 1
    link_bps: float = 0.0
    link_latency_s: float = 0.0


def meets(row: Row, request: PlanRequest) -> bool:
    return not unmet(row, request)


def unmet(row: Row, request: PlanRequest) -> str:
    if request.batch != row.batch:
        return f"one sequence, not --batch {request.batch}"
    if request.min_context is not None and (row.context or 0) < request.min_context:
        return f"context under --min-context {request.min_context}"
    if request.max_memory is not None and row.memory["used"] > request.max_memory:
        return f"over --max-memory {format_bytes(request.max_memory)}"
    if request.quality is not None and row.format.kl is None:
        return f"no KL measured for {row.format.label} against the unquantised weights"
    if request.quality is not None and row.format.kl > request.quality:
        return f"KL over --quality {request.quality:g}"
    return ""


def why_defaults_differ(top: Row, default: Row, request: PlanRequest) -> str:
    """Why the defaults did not pick TOP, one clause per setting in which they differ."""
    why = []
    if not meets(default, request):
        why.append(f"the defaults' row ({default.short()}) does not meet the request: {unmet(default, request)}")
    if top.format.name != default.format.name:
        saved = default.format.facts.total_bytes - top.format.facts.total_bytes
        why.append(
            f"the defaults run the weights as stored ({default.format.label}) and never requantise; this row's "
            f"`shard --quantize {top.format.quantize}` set is {format_bytes(saved)} smaller "
            f"({top.format.kl_note.split(':')[0]})"
        )
    if top.compute_dtype != default.compute_dtype:
        why.append(
            f"the defaults compute in {default.compute_dtype}; {top.compute_dtype}'s measured matvec projects faster "
            f"here ({rate_text(top)} against {rate_text(default)})"
        )
    if (top.kv_dtype == "int4") != (default.kv_dtype == "int4"):
        why.append(
            f"the defaults keep K and V in {default.kv_dtype}; {top.kv_dtype} takes fewer bytes a token, "
            f"leaving memory to weights"
        )
    if top.context != default.context and not top.stages:
        why.append(
            f"the defaults size the KV cache for {default.context} tokens; this row holds {top.context}, "
            f"{format_bytes(abs(default.memory['device']['kv'] - top.memory['device']['kv']))} "
            f"{'less' if (top.context or 0) < (default.context or 0) else 'more'} KV"
        )
    if top.residency_text() != default.residency_text() and not top.stages:
        why.append(f"the defaults keep {default.residency_text()}; this row {top.residency_text()}")
    if top.hosts != default.hosts:
        why.append(
            f"the defaults run one process on one host; this row splits the layers over {top.hosts} hosts "
            f"(--stages {top.stages})"
        )
    if top.speculate != default.speculate:
        why.append(f"speculation {top.speculate} here, {default.speculate} in the defaults")
    return "; ".join(why) or "the same projection as the defaults' row"


def rate_text(row: Row) -> str:
    bps = row.inputs.get("compute_bps")
    return f"{bps / 1e9:.2f} GB/s of weights" if bps else "measured"
