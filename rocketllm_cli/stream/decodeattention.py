"""A decode step's attention on the native kernels (knob decode_attention): transformers' own attention interface,
under a name of its own.

A decode step on the native kernels gives them the cores and torch one thread (threads.py native_pass), so torch's
SDPA reads each layer's whole KV cache on one core: the shared SmolLM2 on 2 cores went from 18 ms a token at 16
positions to 31 at 2,000, where llama.cpp went from 8 to 12. `rl_attend` (native/src/attend.h) computes the same
softmax(scale · q Kᵀ) V in fp32 on the kernels' pool, the cache split in chunks the cores share, reading transformers'
cache tensors in place. Only that case changes: one query position of one sequence that sees every key (no mask,
or one that hides none, as a sliding window's layer gets while its cache holds the window alone), fp32 on the CPU, of
a model whose products run on the native kernels. Every other call (a prefill, a batch, a mask that hides a key,
soft-capping, attention sinks, a value width unlike the key's) goes to transformers' SDPA function unchanged, and so
does every call of a model that never asked for this one. The masks are SDPA's own (the mask interface under the
same name).

    use_native_attention(model)   # '' once the text config's attention implementation is NAME, else why not
"""

from __future__ import annotations

import torch

from ..threads import COMPUTE_THREADS

NAME = "rocketllm_decode"
# keywords transformers passes that change what attention computes: any of them set sends the call to SDPA
_CHANGES = frozenset(("softcap", "s_aux", "sinks", "position_bias", "head_mask"))
_registered = False
_kernels = None  # the native kernels, found when a model first asks for this attention


def _register() -> None:
    global _registered
    if _registered:
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register(NAME, attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, sdpa_mask)
    _registered = True


def attention_path(model, wanted: str, native_products: bool) -> str:
    """How MODEL's decode steps attend, in words: "native" where WANTED (the knob) says so and its products run on
    the native kernels, else "torch" (and why, where native was wanted)."""
    if wanted != "native":
        return "torch"
    why = use_native_attention(model) if native_products else "its products are not on the native kernels"
    return f"torch ({why})" if why else "native"


def use_native_attention(model) -> str:
    """Route MODEL's text attention through `attention` where its modules ask transformers' interface for their
    function and it is SDPA now; '' when done, else why not (in words)."""
    text = model.config.get_text_config()
    current = getattr(text, "_attn_implementation", None)
    if current == NAME:
        return ""
    if current != "sdpa":
        return f"the model's attention is {current!r}, not sdpa"
    from ..native import kernels, why_not

    global _kernels
    _kernels = kernels()
    if _kernels is None:
        return f"no native kernels here ({why_not()})"
    _register()
    text._attn_implementation = NAME
    return ""


def _no_mask(mask, length: int) -> bool:
    """Whether MASK lets one query position see every one of LENGTH keys: None, or a [1, 1, 1, L] mask that hides
    none (a sliding window's layer, whose cache holds the window alone, is handed an all-true one)."""
    if mask is None:
        return True
    if mask.shape != (1, 1, 1, length):
        return False
    return bool(mask.all()) if mask.dtype == torch.bool else not bool(mask.any())  # float: 0 where visible


def _native_case(query, key, value, attention_mask, dropout, kwargs) -> bool:
    # each shape read once: a decode step calls this once a layer, right after a product has left the caches cold
    qs, ks, vs = query.shape, key.shape, value.shape
    return (
        not dropout
        and len(qs) == len(ks) == len(vs) == 4
        and qs[0] == 1
        and qs[2] == 1
        and query.dtype == key.dtype == value.dtype == torch.float32
        and query.is_cpu
        and ks[3] == vs[3] == qs[3]
        and ks[2] == vs[2]
        and qs[1] % ks[1] == 0
        and query.stride(-1) == key.stride(-1) == value.stride(-1) == 1
        and all(kwargs[name] is None for name in kwargs.keys() & _CHANGES)
        and _no_mask(attention_mask, ks[2])
    )


def attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):
    """transformers' attention function contract: query [1, H, 1, D], key and value [1, KH, L, D] -> ([1, 1, H, D],
    None) on the native kernels in the decode case, else exactly what SDPA's function returns."""
    if not _native_case(query, key, value, attention_mask, dropout, kwargs):
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
        )
    scale = query.shape[3] ** -0.5 if scaling is None else float(scaling)
    # a decode on the native kernels gives them the free cores (threads.py native_pass); else torch's count
    threads = COMPUTE_THREADS.native_threads() if COMPUTE_THREADS.native_pass else None
    return _kernels.attend_heads(
        query, key, value, scale, torch.get_num_threads() if threads is None else threads
    ), None
