"""/tokenize, /detokenize and /tokenizer_info, in llama-server's and vLLM's shapes at once (lm-evaluation-harness's
remote tokenizer reads vLLM's; llama.cpp's clients read llama-server's): the model's own tokenizer, nothing
generated."""

from __future__ import annotations

from .fields import boolean, check_fields
from .refusals import bad


def tokenize(body: dict, state) -> dict:
    """{"content": text} (llama-server: add_special, default false; with_pieces) or {"prompt": text} (vLLM:
    add_special_tokens, default true) or {"messages": [...]} (through the chat template) -> {"tokens": [...], "count",
    ...}."""
    check_fields(
        body,
        frozenset(
            {
                "content",
                "prompt",
                "messages",
                "add_special",
                "add_special_tokens",
                "with_pieces",
                "model",
                "add_generation_prompt",
            }
        ),
    )
    if body.get("model") is not None and body["model"] != state.model_id:
        from .refusals import unknown_model

        raise unknown_model(str(body["model"]), state)
    tokenizer = state.builder.tokenizer
    if body.get("messages") is not None:
        from .openai_requests import chat_message

        raw = body["messages"]
        if not isinstance(raw, list) or not raw:
            raise bad("'messages' must be a non-empty list", "messages")
        from .prompts import PromptError

        try:
            ids = state.builder.chat([chat_message(m, i, state) for i, m in enumerate(raw)])
        except PromptError as exc:
            raise bad(str(exc), "messages") from None
    else:
        key = "content" if "content" in body else "prompt"
        text = body.get(key)
        if not isinstance(text, str):
            raise bad("give the text to tokenize as 'content' (or 'prompt'), a string", key)
        special = (
            boolean(body, "add_special") if key == "content" else boolean(body, "add_special_tokens", default=True)
        )
        ids = list(tokenizer(text, add_special_tokens=special).input_ids)
    out: dict = {"tokens": ids, "count": len(ids), "max_model_len": state.max_context}
    if boolean(body, "with_pieces"):
        out["tokens"] = [{"id": t, "piece": state.token_text(t)} for t in ids]
    return out


def detokenize(body: dict, state) -> dict:
    """{"tokens": [...]} -> {"content": text, "prompt": text} (llama-server's key and vLLM's)."""
    check_fields(body, frozenset({"tokens", "model"}))
    ids = body.get("tokens")
    vocab = int(getattr(state.model.config, "vocab_size", 0) or 0)
    if not isinstance(ids, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) and (vocab == 0 or 0 <= t < vocab) for t in ids
    ):
        raise bad(f"'tokens' must be a list of token ids of this model (0..{vocab - 1})", "tokens")
    text = state.builder.tokenizer.decode(ids)
    return {"content": text, "prompt": text}


def tokenizer_info(state) -> dict:
    tokenizer = state.builder.tokenizer
    template = getattr(tokenizer, "chat_template", None)
    return {
        "tokenizer_class": type(tokenizer).__name__,
        "model_max_length": state.max_context,
        "vocab_size": len(tokenizer),
        "bos_token": tokenizer.bos_token,
        "eos_token": tokenizer.eos_token,
        "pad_token": tokenizer.pad_token,
        "chat_template": template if isinstance(template, str) else None,
    }
