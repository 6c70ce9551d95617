"""What both APIs share: the error they raise, field checks with plain messages, sampling settings, SSE framing."""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field

from ..errors import ParameterError
from ..text.loop import GenerationOutcome, GenerationRequest
from ..text.sampling import SamplingParams
from .client import STATS_HEADER  # "1": a streamed reply's usage chunk carries the engine's figures
from .structured import FREE, Structure
from .worker import STOP_WAIT_S


class APIError(Exception):
    """A request the server refuses: HTTP status, message, and the field it is about. Each API renders its own shape."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


@dataclass
class Prepared:
    """A checked request, ready for the worker, and what its response needs."""

    request: GenerationRequest
    stream: bool = False
    tools: bool = False  # parse the reply for tool calls
    include_usage: bool = False
    headers: dict = field(default_factory=dict)  # extra response headers (ignored settings, tool_choice not enforced)
    echo: str = ""  # the prompt text a completion echoes before its reply
    structure: Structure = FREE  # what constrained decoding enforces, and the text the server writes around the reply
    n: int = 1  # choices: rows of one batch, one streaming pass for all of them
    echo_ids: list[int] | None = None  # an echoed prompt's ids, whose log-probabilities a completion returns first
    settings: dict = field(default_factory=dict)  # what a response repeats of its request (the Responses API's object)
    stats: bool = False  # the caller asked for the engine's figures (STATS_HEADER): bytes per tier, residency, peak RSS

    def rows(self) -> list[GenerationRequest]:
        """The request as the worker runs it: n rows sharing one cancel event (a client that leaves stops them all)."""
        import dataclasses

        return [self.request] + [dataclasses.replace(self.request) for _ in range(self.n - 1)]

    def reply_text(self, outcome) -> str:
        """The whole reply: the structure's prefill and closing around the generated text."""
        return self.structure.prefill + outcome.text + self.closing(outcome)

    def closing(self, outcome) -> str:
        """The structure's closing, where the grammar ran to its end (not after max_tokens or a stop string cut it)."""
        return self.structure.closing if outcome.finish_reason == "stop" and outcome.stop_sequence is None else ""

    def finish(self, splitter, outcome) -> tuple[str, list]:
        """What a streamed reply's splitter still holds once OUTCOME ended, its closing written: (content not sent, calls)."""
        held = splitter.feed(self.closing(outcome))
        rest, calls = splitter.finish()
        return held + rest, calls

    def splitter(self, parser):
        """A StreamSplitter for this reply's tool calls, holding the prefill already (None when tools are not parsed)."""
        if not self.tools:
            return None
        from .tools import StreamSplitter

        splitter = StreamSplitter(parser)
        splitter.feed(self.structure.prefill)  # a call's opening: held back with the call
        return splitter


def bad(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param, code)


def unknown_model(name: str, state) -> APIError:
    return APIError(404, f"model '{name}' does not exist; this server serves '{state.model_id}' (see GET /v1/models)",
                    "model", "model_not_found")


def check_model(body: dict, state) -> None:
    name = string(body, "model", needed=True)
    if name != state.model_id:
        raise unknown_model(name, state)


MAX_DEPTH = 64  # nesting of objects and arrays a request body may have (real requests need about 8)


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def parse_body(raw: bytes) -> dict:
    """The body as a JSON object: UTF-8, no NaN or Infinity, nested at most MAX_DEPTH deep, no lone surrogates."""
    if not raw.strip():
        raise bad("the request body is empty; send a JSON object")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise bad(f"the request body is not valid UTF-8 (byte {exc.start})") from None
    try:
        body = json.loads(text, parse_constant=_no_constant)
    except ValueError as exc:
        raise bad(f"the request body is not valid JSON ({_short(str(exc))})") from None
    except RecursionError:
        raise bad(f"the request body nests deeper than {MAX_DEPTH} levels") from None
    if not isinstance(body, dict):
        raise bad(f"the request body must be a JSON object, not {_kind(body)}")
    _check_tree(body)
    return body


def _short(text: str, limit: int = 200) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _check_tree(body: dict) -> None:
    """Refuse nesting past MAX_DEPTH and strings (keys too) that hold lone surrogates, which no reply could encode."""
    stack = [(body, 1)]
    while stack:
        value, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise bad(f"the request body nests deeper than {MAX_DEPTH} levels")
        if isinstance(value, dict):
            for key, item in value.items():
                _check_text(key)
                stack.append((item, depth + 1))
        elif isinstance(value, list):
            stack.extend((item, depth + 1) for item in value)
        elif isinstance(value, str):
            _check_text(value)


