"""The three regimes as knob overrides, and one measured RocketLLM row per regime.

resident - device_cache_bytes covers the whole model: every weight bound once, nothing streams.
host     - nothing resident; every unit in the host tier (on CPU: the page cache through mmap).
storage  - nothing resident, no host tier: every token's bytes come from storage, evicted after each read.
auto     - no overrides: the residency the knobs derive for this machine, as `generate` runs it (under a memory
           limit smaller than the model, the plan's split between resident and streamed units).
expert-cache (mixture-of-experts only) - dense parts resident, experts from storage through an expert cache
           of a quarter of the experts' bytes: the regime of a MoE model whose experts do not fit.
"""

from __future__ import annotations

import gc

from ..sizes import format_bytes
from ..threads import COMPUTE_THREADS
from .timing import fixed_prompt, ms_summary, timed_run

REGIMES = ("resident", "host", "storage", "auto", "expert-cache")
DEFAULT_REGIMES = ("resident", "host", "storage")  # plus expert-cache for a mixture-of-experts model
EXPERT_CACHE_SHARE = 0.25
REGIME_KNOBS = ("device_cache_bytes", "host_cache_bytes")
RAM_SHARE = 0.8  # a regime that holds the whole model in RAM needs it to fit in this share of available RAM


def regime_overrides(regime: str, manifest) -> dict[str, int]:
    total_bytes = manifest.total_bytes
    huge = 2 * total_bytes + (1 << 30)
    experts = sum(u.tensor_bytes for u in manifest.experts)
    return {
        "resident": {"device_cache_bytes": huge, "host_cache_bytes": 0},
        "host": {"device_cache_bytes": 0, "host_cache_bytes": huge},
        "storage": {"device_cache_bytes": 0, "host_cache_bytes": 0},
        "auto": {},
        "expert-cache": {
            "device_cache_bytes": total_bytes - experts + int(EXPERT_CACHE_SHARE * experts),
            "host_cache_bytes": 0,
        },
    }[regime]


def skip_reason(regime: str, total_bytes: int, ram_available: int, has_experts: bool = False) -> str | None:
    """Why a regime cannot run on this machine (the model must fit in RAM to be resident or page-cached)."""
    if regime == "expert-cache":
        return None if has_experts else "not a mixture-of-experts model"
    if regime in ("storage", "auto") or total_bytes <= RAM_SHARE * ram_available:
        return None
    where = "resident" if regime == "resident" else "in the page cache"
    return (
        f"the model ({format_bytes(total_bytes)}) does not fit {where} in {RAM_SHARE:.0%} of the "
        f"{format_bytes(ram_available)} RAM available"
    )


def read_method(knobs) -> str:
    return "O_DIRECT" if knobs.value("direct_io") else "buffered read + POSIX_FADV_DONTNEED"


