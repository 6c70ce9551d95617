"""The widths a forward pass fills per token, which size its activations: from the model's config or GGUF header.

A pass over T tokens holds, inside one decoder layer at a time, the MLP's widest tensors (gate and up side by side,
the activation and the product: 4 x intermediate values a token) and a few hidden-sized ones (the residual, the
normed input in fp32, attention's and the MLP's outputs: 6 x hidden), in fp32 where norms and the native kernels
compute: ACTIVATION_VALUE_BYTES each. Measured on a random 2.5 B Llama (hidden 2560, FFN 6912, fp32, the C heap
returning large blocks, heap.py): a 1,024-token prefill peaked 328 MiB over the loaded model, of which 160 MiB was the
prompt's KV cache, 164 KiB of activations a token; the rule gives 168 KiB.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from ...checkpoint.configreads import config_int, top_k

ACTIVATION_VALUE_BYTES = 4  # fp32: RMSNorm upcasts, the native kernels take and give fp32
MLP_WIDTHS, HIDDEN_WIDTHS = 4, 6  # values a token holds in a layer: 4 x intermediate + 6 x hidden
INTERMEDIATE_KEYS = ("intermediate_size", "n_inner", "ffn_dim", "ffn_hidden_size")
MOE_INTERMEDIATE_KEYS = ("moe_intermediate_size", "expert_intermediate_size")


@dataclass(frozen=True)
class PassShape:
    """Widths of a decoder's forward pass, enough to size its activations per token."""

    hidden: int
    intermediate: int

    @property
    def activation_values_per_token(self) -> int:
        return MLP_WIDTHS * self.intermediate + HIDDEN_WIDTHS * self.hidden

    @property
    def activation_bytes_per_token(self) -> int:
        return self.activation_values_per_token * ACTIVATION_VALUE_BYTES


def pass_shape(config) -> PassShape | None:
    """From a config (a mapping such as config.json, or a transformers config object); None without a hidden size.
    A mixture of experts counts its routed experts' width times the experts a token goes to, where that is wider."""
    hidden = config_int(config, ("hidden_size", "n_embd", "d_model"))
    if hidden is None:
        return None
    dense = config_int(config, INTERMEDIATE_KEYS) or 4 * hidden
    routed = (config_int(config, MOE_INTERMEDIATE_KEYS) or 0) * (top_k(config) or 1)
    return PassShape(hidden, max(dense, routed))


def pass_shape_of(path) -> PassShape | None:
    """From a model path as `--model` takes it: a shard set or Hugging Face directory (config.json) or a .gguf file
    (its header); None where neither says."""
    import json

    path = Path(path).expanduser()
    try:
        if path.is_file() and path.suffix == ".gguf":
            return _gguf_shape(path)
        if path.is_dir() and (path / "config.json").is_file():
            return pass_shape(json.loads((path / "config.json").read_text(encoding="utf-8")))
        ggufs = sorted(path.glob("*.gguf")) if path.is_dir() else []
        return _gguf_shape(ggufs[0]) if len(ggufs) == 1 else None
    except (OSError, ValueError, TypeError, AttributeError):
        return None


def _gguf_shape(path: Path) -> PassShape | None:
    from ...checkpoint.ggufheader import read_gguf_tensors
    from ...errors import RocketError

    try:
        meta = read_gguf_tensors(path)[0]
    except RocketError:
        return None
    arch = str(meta.get("general.architecture", ""))

    def get(key: str):
        value = meta.get(f"{arch}.{key}")
        return max(value) if isinstance(value, list) and value else value  # per-layer arrays: the widest

    config: Mapping = {
        "hidden_size": get("embedding_length"),
        "intermediate_size": get("feed_forward_length"),
        "moe_intermediate_size": get("expert_feed_forward_length"),
        "num_experts_per_tok": get("expert_used_count"),
    }
    return pass_shape({k: int(v) for k, v in config.items() if isinstance(v, (int, float)) and not isinstance(v, bool)})
