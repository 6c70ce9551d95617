"""A prompt as token ids: the chat template by default (the context check it must pass is stream/context.py)."""

from __future__ import annotations

from ..errors import ParameterError, RocketError


def encode_prompt(tokenizer, prompt: str, chat: bool | None = None, system: str | None = None):
    """Token ids as a tensor [1, S]; the chat template is used by default when the tokenizer has one."""
    if tokenizer is None:
        raise RocketError(
            "this model has no tokenizer in its shard directory; re-shard from a model directory that includes one"
        )
    has_template = bool(getattr(tokenizer, "chat_template", None))
    if chat and not has_template:
        raise ParameterError(
            "{chat} needs a chat template, and this model's tokenizer has none; leave {chat} unset to send the text as "
            "it is",
            "chat",
        )
    if has_template if chat is None else chat:
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
        return tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
        )["input_ids"]
    if system:
        prompt = f"{system}\n\n{prompt}"
    return tokenizer(prompt, return_tensors="pt").input_ids
