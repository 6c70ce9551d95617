"""A request the server refuses: the error both APIs render in their own shape, and the context check in
the request's own field names."""

from __future__ import annotations

from ..errors import ParameterError
from ..stream.context import check_context as fits


class APIError(Exception):
    """A request the server refuses: HTTP status, message, and the field it is about. Each API renders its own shape."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


def bad(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param, code)


def unknown_model(name: str, state) -> APIError:
    return APIError(
        404,
        f"model '{name}' does not exist; this server serves '{state.model_id}' (see GET /v1/models)",
        "model",
        "model_not_found",
    )


API_FIELDS = {"max_new_tokens": "max_tokens"}  # library keyword -> request field, where they differ


def api_field(param: str) -> str:
    return API_FIELDS.get(param, param)


def refused(exc: ParameterError) -> APIError:
    """A library ParameterError as a 400 that names the request's fields."""
    return bad(exc.spelled(lambda name: f"'{api_field(name)}'"), api_field(exc.params[0]) if exc.params else None)


def check_context(
    prompt_tokens: int,
    max_tokens: int | None,
    max_context: int,
    param: str,
    why: str = "",
    int4: int | None = None,
    default: int | None = None,
) -> int:
    """The library's context check (stream/context.py) as a 400 naming the request's fields: max_tokens, or when it
    is not given `default` within what the context leaves. `param`: the request's name for the reply's length."""
    names = {"max_new_tokens": param, "prompt": "messages", "kv_cache_dtype": "a server started with --kv-cache-dtype"}
    try:
        return fits(prompt_tokens, max_tokens, max_context, why, int4, default)
    except ParameterError as exc:
        raise bad(exc.spelled(names.__getitem__), names[exc.params[0]], "context_length_exceeded") from None