def run_regime(model_path, regime: str, tokens: int, prompt_tokens: int, flags: dict, log) -> dict:
    """Load MODEL in `regime`, generate, and return the measured row (the ledger's figures over the measured steps)."""
    from ..auto import AutoModel
    from ..checkpoint.manifest import Manifest
    from ..stream.context import run_tokens
    from .timing import WARMUP

    overrides = regime_overrides(regime, Manifest.load(model_path))
    # the KV this run holds, as llama.cpp's row gets n_ctx for the same run (llamacpp.py)
    streamed = AutoModel.from_pretrained(
        model_path, flags=flags, log=log, run_tokens=run_tokens([prompt_tokens], 1 + WARMUP + tokens), **overrides
    )
    directory = streamed.directory
    try:
        streams = [u for u in streamed.manifest.units if streamed.plan.tier[u.name] == "storage" and u.kind != "expert"]
        stats = timed_run(streamed, fixed_prompt(streamed.tokenizer, prompt_tokens), tokens)
        served = stats.bytes_per_token
        moe = bool(streamed.manifest.experts)
        experts = stats.experts_per_token
        row = {
            "name": "rocketllm",
            "regime": regime,
            "status": "measured",
            "reason": "",
            "ttft_ms": round(1000 * stats.ttft_s, 1),
            "ms_per_token": ms_summary(stats.token_gaps_s),
            "tokens_per_s": round(stats.tokens_per_s, 2) if stats.tokens_per_s else None,
            "speculation": stats.speculation or None,
            "bytes_per_token": served,
            # the limit's bytes: each weight once (a MoE token: the dense part and its routed experts, as served)
            "unique_bytes_per_tier": served if moe else streamed.plan.bytes_per_tier(streamed.manifest),
            "experts_per_token": round(experts, 2) if moe and experts is not None else None,
            "expert_cache": stats.expert_cache if moe else None,
            "whole_layer_bytes_per_token": streamed.manifest.total_bytes if moe else None,
            "storage_witnessed_per_token": stats.storage_witnessed_per_token,
            "phase_ms_per_token": {p: round(1000 * s, 2) for p, s in (stats.phase_seconds_per_token or {}).items()},
            "read_method": read_method(streamed.knobs) if served["storage"] else None,
            "residency": streamed.plan.to_dict(),
            "residency_text": streamed.residency_text(),
            "knobs": {
                k: streamed.knobs.value(k)
                for k in (
                    "device_cache_bytes",
                    "host_cache_bytes",
                    "prefetch_depth",
                    "io_workers",
                    "direct_io",
                    "compute_dtype",
                    "kernel",
                    "kv_cache_bytes",
                    "max_context",
                )
            },
            "compute_threads": COMPUTE_THREADS.describe(),  # before close() gives torch its own count back
            **({"stages": streamed.stage.figures()} if getattr(streamed, "stage", None) is not None else {}),
            "_facts": streamed.facts,
            "_profile": streamed.profile,
        }
    finally:
        streamed.close()
        del streamed
        gc.collect()
    if streams:  # the disk as it is now, for the limit: the units this run streamed, read cold (the model closed first)
        knobs = row["knobs"]
        row["disk_now"] = disk_now(directory, streams, (bool(knobs["direct_io"]), int(knobs["io_workers"])))
    return row


# of the streamed layers read for disk_now: enough that a request's latency averages out
SAMPLE_LAYERS_BYTES = 128 * 1024**2


def disk_now(directory, units: list, run_way: tuple[bool, int] | None = None) -> dict | None:
    """The fastest the disk reads a run's streamed units cold, measured now (each method the store has, 1, 2 and 4
    reads in flight, profiles/probe/unitreads.py): a disk shared with other machines delivers what it delivers this
    hour, and the profile measured a large file another day. Layers first (every token reads them), up to
    SAMPLE_LAYERS_BYTES; None where fewer than two units stream or a read fails. RUN_WAY (O_DIRECT?, reads in flight):
    the way the run read, whose rate is given too ("run_way") where it is among those measured."""
    import os

    from ..profiles.probe.unitreads import first_layers, measure

    flights = tuple(sorted({1, 2, 4} | ({run_way[1]} if run_way else set())))
    reads = measure(directory, first_layers(units, SAMPLE_LAYERS_BYTES), 0, hasattr(os, "O_DIRECT"), flights)
    if reads is None:
        return None
    best = max(reads.rows, key=lambda r: r.bps)
    found = {
        "bps": round(best.bps),
        "bytes": best.bytes,
        "units": reads.units,
        "how": f"{'O_DIRECT' if best.direct else 'buffered'} x{best.in_flight}, best of {len(reads.rows)} ways",
    }
    same = next((r for r in reads.rows if run_way and (r.direct, r.in_flight) == run_way), None)
    if same is not None:
        way = f"{'O_DIRECT' if same.direct else 'buffered'} x{same.in_flight}"
        found["run_way"] = {"bps": round(same.bps), "how": f"{way}, the way the run read"}
    return found
