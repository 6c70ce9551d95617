"""Which real client libraries get structured output and tool calls out of a running `rocketllm serve`.

Each check points one client library (the OpenAI and Anthropic SDKs, instructor, pydantic-ai, langchain,
openai-agents, litellm, Simon Willison's `llm`) at the server and asks for one feature: a parsed pydantic
object, JSON mode, a forced tool call, a streamed tool call. It records what happened, it does not assert:
a check is `ok` when the answer came back and validates against the schema that was asked for (jsonschema,
else pydantic), `FAIL` with one line (the exception type and the first line of its message, or what came
back instead) otherwise, and `n/a (why)` when the installed client version lacks the feature. The output is a
Markdown table on stdout (progress goes to stderr); `--json OUT` also writes every row with its timing.
Run it before and after a change to the server and diff the tables.

The clients live in a venv of their own, so the project's venv stays as it is (no torch needed there):

    python3 -m venv .venv-clients && . .venv-clients/bin/activate
    pip install openai anthropic instructor 'pydantic-ai-slim[openai,anthropic]' langchain-openai \
        langchain-anthropic openai-agents litellm llm jsonschema

Start a server first (from the project's venv), then run the checks from the clients' venv:

    rocketllm serve MODEL --port 8123 &          # wait for "listening on ..."
    python benchmarks/clients.py --base-url http://127.0.0.1:8123 --model smol [--only NAME ...] [--json OUT]

`--model` defaults to the first id in `GET /v1/models`. `--only` takes client names or `client:feature`
globs (`--only openai 'anthropic:*stream*'`); `--list` prints the checks. A client that is not installed
makes its checks `n/a`. The model is small and slow on a CPU, so each check asks for few tokens
(`--max-tokens`, default 100) at temperature 0 where the client lets it, with no client-side retries,
and gives up after `--timeout` seconds (default 120). The server runs one request at a time; a full run of
the 35 checks takes one to two minutes with SmolLM2-135M on two cores. The `s` column is each check's wall
time, the first check of a client including that client's import (litellm's alone is about 5 s).
"""

from __future__ import annotations

import argparse
import asyncio
import fnmatch
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any, Callable, Literal

# Before any client is imported: litellm would otherwise fetch its price list from the internet at import,
# and openai-agents would try to upload traces.
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
os.environ.setdefault("OPENAI_AGENTS_DISABLE_TRACING", "1")

from pydantic import BaseModel, ConfigDict  # noqa: E402  (every client here depends on pydantic)

logging.getLogger("instructor").setLevel(logging.CRITICAL)  # it logs each failed attempt; the table has it

API_KEY = "unused"  # the server asks for none unless started with --api-key


class City(BaseModel):
    model_config = ConfigDict(extra="forbid")  # additionalProperties: false, as strict schemas need
    name: str
    country: str
    population: int


def get_weather(city: str, unit: Literal["c", "f"]) -> str:
    """Get the current weather in a city.

    Args:
        city: the city's name
        unit: "c" for Celsius or "f" for Fahrenheit
    """
    return f"18 degrees {unit.upper()} and sunny in {city}"


CITY_SCHEMA = City.model_json_schema()
WEATHER_SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "description": "the city's name"},
        "unit": {"type": "string", "enum": ["c", "f"], "description": '"c" for Celsius or "f" for Fahrenheit'},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
WEATHER_DESCRIPTION = "Get the current weather in a city."
OPENAI_TOOL = {
    "type": "function",
    "function": {"name": "get_weather", "description": WEATHER_DESCRIPTION, "parameters": WEATHER_SCHEMA},
}
ANTHROPIC_TOOL = {"name": "get_weather", "description": WEATHER_DESCRIPTION, "input_schema": WEATHER_SCHEMA}

CITY_PROMPT = "Give the city of Paris: its name, its country and its population as a whole number."
JSON_PROMPT = (
    "Describe the city of Paris as a JSON object with the keys name (string), country (string) "
    "and population (integer). Reply with the JSON object only."
)
WEATHER_PROMPT = "What is the weather in Paris right now, in Celsius?"


# ---------------------------------------------------------------------------------------------- the harness


class NotApplicable(Exception):
    """The installed client version lacks what the check needs."""


class Wrong(Exception):
    """An answer came back, but not the one asked for (prose instead of a tool call, JSON off the schema)."""


@dataclass
class Ctx:
    base_url: str  # http://HOST:PORT, no /v1
    model: str
    max_tokens: int
    timeout: float

    @property
    def openai_url(self) -> str:
        return self.base_url + "/v1"


@dataclass
class Check:
    client: str
    feature: str
    fn: Callable[[Ctx], str]


@dataclass
class Result:
    client: str
    feature: str
    result: str  # ok, FAIL, n/a
    detail: str
    seconds: float
    started: float = field(default=0.0)


CHECKS: list[Check] = []


def check(client: str, feature: str):
    """Register a check: a function of the Ctx that returns a short account of what came back, or raises."""

    def register(fn: Callable[[Ctx], str]) -> Callable[[Ctx], str]:
        CHECKS.append(Check(client, feature, fn))
        return fn

    return register


