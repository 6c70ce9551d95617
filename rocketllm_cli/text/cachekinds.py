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
    """Every layer keeps a state and none a KV: transformers' generate cannot tell how many tokens such a cache has
    seen, so it is given only the tokens after them (a cache with an attention layer is given the whole prompt)."""
    flags = getattr(cache, "is_linear", None)
    return bool(flags) and all(flags)
