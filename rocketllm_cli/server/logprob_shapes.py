"""Log-probabilities in OpenAI's two shapes: chat completions' `logprobs.content` (token, logprob, bytes, top_logprobs)
and completions' legacy object (tokens, token_logprobs, top_logprobs as token -> logprob, text_offset).

A token's text is what the tokenizer decodes it to alone (a piece of a multi-byte character decodes to U+FFFD, and its
`bytes` are then those of that text, as the tokenizer gives no more)."""

from __future__ import annotations


class TokenText:
    """Each token's text, decoded once (the same tokens come back at every step of every request)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._known: dict[int, str] = {}

    def __call__(self, token: int) -> str:
        text = self._known.get(token)
        if text is None:
            text = self._known[token] = self.tokenizer.decode([token])
        return text


def chat_content(entries: list, text_of: TokenText) -> list[dict]:
    def one(token: int, logprob: float) -> dict:
        text = text_of(token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    return [{**one(e.token, e.logprob), "top_logprobs": [one(t, lp) for t, lp in e.top]} for e in entries]


def chat_logprobs(entries: list | None, text_of: TokenText) -> dict | None:
    return None if entries is None else {"content": chat_content(entries, text_of), "refusal": None}


def completion_logprobs(entries: list, text_of: TokenText, offset: int = 0) -> dict:
    """The legacy object over ENTRIES (a None entry is an echoed first token: no log-probability); text offsets count
    from OFFSET characters into the choice's text."""
    tokens, values, tops, offsets = [], [], [], []
    for entry in entries:
        tokens.append(text_of(entry.token) if entry is not None else None)
        values.append(entry.logprob if entry is not None else None)
        tops.append({text_of(t): lp for t, lp in entry.top} if entry is not None and entry.top else None)
        offsets.append(offset)
        offset += len(tokens[-1] or "")
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}


def echoed(prompt_ids: list[int], scored: list) -> list:
    """An echoed prompt's entries: its first token has no log-probability, but its text is part of the echo."""
    from ..text.logprobs import TokenLogprob

    first = TokenLogprob(prompt_ids[0], None, []) if prompt_ids else None  # type: ignore[arg-type]
    return ([first] if first is not None else []) + list(scored[1:])