def one_line(text: object, limit: int = 300) -> str:
    s = " ".join(str(text).split())
    return s if len(s) <= limit else s[: limit - 1] + "…"


def _server_message(exc: BaseException) -> str | None:
    """The message inside an API error's body ({"error": {"message": ...}} or Anthropic's shape), if any."""
    body = getattr(exc, "body", None)
    if isinstance(body, (bytes, str)):
        try:
            body = json.loads(body)
        except ValueError:
            return None
    while isinstance(body, dict):
        if isinstance(body.get("message"), str):
            return body["message"]
        body = body.get("error")
    return body if isinstance(body, str) else None


def _first_line(exc: BaseException) -> str:
    """The first line of an exception's message; for pydantic's ValidationError (whose first line only counts
    the errors) the first error with its input."""
    errors = getattr(exc, "errors", None)
    if type(exc).__name__ == "ValidationError" and callable(errors):
        first = errors()[0]
        loc = ".".join(str(x) for x in first.get("loc", ()))
        return f"{loc + ': ' if loc else ''}{first.get('msg')} [input {one_line(repr(first.get('input')), 100)}]"
    text = str(exc).strip()
    return text.splitlines()[0] if text else "(no message)"


def _completion_text(completion: Any) -> str | None:
    """The text of an OpenAI ChatCompletion or an Anthropic Message a wrapper kept, if any."""
    if completion is None:
        return None
    try:
        if hasattr(completion, "choices"):
            return completion.choices[0].message.content
        return "".join(getattr(b, "text", "") for b in completion.content)
    except (AttributeError, IndexError, TypeError):
        return None


def describe(exc: BaseException) -> str:
    """One line: the exception's type; for a wrapper (instructor's retry exception, an agent's error) also the
    type of what it wraps; the HTTP status and the server's message where there is one, else the innermost
    exception's first line; and what the model said, where the wrapper kept it (instructor's last_completion,
    langchain's llm_output)."""
    if isinstance(exc, Wrong):
        return str(exc)
    chain = [exc]  # explicit causes only (`raise ... from`): an implicit __context__ is often unrelated
    while len(chain) < 10 and chain[-1].__cause__ is not None and chain[-1].__cause__ not in chain:
        chain.append(chain[-1].__cause__)
    api = next((e for e in chain if getattr(e, "status_code", None) is not None), None)
    inner = api if api is not None else chain[-1]
    lead = type(exc).__name__ if inner is exc else f"{type(exc).__name__} ← {type(inner).__name__}"
    if api is not None:
        msg = _server_message(api) or str(api)
        text = f"{lead} {api.status_code}: {msg.splitlines()[0] if msg else ''}"
    else:
        text = f"{lead}: {_first_line(inner)}"
    said = getattr(exc, "llm_output", None) or _completion_text(getattr(exc, "last_completion", None))
    if said:
        text += f"; the model said {one_line(repr(said), 100)}"
    return one_line(text)


def run_check(c: Check, ctx: Ctx) -> Result:
    """Run one check in a daemon thread, give up after the timeout; never raises."""
    box: dict[str, Any] = {}

    def target():
        try:
            box["value"] = c.fn(ctx)
        except BaseException as exc:  # noqa: BLE001 (a check must never end the run)
            box["error"] = exc

    t0 = time.time()
    thread = threading.Thread(target=target, daemon=True, name=f"{c.client}:{c.feature}")
    thread.start()
    thread.join(ctx.timeout + 10)  # clients get ctx.timeout themselves; this is the backstop
    seconds = round(time.time() - t0, 1)
    if thread.is_alive():
        return Result(c.client, c.feature, "FAIL", f"TimeoutError: no answer in {ctx.timeout + 10:.0f} s", seconds, t0)
    exc = box.get("error")
    if exc is None:
        return Result(c.client, c.feature, "ok", one_line(box.get("value", "")), seconds, t0)
    if isinstance(exc, NotApplicable):
        return Result(c.client, c.feature, "n/a", one_line(exc), seconds, t0)
    if isinstance(exc, ImportError):
        return Result(c.client, c.feature, "n/a", one_line(f"not installed: {exc}"), seconds, t0)
    return Result(c.client, c.feature, "FAIL", one_line(describe(exc)), seconds, t0)


# ------------------------------------------------------------------------------------------- validation


def _validate(instance: Any, schema: dict, model: type[BaseModel] | None) -> None:
    try:
        import jsonschema
    except ImportError:
        jsonschema = None
    if jsonschema is not None:
        try:
            jsonschema.validate(instance, schema)
        except jsonschema.ValidationError as exc:
            raise Wrong(
                f"off the schema: {one_line(exc.message, 120)}: {one_line(json.dumps(instance), 120)}"
            ) from None
    elif model is not None:
        model.model_validate(instance, strict=True)


