"""The default KV cache, appended to in place: keys and values are views of buffers grown STEP tokens at a time.

transformers' DynamicLayer appends a token by `torch.cat` of the whole cache, so every decode step copies every
layer's keys and values into fresh memory: O(context) bytes a token. With the C heap giving large blocks back to the
OS (heap.py), each copy also faults its pages in anew. The shared SmolLM2 at 2,000 tokens of context spent 33 ms a
token in those copies (97 ms/token against 20 at 16 tokens). AppendLayer writes the new tokens into spare room and
hands attention a view of the tokens held; a buffer is copied only when it fills, STEP tokens at a time, at most STEP
tokens of KV beyond what the cache holds. Same values, same tokens: attention reads the same keys and values.

Anything that replaces a layer's keys or values (a crop that compacts, a restored prefix, a reorder) is seen on the
next append (the keys are no longer a view of the buffer) and the buffer is made again from them. Models whose config
declares sliding-window or other non-full-attention layers keep transformers' own cache (appending_cache: None).
"""

from __future__ import annotations

import inspect

import torch
from transformers.cache_utils import DynamicLayer

_CACHE_KWARGS = ("cache", "past_key_values")  # what a forward and generate take a KV cache as (5.x, 4.x)
STEP = 256  # tokens a buffer grows by: the most KV held beyond the tokens, and how often a buffer is copied


