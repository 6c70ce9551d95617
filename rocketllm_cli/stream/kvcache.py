"""KV caches that store keys and values in something other than the compute dtype: int4, or another float dtype.

int4 (KIVI's layout, written here in torch: transformers' QuantizedCache needs quanto or hqq):

    keys   [B, H, T, D] -> per channel: a scale and a minimum (fp16) per group of G tokens and channel
    values [B, H, T, D] -> per token: a scale and a minimum per group of G channels (a whole head when shorter)
    codes: asymmetric 4-bit, two per byte along D

The most recent tokens stay in the compute dtype (the residual window). Which tokens are quantized is a function
of the length alone: q(L) = G * floor((L - R) / G) for L >= R + G, else 0, so the window holds R to R + G - 1
tokens (R = kv_residual_tokens). Attention always reads what the cache holds: every key and value before q(L)
as its int4 value, in the very pass that quantized it (a single-pass perplexity therefore sees more int4 than a
decode, never less).

crop (speculative rollback): tokens in the window are dropped exactly. Once past recording is on (transformers 5's
assisted generation calls `activate_past_recording()`; a speculative loop of its own calls it too), the last
quantized block keeps a full-precision copy, so a crop that reaches back into it (a rollback of fewer than G tokens
after a pass that quantized a block) restores the very state a cache of that length holds. Without it, or deeper,
the blocks' int4 values go back into the window: the layout is that of the length, the values int4 (re-quantized
as the window fills again), and the layer is no longer `exact`.

Prefix cache (text/prefix.py, mode "exact"): which tokens are int4 depends on the length, so a cache is kept only as
it stood at exactly its length (`snapshot()`, or the cache a generation left), never cropped from a longer one.

Works with transformers 5.x and 4.56+ (both have layered caches; signatures that differ are taken both ways).
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicLayer

from ..dtypes import KV_INT4_GROUP, torch_dtype
from ..errors import ParameterError
from .int4codes import SCALE_DTYPE, dequantize_keys, dequantize_values, quantize_keys, quantize_values

FULL_ATTENTION = {"full_attention", "attention", "global_attention"}


def generate_cache_kwarg() -> str:
    """The keyword transformers' generate takes a cache under: `cache` from 5.x on, `past_key_values` before."""
    from transformers.generation.utils import GenerateDecoderOnlyOutput

    return "cache" if "cache" in getattr(GenerateDecoderOnlyOutput, "__dataclass_fields__", {}) else "past_key_values"


def refusal(config, kv_dtype: str) -> str:
    """Why this model cannot store its KV in `kv_dtype` with these caches ('' when it can)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    types = set(getattr(text, "layer_types", None) or ())
    if types - FULL_ATTENTION:
        return (
            f"an {kv_dtype} KV cache needs every layer to be full attention, and this model has "
            f"{', '.join(sorted(types - FULL_ATTENTION))} layers; use {{kv_cache_dtype}} auto"
        )
    if getattr(text, "sliding_window", None) and getattr(text, "use_sliding_window", True) is not False and not types:
        return (
            f"a {kv_dtype} KV cache does not apply a sliding window, which this model's config sets; use "
            f"{{kv_cache_dtype}} auto"
        )
    if kv_dtype == "int4" and _head_dim(text) % 2:
        return "an int4 KV cache packs two codes a byte and needs an even head dimension; use {kv_cache_dtype} auto"
    return ""


def make_cache(config, kv_dtype: str, compute_dtype: torch.dtype, residual_tokens: int):
    """A fresh cache storing KV as `kv_dtype` ('int4', 'bf16' ...), or None where the compute dtype's own cache does."""
    if kv_dtype in ("", "auto") or (kv_dtype != "int4" and torch_dtype(kv_dtype) == compute_dtype):
        return None
    why = refusal(config, kv_dtype)
    if why:
        raise ParameterError(why, "kv_cache_dtype")
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    layers = int(text.num_hidden_layers)
    if kv_dtype == "int4":
        return QuantizedKVCache([Int4Layer(residual_tokens) for _ in range(layers)])
    return QuantizedKVCache([CastLayer(torch_dtype(kv_dtype)) for _ in range(layers)])