def as_json(value: Any, what: str = "reply") -> Any:
    """A JSON value from a string (the whole string must parse), a dict, or a pydantic object."""
    if isinstance(value, BaseModel):
        return value.model_dump()
    if isinstance(value, (dict, list)):
        return value
    if value is None:
        raise Wrong(f"no {what} (None)")
    try:
        return json.loads(value)
    except ValueError:
        raise Wrong(f"{what} is not JSON: {one_line(repr(value), 160)}") from None


def city(value: Any) -> str:
    """Validate a City (JSON text, dict or pydantic object) against CITY_SCHEMA; the compact JSON."""
    data = as_json(value)
    _validate(data, CITY_SCHEMA, City)
    return json.dumps(data, separators=(",", ":"))


def weather_call(name: str | None, args: Any) -> str:
    """Validate a get_weather call's name and arguments; `get_weather({...})`."""
    if name != "get_weather":
        raise Wrong(f"called {name!r}, not get_weather")
    data = as_json(args, "arguments")
    _validate(data, WEATHER_SCHEMA, None)
    return f"get_weather({json.dumps(data, separators=(',', ':'))})"


def need(obj: Any, attr: str, why: str) -> Any:
    """getattr, or n/a saying which client feature is missing."""
    if not hasattr(obj, attr):
        raise NotApplicable(why)
    return getattr(obj, attr)


def run_async(coro):
    return asyncio.run(coro)


# ------------------------------------------------------------------------------------------- openai SDK


def openai_client(ctx: Ctx, async_: bool = False):
    import openai

    cls = openai.AsyncOpenAI if async_ else openai.OpenAI
    return cls(base_url=ctx.openai_url, api_key=API_KEY, max_retries=0, timeout=ctx.timeout)


def _openai_tool_result(choice) -> str:
    msg = choice.message
    if not msg.tool_calls:
        raise Wrong(f"no tool call (finish_reason={choice.finish_reason}): {one_line(repr(msg.content), 120)}")
    call = msg.tool_calls[0]
    shown = weather_call(call.function.name, call.function.arguments)
    if choice.finish_reason != "tool_calls":
        raise Wrong(f"{shown} but finish_reason={choice.finish_reason}")
    return f"{shown} finish={choice.finish_reason}"


@check("openai", "chat.completions.parse(response_format=City)")
def openai_parse(ctx: Ctx) -> str:
    client = openai_client(ctx)
    parse = need(client.chat.completions, "parse", "this openai version has no chat.completions.parse")
    r = parse(
        model=ctx.model,
        messages=[{"role": "user", "content": CITY_PROMPT}],
        response_format=City,
        max_tokens=ctx.max_tokens,
        temperature=0,
    )
    msg = r.choices[0].message
    if msg.parsed is None:
        raise Wrong(f"parsed is None (refusal={msg.refusal!r}): {one_line(repr(msg.content), 120)}")
    return city(msg.parsed)


@check("openai", "response_format json_object")
def openai_json_object(ctx: Ctx) -> str:
    r = openai_client(ctx).chat.completions.create(
        model=ctx.model,
        messages=[{"role": "user", "content": JSON_PROMPT}],
        response_format={"type": "json_object"},
        max_tokens=ctx.max_tokens,
        temperature=0,
    )
    data = as_json(r.choices[0].message.content)
    if not isinstance(data, dict):
        raise Wrong(f"JSON but not an object: {one_line(json.dumps(data), 120)}")
    try:
        return "City " + city(data)
    except Wrong:
        return "JSON object (not a City) " + json.dumps(data, separators=(",", ":"))


@check("openai", "tool_choice {function: get_weather}")
def openai_named_tool(ctx: Ctx) -> str:
    r = openai_client(ctx).chat.completions.create(
        model=ctx.model,
        messages=[{"role": "user", "content": WEATHER_PROMPT}],
        tools=[OPENAI_TOOL],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=ctx.max_tokens,
        temperature=0,
    )
    return _openai_tool_result(r.choices[0])


@check("openai", 'tool_choice "required"')
def openai_required_tool(ctx: Ctx) -> str:
    r = openai_client(ctx).chat.completions.create(
        model=ctx.model,
        messages=[{"role": "user", "content": WEATHER_PROMPT}],
        tools=[OPENAI_TOOL],
        tool_choice="required",
        max_tokens=ctx.max_tokens,
        temperature=0,
    )
    return _openai_tool_result(r.choices[0])


@check("openai", "stream, tool_choice {function: get_weather}")
def openai_stream_tool(ctx: Ctx) -> str:
    stream = openai_client(ctx).chat.completions.create(
        model=ctx.model,
        messages=[{"role": "user", "content": WEATHER_PROMPT}],
        tools=[OPENAI_TOOL],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=ctx.max_tokens,
        temperature=0,
        stream=True,
    )
    calls: dict[int, dict[str, str]] = {}
    text, finish, deltas = "", None, 0
    for chunk in stream:
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            text += choice.delta.content or ""
            for tc in choice.delta.tool_calls or []:
                deltas += 1
                slot = calls.setdefault(tc.index, {"name": "", "arguments": ""})
                if tc.function and tc.function.name:
                    slot["name"] += tc.function.name
                if tc.function and tc.function.arguments:
                    slot["arguments"] += tc.function.arguments
    if not calls:
        raise Wrong(f"no tool call deltas (finish_reason={finish}): {one_line(repr(text), 120)}")
    first = calls[min(calls)]
    shown = weather_call(first["name"], first["arguments"])
    if finish != "tool_calls":
        raise Wrong(f"{shown} but finish_reason={finish}")
    return f"{shown} from {deltas} deltas, finish={finish}"


