"""What a model's cache is made of and what can be done to it: the layer kinds transformers would build and which
of them a prefix can be cropped from (asked without running it: reuse.py and speculate.py decide from the same
answer), and a cache's layers, length, cropping and bytes (what prefix.py keeps and restores)."""

from __future__ import annotations

# cache layers crop() handles (a DummyLayer holds nothing)
CROPPABLE = frozenset({"DynamicLayer", "DynamicSlidingWindowLayer", "DummyLayer", "AppendLayer"})


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


def output_cache(output):
    """The cache a `return_dict_in_generate=True` output carries (named `cache` in 5.x, `past_key_values` before)."""
    for name in ("cache", "past_key_values"):
        value = getattr(output, name, None)
        if value is not None:
            return value
    return None


def _layers(cache) -> list[tuple[object, str, str]] | None:
    """(holder, keys attribute, values attribute) per layer, or None for a cache of another kind."""
    layers = getattr(cache, "layers", None)
    if layers is not None:
        return [(layer, "keys", "values") for layer in layers]
    if hasattr(cache, "key_cache") and hasattr(cache, "value_cache"):  # transformers before the layered caches
        return [(_ListSlot(cache, i), "keys", "values") for i in range(len(cache.key_cache))]
    return None


class _ListSlot:
    """One layer of a pre-4.56 DynamicCache, seen through the attribute names of a layer object."""

    def __init__(self, cache, index: int) -> None:
        self._cache, self._index = cache, index

    @property
    def keys(self):
        return self._cache.key_cache[self._index]

    @keys.setter
    def keys(self, value):
        self._cache.key_cache[self._index] = value

    @property
    def values(self):
        return self._cache.value_cache[self._index]

    @values.setter
    def values(self, value):
        self._cache.value_cache[self._index] = value


def supported(cache) -> tuple[bool, str]:
    """Whether caches of this kind can be cropped back to a shorter prefix and restored."""
    if type(cache).__name__ == "QuantizedKVCache":
        if getattr(cache, "is_int4", False):
            return False, (
                "an int4 KV cache's quantized blocks and full-precision window depend on its length, so it cannot be "
                "cropped to a shorter prefix: its entries are kept at exactly their length (mode exact)"
            )
        return True, ""  # another float dtype: its layers crop as a DynamicCache's do
    if type(cache).__name__ != "DynamicCache":
        return False, f"the model's cache is a {type(cache).__name__}, not a DynamicCache"
    layers = getattr(cache, "layers", None)
    if layers is not None:
        other = {type(layer).__name__ for layer in layers} - CROPPABLE
        if other:
            return False, f"the model has {', '.join(sorted(other))} cache layers, which cannot be cropped back"
        return True, ""
    if _layers(cache) is None:
        return False, "the cache layout of this transformers version is not known"
    return True, ""


def holds_every_token(cache) -> bool:
    """False once a sliding-window layer has dropped tokens that fell out of its window: it cannot be cropped back."""
    for layer in getattr(cache, "layers", None) or ():
        if getattr(layer, "sliding_window", None) is None:
            continue
        keys = getattr(layer, "keys", None)
        seen = getattr(layer, "cumulative_length", None)
        if keys is None or seen is None or keys.shape[-2] != seen:
            return False
    return True


def seq_length(cache) -> int:
    return int(cache.get_seq_length())


def crop(cache, length: int) -> None:
    """Crop to exactly `length` tokens and compact (a slice keeps the whole tensor alive; a clone does not)."""
    for holder, k_attr, v_attr in _layers(cache) or ():
        keys, values = getattr(holder, k_attr), getattr(holder, v_attr)
        if keys is None or getattr(keys, "numel", lambda: 0)() == 0:
            continue
        setattr(holder, k_attr, keys[..., :length, :].clone())
        setattr(holder, v_attr, values[..., :length, :].clone())
        if hasattr(holder, "release_spare"):  # an AppendLayer's buffers, which the clones no longer view
            holder.release_spare()
    if hasattr(cache, "_seen_tokens"):  # transformers < 4.56 counts tokens separately
        cache._seen_tokens = length
    for layer in getattr(cache, "layers", None) or ():
        if hasattr(layer, "cumulative_length"):
            layer.cumulative_length = length


def nbytes(cache) -> int:
    """Bytes of every tensor the cache holds: keys and values, and the states of layers that keep them."""
    layers = getattr(cache, "layers", None)
    if layers is None:  # a pre-4.56 DynamicCache: its key and value lists
        return sum(_size(t) for name in ("key_cache", "value_cache") for t in getattr(cache, name, ()))
    seen: set[int] = set()
    total = 0
    for owner in (*layers, cache):
        held = owner.tensors() if hasattr(owner, "tensors") else None  # an int4 layer: codes, scales, window
        for name, value in ({"tensors": held} if held is not None else vars(owner)).items():
            items = (
                value.values()
                if isinstance(value, dict)
                else value
                if isinstance(value, (list, tuple)) and name != "layers"
                else (value,)
            )
            for t in items:
                if hasattr(t, "element_size") and id(t) not in seen:  # one tensor may be a layer's keys and its values
                    seen.add(id(t))
                    total += _size(t)
    return total


def _size(t) -> int:
    return t.numel() * t.element_size() if hasattr(t, "element_size") else 0
