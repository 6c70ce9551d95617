"""What the knob formulas and the cost model need to know about a model."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class ModelFacts:
    """Sizes of a model as stored in its shards (or as described by --model-size/--weight-bits)."""

    name: str
    total_bytes: int  # all weights, as stored
    num_layers: int  # decoder layers in the repeated stack
    layer_bytes: int  # the largest decoder layer
    largest_unit_bytes: int  # the largest unit of any kind (a layer, embed, lm_head ...)
    non_layer_bytes: int  # embed, norm, lm_head and extras together
    kv_bytes_per_token: int  # K and V for every layer, per token, in the compute dtype
    max_positions: int  # the context the config allows
    dtype: str = "bf16"
    active_bytes: int | None = None  # mixture-of-experts: what one decode token reads (dense part + routed experts); None = every weight

    @property
    def bytes_per_token(self) -> int:
        return self.active_bytes if self.active_bytes is not None else self.total_bytes

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_size(cls, params: float, weight_bits: float, name: str | None = None) -> "ModelFacts":
        """Rough facts for a dense decoder of `params` parameters (doctor --model-size 70B --weight-bits 4).

        Shape rules of thumb from Llama-family models: layers = 20 * (params/1e9) ** 0.28 rounded,
        embed + head ~ 2 * vocab (128k) * hidden, KV per token with grouped-query attention (8 KV heads, head 128).
        """
        total = int(params * weight_bits / 8)
        num_layers = max(1, round(20 * (params / 1e9) ** 0.28))
        hidden = max(256, int((params / (12 * num_layers)) ** 0.5) // 128 * 128)
        non_layer = int(2 * 128_256 * hidden * weight_bits / 8)
        layer = max(1, (total - non_layer) // num_layers)
        kv = num_layers * 2 * 8 * 128 * 2
        return cls(
            name=name or f"{params / 1e9:g}B@{weight_bits:g}bit",
            total_bytes=total,
            num_layers=num_layers,
            layer_bytes=layer,
            largest_unit_bytes=max(layer, non_layer // 2),
            non_layer_bytes=non_layer,
            kv_bytes_per_token=kv,
            max_positions=131_072,
            dtype=f"{weight_bits:g}bit",
        )


_SUFFIXES = {"": 1, "k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}


def parse_param_count(text: str) -> float:
    """'70B', '7.5b', '135M', '1e9' -> parameters; ValueError naming the accepted forms."""
    raw = str(text).strip().lower()
    suffix = raw[-1:] if raw[-1:] in _SUFFIXES and raw[-1:].isalpha() else ""
    try:
        value = float(raw[: len(raw) - len(suffix)]) * _SUFFIXES[suffix]
    except ValueError:
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise ValueError(f"cannot read {text!r} as a parameter count; expected a positive number with an optional K/M/B/T suffix, e.g. 70B, 7.5B, 135M")
    return value
