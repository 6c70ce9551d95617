"""Which prefix reuse a model's cache allows, decided from the cache transformers builds for it, never from its name.

A KV layer (full attention, a sliding window still within its window, a layer that holds nothing) keeps one entry
per token, so it can be cropped to any shorter prefix: mode "blocks". An int4 KV cache cannot (which tokens are int4
depends on the length): mode "exact" keeps it as it stood at a length, for prompts that extend those tokens. A layer
that keeps a recurrent or convolution
state (Mamba, linear attention, LFM2's short convolutions ...) holds the state after every token it has seen, and no
crop gives an earlier one back: such a cache is valid only for a prompt that extends what it holds exactly, which is
what a conversation's next turn does (mode "extend"). That needs the model's forward to continue a kept state over
several new tokens as a fresh prefill would, so a probe checks it once on the model itself; where it does not
(transformers' Mamba scan starts from a zero state whenever more than one token comes in), reuse is off, and
the reason says why.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from .cachekinds import CROPPABLE, declared_kinds, layer_kinds, linear_only
from .endtokens import pad_token_id

STATES = ("conv_states", "recurrent_states")  # what transformers' linear-attention cache layers keep
PROBE_PREFIX, PROBE_NEW = 13, 7  # tokens the probe keeps, then extends by (odd: no chunk boundary lines up)
TOLERANCE = {torch.float32: 1e-3, torch.float64: 1e-6}  # max logit change / max |logit| a continuation may show
HALF_TOLERANCE = 3e-2  # 16-bit compute


@dataclass(frozen=True)
class Reuse:
    mode: str | None  # "blocks", "extend", or None: prefix reuse is off for this model
    reason: str = ""  # why (for "extend" and None)


EXACT_REASON = (
    "an int4 KV cache's int4 blocks and full-precision window depend on its length, so a prompt's cache is kept as it "
    "stood once the prompt was in, and a reply's as the generation left it, never cropped; a prompt reuses one only "
    "when it extends its tokens"
)


def reuse_for(model) -> Reuse:
    """The reuse MODEL's cache allows: exact for an int4 KV cache, blocks for KV caches (read from the config), else
    what a probe finds."""
    own = getattr(model, "new_kv_cache", None)  # a StreamingModel whose kv_cache_dtype is not the compute dtype's
    kv = own() if callable(own) else None
    if kv is not None:
        return Reuse("exact", EXACT_REASON) if getattr(kv, "is_int4", False) else Reuse("blocks")
    kinds = declared_kinds(model)
    if kinds is not None and kinds <= CROPPABLE:
        return Reuse("blocks")
    try:
        return _probe(model)
    except Exception as exc:  # noqa: BLE001 - whatever fails here makes reuse unsafe, not the server
        return Reuse(
            None,
            f"continuing a kept cache fails on this model ({type(exc).__name__}: {' '.join(str(exc).split())[:120]})",
        )


def _probe(model) -> Reuse:
    """Keep the cache of PROBE_PREFIX tokens, extend it by PROBE_NEW, and compare with a fresh prefill of them all;
    then change each kind of kept state: a forward that continues the state gives other logits."""
    vocab = int(model.config.get_text_config(decoder=True).vocab_size)
    ids = torch.randint(0, vocab, (1, PROBE_PREFIX + PROBE_NEW), generator=torch.Generator().manual_seed(0))
    kept = _output(model, ids[:, :PROBE_PREFIX])
    from .cachekinds import output_cache, supported

    cache = output_cache(kept)
    kinds = layer_kinds(cache)
    if cache is None:
        return Reuse(None, "transformers' generate hands no cache back for this model, so there is none to keep")
    if kinds is None:
        return Reuse(
            None,
            f"the model keeps its cache in a {type(cache).__name__}, not a transformers cache of "
            f"layers, "
            "so it cannot be kept and restored",
        )
    if kinds <= CROPPABLE and supported(cache)[0]:
        return Reuse("blocks")
    stateful = sorted(kinds - CROPPABLE)
    fresh = _logits(model, ids)
    extended = _logits(model, ids, cache)
    scale = float(fresh.abs().max()) or 1.0
    change = float((extended - fresh).abs().max()) / scale
    limit = TOLERANCE.get(getattr(model, "dtype", None), HALF_TOLERANCE)
    what = (
        f"the model's cache has {', '.join(stateful)} layers, whose state"
        if stateful
        else f"the model's cache is a {type(cache).__name__}, which"
    ) + " cannot be cropped back to a shorter prefix"
    if not change <= limit:
        return Reuse(
            None,
            f"{what}, and continuing a kept state over {PROBE_NEW} new tokens gives other logits than a fresh prefill "
            f"(by {change:.2g} of their scale)",
        )
    for state in _states(cache):
        if torch.equal(_logits(model, ids, _perturbed(cache, state)), extended):
            return Reuse(
                None,
                f"{what}, and the model's forward does not read its kept {state} when several new "
                f"tokens "
                "follow them (it starts from a fresh state)",
            )
    return Reuse(
        "extend", f"{what}: a prompt reuses a kept one only when it extends it exactly (a conversation's next turn)"
    )


def _output(model, ids: torch.Tensor, cache=None):
    """generate() of one greedy token, as the generation loop calls it (a kept cache under its keyword)."""
    from ..stream.kvcache import generate_cache_kwarg

    extra = {}
    if cache is not None:
        extra[generate_cache_kwarg()] = copy.deepcopy(cache)
        if linear_only(cache):
            ids = ids[:, PROBE_PREFIX:]
    device = getattr(model, "device", None) or torch.device("cpu")
    with torch.inference_mode():
        return model.generate(
            ids.to(device),
            attention_mask=torch.ones_like(ids).to(device),
            max_new_tokens=1,
            do_sample=False,
            pad_token_id=pad_token_id(model),
            return_dict_in_generate=True,
            output_logits=True,
            **extra,
        )


def _logits(model, ids: torch.Tensor, cache=None) -> torch.Tensor:
    return _output(model, ids, cache).logits[0][0].float()


def _states(cache) -> list[str]:
    """The kinds of state CACHE keeps: transformers' layer states (STATES), and lists of tensors held by the cache
    object itself (MiniMax keeps its linear attention's state so)."""
    names = [s for s in STATES if any(_tensors(getattr(layer, s, None)) for layer in cache.layers)]
    return names + [k for k, v in vars(cache).items() if k != "layers" and isinstance(v, (list, tuple)) and _tensors(v)]


def _tensors(holder) -> list[torch.Tensor]:
    values = holder.values() if isinstance(holder, dict) else holder if isinstance(holder, (list, tuple)) else ()
    return [t for t in values if isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel()]


def _perturbed(cache, state: str):
    """A copy of CACHE with every tensor of STATE moved away from its value."""
    changed = copy.deepcopy(cache)
    holders = (
        [getattr(layer, state, None) for layer in changed.layers] if state in STATES else [getattr(changed, state)]
    )
    for holder in holders:
        for tensor in _tensors(holder):
            tensor.add_(1.0)
    return changed


def prefix_cache_for(model, max_bytes: int):
    """A PrefixCache in the mode MODEL's cache allows; where it allows none, one that keeps nothing and says why."""
    from .prefix import PrefixCache

    reuse = reuse_for(model)
    cache = PrefixCache(max_bytes, mode=reuse.mode or "blocks")
    cache.disabled_reason = "" if reuse.mode else reuse.reason
    return cache
