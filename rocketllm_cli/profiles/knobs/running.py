"""The knobs of how a pass computes and a generation runs: compute dtype and kernel, decode graphs, the prefix
cache, speculation and its draft, the reply length a request that sets none gets, the expert cache, pipeline stages."""

from __future__ import annotations

import math

from ...replies import DEFAULT_REPLY_TOKENS
from .derivation import (
    DEFAULT_DRAFT_TOKENS,
    DEFAULT_EXPERT_CACHE_POLICY,
    FALLBACK_COMPUTE_DTYPE,
    Context,
    Derivation,
)
from .table import NATIVE_ATTENTION_KERNELS


def compute_dtype(c: Context) -> Derivation:
    cap = c.profile.capabilities.get("compute_dtype")
    if cap is None:
        return Derivation.default(repr(FALLBACK_COMPUTE_DTYPE), "compute dtype capability was not measured")
    return Derivation("decided_dtype", {"decided_dtype": cap.value}, note=cap.reason)


def kernel(c: Context) -> Derivation:
    inputs: dict = {"device_kind": c.profile.compute_device.split(":")[0]}
    formula = "'int16' if device_kind == 'cpu' else 'exact'"
    if c.model is not None:  # a set without GGUF blocks has nothing the native kernels compute on
        inputs["gguf_blocks"] = int(bool(c.model.gguf_blocks))
        formula = "'int16' if device_kind == 'cpu' and gguf_blocks else 'exact'"
    return Derivation(
        formula,
        inputs,
        note="int16: a GGUF type's own blocks times activations held to 16 bits per 32 values (~2e-5 relative error "
        "per product, 1.1-2.1x the exact kernels' rate; mean KL against exact under 1e-6 nats per token on real "
        "models, `bench --perplexity --reference` measures it); exact multiplies fp32 activations, int8 is faster "
        "still at ~5e-3; other packed Linears compute in the compute dtype either way, and torch trades that for "
        "speed where its low-bit kernel runs faster in another dtype (bf16 on x86)",
    )


def decode_attention(c: Context) -> Derivation:
    return Derivation(
        f"'native' if kernel in {NATIVE_ATTENTION_KERNELS!r} else 'torch'",
        {"kernel": c.values["kernel"]},
        note="a decode on the native kernels gives them the cores and torch one thread: SDPA then reads each layer's "
        "KV cache on one core (SmolLM2 135M on 2 cores, 18 ms a token at 16 positions, 31 at 2,000); the native "
        "attention computes the same fp32 softmax (errors ~1e-6 relative, as SDPA's) with the cache split between "
        "the cores; exact keeps transformers' own SDPA",
    )


GRAPH_MIN_RUN_TOKENS = 256  # a one-shot run shorter than this does not earn back the compile (tens of seconds)


def decode_graphs(c: Context) -> Derivation:
    if c.model is None:
        return Derivation.default("'auto'", "needs a model (missing total_bytes): on where a CUDA GPU holds every unit")
    inputs = {
        "device_kind": c.profile.compute_device.split(":")[0],
        "device_cache_bytes": c.values["device_cache_bytes"],
        "total_bytes": c.model.total_bytes,
        "run_tokens": c.run_tokens or 0,
        "min_run_tokens": GRAPH_MIN_RUN_TOKENS,
    }
    return Derivation(
        "'on' if device_kind == 'cuda' and device_cache_bytes >= total_bytes and "
        "(run_tokens == 0 or run_tokens >= min_run_tokens) else 'off'",
        inputs,
        note="a resident decode step is hundreds of kernel launches: as CUDA graphs the GPU, not Python, bounds it; "
        "run_tokens 0 is a server or session, whose first request pays the compile once",
    )


def prefix_cache(c: Context) -> Derivation:
    return Derivation.default("'auto'", "reuse the KV cache when a prompt repeats a cached prefix")


def draft_model(c: Context) -> Derivation:
    return Derivation.default("None", "no draft model: speculation drafts by prompt lookup")


