"""A prompt sent to a running `rocketllm serve` instead of loading the model: `generate --server URL`.

A process that loads a model pays for importing torch and transformers and for building the model on every
launch; a server pays once. This client is standard library only (nothing heavy is imported), so a prompt in a
shell loop costs an HTTP round trip plus the generation. It speaks the server's OpenAI API: /v1/completions for
raw text, /v1/chat/completions when the chat template applies, streamed as server-sent events.
"""

from __future__ import annotations

import http.client
import json
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

from ..errors import RocketError

TIMEOUT_S = 600.0  # a streamed reply's events may be far apart when layers stream from a slow disk


def server_url(url: str) -> str:
    """--server as given: a URL, or host:port (localhost:8000), which means http://host:port."""
    url = url.strip()
    if "://" not in url and not url.startswith("unix:"):
        return "http://" + url
    return url


def default_model_id(model: str) -> str:
    """The name clients use: the model directory's name, a .gguf file's name without the suffix, or the hub id."""
    path = Path(str(model)).expanduser()
    if path.exists():
        path = path.resolve()
        return path.stem if path.is_file() else path.name
    return str(model)


def served_model(url: str, api_key: str | None = None) -> str:
    """The model id the server at `url` serves (GET /v1/models)."""
    body = _call(url, "/v1/models", None, api_key)
    models = body.get("data") if isinstance(body, dict) else None
    if not models or not isinstance(models[0], dict) or "id" not in models[0]:
        raise RocketError(f"{url} answered GET /v1/models without a model id: is it a rocketllm serve?")
    return str(models[0]["id"])


def remote_generate(
    url: str,
    model_id: str,
    prompt: str,
    *,
    chat: bool | None,
    system: str | None,
    params,
    on_text: Callable[[str], None] | None,
    json_schema: str | None = None,
    api_key: str | None = None,
    keep_alive_s: float | None = None,
) -> dict:
    """Generate through the server; {text, prompt_tokens, new_tokens, finish_reason, stats} with the client's timings.

    chat None: the chat endpoint, which applies the model's template when it has one (as a local run does).
    json_schema: a JSON Schema as JSON text the reply must follow (response_format json_schema; chat only).
    api_key: the server's key (`serve --api-key`), sent as OpenAI clients send it."""
    body: dict = {
        "model": model_id,
        "max_tokens": params.max_new_tokens,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if params.top_k:
        body["top_k"] = params.top_k
    if params.seed is not None:
        body["seed"] = params.seed
    if chat is False:
        if system is not None:
            raise RocketError("--system needs the chat template; drop --raw or --system")
        path, body["prompt"] = "/v1/completions", prompt
    else:
        path = "/v1/chat/completions"
        body["messages"] = ([{"role": "system", "content": system}] if system is not None else []) + [
            {"role": "user", "content": prompt}
        ]
        if json_schema is not None:
            body["response_format"] = {
                "type": "json_schema",
                "json_schema": {"name": "output", "schema": json.loads(json_schema)},
            }
    started = time.perf_counter()
    first = None
    pieces: list[str] = []
    usage: dict = {}
    engine: dict = {}  # the server's own figures for this generation (STATS_HEADER), where it sends them
    finish = None
    for event in _events(url, path, body, api_key, keep_alive_s):
        for choice in event.get("choices") or []:
            piece = (choice.get("delta") or {}).get("content") if "delta" in choice else choice.get("text")
            if piece:
                if first is None:
                    first = time.perf_counter() - started
                pieces.append(piece)
                if on_text is not None:
                    on_text(piece)
            finish = choice.get("finish_reason") or finish
        usage = event.get("usage") or usage
        engine = event.get("x_rocketllm_stats") or engine
    total = time.perf_counter() - started
    new = int(usage.get("completion_tokens") or 0)
    decode = (new - 1) / (total - first) if first is not None and new > 1 and total > first else None
    return {
        "text": "".join(pieces),
        "prompt_tokens": int(usage.get("prompt_tokens") or 0),
        "new_tokens": new,
        "finish_reason": finish,
        # the engine's figures first, then what this client measured (time to first token and total include the socket)
        "stats": {
            **engine,
            "server": url,
            "time_to_first_token_s": round(first, 3) if first is not None else None,
            "total_s": round(total, 3),
            "decode_tokens_per_s": engine.get("decode_tokens_per_s") or (round(decode, 2) if decode else None),
            "cached_prompt_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens"),
        },
    }