def _check_text(text: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise bad("the request body holds a lone UTF-16 surrogate (\\ud800-\\udfff) in a string; send valid Unicode") from None


def _kind(value: object) -> str:
    return {dict: "an object", list: "an array", str: "a string", bool: "a boolean", type(None): "null"}.get(
        type(value), "a number" if isinstance(value, (int, float)) else type(value).__name__)


JSON_TYPES = ("object", "array", "string", "number", "integer", "boolean", "null")
SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")


def tool_list(value: object, not_a_list: str, item) -> list[dict]:
    """A request's `tools`: absent is none; else a list whose entries item(i, entry) checks and turns into the
    one form the prompt builder takes, {"type": "function", "function": {name, description, parameters}}."""
    if value is None:
        return []
    if not isinstance(value, list):
        raise bad(not_a_list, "tools")
    return [item(i, entry) for i, entry in enumerate(value)]


def function_tool(name: str, description: str | None, parameters: dict) -> dict:
    return {"type": "function", "function": {"name": name, "description": description or "", "parameters": parameters}}


def tool_schema(value: object, where: str) -> dict:
    """A tool's parameter schema, checked to be JSON Schema where a chat template reads it: `type` a JSON type (or a
    list of them), `properties` an object of schemas, `items` a schema, `required` a list of names, `enum` a list."""
    if not isinstance(value, dict):
        raise bad(f"'{where}' must be a JSON Schema object, not {_kind(value)}", where)
    stack = [(value, where)]
    while stack:
        node, at = stack.pop()

        def wrong(key: str, what: str, at=at) -> APIError:
            return bad(f"'{where}' is not JSON Schema: '{at}.{key}' must be {what}", where)

        kind = node.get("type")
        if kind is not None and not (kind in JSON_TYPES if isinstance(kind, str) else
                                     isinstance(kind, list) and kind and all(isinstance(k, str) and k in JSON_TYPES for k in kind)):
            raise wrong("type", "one of " + ", ".join(JSON_TYPES) + " (or a list of them)")
        for key in ("description", "title"):
            if key in node and not isinstance(node[key], str):
                raise wrong(key, "a string")
        props = node.get("properties")
        if props is not None:
            if not isinstance(props, dict) or not all(isinstance(v, dict) for v in props.values()):
                raise wrong("properties", "an object whose values are schemas")
            stack.extend((v, f"{at}.properties.{k}") for k, v in props.items())
        req = node.get("required")
        if req is not None and not (isinstance(req, list) and all(isinstance(r, str) for r in req)):
            raise wrong("required", "a list of property names")
        if "enum" in node and not isinstance(node["enum"], list):
            raise wrong("enum", "a list")
        items = node.get("items")
        if items is not None:
            if not isinstance(items, (dict, bool)):
                raise wrong("items", "a schema")
            if isinstance(items, dict):
                stack.append((items, f"{at}.items"))
        for key in SUBSCHEMA_LISTS:
            subs = node.get(key)
            if subs is not None:
                if not isinstance(subs, list) or not all(isinstance(v, dict) for v in subs):
                    raise wrong(key, "a list of schemas")
                stack.extend((v, f"{at}.{key}[{i}]") for i, v in enumerate(subs))
    return value


# Fields that do not change a reply by their nature (an end user's id, tags, a routing or caching hint): accepted as
# they are, documented in README's Serve section. Everything else a request carries must take effect, or be a 400.
INFORMATIONAL = frozenset({"user", "metadata", "safety_identifier", "prompt_cache_key", "service_tier"})


def check_fields(body: dict, takes: frozenset[str], refused: dict[str, str] | None = None) -> None:
    """A 400 for the first field the endpoint does not take: one of `refused` (name -> why) when it is set, any other
    unknown name always, so nothing a client asks for is dropped silently."""
    for name, value in body.items():
        if name in takes or name in INFORMATIONAL:
            continue
        if refused and name in refused:
            if value is None or value is False:
                continue
            raise bad(f"'{name}' is not supported: {refused[name]}", name)
        raise bad(f"unknown field '{name}'; this endpoint takes {', '.join(sorted(takes))} (and {', '.join(sorted(INFORMATIONAL))}, "
                  "which do not change the reply)", name)


def required(body: dict, name: str, where: str = "") -> object:
    if name not in body or body[name] is None:
        raise bad(f"missing required field '{where}{name}'", f"{where}{name}")
    return body[name]


def string(body: dict, name: str, where: str = "", *, needed: bool = False, default: str | None = None) -> str | None:
    value = required(body, name, where) if needed else body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, str):
        raise bad(f"'{where}{name}' must be a string, not {_kind(value)}", f"{where}{name}")
    return value