# ---------------------------------------------------------------------------------------- anthropic SDK


def anthropic_client(ctx: Ctx, async_: bool = False):
    import anthropic

    cls = anthropic.AsyncAnthropic if async_ else anthropic.Anthropic
    return cls(base_url=ctx.base_url, api_key=API_KEY, max_retries=0, timeout=ctx.timeout)


def anthropic_sampling(create: Callable) -> dict:
    """temperature=0 as a parameter where the SDK's create takes one, else in the body (newer SDKs dropped it)."""
    import inspect

    if "temperature" in inspect.signature(create).parameters:
        return {"temperature": 0}
    return {"extra_body": {"temperature": 0}}


def _anthropic_tool_result(msg) -> str:
    uses = [b for b in msg.content if b.type == "tool_use"]
    if not uses:
        text = "".join(getattr(b, "text", "") for b in msg.content)
        raise Wrong(f"no tool_use block (stop_reason={msg.stop_reason}): {one_line(repr(text), 120)}")
    shown = weather_call(uses[0].name, uses[0].input)
    if msg.stop_reason != "tool_use":
        raise Wrong(f"{shown} but stop_reason={msg.stop_reason}")
    return f"{shown} stop={msg.stop_reason}"


def _anthropic_forced(ctx: Ctx, choice: dict) -> str:
    client = anthropic_client(ctx)
    msg = client.messages.create(
        model=ctx.model,
        max_tokens=ctx.max_tokens,
        messages=[{"role": "user", "content": WEATHER_PROMPT}],
        tools=[ANTHROPIC_TOOL],
        tool_choice=choice,
        **anthropic_sampling(client.messages.create),
    )
    return _anthropic_tool_result(msg)


@check("anthropic", "tool_choice {type: tool, name: get_weather}")
def anthropic_named_tool(ctx: Ctx) -> str:
    return _anthropic_forced(ctx, {"type": "tool", "name": "get_weather"})


@check("anthropic", "tool_choice {type: any}")
def anthropic_any_tool(ctx: Ctx) -> str:
    return _anthropic_forced(ctx, {"type": "any"})


@check("anthropic", "output_config.format json_schema")
def anthropic_output_config(ctx: Ctx) -> str:
    import inspect

    client = anthropic_client(ctx)
    fmt = {"format": {"type": "json_schema", "schema": CITY_SCHEMA}}
    # Newer SDKs take output_config as a parameter; older ones get it through extra_body.
    if "output_config" in inspect.signature(client.messages.create).parameters:
        extra = {"output_config": fmt}
    else:
        extra = {"extra_body": {"output_config": fmt}}
    sampling = anthropic_sampling(client.messages.create)
    if "extra_body" in extra and "extra_body" in sampling:
        extra["extra_body"].update(sampling.pop("extra_body"))
    msg = client.messages.create(
        model=ctx.model,
        max_tokens=ctx.max_tokens,
        messages=[{"role": "user", "content": CITY_PROMPT}],
        **extra,
        **sampling,
    )
    text = "".join(getattr(b, "text", "") for b in msg.content)
    return city(text) + f" stop={msg.stop_reason}"


@check("anthropic", "messages.parse(output_format=City)")
def anthropic_parse(ctx: Ctx) -> str:
    import inspect

    client = anthropic_client(ctx)
    parse = need(client.messages, "parse", "this anthropic version has no messages.parse")
    if "output_format" not in inspect.signature(parse).parameters:
        raise NotApplicable("messages.parse takes no output_format in this anthropic version")
    msg = parse(
        model=ctx.model,
        max_tokens=ctx.max_tokens,
        messages=[{"role": "user", "content": CITY_PROMPT}],
        output_format=City,
        **anthropic_sampling(parse),
    )
    if msg.parsed_output is None:
        text = "".join(getattr(b, "text", "") for b in msg.content)
        raise Wrong(f"parsed_output is None (stop_reason={msg.stop_reason}): {one_line(repr(text), 120)}")
    return city(msg.parsed_output)


