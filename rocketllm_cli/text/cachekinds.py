"""What a model's cache is made of, asked without running it: the layer kinds transformers would build and which of
them a prefix can be cropped from (prefix.py crops, reuse.py and speculate.py decide from the same answer)."""

from __future__ import annotations

# cache layers prefix.crop handles (a DummyLayer holds nothing)
CROPPABLE = frozenset({"DynamicLayer", "DynamicSlidingWindowLayer", "DummyLayer"})


def layer_kinds(cache) -> set[str] | None:
    """The class names of a cache's layers (None for a cache without layers: a list, a legacy cache)."""
    layers = getattr(cache, "layers", None)
    return None if layers is None else {type(layer).__name__ for layer in layers}


def declared_kinds(model) -> set[str] | None:
    """The layer kinds of the DynamicCache transformers' generate would build for MODEL, without running it;
    None when the model builds a cache of its own or this transformers cannot say."""
    supports = getattr(model, "_supports_default_dynamic_cache", None)
    if supports is not None and not supports():
        return None
    try:
        from transformers import DynamicCache

        return layer_kinds(DynamicCache(config=model.config.get_text_config(decoder=True)))
    except Exception:  # noqa: BLE001 - a transformers whose DynamicCache takes no config: the probe finds out
        return None


def linear_only(cache) -> bool:
    """transformers' generate cannot tell how many tokens CACHE has seen, so it is given only the tokens after them:
    every layer keeps a state, none a KV, and the cache cannot count its tokens (get_seq_length raises for such a
    cache up to transformers 5.24). A cache that counts them is given the whole prompt, as one with an attention
    layer is: generate slices off what it holds itself, and would slice the new tokens alone down to their last few."""
    flags = getattr(cache, "is_linear", None)
    if not (bool(flags) and all(flags)):
        return False
    try:
        return int(cache.get_seq_length()) <= 0
    except Exception:  # noqa: BLE001 - 'can only be called on Attention layers': generate does not count them either
        return True
