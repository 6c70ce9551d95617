"""A request the server refuses: the error both APIs render in their own shape, and the context check in
the request's own field names."""

from __future__ import annotations

from ..errors import ParameterError


class APIError(Exception):
    """A request the server refuses: HTTP status, message, and the field it is about. Each API renders its own shape."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


def bad(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param, code)


def unknown_model(name: str, state) -> APIError:
    return APIError(404, f"model '{name}' does not exist; this server serves '{state.model_id}' (see GET /v1/models)",
                    "model", "model_not_found")


API_FIELDS = {"max_new_tokens": "max_tokens"}  # library keyword -> request field, where they differ


def api_field(param: str) -> str:
    return API_FIELDS.get(param, param)


def refused(exc: ParameterError) -> APIError:
    """A library ParameterError as a 400 that names the request's fields."""
    return bad(exc.spelled(lambda name: f"'{api_field(name)}'"), api_field(exc.params[0]) if exc.params else None)


def check_context(prompt_tokens: int, max_tokens: int | None, max_context: int, param: str, why: str = "",
                  int4: int | None = None, default: int | None = None) -> int:
    """max_tokens, or when it is not given `default` within what the context leaves; a prompt that does not fit is a 400.
    `why`: how max_context was reached (text.prompts.context_reason); `int4`: what a server with an int4 KV cache
    would admit in the same memory (text.prompts.int4_context), said where that holds the request."""
    reason = f" ({why})" if why else ""

    def suggestion(needed: int) -> str:
        return f"; a server started with --kv-cache-dtype int4 would admit {int4} tokens in the same memory" if \
            int4 is not None and int4 >= needed else ""

    if max_tokens is None:
        left = max_context - prompt_tokens
        if left < 1:
            raise bad(f"the prompt is {prompt_tokens} tokens, but the context allows {max_context}{reason}; shorten the prompt"
                      + suggestion(prompt_tokens + 1), "messages", "context_length_exceeded")
        return left if default is None else min(left, default)
    if prompt_tokens + max_tokens > max_context:
        raise bad(f"the prompt is {prompt_tokens} tokens and {param} is {max_tokens}, but the context allows {max_context}{reason}; "
                  f"shorten the prompt or lower {param}" + suggestion(prompt_tokens + max_tokens), param, "context_length_exceeded")
    return max_tokens
