"""What a config says, read the same way from config.json, a transformers config object or a GGUF's header view:
integers by any of their spellings at the decoder's part of a multimodal config, the architecture, experts per layer
and per token; and a parameter count as people write it (70B, 135M)."""

from __future__ import annotations

from collections.abc import Mapping

POSITION_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len")
# A config that names no context length sets no limit we can trust. 0 would make max_context (and with it
# kv_cache_bytes) 0, a model that cannot take a prompt; 4096 is a length today's decoders all handle, and a
# --max-context override still goes past it.
DEFAULT_POSITIONS = 4096

EXPERT_COUNT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")


TOP_K_KEYS = ("num_experts_per_tok", "moe_top_k", "top_k")


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
        raise ValueError(
            f"cannot read {text!r} as a parameter count; expected a positive number with an optional "
            f"K/M/B/T suffix, e.g. 70B, 7.5B, 135M"
        )
    return value


def config_int(config, keys: tuple[str, ...], minimum: int = 1) -> int | None:
    """The first of `keys` set to an integer >= minimum, read at the decoder's part of a multimodal config.
    `config` is a mapping (config.json, `config.to_dict()`) or a transformers config object."""
    if isinstance(config, Mapping):
        text = config.get("text_config") or config
        values = (text.get(key) for key in keys)
    else:
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        values = (getattr(text, key, None) for key in keys)
    return next((v for v in values if type(v) is int and v >= minimum), None)


def architecture_of(config) -> str:
    """The decoder's model type, one name for a checkpoint's config and a GGUF's header ("gemma3_text" -> "gemma3")."""
    if isinstance(config, Mapping):
        text = config.get("text_config") or config
        name = text.get("model_type") or config.get("model_type")
    else:
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        name = getattr(text, "model_type", None) or getattr(config, "model_type", None)
    return str(name or "").lower().removesuffix("_text")


def expert_count(config) -> int | None:
    """Experts per MoE layer (None for a dense model)."""
    return config_int(config, EXPERT_COUNT_KEYS, minimum=2)


def top_k(config) -> int | None:
    """Experts the router picks per token."""
    return config_int(config, TOP_K_KEYS)