@check("anthropic", "stream, tool_choice {type: tool}")
def anthropic_stream_tool(ctx: Ctx) -> str:
    client = anthropic_client(ctx)
    stream = client.messages.create(
        model=ctx.model,
        max_tokens=ctx.max_tokens,
        messages=[{"role": "user", "content": WEATHER_PROMPT}],
        tools=[ANTHROPIC_TOOL],
        tool_choice={"type": "tool", "name": "get_weather"},
        stream=True,
        **anthropic_sampling(client.messages.create),
    )
    name, partial, text, stop, deltas = None, "", "", None, 0
    for event in stream:
        if event.type == "content_block_start" and event.content_block.type == "tool_use" and name is None:
            name = event.content_block.name
        elif event.type == "content_block_delta":
            if event.delta.type == "input_json_delta":
                deltas += 1
                partial += event.delta.partial_json
            elif event.delta.type == "text_delta":
                text += event.delta.text
        elif event.type == "message_delta":
            stop = event.delta.stop_reason or stop
    if name is None:
        raise Wrong(f"no tool_use block (stop_reason={stop}): {one_line(repr(text), 120)}")
    shown = weather_call(name, partial)
    if stop != "tool_use":
        raise Wrong(f"{shown} but stop_reason={stop}")
    return f"{shown} from {deltas} input_json deltas, stop={stop}"


# ------------------------------------------------------------------------------------------- instructor


def _instructor_openai(ctx: Ctx, mode_name: str) -> str:
    import instructor

    mode = need(instructor.Mode, mode_name, f"this instructor version has no Mode.{mode_name}")
    client = instructor.from_openai(openai_client(ctx), mode=mode)
    obj = client.chat.completions.create(
        model=ctx.model,
        response_model=City,
        max_retries=0,
        messages=[{"role": "user", "content": CITY_PROMPT}],
        max_tokens=ctx.max_tokens,
        temperature=0,
    )
    return city(obj)


@check("instructor", "from_openai Mode.TOOLS")
def instructor_tools(ctx: Ctx) -> str:
    return _instructor_openai(ctx, "TOOLS")


@check("instructor", "from_openai Mode.JSON_SCHEMA")
def instructor_json_schema(ctx: Ctx) -> str:
    return _instructor_openai(ctx, "JSON_SCHEMA")


@check("instructor", "from_openai Mode.JSON")
def instructor_json(ctx: Ctx) -> str:
    return _instructor_openai(ctx, "JSON")


def _instructor_anthropic(ctx: Ctx, mode_name: str) -> str:
    import instructor

    mode = need(instructor.Mode, mode_name, f"this instructor version has no Mode.{mode_name}")
    raw = anthropic_client(ctx)
    client = instructor.from_anthropic(raw, mode=mode)
    obj = client.messages.create(
        model=ctx.model,
        response_model=City,
        max_retries=0,
        messages=[{"role": "user", "content": CITY_PROMPT}],
        max_tokens=ctx.max_tokens,
        **anthropic_sampling(raw.messages.create),
    )
    return city(obj)


@check("instructor", "from_anthropic Mode.ANTHROPIC_TOOLS")
def instructor_anthropic_tools(ctx: Ctx) -> str:
    return _instructor_anthropic(ctx, "ANTHROPIC_TOOLS")


@check("instructor", "from_anthropic Mode.ANTHROPIC_JSON")
def instructor_anthropic_json(ctx: Ctx) -> str:
    return _instructor_anthropic(ctx, "ANTHROPIC_JSON")


# ------------------------------------------------------------------------------------------- pydantic-ai


def _pydantic_ai(ctx: Ctx, provider: str, wrapper: str | None) -> str:
    import pydantic_ai

    if provider == "openai":
        from pydantic_ai.models.openai import OpenAIChatModel
        from pydantic_ai.providers.openai import OpenAIProvider

        model = OpenAIChatModel(ctx.model, provider=OpenAIProvider(openai_client=openai_client(ctx, async_=True)))
    else:
        from pydantic_ai.models.anthropic import AnthropicModel
        from pydantic_ai.providers.anthropic import AnthropicProvider

        prov = AnthropicProvider(anthropic_client=anthropic_client(ctx, async_=True))
        profile = None
        if wrapper == "NativeOutput":
            # pydantic-ai allows native output only for the Claude models it lists; say this one has it,
            # so that the request is the one a Claude model would get (output_config.format).
            profile = {**(prov.model_profile(ctx.model) or {}), "supports_json_schema_output": True}
        model = AnthropicModel(ctx.model, provider=prov, profile=profile)
    output_type: Any = City
    if wrapper:
        output_type = need(pydantic_ai, wrapper, f"this pydantic-ai version has no {wrapper}")(City)
    agent = pydantic_ai.Agent(
        model, output_type=output_type, retries=0, model_settings={"max_tokens": ctx.max_tokens, "temperature": 0}
    )
    result = run_async(agent.run(CITY_PROMPT))
    return city(result.output)


@check("pydantic-ai", "OpenAIChatModel output_type=City (tool output)")
def pydantic_ai_tool(ctx: Ctx) -> str:
    return _pydantic_ai(ctx, "openai", None)


@check("pydantic-ai", "OpenAIChatModel NativeOutput(City)")
def pydantic_ai_native(ctx: Ctx) -> str:
    return _pydantic_ai(ctx, "openai", "NativeOutput")


@check("pydantic-ai", "OpenAIChatModel PromptedOutput(City)")
def pydantic_ai_prompted(ctx: Ctx) -> str:
    return _pydantic_ai(ctx, "openai", "PromptedOutput")


