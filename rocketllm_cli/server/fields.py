"""Request bodies read field by field with plain messages: the JSON itself, tools' schemas, numbers, strings,
stop strings and the sampling settings both APIs share."""

from __future__ import annotations

import json

from ..errors import ParameterError
from ..text.sampling import SamplingParams
from .refusals import APIError, bad, refused, unknown_model


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
        raise bad(
            "the request body holds a lone UTF-16 surrogate (\\ud800-\\udfff) in a string; send valid Unicode"
        ) from None


def _kind(value: object) -> str:
    return {dict: "an object", list: "an array", str: "a string", bool: "a boolean", type(None): "null"}.get(
        type(value), "a number" if isinstance(value, (int, float)) else type(value).__name__
    )


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
        if kind is not None and not (
            kind in JSON_TYPES
            if isinstance(kind, str)
            else isinstance(kind, list) and kind and all(isinstance(k, str) and k in JSON_TYPES for k in kind)
        ):
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
        raise bad(
            f"unknown field '{name}'; this endpoint takes {', '.join(sorted(takes))} (and "
            f"{', '.join(sorted(INFORMATIONAL))}, "
            "which do not change the reply)",
            name,
        )


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


def number(
    body: dict,
    name: str,
    low: float | None = None,
    high: float | None = None,
    *,
    low_open: bool = False,
    integer: bool = False,
    needed: bool = False,
    default: float | int | None = None,
):
    value = required(body, name) if needed else body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise bad(f"'{name}' must be {'an integer' if integer else 'a number'}, not {_kind(value)}", name)
    if integer and isinstance(value, float) and not (value.is_integer() and abs(value) < 2**53):  # 1e308 is no count
        raise bad(f"'{name}' must be an integer (got {value})", name)
    value = int(value) if integer else float(value)
    if low is not None and (value <= low if low_open else value < low):
        raise bad(
            f"'{name}' must be {'>' if low_open else '>='} {_plain(low)}"
            + (f" and <= {_plain(high)}" if high is not None else "")
            + f" (got {_plain(value)})",
            name,
        )
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


def sampling(
    body: dict, max_tokens: int, temperature_max: float, temperature_default: float = 1.0, logit_bias: tuple = ()
) -> SamplingParams:
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
    # the fields are checked above; a check of the library's own still reads in the API's terms
    except ParameterError as exc:
        raise refused(exc) from None