def cache_bytes(cache) -> int:
    """Bytes a cache holds (every tensor of every layer; an int4 layer's codes, scales and window)."""
    total = 0
    for layer in getattr(cache, "layers", ()):
        tensors = (
            layer.tensors()
            if hasattr(layer, "tensors")
            else (getattr(layer, "keys", None), getattr(layer, "values", None))
        )
        total += sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))
    return total


def head_dim(config) -> int:
    """The attention head dimension of a model's (text) config."""
    return _head_dim(config.get_text_config() if hasattr(config, "get_text_config") else config)


def _head_dim(text) -> int:
    heads = getattr(text, "num_attention_heads", 0) or 1
    return int(getattr(text, "head_dim", None) or getattr(text, "hidden_size", 0) // heads)


def _crop_target(layer, arg: int) -> int:
    """The length `crop(arg)` asks for: 5.x passes -tokens_to_remove; 4.x a length (negative: tokens to remove)."""
    length = layer.get_seq_length()
    return max(0, length + arg) if arg < 0 else (length if arg == 0 else min(length, arg))


def _mask_sizes(layer, query) -> tuple[int, int]:
    # 5.x passes the query length, 4.x the cache positions
    q = query if isinstance(query, int) else int(query.shape[0])
    return layer.get_seq_length() + q, 0


class QuantizedKVCache(Cache):
    """A cache of given layers (Int4Layer or CastLayer), one per decoder layer."""

    def __init__(self, layers: list) -> None:
        super().__init__(layers=layers)

    # transformers 4.x has no such call; 5.x's loops over the layers too
    def activate_past_recording(self, **kwargs) -> None:
        # 5.25 and later pass recurrent_states_to_keep (for layers that keep a recurrent state): taken and passed on
        for layer in self.layers:
            if hasattr(layer, "activate_past_recording"):
                layer.activate_past_recording(**kwargs)

    @property
    def is_int4(self) -> bool:
        return any(isinstance(layer, Int4Layer) for layer in self.layers)

    @property
    def exact(self) -> bool:
        """Every layer holds what a cache fed only this far holds (False once a crop put int4 values back in a
        window)."""
        return all(getattr(layer, "exact", True) for layer in self.layers)

    def snapshot(self) -> QuantizedKVCache:
        """A copy of what the cache holds at this length, without the full-precision block kept for rollbacks."""
        import copy

        held = copy.deepcopy(self)
        held.forget_past()
        return held

    def forget_past(self) -> None:
        """Drop the full-precision copies kept for speculative rollbacks (a kept prefix is never rolled back)."""
        for layer in self.layers:
            if isinstance(layer, Int4Layer):
                layer.shadow, layer.record_past = None, False


class CastLayer(DynamicLayer):
    """Keys and values stored in another float dtype (bf16 beside fp32 compute), handed to attention in the compute
    dtype."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.store_dtype = dtype

    def lazy_initialization(self, key_states, value_states=None) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.keys = torch.tensor([], dtype=self.store_dtype, device=self.device)
        self.values = torch.tensor([], dtype=self.store_dtype, device=self.device)
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.keys = torch.cat([self.keys, key_states.to(self.store_dtype)], dim=-2)
        self.values = torch.cat([self.values, value_states.to(self.store_dtype)], dim=-2)
        return self.keys.to(key_states.dtype), self.values.to(value_states.dtype)

    def get_mask_sizes(self, query, *args) -> tuple[int, int]:
        return _mask_sizes(self, query)

    def get_max_cache_shape(self) -> int:  # 4.x
        return -1

    def crop(self, arg: int) -> None:
        if self.is_initialized:
            keep = _crop_target(self, arg)
            self.keys, self.values = self.keys[..., :keep, :], self.values[..., :keep, :]


class Int4Layer(DynamicLayer):
    """One decoder layer's int4 KV: `keys`/`values` are the full-precision window [B, H, r, D]; the quantized
    tokens [0, quantized) are k_codes [B, H, Tq, D/2] with k_scale/k_min [B, H, Tq/G, D] (per channel, per G
    tokens) and v_codes [B, H, Tq, D/2] with v_scale/v_min [B, H, Tq, D/g] (per token, per g channels)."""

    is_sliding = False
    is_croppable = True  # exactly for rollbacks of fewer than G tokens; see the module's note

    def __init__(self, residual_tokens: int, group: int = KV_INT4_GROUP) -> None:
        super().__init__()
        self.residual_tokens, self.group = int(residual_tokens), int(group)
        self.quantized = 0
        self.k_codes = self.k_scale = self.k_min = self.v_codes = self.v_scale = self.v_min = None
        self.shadow = None  # (keys, values) of the last quantized block in full precision, kept while recording
        self.record_past = False
        self.exact = True  # False once a crop put a block's int4 values back into the window (see the module's note)

    def tensors(self) -> list[torch.Tensor]:
        shadow = list(self.shadow) if self.shadow is not None else []
        return [
            t
            for t in (
                self.keys,
                self.values,
                self.k_codes,
                self.k_scale,
                self.k_min,
                self.v_codes,
                self.v_scale,
                self.v_min,
                *shadow,
            )
            if t is not None
        ]

    def lazy_initialization(self, key_states, value_states=None) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        b, h, _, d = key_states.shape
        self.value_group = min(self.group, d)
        if d % self.value_group:
            self.value_group = d
        self.keys = key_states.new_empty((b, h, 0, d))
        self.values = (
            value_states.new_empty((b, h, 0, value_states.shape[-1])) if value_states is not None else self.keys
        )
        codes = torch.empty((b, h, 0, d // 2), dtype=torch.uint8, device=self.device)
        self.k_codes, self.v_codes = codes, codes.clone()
        self.k_scale = torch.empty((b, h, 0, d), dtype=SCALE_DTYPE, device=self.device)
        self.k_min = self.k_scale.clone()
        self.v_scale = torch.empty((b, h, 0, d // self.value_group), dtype=SCALE_DTYPE, device=self.device)
        self.v_min = self.v_scale.clone()
        self.is_initialized = True

    # -- what transformers calls ---------------------------------------------------------------
    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.keys = torch.cat([self.keys, key_states], dim=-2)
        self.values = torch.cat([self.values, value_states], dim=-2)
        self._quantize_full_blocks()
        return self._dequantized()

    def activate_past_recording(self, **kwargs) -> None:
        """Keep the last quantized block in full precision too (G tokens), so a rollback across it is exact. KWARGS
        (transformers 5.25's recurrent_states_to_keep) concern recurrent states, which a KV layer has none of."""
        self.record_past = True

    def get_seq_length(self) -> int:
        if not self.is_initialized:
            return 0
        return self.quantized + self.keys.shape[-2]

    def get_mask_sizes(self, query, *args) -> tuple[int, int]:
        return _mask_sizes(self, query)

    def get_max_length(self) -> int:  # 5.x
        return -1

    def get_max_cache_shape(self) -> int:  # 4.x
        return -1

    def reset(self) -> None:
        self.keys = self.values = None
        self.k_codes = self.k_scale = self.k_min = self.v_codes = self.v_scale = self.v_min = self.shadow = None
        self.quantized, self.is_initialized, self.exact = 0, False, True

    def crop(self, arg: int) -> None:
        if not self.is_initialized:
            return
        length = _crop_target(self, arg)
        target = self._quantized_at(length)
        while self.quantized > target:  # the blocks past q(length) go back into the window
            self._unquantize_last_block()
        keep = length - self.quantized
        self.keys, self.values = self.keys[..., :keep, :].clone(), self.values[..., :keep, :].clone()

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._map(lambda t: t[indices, ...])

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._map(lambda t: t.repeat_interleave(repeats, dim=0))

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._map(lambda t: t.index_select(0, beam_idx.to(t.device)))

    # -- the layout ---------------------------------------------------------------------------
    def _quantized_at(self, length: int) -> int:
        """q(L): how many leading tokens a cache of this length holds in int4."""
        r, g = self.residual_tokens, self.group
        return g * ((length - r) // g) if length >= r + g else 0

    def _quantize_full_blocks(self) -> None:
        take = self._quantized_at(self.get_seq_length()) - self.quantized
        if take <= 0:
            return
        k, v = self.keys[..., :take, :], self.values[..., :take, :]
        k_codes, k_scale, k_min = quantize_keys(k, self.group)
        v_codes, v_scale, v_min = quantize_values(v, self.value_group)
        self.k_codes = torch.cat([self.k_codes, k_codes], dim=-2)
        self.k_scale, self.k_min = torch.cat([self.k_scale, k_scale], dim=-2), torch.cat([self.k_min, k_min], dim=-2)
        self.v_codes = torch.cat([self.v_codes, v_codes], dim=-2)
        self.v_scale, self.v_min = torch.cat([self.v_scale, v_scale], dim=-2), torch.cat([self.v_min, v_min], dim=-2)
        self.shadow = (k[..., -self.group :, :].clone(), v[..., -self.group :, :].clone()) if self.record_past else None
        self.keys, self.values = self.keys[..., take:, :].clone(), self.values[..., take:, :].clone()
        self.quantized += take

    def _unquantize_last_block(self) -> None:
        g, start = self.group, self.quantized - self.group
        if self.shadow is not None:
            k, v = self.shadow
        else:  # lossy: the block's int4 values
            self.exact = False
            k = self.keys.new_empty((*self.keys.shape[:2], g, self.keys.shape[-1]))
            v = self.values.new_empty((*self.values.shape[:2], g, self.values.shape[-1]))
            dequantize_keys(k, self.k_codes[..., start:, :], self.k_scale[..., -1:, :], self.k_min[..., -1:, :], g)
            dequantize_values(
                v,
                self.v_codes[..., start:, :],
                self.v_scale[..., start:, :],
                self.v_min[..., start:, :],
                self.value_group,
            )
        self.shadow = None
        self.keys, self.values = torch.cat([k, self.keys], dim=-2), torch.cat([v, self.values], dim=-2)
        self.k_codes, self.v_codes = self.k_codes[..., :start, :], self.v_codes[..., :start, :]
        self.k_scale, self.k_min = self.k_scale[..., :-1, :], self.k_min[..., :-1, :]
        self.v_scale, self.v_min = self.v_scale[..., :start, :], self.v_min[..., :start, :]
        self.quantized = start

    def _dequantized(self) -> tuple[torch.Tensor, torch.Tensor]:
        """[int4 tokens dequantized | window], one tensor each, in the compute dtype."""
        q, r = self.quantized, self.keys.shape[-2]
        keys = self.keys.new_empty((*self.keys.shape[:2], q + r, self.keys.shape[-1]))
        values = self.values.new_empty((*self.values.shape[:2], q + r, self.values.shape[-1]))
        if q:
            dequantize_keys(keys[..., :q, :], self.k_codes, self.k_scale, self.k_min, self.group)
            dequantize_values(values[..., :q, :], self.v_codes, self.v_scale, self.v_min, self.value_group)
        keys[..., q:, :] = self.keys
        values[..., q:, :] = self.values
        return keys, values

    def _map(self, fn) -> None:
        if not self.is_initialized:
            return
        for name in ("keys", "values", "k_codes", "k_scale", "k_min", "v_codes", "v_scale", "v_min"):
            setattr(self, name, fn(getattr(self, name)))
        if self.shadow is not None:
            self.shadow = tuple(fn(t) for t in self.shadow)


# -- int4 codes ------------------------------------------------------------------------------------
