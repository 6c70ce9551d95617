"""Every knob's derivation, in the order knobs are resolved: each may read the values resolved before it.

A derivation returns a Derivation (derivation.py): an expression and its inputs, whose value is the expression
evaluated on them, so a printed knob can always be recomputed from what was printed. The derivations live by what
they decide: memory.py (the reserve, the runtime, the KV cache and context, the weights' budgets, the floor),
reads.py (how streamed weights are read), running.py (how a pass computes and a generation runs).
"""

from __future__ import annotations

from .memory import (
    device_cache_bytes,
    host_cache_bytes,
    kv_cache_bytes,
    kv_cache_dtype,
    kv_residual_tokens,
    max_context,
    reserve_bytes,
    runtime_bytes,
)
from .reads import direct_io, io_workers, pin_memory, prefetch_depth
from .running import (
    compute_dtype,
    decode_attention,
    decode_graphs,
    default_max_tokens,
    draft_model,
    draft_tokens,
    expert_cache_policy,
    kernel,
    prefix_cache,
    speculate,
    stage_timeout_s,
    stages,
)

# Resolution order: each derivation may read the values resolved before it.
DERIVATIONS = {
    "reserve_bytes": reserve_bytes,
    "runtime_bytes": runtime_bytes,
    "compute_dtype": compute_dtype,
    "kernel": kernel,
    "decode_attention": decode_attention,
    "kv_cache_dtype": kv_cache_dtype,
    "kv_residual_tokens": kv_residual_tokens,
    "kv_cache_bytes": kv_cache_bytes,
    "direct_io": direct_io,
    "io_workers": io_workers,
    "prefetch_depth": prefetch_depth,
    "device_cache_bytes": device_cache_bytes,
    "host_cache_bytes": host_cache_bytes,
    "max_context": max_context,
    "pin_memory": pin_memory,
    "decode_graphs": decode_graphs,
    "prefix_cache": prefix_cache,
    "draft_model": draft_model,
    "speculate": speculate,
    "draft_tokens": draft_tokens,
    "expert_cache_policy": expert_cache_policy,
    "default_max_tokens": default_max_tokens,
    "stages": stages,
    "stage_timeout_s": stage_timeout_s,
}
