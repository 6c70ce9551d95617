"""The OpenAI API: /v1/chat/completions, /v1/completions and /v1/models, in OpenAI's request, response,
stream-chunk and error shapes."""

from __future__ import annotations

from ..text.loop import GenerationRequest
from .common import (
    APIError,
    Prepared,
    bad,
    boolean,
    check_context,
    check_fields,
    check_model,
    function_tool,
    job_events,
    new_id,
    now,
    number,
    required,
    sampling,
    sse,
    stop_strings,
    string,
    tool_list,
    tool_schema,
)
from ..text.constraints import Constraint
from .images import openai_image
from .prompts import PromptError
from .structured import plan, relaxed_header

FINISH = {"stop": "stop", "length": "length", "cancelled": "stop"}
SAMPLING = frozenset({"model", "max_tokens", "temperature", "top_p", "top_k", "seed", "n", "stream", "stream_options", "stop",
                      "logprobs", "logit_bias", "presence_penalty", "frequency_penalty", "repetition_penalty"})
CHAT_FIELDS = SAMPLING | {"messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice", "parallel_tool_calls",
                          "response_format", "store", "modalities"}
COMPLETION_FIELDS = SAMPLING | {"prompt", "echo", "suffix", "best_of"}
REFUSED = {  # OpenAI fields with an effect this server does not have
    "audio": "this server replies in text only",
    "prediction": "predicted outputs are not implemented", "web_search_options": "this server has no web search",
    "functions": "the legacy functions API is not implemented; send 'tools'", "function_call": "send 'tool_choice' with 'tools'",
    "reasoning_effort": "the model has no reasoning effort setting", "verbosity": "the model has no verbosity setting",
}


ERROR_TYPES = {429: "rate_limit_error"}


def error_body(err: APIError) -> dict:
    kind = ERROR_TYPES.get(err.status, "invalid_request_error" if err.status < 500 else "server_error")
    return {"error": {"message": err.message, "type": kind, "param": err.param, "code": err.code}}


def model_card(state) -> dict:
    return {"id": state.model_id, "object": "model", "created": state.created, "owned_by": "rocketllm",
            "multimodal": state.multimodal, "max_context": state.max_context}


def models(state) -> dict:
    return {"object": "list", "data": [model_card(state)]}


# -- requests ------------------------------------------------------------------------------------------
def _content(value: object, where: str, state) -> str | list | None:
    """The text, or (with pictures) the text and image parts in order."""
    if value is None or isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise bad(f"'{where}content' must be a string or a list of content parts", f"{where}content")
    texts, parts = [], []
    for j, part in enumerate(value):
        if not isinstance(part, dict):
            raise bad(f"'{where}content[{j}]' must be an object", f"{where}content")
        kind = part.get("type")
        if kind == "text":
            texts.append(string(part, "text", f"{where}content[{j}].", needed=True))
            parts.append({"type": "text", "text": texts[-1]})
        elif kind == "image_url":
            parts.append(openai_image(part, f"{where}content[{j}]", f"{where}content", state))
        elif kind in ("input_image", "input_audio", "file"):
            raise bad(f"'{where}content[{j}]' is {kind}, but {state.model_id} takes text{' and image_url parts' if state.multimodal else ''} only",
                      f"{where}content")
        else:
            raise bad(f"'{where}content[{j}].type' must be 'text'{' or image_url' if state.multimodal else ''} (got {kind!r})", f"{where}content")
    return parts if len(parts) > len(texts) else "\n".join(texts)


def _message(m: object, i: int, state) -> dict:
    where = f"messages[{i}]."
    if not isinstance(m, dict):
        raise bad(f"'messages[{i}]' must be an object with 'role' and 'content'", "messages")
    role = string(m, "role", where, needed=True)
    role = "system" if role == "developer" else role
    if role not in ("system", "user", "assistant", "tool"):
        raise bad(f"'{where}role' must be system, developer, user, assistant or tool (got {role!r})", f"{where}role")
    content = _content(m.get("content"), where, state)
    out: dict = {"role": role, "content": content}
    if role == "assistant" and m.get("tool_calls"):
        calls = m["tool_calls"]
        if not isinstance(calls, list):
            raise bad(f"'{where}tool_calls' must be a list", f"{where}tool_calls")
        out["tool_calls"] = []
        for j, c in enumerate(calls):
            cw = f"{where}tool_calls[{j}]."
            if not isinstance(c, dict) or not isinstance(c.get("function"), dict):
                raise bad(f"'{cw}function' must be an object with 'name' and 'arguments'", f"{cw}function")
            name = string(c["function"], "name", f"{cw}function.", needed=True)
            args = c["function"].get("arguments", "{}")
            out["tool_calls"].append({"id": c.get("id") or "", "type": "function", "function": {"name": name, "arguments": args}})
    elif content is None:
        raise bad(f"missing required field '{where}content'", f"{where}content")
    if role == "tool":
        out["tool_call_id"] = string(m, "tool_call_id", where) or ""
    return out


