"""The one context check: a prompt plus its new tokens must fit max_context, refused before any work with the numbers.

max_context is what the memory left after the weights and streaming buffers holds of K and V (profiles/knobs),
so a request it admits cannot run the machine out of memory for its cache.
"""

from __future__ import annotations

from ..errors import ParameterError

# past a one-shot run's last token: the speculative draft verified beyond it (10 by default) and slack
RUN_MARGIN_TOKENS = 16


def run_tokens(prompt_lengths: list[int], max_new_tokens: int) -> int:
    """The tokens of KV a one-shot run holds at most: every row's longest prompt, its new tokens and the margin
    (AutoModel.from_pretrained's run_tokens; llama.cpp's n_ctx for the same run)."""
    return len(prompt_lengths) * (max(prompt_lengths) + max_new_tokens + RUN_MARGIN_TOKENS)


def check_context(
    prompt_tokens: int,
    max_new_tokens: int | None,
    max_context: int,
    why: str = "",
    int4: int | None = None,
    default: int | None = None,
) -> int:
    """A prompt and its new tokens must fit the context the model (or the max_context knob) allows; returns the new
    tokens to run: max_new_tokens, or where that is None `default` within what the context leaves after the prompt
    (all of it without a default). `why`: how max_context was reached (context_reason), said in the refusal with what
    to change; `int4`: what an int4 KV cache would admit in the same memory (int4_context), said where that holds the
    request. The server's refusal is this one with its own field names (server/refusals.py)."""
    reason = f" ({why})".replace("{", "{{").replace("}", "}}") if why else ""
    needed = prompt_tokens + (1 if max_new_tokens is None else max_new_tokens)
    if needed <= max_context:
        if max_new_tokens is not None:
            return max_new_tokens
        left = max_context - prompt_tokens
        return left if default is None else min(left, default)
    first = ("prompt",) if max_new_tokens is None else ("max_new_tokens",)
    more, params = "", first
    if int4 is not None and int4 >= needed:
        more, params = (
            f"; {{kv_cache_dtype}} int4 would admit {int4} tokens in the same memory",
            (*first, "kv_cache_dtype"),
        )
    if max_new_tokens is None:
        raise ParameterError(
            f"prompt is {prompt_tokens} tokens, but the context allows {max_context}{reason}; shorten "
            f"the prompt" + more,
            *params,
        )
    raise ParameterError(
        f"prompt is {prompt_tokens} tokens and {{max_new_tokens}} {max_new_tokens}, but the context allows "
        f"{max_context}{reason}; "
        "shorten the prompt or lower {max_new_tokens}" + more,
        *params,
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


def int4_context(knobs, config) -> int | None:
    """The context an int4 KV cache would admit in the memory max_context was derived from (max_context's formula
    with int4's bytes per value and full-precision window); None where the KV is int4 already, max_context was set
    by hand, or this model cannot keep an int4 cache (stream/kvcache.py refusal)."""
    if knobs is None or config is None:
        return None
    knob = knobs["max_context"]
    if (
        knob.overridden
        or knob.value is None
        or "kv_value_bytes" not in knob.inputs
        or str(knobs.value("kv_cache_dtype")) == "int4"
    ):
        return None
    from ..profiles.knobs.memory import int4_max_context
    from .kvcache import head_dim, refusal

    if refusal(config, "int4"):
        return None
    return int4_max_context(knob.inputs, int(knobs.value("kv_residual_tokens")), head_dim(config))


def check_generate_call(knobs, args: tuple, kwargs: dict, generation_config, model_config=None) -> None:
    """The check on transformers' generate(input_ids, max_new_tokens=...) as the Python API calls it (MODEL_CONFIG:
    the model's, for what an int4 KV cache would admit)."""
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
    max_context = int(knobs.value("max_context"))
    if prompt + int(new) > max_context:
        check_context(prompt, int(new), max_context, context_reason(knobs), int4_context(knobs, model_config))