def number(body: dict, name: str, low: float | None = None, high: float | None = None, *, low_open: bool = False,
           integer: bool = False, needed: bool = False, default: float | int | None = None):
    value = required(body, name) if needed else body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise bad(f"'{name}' must be {'an integer' if integer else 'a number'}, not {_kind(value)}", name)
    if integer and isinstance(value, float) and not (value.is_integer() and abs(value) < 2**53):  # 1e308 is no count
        raise bad(f"'{name}' must be an integer (got {value})", name)
    value = int(value) if integer else float(value)
    if low is not None and (value <= low if low_open else value < low):
        raise bad(f"'{name}' must be {'>' if low_open else '>='} {_plain(low)}" + (f" and <= {_plain(high)}" if high is not None else "") + f" (got {_plain(value)})", name)
    if high is not None and value > high:
        raise bad(f"'{name}' must be <= {_plain(high)} (got {_plain(value)})", name)
    return value


def boolean(body: dict, name: str, default: bool = False) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad(f"'{name}' must be true or false, not {_kind(value)}", name)
    return value


def _plain(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


def stop_strings(value: object, name: str) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        raise bad(f"'{name}' must be a string or a list of strings", name)
    return tuple(s for s in value if s)


def sampling(body: dict, max_tokens: int, temperature_max: float, temperature_default: float = 1.0, logit_bias: tuple = ()) -> SamplingParams:
    """Sampling settings from a request body (after max_tokens is known). Temperature 0 is greedy."""
    top_k = number(body, "top_k", -1, integer=True, default=0)
    settings = dict(
        max_new_tokens=max_tokens,
        temperature=number(body, "temperature", 0, temperature_max, default=temperature_default),
        top_p=number(body, "top_p", 0, 1, low_open=True, default=1.0),
        top_k=max(0, top_k),  # -1 (some clients' "off") is 0 here
        seed=number(body, "seed", integer=True),
        repetition_penalty=number(body, "repetition_penalty", 0, low_open=True, default=1.0),
        presence_penalty=number(body, "presence_penalty", -2, 2, default=0.0),
        frequency_penalty=number(body, "frequency_penalty", -2, 2, default=0.0),
        logit_bias=logit_bias,
    )
    try:
        return SamplingParams(**settings)
    except ParameterError as exc:  # the fields are checked above; a check of the library's own still reads in the API's terms
        raise refused(exc) from None


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


def new_id(prefix: str) -> str:
    return prefix + uuid.uuid4().hex[:24]


def now() -> int:
    return int(time.time())


def sse(data: object, event: str | None = None) -> str:
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    return (f"event: {event}\n" if event else "") + f"data: {payload}\n\n"


HEARTBEAT_S = 5.0  # a stream quiet this long (waiting in the queue, a slow prefill) sends a keep-alive


async def job_events(job, heartbeat: float = HEARTBEAT_S):
    """A job's events as they come: ("text", (index, piece)), ("logprobs", (index, entries)), ("heartbeat", None), then
    one of ("done", outcome), ("cancelled", outcome) or ("failed", exception) (outcome: the first row's; every row's are
    in outcomes_of(job, outcome)). A stream sees "cancelled" only when the server stops (a client
    that left reads no more): once told "stopping", this waits at most STOP_WAIT_S for the running step's outcome,
    so a long step cannot hold the stream open."""
    import asyncio

    deadline = None
    while True:
        wait = heartbeat if deadline is None else max(0.0, deadline - time.monotonic())
        try:
            kind, payload = await job.next_event(wait)
        except (asyncio.TimeoutError, TimeoutError):
            if deadline is not None:
                yield "cancelled", _nothing_more(job)
                return
            yield "heartbeat", None
            continue
        if kind == "stopping":
            deadline = time.monotonic() + STOP_WAIT_S
            continue
        if kind == "cancelled" and payload is None:  # cancelled before it ran
            payload = _nothing_more(job)
        yield kind, payload
        if kind not in ("text", "logprobs"):
            return


def outcomes_of(job, outcome) -> list:
    """Every row's outcome once a job ended (the one given for each row when it never ran or the server stopped)."""
    return list(job.outcomes) if len(job.outcomes) == len(job.requests) else [outcome] * len(job.requests)


def _nothing_more(job) -> GenerationOutcome:
    """The outcome a stream reports when the job never ran, or the server stopped before its step ended:
    the prompt, and no generated tokens counted (the text already streamed stands)."""
    return GenerationOutcome(text="", token_ids=[], prompt_tokens=len(job.request.prompt_ids), finish_reason="cancelled")