def _tools(value: object) -> list[dict]:
    return tool_list(value, "'tools' must be a list of function tools", _tool)


def _tool(i: int, t: object) -> dict:
    where = f"tools[{i}]."
    if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(t.get("function"), dict):
        raise bad(f"'tools[{i}]' must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}", f"tools[{i}]")
    fn = t["function"]
    params = fn.get("parameters")
    params = {"type": "object", "properties": {}} if params is None else tool_schema(params, f"{where}function.parameters")
    return function_tool(string(fn, "name", f"{where}function.", needed=True), string(fn, "description", f"{where}function."), params)


def tool_choice(value: object, tools: list[dict], param: str = "tool_choice") -> object:
    """'none' | 'auto' | 'required' | {'name': ...}, checked against the tools offered."""
    if value is None:
        return "auto" if tools else "none"
    if isinstance(value, dict):
        fn = value.get("function") if isinstance(value.get("function"), dict) else value
        name = fn.get("name")
        if not isinstance(name, str):
            raise bad(f"'{param}' must be none, auto, required or {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}", param)
        value = {"name": name}
    elif value not in ("none", "auto", "required"):
        raise bad(f"'{param}' must be none, auto, required or a named function (got {value!r})", param)
    if value != "none" and not tools:
        raise bad(f"'{param}' needs 'tools'", param)
    if isinstance(value, dict) and value["name"] not in {t["function"]["name"] for t in tools}:
        raise bad(f"'{param}' names function '{value['name']}', which is not among the tools", param)
    return value


def _common(body: dict, state, headers: dict, takes: frozenset[str]) -> None:
    """Checks shared by both endpoints: every field takes effect, or is a 400 naming it."""
    check_fields(body, takes, REFUSED)
    if body.get("modalities") not in (None, ["text"]):
        raise bad("'modalities' must be [\"text\"]: this server replies in text only", "modalities")
    if body.get("store") is True:
        raise bad("'store' is not supported: this server keeps no completions to retrieve later", "store")
    options = body.get("stream_options")
    if options is not None and (not isinstance(options, dict) or set(options) - {"include_usage", "include_obfuscation"}):
        raise bad("'stream_options' must be an object with 'include_usage' (and 'include_obfuscation')", "stream_options")
    if number(body, "n", 1, integer=True, default=1) != 1:
        raise bad("only n=1 is supported (one model instance, no batching)", "n")
    if body.get("logprobs") not in (None, False) or body.get("top_logprobs") is not None:
        raise bad("logprobs are not supported", "logprobs")
    if body.get("logit_bias"):
        raise bad("logit_bias is not supported", "logit_bias")


