"""ModelFacts of a shard set: what the knob formulas and the cost model need to know."""

from __future__ import annotations

from ..dtypes import ITEMSIZE
from .manifest import Manifest
from .modelfacts import ModelFacts


def facts_from_manifest(manifest: Manifest, hf_config, compute_dtype: str | None = None) -> ModelFacts:
    text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    layers = manifest.layers
    heads = getattr(text, "num_attention_heads", 1) or 1
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    hidden = getattr(text, "hidden_size", 0) or 0
    head_dim = getattr(text, "head_dim", None) or (hidden // heads if heads else 0)
    itemsize = ITEMSIZE.get(compute_dtype or manifest.dtype, 2)
    kv_per_token = 2 * len(layers) * kv_heads * head_dim * itemsize  # K and V, every layer
    positions = getattr(text, "max_position_embeddings", None) or getattr(text, "n_positions", None) or 4096
    return ModelFacts(
        name=manifest.source.get("name", "model"),
        total_bytes=manifest.total_bytes,
        num_layers=len(layers),
        # a layer as stored: its dense part and all of its experts (what streaming it whole would read)
        layer_bytes=max(_stored_layer_bytes(manifest).values(), default=0),
        largest_unit_bytes=max((u.tensor_bytes for u in manifest.units), default=0),
        non_layer_bytes=sum(u.tensor_bytes for u in manifest.units if u.kind not in ("layer", "expert")),
        kv_bytes_per_token=int(kv_per_token),
        max_positions=int(positions),
        dtype=manifest.dtype,
        active_bytes=_active_bytes(manifest, hf_config),
    )


def _stored_layer_bytes(manifest: Manifest) -> dict[int, int]:
    """layer index -> its bytes as stored: the dense part and all of its experts."""
    out: dict[int, int] = {}
    for u in manifest.units:
        if u.kind in ("layer", "expert"):
            out[u.index] = out.get(u.index, 0) + u.tensor_bytes
    return out


def _active_bytes(manifest: Manifest, hf_config) -> int | None:
    """A mixture-of-experts decode token: every non-expert weight plus top-k experts in each layer that has experts."""
    if not manifest.experts:
        return None
    from .expertlayout import top_k

    k = top_k(hf_config) or 1
    dense = sum(u.tensor_bytes for u in manifest.units if u.kind != "expert")
    per_layer: dict[int, list[int]] = {}
    for u in manifest.experts:
        per_layer.setdefault(u.index, []).append(u.tensor_bytes)
    return dense + sum(min(k, len(sizes)) * sum(sizes) // len(sizes) for sizes in per_layer.values())
