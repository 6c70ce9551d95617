"""What a request's path and headers say before any route runs: the endpoints the server answers, which of them
need no key, which API's error shape a path gets, its label in the metrics, and the keys a request offers
(framework-free: the key check and the metrics use them)."""

from __future__ import annotations

ROUTES = (
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/responses",
    "/v1/messages",
    "/v1/messages/count_tokens",
    "/v1/models",
    "/metrics",
    "/tokenize",
    "/detokenize",
    "/tokenizer_info",
)


OPEN = ("/health",)  # served without the key: a liveness probe carries no secret


def api_of(path: str, headers=None) -> str:
    if path.startswith("/v1/messages"):
        return "anthropic"
    if path.startswith("/v1/models") and headers is not None and "anthropic-version" in headers:
        return "anthropic"
    return "openai"


def endpoint_label(path: str) -> str:
    if path.startswith("/v1/models"):
        return "/v1/models"
    return path if path in ROUTES or path in OPEN else "other"


def given_keys(headers) -> list[str]:
    """The keys a request offers: OpenAI clients send `Authorization: Bearer KEY`, Anthropic's `x-api-key: KEY`."""
    keys = []
    auth = headers.get("authorization")
    if auth:
        scheme, _, value = auth.partition(" ")
        if scheme.lower() == "bearer" and value.strip():
            keys.append(value.strip())
    if headers.get("x-api-key"):
        keys.append(headers["x-api-key"])
    return keys
