"""The architecture table and `config_for`: a transformers config of a named family and size.

Each row names a transformers model_type, the config keys of the shape knobs where
they differ from Llama's, the kwargs of its tiny test shape, and how it scales.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from .tensors import saved_tensors
from .tokenizer import SPECIAL_IDS

_LLAMA_NAMES = {
    "hidden": "hidden_size",
    "intermediate": "intermediate_size",
    "layers": "num_hidden_layers",
    "heads": "num_attention_heads",
    "kv_heads": "num_key_value_heads",
    "head_dim": None,  # None: the config derives it as hidden // heads
}


@dataclass(frozen=True)
class ArchSpec:
    """One family: how to name, shrink and grow its config, and what its identity weights look like."""

    model_type: str
    names: dict = field(default_factory=dict)  # shape knob -> config key, over _LLAMA_NAMES; None = not settable
    tiny: dict = field(default_factory=dict)  # config kwargs of the tiny shape, over TINY_SHAPE
    sized: dict = field(default_factory=dict)  # config kwargs of every non-tiny size
    mlp_ratio: float = 3.5  # intermediate / hidden when sized (per expert for MoE)
    hidden_scale: float = 1.0  # pick the hidden size of a dense model this fraction of the target (MoE < 1)
    norm_init: float = 1.0  # identity value of norm weights as stored; 0 where the norm computes x * (1 + w)
    embed_scaled: bool = False  # the model multiplies input embeddings by sqrt(hidden)
    experts_key: str | None = None  # config key of the expert count, for mixture-of-experts families

    def key(self, knob: str) -> str | None:
        return {**_LLAMA_NAMES, **self.names}[knob]


ARCHS: dict[str, ArchSpec] = {  # short name -> row
    "llama": ArchSpec("llama"),
    "mistral": ArchSpec("mistral"),
    "qwen2": ArchSpec("qwen2"),
    "qwen3": ArchSpec("qwen3", names={"head_dim": "head_dim"}),
    "gemma2": ArchSpec("gemma2", names={"head_dim": "head_dim"}, mlp_ratio=4.0, norm_init=0.0, embed_scaled=True),
    "gemma3": ArchSpec("gemma3_text", names={"head_dim": "head_dim"}, mlp_ratio=4.0, norm_init=0.0, embed_scaled=True),
    "phi3": ArchSpec("phi3"),
    "gpt2": ArchSpec(
        "gpt2",
        names={"hidden": "n_embd", "intermediate": "n_inner", "layers": "n_layer", "heads": "n_head", "kv_heads": None},
        tiny={"n_positions": 256},
        mlp_ratio=4.0,
    ),
    "gpt_neox": ArchSpec("gpt_neox", names={"kv_heads": None}, mlp_ratio=4.0),
    "olmo2": ArchSpec("olmo2"),
    "mixtral": ArchSpec(
        "mixtral",
        tiny={"num_local_experts": 4, "num_experts_per_tok": 2},
        sized={"num_local_experts": 8, "num_experts_per_tok": 2},
        hidden_scale=0.25,
        experts_key="num_local_experts",
    ),
    "qwen3_moe": ArchSpec(
        "qwen3_moe",
        names={"intermediate": "moe_intermediate_size", "head_dim": "head_dim"},
        tiny={"num_experts": 4, "num_experts_per_tok": 2},
        sized={"num_experts": 64, "num_experts_per_tok": 8},
        mlp_ratio=0.375,
        hidden_scale=0.1,
        experts_key="num_experts",
    ),
    # shared expert beside the routed ones, and one dense layer (mlp_only_layers) in the tiny shape
    "qwen2_moe": ArchSpec(
        "qwen2_moe",
        names={"intermediate": "moe_intermediate_size"},
        tiny={
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "shared_expert_intermediate_size": 96,
            "intermediate_size": 96,
            "mlp_only_layers": [1],
        },
        sized={"num_experts": 60, "num_experts_per_tok": 4},
        mlp_ratio=0.375,
        hidden_scale=0.1,
        experts_key="num_experts",
    ),
}

MOE_ARCHS = tuple(name for name, spec in ARCHS.items() if spec.experts_key)
TINY_SHAPE = {"hidden": 64, "intermediate": 128, "layers": 4, "heads": 4, "kv_heads": 2, "head_dim": 16}
TINY_VOCAB = 320
SIZED_VOCAB = 32_000
# (largest target in params, hidden, head_dim): shapes in the range of published models of that size
_HIDDEN_LADDER = (
    (0.25e9, 576, 64),
    (0.7e9, 1024, 64),
    (2.5e9, 2048, 64),
    (5e9, 3072, 128),
    (11e9, 4096, 128),
    (24e9, 5120, 128),
    (float("inf"), 8192, 128),
)
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([kmbt])\s*$", re.IGNORECASE)
_SUFFIX = {"k": 1e3, "m": 1e6, "b": 1e9, "t": 1e12}


def parse_size(size: str) -> int:
    """'135M' -> 135_000_000, '1.5B' -> 1_500_000_000."""
    match = _SIZE.match(size)
    if not match:
        raise ValueError(f"cannot read {size!r} as a model size; expected 'tiny' or a count such as 135M, 1B, 8B")
    return int(float(match.group(1)) * _SUFFIX[match.group(2).lower()])


def config_for(arch: str, size: str | None = None, **overrides):
    """A config of family `arch` ('llama', 'qwen3_moe' ... see ARCHS) and `size` ('tiny' or e.g. '135M', '8B').

    Sized configs land within a few percent of the target parameter count (tied embeddings counted once);
    `overrides` are config kwargs applied last.
    """
    spec = ARCHS.get(arch)
    if spec is None:
        raise ValueError(f"unknown architecture {arch!r}; known: {', '.join(ARCHS)}")
    if size in (None, "tiny"):
        kwargs = {**_shape_kwargs(spec, TINY_SHAPE), "vocab_size": TINY_VOCAB, **spec.tiny}
    else:
        kwargs = _fit(spec, parse_size(size))
    return _build(spec, {**kwargs, **SPECIAL_IDS, **overrides})


def config_from_spec(text: str, **overrides):
    """'llama' or 'llama:1B' (the form `bench --synthetic` takes) -> config_for(arch, size)."""
    arch, _, size = text.partition(":")
    return config_for(arch.strip(), size.strip() or None, **overrides)


def count_params(config) -> int:
    """Parameters as saved (tied embeddings once), counted on the meta device."""
    return sum(spec.numel for spec in saved_tensors(config))


def _build(spec: ArchSpec, kwargs: dict):
    from transformers import AutoConfig

    return AutoConfig.for_model(spec.model_type, **kwargs)


def _shape_kwargs(spec: ArchSpec, shape: dict) -> dict:
    return {spec.key(knob): value for knob, value in shape.items() if spec.key(knob) is not None}


def _fit(spec: ArchSpec, target: int) -> dict:
    # params(L, I) = fixed + L * (a + b * I): measure fixed, a and b on 1- and 2-layer meta models,
    # choose L from the ladder's hidden size, then tune I so the rounded L still lands on target.
    _, hidden, head_dim = next(row for row in _HIDDEN_LADDER if target * spec.hidden_scale <= row[0])
    heads = hidden // head_dim
    group = next(g for g in (4, 3, 2, 1) if heads % g == 0)
    shape = {"hidden": hidden, "heads": heads, "kv_heads": heads // group, "head_dim": head_dim}
    inter = _round(spec.mlp_ratio * hidden, 64)

    def params(layers: int, intermediate: int) -> int:
        kwargs = {
            **_shape_kwargs(spec, {**shape, "layers": layers, "intermediate": intermediate}),
            "vocab_size": SIZED_VOCAB,
        }
        return count_params(_build(spec, {**kwargs, **spec.sized, **SPECIAL_IDS}))

    one, two, wider = params(1, inter), params(2, inter), params(1, inter + 256)
    per_layer, per_unit = two - one, (wider - one) / 256
    fixed = one - per_layer
    layers = max(1, round((target - fixed) / per_layer))
    inter = max(64, _round(inter + ((target - fixed) / layers - per_layer) / per_unit, 64))
    kwargs = _shape_kwargs(spec, {**shape, "layers": layers, "intermediate": inter})
    return {**kwargs, "vocab_size": SIZED_VOCAB, **spec.sized}


def _round(value: float, multiple: int) -> int:
    return int(round(value / multiple)) * multiple