def speculate(c: Context) -> Derivation:
    if c.model is None:
        return Derivation.default(
            "'auto'",
            "needs a model (missing total_bytes): on where layers stream, off where every unit is resident",
        )
    # On a CPU the host tier is the page cache mapped zero-copy: a pass from it costs compute, like a resident one.
    inputs = {
        "draft_model": c.values["draft_model"],
        "device_cache_bytes": c.values["device_cache_bytes"],
        "host_tier_is_memory": int(c.unified),
        "host_cache_bytes": c.values["host_cache_bytes"],
        "total_bytes": c.model.total_bytes,
    }
    return Derivation(
        "('draft' if draft_model else 'prompt-lookup') if device_cache_bytes + host_tier_is_memory * host_cache_bytes "
        "< total_bytes else 'off'",
        inputs,
        note="a pass that streams layers costs the bytes it moves whatever its tokens, so verifying drafted tokens is "
        "nearly free; where every unit is in memory a pass costs its compute, which grows with its tokens",
    )


def draft_tokens(c: Context) -> Derivation:
    return Derivation.default(
        str(DEFAULT_DRAFT_TOKENS),
        "tokens drafted per pass (a drafted run longer than what is accepted costs only its share of one pass's "
        "compute)",
    )


REPLY_BUDGET_S = 60  # what a request that gives no max_tokens may run for, at the projected speed


REPLY_TOKENS_MIN, REPLY_TOKENS_MAX = 64, 2048


def default_max_tokens(c: Context) -> Derivation:
    """The reply length `serve` gives a request that sets none: what the cost model projects fits in a minute, within
    [64, 2048] and the context (a reply with no bound ran for 12 minutes of noise on a streamed model)."""
    from ..cost import project

    bounds = {"reply_budget_s": REPLY_BUDGET_S, "min_tokens": REPLY_TOKENS_MIN, "max_tokens": REPLY_TOKENS_MAX}
    if c.model is None:
        return Derivation.default(str(DEFAULT_REPLY_TOKENS), "needs a model to project its speed: pass --model")
    v = c.values
    device = min(c.model.total_bytes, int(v["device_cache_bytes"] or 0))
    host = min(c.model.total_bytes - device, int(v["host_cache_bytes"] or 0))
    projection = project(
        c.profile, c.model, {"device": device, "host": host, "storage": c.model.total_bytes - device - host}
    )
    seconds = projection.overlapped_seconds or projection.serial_seconds
    # six significant digits, not decimals: a small model on a fast GPU projects well under a microsecond a token
    seconds = float(f"{seconds:.6g}") if seconds and math.isfinite(seconds) else 0.0
    if seconds <= 0:
        return Derivation.default(
            str(DEFAULT_REPLY_TOKENS), f"no projected speed ({projection.reason or 'unmeasured'})"
        )
    inputs = {
        **bounds,
        "seconds_per_token": seconds,
        "max_context": v["max_context"] if v["max_context"] is not None else 1 << 30,
    }
    return Derivation(
        "min(max_context, max(min_tokens, min(max_tokens, floor(reply_budget_s / seconds_per_token))))",
        inputs,
        note="the cost model's projected seconds per token at this residency; a request's max_tokens wins",
    )


def expert_cache_policy(c: Context) -> Derivation:
    return Derivation.default(
        repr(DEFAULT_EXPERT_CACHE_POLICY),
        "measured: a decode pass walks the layers in a cycle, so LRU with room for fewer experts "
        "than one pass routes evicts each just before its layer comes round again (docs/ARCHITECTURE.md)",
    )


# a pass streaming a large model from disk takes seconds; a heartbeat comes every timeout / 8
DEFAULT_STAGE_TIMEOUT_S = 30


def stages(c: Context) -> Derivation:
    return Derivation.default(
        "'auto'",
        "under torchrun, contiguous layer ranges that minimise the slowest stage's projected seconds per token, from "
        "every rank's own profile and measured link (distributed/stageplan.py)",
    )


def stage_timeout_s(c: Context) -> Derivation:
    return Derivation.default(
        str(DEFAULT_STAGE_TIMEOUT_S),
        "a rank whose heartbeat has not moved this long is stopped or hung: the command exits naming it, the server "
        "answers 503",
    )