def prepare_chat(body: dict, state) -> Prepared:
    check_model(body, state)
    raw = required(body, "messages")
    if not isinstance(raw, list) or not raw:
        raise bad("'messages' must be a non-empty list", "messages")
    messages = [_message(m, i, state) for i, m in enumerate(raw)]
    tools = _tools(body.get("tools"))
    choice = tool_choice(body.get("tool_choice"), tools)
    answer, strict = response_format(body.get("response_format"))
    parallel = boolean(body, "parallel_tool_calls", default=True)
    strict = strict or strict_tools(body.get("tools"))
    headers: dict = {}
    _common(body, state, headers, CHAT_FIELDS)
    stream = boolean(body, "stream")
    options = body.get("stream_options") or {}
    include_usage = isinstance(options, dict) and options.get("include_usage") is True
    max_tokens = number(body, "max_completion_tokens", 1, integer=True)
    param = "max_completion_tokens"
    if max_tokens is None:
        max_tokens, param = number(body, "max_tokens", 1, integer=True), "max_tokens"
    stop = stop_strings(body.get("stop"), "stop")
    structure = plan(state, tools, choice, parallel, answer, "response_format", strict)
    try:
        ids, inputs = state.builder.chat_inputs(messages, tools, choice)
    except PromptError as exc:
        raise bad(str(exc), "messages") from None
    ids = ids + state.builder.prefill_ids(structure.prefill)
    max_tokens = check_context(len(ids), max_tokens, state.max_context, param, state.context_why, state.context_int4)
    params = sampling(body, max_tokens, 2.0)
    use_tools = bool(tools) and choice != "none"
    request = GenerationRequest(ids, params, stop, model_inputs=inputs, constraint=structure.constraint)
    return Prepared(request, stream, use_tools, include_usage, {**headers, **relaxed_header(structure)}, structure=structure)


def strict_tools(tools: object) -> bool:
    """Whether any function tool asks for strict adherence to its schema (function.strict: true)."""
    return isinstance(tools, list) and any(isinstance(t, dict) and isinstance(t.get("function"), dict) and t["function"].get("strict") is True
                                           for t in tools)


def response_format(value: object) -> tuple:
    """response_format as (a Constraint, whether strict adherence is asked for): None for text; json_object and
    json_schema are enforced, a strict schema wholly (or a 400), another without what the engine does not implement."""
    if value is None:
        return None, False
    if not isinstance(value, dict):
        raise bad("'response_format' must be an object such as {\"type\": \"json_object\"}", "response_format")
    kind = value.get("type")
    if kind in (None, "text"):
        return None, False
    if kind == "json_object":
        return Constraint.json_object(), False
    if kind != "json_schema":
        raise bad(f"'response_format.type' must be text, json_object or json_schema (got {kind!r})", "response_format")
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise bad("'response_format.json_schema' must be an object with 'name' and 'schema'", "response_format")
    if "strict" in spec and not isinstance(spec["strict"], bool):
        raise bad("'response_format.json_schema.strict' must be true or false", "response_format")
    schema = spec.get("schema", {})  # no schema: any JSON (OpenAI's own default)
    if not isinstance(schema, (dict, bool)):
        raise bad("'response_format.json_schema.schema' must be a JSON Schema object", "response_format")
    return Constraint.json_schema(schema), spec.get("strict") is True


def prepare_completion(body: dict, state) -> Prepared:
    check_model(body, state)
    prompt = required(body, "prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, list):
        if not prompt or not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            raise bad("'prompt' must be a string, or a list of token ids; one prompt per request", "prompt")
    elif not isinstance(prompt, str):
        raise bad("'prompt' must be a string, or a list of token ids", "prompt")
    elif not prompt:
        raise bad("'prompt' is empty", "prompt")
    if body.get("suffix"):
        raise bad("suffix (fill-in-the-middle) is not supported", "suffix")
    if number(body, "best_of", 1, integer=True, default=1) != 1:
        raise bad("only best_of=1 is supported", "best_of")
    headers: dict = {}
    _common(body, state, headers, COMPLETION_FIELDS)
    stream = boolean(body, "stream")
    options = body.get("stream_options") or {}
    include_usage = isinstance(options, dict) and options.get("include_usage") is True
    max_tokens = number(body, "max_tokens", 1, integer=True, default=16)  # the completions API's own default
    ids = state.builder.completion(prompt)
    vocab = int(getattr(state.model.config, "vocab_size", 0) or 0)
    if vocab and any(not 0 <= t < vocab for t in ids):
        raise bad(f"'prompt' has token ids outside the vocabulary (0..{vocab - 1})", "prompt")
    max_tokens = check_context(len(ids), max_tokens, state.max_context, "max_tokens", state.context_why, state.context_int4)
    params = sampling(body, max_tokens, 2.0)
    echo = ""
    if boolean(body, "echo"):
        echo = prompt if isinstance(prompt, str) else state.builder.decode(ids)
    return Prepared(GenerationRequest(ids, params, stop_strings(body.get("stop"), "stop")), stream, False, include_usage, headers,
                    echo=echo)


# -- responses -----------------------------------------------------------------------------------------
def usage(outcome) -> dict:
    return {"prompt_tokens": outcome.prompt_tokens, "completion_tokens": outcome.new_tokens,
            "total_tokens": outcome.prompt_tokens + outcome.new_tokens,
            "prompt_tokens_details": {"cached_tokens": outcome.reused_tokens}}


def _tool_call(call, index: int | None = None) -> dict:
    out = {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments_json}}
    return out if index is None else {"index": index, **out}


