"""The one context check: a prompt plus its new tokens must fit max_context, refused before any work with the numbers.

max_context is what the memory left after the weights and streaming buffers holds of K and V (profiles/knobs),
so a request it admits cannot run the machine out of memory for its cache.
"""

from __future__ import annotations

from ..errors import ParameterError


def check_context(prompt_tokens: int, max_new_tokens: int, max_context: int, why: str = "") -> None:
    """A prompt and its new tokens must fit the context the model (or the max_context knob) allows.
    `why`: how max_context was reached (context_reason), said in the refusal with what to change."""
    if prompt_tokens + max_new_tokens > max_context:
        reason = f" ({why})".replace("{", "{{").replace("}", "}}") if why else ""
        more, params = ("", ("max_new_tokens",))
        if "left for KV" in why and "in int4" not in why:
            more, params = (", or store the KV cache in int4 ({kv_cache_dtype} int4)", ("max_new_tokens", "kv_cache_dtype"))
        raise ParameterError(
            f"prompt is {prompt_tokens} tokens and {{max_new_tokens}} {max_new_tokens}, but the context allows {max_context}{reason}; "
            "shorten the prompt or lower {max_new_tokens}" + more, *params,
        )


def context_reason(knobs) -> str:
    """How the max_context knob came to its value, in words for a refusal (empty without knobs)."""
    if knobs is None:
        return ""
    knob = knobs["max_context"]
    if knob.overridden:
        return f"max_context from {knob.formula}"
    inputs = knob.inputs
    if knob.value is not None and knob.value >= inputs.get("max_positions", 0) > 0:
        return f"the model's own limit, max_positions {inputs['max_positions']}"
    return knob.note.split(";")[0]


def check_generate_call(knobs, args: tuple, kwargs: dict, generation_config) -> None:
    """The check on transformers' generate(input_ids, max_new_tokens=...) as the Python API calls it."""
    if knobs is None or knobs.value("max_context") is None:
        return
    ids = kwargs.get("input_ids", args[0] if args else None)
    if getattr(ids, "shape", None) is None or len(ids.shape) < 1:
        return
    prompt = int(ids.shape[-1])
    config = kwargs.get("generation_config") or generation_config
    new = kwargs.get("max_new_tokens", getattr(config, "max_new_tokens", None))
    if new is None:
        length = kwargs.get("max_length", getattr(config, "max_length", None))
        new = max(0, int(length) - prompt) if length is not None else 0
    check_context(prompt, int(new), int(knobs.value("max_context")), context_reason(knobs))