# Sent by generate: the last (usage) chunk of a streamed reply then carries `x_rocketllm_stats`, the figures a local
# run prints (bytes per tier, residency, peak RSS); other clients get the API's chunks as they are.
STATS_HEADER = "x-rocketllm-stats"
# Sent by generate to a warm model: its keep-alive in seconds from this request on (`--keep-alive`, as ollama's
# per-request keep_alive); a server started without one ignores it.
KEEP_ALIVE_HEADER = "x-rocketllm-keep-alive"


def _request(
    url: str, path: str, body: dict | None, api_key: str | None = None, keep_alive_s: float | None = None
) -> urllib.request.Request:
    data = None if body is None else json.dumps(body).encode()
    headers = {
        "content-type": "application/json",
        "accept": "text/event-stream" if body and body.get("stream") else "application/json",
        STATS_HEADER: "1",
        **({KEEP_ALIVE_HEADER: f"{keep_alive_s:g}"} if keep_alive_s is not None else {}),
    }
    if api_key:
        headers["authorization"] = f"Bearer {api_key}"
    return urllib.request.Request(
        url.rstrip("/") + path, data=data, headers=headers, method="GET" if body is None else "POST"
    )


class _UnixConnection(http.client.HTTPConnection):
    """HTTP over a unix socket (a warm model's server, warm/): the standard library's connection, another address."""

    def __init__(self, socket_path: str, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self.socket_path = socket_path

    def connect(self) -> None:
        import socket

        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(self.timeout)
        self.sock.connect(self.socket_path)


def _open_unix(url: str, path: str, body: dict | None, api_key: str | None, keep_alive_s: float | None = None):
    request = _request("http://localhost", path, body, api_key, keep_alive_s)
    connection = _UnixConnection(url.removeprefix("unix:"), TIMEOUT_S)
    try:
        connection.request(request.get_method(), path, body=request.data, headers=dict(request.header_items()))
        response = connection.getresponse()
    except OSError as exc:
        raise RocketError(
            f"the warm server at {url} does not answer ({exc}); `rocketllm stop` it and run again"
        ) from None
    if response.status >= 400:
        try:
            detail = f"{_message(json.loads(response.read()))} (HTTP {response.status})"
        except (ValueError, OSError):
            detail = f"HTTP {response.status}"
        raise RocketError(f"the server at {url} refused the request: {detail}")
    return response


def _open(url: str, path: str, body: dict | None, api_key: str | None = None, keep_alive_s: float | None = None):
    if url.startswith("unix:"):
        return _open_unix(url, path, body, api_key, keep_alive_s)
    try:
        return urllib.request.urlopen(_request(url, path, body, api_key, keep_alive_s), timeout=TIMEOUT_S)
    except urllib.error.HTTPError as exc:
        hint = "; give its key with --api-key or ROCKETLLM_API_KEY" if exc.code == 401 else ""
        raise RocketError(f"the server at {url} refused the request: {_error_text(exc)}{hint}") from None
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise RocketError(
            f"no server answers at {url} ({reason}); start one with `rocketllm serve MODEL`, "
            "or drop --server to load the model here"
        ) from None
    except ValueError as exc:  # a URL urllib cannot parse
        raise RocketError(
            f"--server {url!r} is not an http(s) URL ({exc}); e.g. --server http://127.0.0.1:8000"
        ) from None


def _call(url: str, path: str, body: dict | None, api_key: str | None = None) -> dict:
    with _open(url, path, body, api_key) as response:
        try:
            return json.loads(response.read())
        except ValueError:
            raise RocketError(f"{url}{path} did not answer JSON: is it a rocketllm serve?") from None


def _events(url: str, path: str, body: dict, api_key: str | None = None, keep_alive_s: float | None = None):
    """The JSON payloads of a server-sent event stream, up to [DONE]; an error event raises."""
    with _open(url, path, body, api_key, keep_alive_s) as response:
        done = False
        for raw in response:
            line = raw.decode("utf-8", errors="replace").strip()
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                done = True
                break
            event = json.loads(data)
            if isinstance(event, dict) and "error" in event:
                raise RocketError(f"the server at {url} failed the request: {_message(event)}")
            yield event
        if not done:
            raise RocketError(f"the server at {url} closed the stream before it ended ([DONE] never came)")


def _error_text(exc: urllib.error.HTTPError) -> str:
    try:
        return f"{_message(json.loads(exc.read()))} (HTTP {exc.code})"
    except (ValueError, OSError):
        return f"HTTP {exc.code} {exc.reason}"


def _message(payload: dict) -> str:
    error = payload.get("error") if isinstance(payload, dict) else None
    return str(error.get("message") if isinstance(error, dict) else error or payload)