@check("pydantic-ai", "AnthropicModel output_type=City (tool output)")
def pydantic_ai_anthropic_tool(ctx: Ctx) -> str:
    return _pydantic_ai(ctx, "anthropic", None)


@check("pydantic-ai", "AnthropicModel NativeOutput(City), profile says json_schema output")
def pydantic_ai_anthropic_native(ctx: Ctx) -> str:
    return _pydantic_ai(ctx, "anthropic", "NativeOutput")


# -------------------------------------------------------------------------------------------- langchain


def _chat_openai(ctx: Ctx):
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(
        base_url=ctx.openai_url,
        api_key=API_KEY,
        model=ctx.model,
        temperature=0,
        max_tokens=ctx.max_tokens,
        max_retries=0,
        timeout=ctx.timeout,
    )


def _chat_anthropic(ctx: Ctx):
    from langchain_anthropic import ChatAnthropic

    return ChatAnthropic(
        base_url=ctx.base_url,
        api_key=API_KEY,
        model=ctx.model,
        temperature=0,
        max_tokens=ctx.max_tokens,
        max_retries=0,
        timeout=ctx.timeout,
    )


def _langchain_tool_result(msg) -> str:
    if not msg.tool_calls:
        bad = getattr(msg, "invalid_tool_calls", None)
        if bad:
            raise Wrong(f"invalid tool call: {one_line(bad[0], 120)}")
        raise Wrong(f"no tool call: {one_line(repr(msg.content), 120)}")
    call = msg.tool_calls[0]
    meta = msg.response_metadata or {}
    finish = meta.get("finish_reason") or meta.get("stop_reason")
    return f"{weather_call(call['name'], call['args'])} finish={finish}"


def _langchain_structured(llm, **kwargs) -> str:
    out = llm.with_structured_output(City, include_raw=True, **kwargs).invoke(CITY_PROMPT)
    if out.get("parsing_error") is not None:
        raise out["parsing_error"]
    if out.get("parsed") is None:
        raw = out.get("raw")
        raise Wrong(f"parsed is None: {one_line(repr(getattr(raw, 'content', raw)), 120)}")
    return city(out["parsed"])


@check("langchain-openai", "with_structured_output(City) (default method)")
def lc_openai_default(ctx: Ctx) -> str:
    return _langchain_structured(_chat_openai(ctx))


@check("langchain-openai", 'with_structured_output method="function_calling"')
def lc_openai_function_calling(ctx: Ctx) -> str:
    return _langchain_structured(_chat_openai(ctx), method="function_calling")


@check("langchain-openai", 'with_structured_output method="json_mode"')
def lc_openai_json_mode(ctx: Ctx) -> str:
    llm = _chat_openai(ctx).with_structured_output(City, method="json_mode", include_raw=True)
    out = llm.invoke(JSON_PROMPT)  # json_mode sends no schema: the prompt must describe it
    if out.get("parsing_error") is not None:
        raise out["parsing_error"]
    return city(out["parsed"])


@check("langchain-openai", 'bind_tools tool_choice="get_weather"')
def lc_openai_named_tool(ctx: Ctx) -> str:
    return _langchain_tool_result(
        _chat_openai(ctx).bind_tools([get_weather], tool_choice="get_weather").invoke(WEATHER_PROMPT)
    )


@check("langchain-openai", 'bind_tools tool_choice="any"')
def lc_openai_any_tool(ctx: Ctx) -> str:
    return _langchain_tool_result(_chat_openai(ctx).bind_tools([get_weather], tool_choice="any").invoke(WEATHER_PROMPT))


@check("langchain-anthropic", "with_structured_output(City) (default method)")
def lc_anthropic_default(ctx: Ctx) -> str:
    return _langchain_structured(_chat_anthropic(ctx))


@check("langchain-anthropic", 'with_structured_output method="json_schema"')
def lc_anthropic_json_schema(ctx: Ctx) -> str:
    import inspect
    from langchain_anthropic import ChatAnthropic

    sig = inspect.signature(ChatAnthropic.with_structured_output)
    if "json_schema" not in str(sig.parameters.get("method", "")):
        raise NotApplicable("this langchain-anthropic has no method='json_schema'")
    return _langchain_structured(_chat_anthropic(ctx), method="json_schema")


@check("langchain-anthropic", 'bind_tools tool_choice="get_weather"')
def lc_anthropic_named_tool(ctx: Ctx) -> str:
    return _langchain_tool_result(
        _chat_anthropic(ctx).bind_tools([get_weather], tool_choice="get_weather").invoke(WEATHER_PROMPT)
    )


@check("langchain-anthropic", 'bind_tools tool_choice="any"')
def lc_anthropic_any_tool(ctx: Ctx) -> str:
    return _langchain_tool_result(
        _chat_anthropic(ctx).bind_tools([get_weather], tool_choice="any").invoke(WEATHER_PROMPT)
    )


# ----------------------------------------------------------------------------------------- openai-agents


