"""A model's end-of-sequence ids and the one pad rule, from its generation config."""

from __future__ import annotations


def eos_token_ids(model) -> list[int]:
    """The model's end-of-sequence ids, in the generation config's order."""
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    return [] if eos is None else [int(e) for e in (eos if isinstance(eos, list) else [eos])]


def pad_token_id(model) -> int:
    """The one pad rule: generation_config.pad_token_id, else the first end-of-sequence id, else 0."""
    pad = getattr(getattr(model, "generation_config", None), "pad_token_id", None)
    if pad is not None:
        return int(pad)
    eos = eos_token_ids(model)
    return eos[0] if eos else 0