class AppendLayer(DynamicLayer):
    """A DynamicLayer whose `keys` / `values` are prefixes of buffers with room for more tokens."""

    _kbuf: torch.Tensor | None = None
    _vbuf: torch.Tensor | None = None
    _kview: torch.Tensor | None = None  # the views of the buffers the last update handed out as keys and values
    _vview: torch.Tensor | None = None
    limit: int | None = None  # the tokens this cache is meant to hold (a generate call's prompt and new tokens)

    def lazy_initialization(self, key_states, value_states=None) -> None:  # transformers 4.x passes the keys alone
        self.dtype, self.device = key_states.dtype, key_states.device
        self.keys = torch.tensor([], dtype=key_states.dtype, device=self.device)
        self.values = torch.tensor(
            [], dtype=(key_states if value_states is None else value_states).dtype, device=self.device
        )
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        keys, new = self.keys, key_states.shape[-2]
        held = keys.shape[-2] if keys.dim() == key_states.dim() else 0
        total = held + new
        # The keys and values are still the views the last update handed out (nothing replaced them): only the room
        # and the new tokens' shape and dtype need checking. Else the full check, as after a crop or a restore.
        if not (keys is self._kview and self.values is self._vview and self._fits(total, key_states, value_states)):
            if not self._room_for(total, key_states, value_states):
                self._grow(held, total, key_states, value_states)
        kbuf, vbuf = self._kbuf, self._vbuf
        kbuf.narrow(-2, held, new).copy_(key_states)
        vbuf.narrow(-2, held, new).copy_(value_states)
        self.keys = self._kview = kbuf.narrow(-2, 0, total)
        self.values = self._vview = vbuf.narrow(-2, 0, total)
        return self.keys, self.values

    def release_spare(self) -> None:
        """Let the buffers go where the keys and values are no longer views of them (cachekinds.crop compacts)."""
        if self._kbuf is not None and not (_prefix_of(self.keys, self._kbuf) and _prefix_of(self.values, self._vbuf)):
            self._kbuf = self._vbuf = None

    def tensors(self) -> list[torch.Tensor]:
        """What the layer holds (cachekinds.nbytes): the buffers, or the keys and values where there are none."""
        if self._kbuf is not None and _prefix_of(self.keys, self._kbuf) and _prefix_of(self.values, self._vbuf):
            return [self._kbuf, self._vbuf]
        return [t for t in (getattr(self, "keys", None), getattr(self, "values", None)) if isinstance(t, torch.Tensor)]

    def _fits(self, total: int, key_states, value_states) -> bool:
        """Whether the buffers have room for TOTAL tokens of these keys' and values' dtype and leading shape."""
        k, v = self._kbuf, self._vbuf
        return (
            k is not None
            and total <= k.shape[-2]
            and k.dtype == key_states.dtype
            and v.dtype == value_states.dtype
            and k.shape[:-2] == key_states.shape[:-2]
            and v.shape[:-2] == value_states.shape[:-2]
        )

    def _room_for(self, total: int, key_states, value_states) -> bool:
        return (
            self._fits(total, key_states, value_states)
            and _prefix_of(self.keys, self._kbuf)
            and _prefix_of(self.values, self._vbuf)
        )

    def _grow(self, held: int, total: int, key_states, value_states) -> None:
        room = -(-(total + 1) // STEP) * STEP  # a STEP multiple with room for at least one more token
        if self.limit is not None and total <= self.limit:  # never past what the run was sized for (its KV budget)
            room = min(room, self.limit)
        k = key_states.new_empty((*key_states.shape[:-2], room, key_states.shape[-1]))
        v = value_states.new_empty((*value_states.shape[:-2], room, value_states.shape[-1]))
        if held:
            k[..., :held, :].copy_(self.keys)
            v[..., :held, :].copy_(self.values)
        self._kbuf, self._vbuf = k, v


def _prefix_of(view, buffer) -> bool:
    """Whether VIEW is buffer[..., :n, :] for some n (what update() left there, or a crop of it by slicing)."""
    return (
        isinstance(view, torch.Tensor)
        and view.dim() == buffer.dim()
        and view.data_ptr() == buffer.data_ptr()
        and view.stride() == buffer.stride()
        and view.shape[:-2] == buffer.shape[:-2]
        and view.shape[-1] == buffer.shape[-1]
    )


def appending_cache(config, tokens: int | None = None):
    """An empty DynamicCache whose layers are AppendLayers, or None (transformers builds its own) where the model has
    layers other than full attention, or this transformers' DynamicCache does not make its layers on demand. TOKENS:
    what the cache will hold (a prompt and its new tokens), which no buffer grows past while it suffices."""
    from transformers import DynamicCache

    from .kvcache import refusal

    if refusal(config, "appending") or getattr(config, "is_encoder_decoder", False):
        return None
    cache = DynamicCache()
    if getattr(cache, "layer_class_to_replicate", None) is not DynamicLayer or getattr(cache, "layers", None):
        return None

    def layer() -> AppendLayer:  # the cache calls it for each layer's first update
        made = AppendLayer()
        made.limit = tokens
        return made

    cache.layer_class_to_replicate = layer
    return cache


def needs_cache(model, kwargs) -> bool:
    """Whether a generate call of MODEL with KWARGS is to be handed a KV cache: none given, and the call keeps one (its
    own use_cache, else its generation config's, else the model's). A call that keeps none (MPT's config says so)
    recomputes the whole sequence each step; handed a cache anyway, it attended the cache's keys beside the recomputed
    ones and its tokens drifted from transformers'."""
    if any(kwargs.get(name) is not None for name in _CACHE_KWARGS) or not _takes_a_cache(model):
        return False
    if kwargs.get("use_cache") is not None:
        return bool(kwargs["use_cache"])
    config = kwargs.get("generation_config") or getattr(model, "generation_config", None)
    return getattr(config, "use_cache", True) is not False


def _takes_a_cache(model) -> bool:
    """Whether MODEL's forward takes a KV cache that a DynamicCache can be: GPT-1's forward takes none, and xLSTM,
    RWKV, Reformer and XLNet keep caches of their own (transformers' `_supports_default_dynamic_cache`)."""
    supports = getattr(model, "_supports_default_dynamic_cache", None)
    try:
        if supports is not None and not supports():
            return False
    except TypeError:  # another signature than transformers' classmethod of none: take the forward's word
        pass
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return True
    return any(name in params for name in _CACHE_KWARGS)


def run_tokens(args, kwargs) -> int | None:
    """A generate call's prompt length plus its max_new_tokens (what its cache holds at most), or None (unknown)."""
    ids = args[0] if args else kwargs.get("input_ids", kwargs.get("inputs"))
    new = kwargs.get("max_new_tokens")
    if new is None and kwargs.get("generation_config") is not None:
        new = getattr(kwargs["generation_config"], "max_new_tokens", None)
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or not isinstance(new, int):
        return None
    return int(ids.shape[1]) + new