def _agents_model(ctx: Ctx):
    import agents

    agents.set_tracing_disabled(True)
    return agents.OpenAIChatCompletionsModel(model=ctx.model, openai_client=openai_client(ctx, async_=True))


@check("openai-agents", "Agent(output_type=City) Runner.run")
def agents_output_type(ctx: Ctx) -> str:
    import agents

    agent = agents.Agent(
        name="city",
        instructions="Answer with the requested data.",
        model=_agents_model(ctx),
        output_type=City,
        model_settings=agents.ModelSettings(temperature=0, max_tokens=ctx.max_tokens),
    )
    result = run_async(agents.Runner.run(agent, CITY_PROMPT, max_turns=2))
    return city(result.final_output)


@check("openai-agents", 'function_tool + tool_choice="required", max_turns=3')
def agents_required_tool(ctx: Ctx) -> str:
    """ok when the tool ran with valid arguments; what the run did after that is reported, not judged."""
    import agents

    calls: list[dict] = []

    @agents.function_tool
    def get_weather_tool(city: str, unit: Literal["c", "f"]) -> str:
        """Get the current weather in a city.

        Args:
            city: the city's name
            unit: "c" for Celsius or "f" for Fahrenheit
        """
        calls.append({"city": city, "unit": unit})
        return get_weather(city, unit)

    get_weather_tool.name = "get_weather"
    agent = agents.Agent(
        name="weather",
        instructions="Use the tools to answer.",
        model=_agents_model(ctx),
        tools=[get_weather_tool],
        model_settings=agents.ModelSettings(tool_choice="required", temperature=0, max_tokens=ctx.max_tokens),
    )
    try:
        result = run_async(agents.Runner.run(agent, WEATHER_PROMPT, max_turns=3))
        ending = f"final: {one_line(repr(result.final_output), 60)}"
    except agents.MaxTurnsExceeded:
        ending = "then MaxTurnsExceeded"
    if not calls:
        raise Wrong(f"the tool never ran; {ending}")
    return f"{weather_call('get_weather', calls[0])} ran {len(calls)}x; {ending}"


# ---------------------------------------------------------------------------------------------- litellm


def _litellm():
    import litellm

    litellm.telemetry = False
    litellm.suppress_debug_info = True
    return litellm


@check("litellm", "completion(openai/..., response_format=City)")
def litellm_response_format(ctx: Ctx) -> str:
    litellm = _litellm()
    r = litellm.completion(
        model=f"openai/{ctx.model}",
        api_base=ctx.openai_url,
        api_key=API_KEY,
        messages=[{"role": "user", "content": CITY_PROMPT}],
        response_format=City,
        max_tokens=ctx.max_tokens,
        temperature=0,
        num_retries=0,
        timeout=ctx.timeout,
    )
    return city(r.choices[0].message.content)


@check("litellm", "completion(openai/..., tool_choice {function: get_weather})")
def litellm_named_tool(ctx: Ctx) -> str:
    litellm = _litellm()
    r = litellm.completion(
        model=f"openai/{ctx.model}",
        api_base=ctx.openai_url,
        api_key=API_KEY,
        messages=[{"role": "user", "content": WEATHER_PROMPT}],
        tools=[OPENAI_TOOL],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=ctx.max_tokens,
        temperature=0,
        num_retries=0,
        timeout=ctx.timeout,
    )
    return _openai_tool_result(r.choices[0])


@check("litellm", "completion(anthropic/..., response_format=City)")
def litellm_anthropic_response_format(ctx: Ctx) -> str:
    litellm = _litellm()
    r = litellm.completion(
        model=f"anthropic/{ctx.model}",
        api_base=ctx.base_url,
        api_key=API_KEY,
        messages=[{"role": "user", "content": CITY_PROMPT}],
        response_format=City,
        max_tokens=ctx.max_tokens,
        temperature=0,
        num_retries=0,
        timeout=ctx.timeout,
    )
    return city(r.choices[0].message.content)


# -------------------------------------------------------------------------------------------------- llm


@check("llm", "llm --schema 'name, country, population int'")
def llm_schema(ctx: Ctx) -> str:
    exe = shutil.which("llm", path=str(Path(sys.executable).parent)) or shutil.which("llm")
    if exe is None:
        raise ImportError("no llm command next to this python or on PATH")
    with tempfile.TemporaryDirectory(prefix="llm-user-") as home:
        (Path(home) / "extra-openai-models.yaml").write_text(
            f"- model_id: rocketllm-test\n  model_name: {json.dumps(ctx.model)}\n  api_base: "
            f"{json.dumps(ctx.openai_url)}\n"
            "  supports_schema: true\n  supports_tools: true\n"
        )
        env = {**os.environ, "LLM_USER_PATH": home, "OPENAI_API_KEY": API_KEY}
        try:
            proc = subprocess.run(
                [
                    exe,
                    "-m",
                    "rocketllm-test",
                    "--no-log",
                    "--schema",
                    "name, country, population int",
                    "-o",
                    "max_tokens",
                    str(ctx.max_tokens),
                    "-o",
                    "temperature",
                    "0",
                    CITY_PROMPT,
                ],
                capture_output=True,
                text=True,
                timeout=ctx.timeout,
                env=env,
            )
        except subprocess.TimeoutExpired:
            raise TimeoutError(f"llm gave no answer in {ctx.timeout:g} s") from None
    if proc.returncode != 0:
        lines = [line for line in proc.stderr.strip().splitlines() if line.strip()]
        raise Wrong(f"exit {proc.returncode}: {one_line(lines[-1] if lines else proc.stdout, 200)}")
    return city(proc.stdout.strip())