def chat_response(outcome, prepared: Prepared, state) -> dict:
    content, calls = prepared.reply_text(outcome), []
    if prepared.tools:
        content, calls = state.builder.parser.parse(content)
    message: dict = {"role": "assistant", "content": content if (content or not calls) else None}
    if calls:
        message["tool_calls"] = [_tool_call(c) for c in calls]
    return {
        "id": new_id("chatcmpl-"), "object": "chat.completion", "created": now(), "model": state.model_id,
        "choices": [{"index": 0, "message": message, "logprobs": None,
                     "finish_reason": "tool_calls" if calls else FINISH[outcome.finish_reason]}],
        "usage": usage(outcome), "system_fingerprint": None,
    }


def completion_response(outcome, prepared: Prepared, state) -> dict:
    return {
        "id": new_id("cmpl-"), "object": "text_completion", "created": now(), "model": state.model_id,
        "choices": [{"index": 0, "text": prepared.echo + outcome.text, "logprobs": None, "finish_reason": FINISH[outcome.finish_reason]}],
        "usage": usage(outcome),
    }


async def chat_stream(job, prepared: Prepared, state):
    """chat.completion.chunk events: the role, content pieces, tool calls whole at the end, finish_reason, usage, [DONE]."""
    base = {"id": new_id("chatcmpl-"), "object": "chat.completion.chunk", "created": now(), "model": state.model_id,
            "system_fingerprint": None}

    def chunk(delta: dict, finish: str | None = None, **extra) -> str:
        return sse({**base, "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}], **extra})

    splitter = prepared.splitter(state.builder.parser)
    yield chunk({"role": "assistant", "content": ""})
    async for kind, payload in job_events(job):
        if kind == "heartbeat":
            yield ": keep-alive\n\n"
        elif kind == "text":
            text = splitter.feed(payload) if splitter else payload
            if text:
                yield chunk({"content": text})
        elif kind == "failed":
            yield sse({"error": {"message": f"generation failed: {payload}", "type": "server_error", "param": None, "code": None}})
            yield sse("[DONE]")
        elif kind in ("done", "cancelled"):  # cancelled: the server is stopping; the stream still ends as the API says
            calls = []
            if splitter:
                held = splitter.feed(prepared.closing(payload))
                rest, calls = splitter.finish()
                rest = held + rest
                if rest:
                    yield chunk({"content": rest})
                if calls:
                    yield chunk({"tool_calls": [_tool_call(c, i) for i, c in enumerate(calls)]})
            finish = "tool_calls" if calls else FINISH[payload.finish_reason]
            if prepared.include_usage:
                yield chunk({}, finish)
                yield sse({**base, "choices": [], "usage": usage(payload)})
            else:
                yield chunk({}, finish, usage=usage(payload))
            yield sse("[DONE]")


async def completion_stream(job, prepared: Prepared, state):
    base = {"id": new_id("cmpl-"), "object": "text_completion", "created": now(), "model": state.model_id}

    def chunk(text: str, finish: str | None = None, **extra) -> str:
        return sse({**base, "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}], **extra})

    if prepared.echo:
        yield chunk(prepared.echo)
    async for kind, payload in job_events(job):
        if kind == "heartbeat":
            yield ": keep-alive\n\n"
        elif kind == "text":
            yield chunk(payload)
        elif kind == "failed":
            yield sse({"error": {"message": f"generation failed: {payload}", "type": "server_error", "param": None, "code": None}})
            yield sse("[DONE]")
        elif kind in ("done", "cancelled"):  # cancelled: the server is stopping; the stream still ends as the API says
            if prepared.include_usage:
                yield chunk("", FINISH[payload.finish_reason])
                yield sse({**base, "choices": [], "usage": usage(payload)})
            else:
                yield chunk("", FINISH[payload.finish_reason], usage=usage(payload))
            yield sse("[DONE]")