# ------------------------------------------------------------------------------------------------- main

DIST = {
    "openai": "openai",
    "anthropic": "anthropic",
    "instructor": "instructor",
    "pydantic-ai": "pydantic-ai-slim",
    "langchain-openai": "langchain-openai",
    "langchain-anthropic": "langchain-anthropic",
    "openai-agents": "openai-agents",
    "litellm": "litellm",
    "llm": "llm",
}


def versions() -> dict[str, str]:
    out = {}
    for name in [
        "openai",
        "anthropic",
        "instructor",
        "pydantic-ai-slim",
        "langchain-openai",
        "langchain-anthropic",
        "openai-agents",
        "litellm",
        "llm",
        "pydantic",
        "jsonschema",
    ]:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = "not installed"
    return out


def served_models(base_url: str) -> list[str]:
    with urllib.request.urlopen(base_url + "/v1/models", timeout=10) as r:
        return [m["id"] for m in json.load(r).get("data", [])]


def selected(c: Check, only: list[str] | None) -> bool:
    if not only:
        return True
    return any(fnmatch.fnmatch(c.client, pat) or fnmatch.fnmatch(f"{c.client}:{c.feature}", pat) for pat in only)


def cell(text: str, limit: int) -> str:
    text = one_line(text, limit)
    return text.replace("|", "\\|")


def table(results: list[Result], limit: int = 80) -> str:
    lines = ["| client | feature | result | s | what came back |", "|---|---|---|---:|---|"]
    for r in results:
        lines.append(f"| {r.client} | {cell(r.feature, 70)} | {r.result} | {r.seconds:g} | {cell(r.detail, limit)} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server, without /v1")
    p.add_argument("--model", help="model id (default: the first of GET /v1/models)")
    p.add_argument("--only", nargs="+", metavar="NAME", help="client names or client:feature globs")
    p.add_argument("--json", metavar="OUT", help="also write the rows, versions and settings as JSON")
    p.add_argument("--max-tokens", type=int, default=100)
    p.add_argument("--timeout", type=float, default=120.0, help="seconds per check")
    p.add_argument("--width", type=int, default=80, help="characters of 'what came back' in the table")
    p.add_argument("--list", action="store_true", help="print the checks and exit")
    args = p.parse_args(argv)

    checks = [c for c in CHECKS if selected(c, args.only)]
    if args.list:
        for c in checks:
            print(f"{c.client}:{c.feature}")
        return 0
    if not checks:
        print(f"no check matches {args.only}; --list shows them", file=sys.stderr)
        return 2
    base = args.base_url.rstrip("/")
    if base.endswith("/v1"):
        base = base[:-3]
    try:
        models = served_models(base)
    except OSError as exc:
        print(f"cannot reach {base}/v1/models: {exc}; start `rocketllm serve MODEL --port PORT` first", file=sys.stderr)
        return 2
    model = args.model or (models[0] if models else None)
    if not model:
        print(f"{base}/v1/models lists no model; pass --model", file=sys.stderr)
        return 2
    ctx = Ctx(base, model, args.max_tokens, args.timeout)
    vers = versions()

    results = []
    for i, c in enumerate(checks, 1):
        print(f"[{i}/{len(checks)}] {c.client}: {c.feature} ...", end=" ", file=sys.stderr, flush=True)
        r = run_check(c, ctx)
        print(f"{r.result} ({r.seconds:g} s) {one_line(r.detail, 160)}", file=sys.stderr, flush=True)
        results.append(r)

    used = sorted({c.client for c in checks}, key=list(DIST).index)
    print(
        f"server {base}, model {model}, max_tokens {args.max_tokens}, "
        f"{time.strftime('%Y-%m-%d %H:%M', time.localtime())}; "
        + ", ".join(f"{DIST[n]} {vers.get(DIST[n], '?')}" for n in used)
        + "\n"
    )
    print(table(results, args.width))
    counts = {k: sum(r.result == k for r in results) for k in ("ok", "FAIL", "n/a")}
    print(f"\n{counts['ok']} ok, {counts['FAIL']} FAIL, {counts['n/a']} n/a of {len(results)} checks")
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "base_url": base,
                    "model": model,
                    "max_tokens": args.max_tokens,
                    "timeout": args.timeout,
                    "versions": vers,
                    "results": [asdict(r) for r in results],
                },
                indent=1,
            )
            + "\n"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
