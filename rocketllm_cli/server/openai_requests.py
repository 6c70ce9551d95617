"""OpenAI chat and completion requests, checked field by field and made the Prepared request the worker runs:
messages and their content parts, tools and tool_choice, response_format, logit_bias, n, logprobs; the fields this
server refuses or ignores, said by name."""

from __future__ import annotations

from ..text.constraints import Constraint
from ..text.logprobs import MAX_TOP
from ..text.loop import GenerationRequest
from .fields import (
    boolean,
    check_fields,
    check_model,
    function_tool,
    number,
    required,
    sampling,
    stop_strings,
    string,
    tool_list,
    tool_schema,
)
from .imageparts import openai_image
from .prepared import Prepared
from .prompts import PromptError
from .refusals import bad, check_context
from .structured import plan, relaxed_header

SAMPLING = frozenset(
    {
        "model",
        "max_tokens",
        "temperature",
        "top_p",
        "top_k",
        "seed",
        "n",
        "stream",
        "stream_options",
        "stop",
        "logprobs",
        "logit_bias",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
    }
)


CHAT_FIELDS = SAMPLING | {
    "messages",
    "max_completion_tokens",
    "top_logprobs",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "response_format",
    "store",
    "modalities",
}


COMPLETION_FIELDS = SAMPLING | {"prompt", "echo", "suffix", "best_of"}


REFUSED = {  # OpenAI fields with an effect this server does not have
    "audio": "this server replies in text only",
    "prediction": "predicted outputs are not implemented",
    "web_search_options": "this server has no web search",
    "functions": "the legacy functions API is not implemented; send 'tools'",
    "function_call": "send 'tool_choice' with 'tools'",
    "reasoning_effort": "the model has no reasoning effort setting",
    "verbosity": "the model has no verbosity setting",
}


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
            raise bad(
                f"'{where}content[{j}]' is {kind}, but {state.model_id} takes "
                f"text{' and image_url parts' if state.multimodal else ''} only",
                f"{where}content",
            )
        else:
            raise bad(
                f"'{where}content[{j}].type' must be 'text'{' or image_url' if state.multimodal else ''} (got "
                f"{kind!r})",
                f"{where}content",
            )
    return parts if len(parts) > len(texts) else "\n".join(texts)


def chat_message(m: object, i: int, state) -> dict:
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
            out["tool_calls"].append(
                {"id": c.get("id") or "", "type": "function", "function": {"name": name, "arguments": args}}
            )
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
    params = (
        {"type": "object", "properties": {}} if params is None else tool_schema(params, f"{where}function.parameters")
    )
    return function_tool(
        string(fn, "name", f"{where}function.", needed=True), string(fn, "description", f"{where}function."), params
    )


def tool_choice(value: object, tools: list[dict], param: str = "tool_choice") -> object:
    """'none' | 'auto' | 'required' | {'name': ...}, checked against the tools offered."""
    if value is None:
        return "auto" if tools else "none"
    if isinstance(value, dict):
        fn = value.get("function") if isinstance(value.get("function"), dict) else value
        name = fn.get("name")
        if not isinstance(name, str):
            raise bad(
                f"'{param}' must be none, auto, required or {{\"type\": \"function\", \"function\": {{\"name\": "
                f"...}}}}",
                param,
            )
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
    if options is not None and (
        not isinstance(options, dict) or set(options) - {"include_usage", "include_obfuscation"}
    ):
        raise bad(
            "'stream_options' must be an object with 'include_usage' (and 'include_obfuscation')", "stream_options"
        )


MAX_N = 64  # choices per request at most; the context check bounds it further by memory


def _choices(body: dict, prompt_tokens: int, max_tokens: int, state) -> int:
    """n: choices generated as rows of one batch, each holding its own KV cache, so all of them must fit the context."""
    n = number(body, "n", 1, MAX_N, integer=True, default=1)
    if n > 1 and n * (prompt_tokens + max_tokens) > state.max_context:
        raise bad(
            f"n={n} choices of {prompt_tokens} prompt tokens and {max_tokens} new ones need "
            f"{n * (prompt_tokens + max_tokens)} tokens "
            f"of KV cache, but the memory holds {state.max_context}; lower n or max_tokens",
            "n",
        )
    return n


def logit_bias(value: object, state) -> tuple:
    """logit_bias {token id: bias in [-100, 100]} as the sampling settings' pairs."""
    if value is None or value == {}:
        return ()
    if not isinstance(value, dict):
        raise bad("'logit_bias' must be an object mapping token ids to biases", "logit_bias")
    vocab = int(getattr(state.model.config, "vocab_size", 0) or 0)
    pairs = []
    for key, bias in value.items():
        if not (isinstance(key, str) and key.lstrip("-").isdigit()) or not (vocab == 0 or 0 <= int(key) < vocab):
            raise bad(f"'logit_bias' key {key!r} is not a token id of this model (0..{vocab - 1})", "logit_bias")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not -100 <= bias <= 100:
            raise bad(f"'logit_bias' of token {key} must be a number between -100 and 100 (got {bias!r})", "logit_bias")
        pairs.append((int(key), float(bias)))
    return tuple(sorted(pairs))


def prepare_chat(body: dict, state) -> Prepared:
    check_model(body, state)
    raw = required(body, "messages")
    if not isinstance(raw, list) or not raw:
        raise bad("'messages' must be a non-empty list", "messages")
    messages = [chat_message(m, i, state) for i, m in enumerate(raw)]
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
    max_tokens = check_context(
        len(ids), max_tokens, state.max_context, param, state.context_why, state.context_int4, state.default_max_tokens
    )
    n = _choices(body, len(ids), max_tokens, state)
    params = sampling(body, max_tokens, 2.0, logit_bias=logit_bias(body.get("logit_bias"), state))
    use_tools = bool(tools) and choice != "none"
    request = GenerationRequest(
        ids, params, stop, model_inputs=inputs, constraint=structure.constraint, logprobs=_chat_logprobs(body)
    )
    return Prepared(
        request, stream, use_tools, include_usage, {**headers, **relaxed_header(structure)}, structure=structure, n=n
    )


def _chat_logprobs(body: dict) -> int | None:
    """logprobs: true (and top_logprobs 0-20): the count of most likely tokens to report with each token, else None."""
    wanted = boolean(body, "logprobs")
    top = number(body, "top_logprobs", 0, MAX_TOP, integer=True)
    if top is not None and not wanted:
        raise bad("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    return (top or 0) if wanted else None


def strict_tools(tools: object) -> bool:
    """Whether any function tool asks for strict adherence to its schema (function.strict: true)."""
    return isinstance(tools, list) and any(
        isinstance(t, dict) and isinstance(t.get("function"), dict) and t["function"].get("strict") is True
        for t in tools
    )


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
    echo = boolean(body, "echo")
    top = number(body, "logprobs", 0, 5, integer=True)
    # max_tokens 0 with echo: score the prompt, generate nothing (lm-evaluation-harness's loglikelihood asks so)
    # the completions API's own default
    max_tokens = number(body, "max_tokens", 0 if echo else 1, integer=True, default=16)
    ids = state.builder.completion(prompt)
    vocab = int(getattr(state.model.config, "vocab_size", 0) or 0)
    if vocab and any(not 0 <= t < vocab for t in ids):
        raise bad(f"'prompt' has token ids outside the vocabulary (0..{vocab - 1})", "prompt")
    max_tokens = check_context(
        len(ids), max_tokens, state.max_context, "max_tokens", state.context_why, state.context_int4
    )
    n = _choices(body, len(ids), max_tokens, state)
    params = sampling(body, max(1, max_tokens), 2.0, logit_bias=logit_bias(body.get("logit_bias"), state))
    text = (prompt if isinstance(prompt, str) else state.builder.decode(ids)) if echo else ""
    request = GenerationRequest(
        ids,
        params,
        stop_strings(body.get("stop"), "stop"),
        logprobs=top,
        prompt_logprobs=top if echo and top is not None else None,
        score_only=max_tokens == 0,
    )
    return Prepared(request, stream, False, include_usage, headers, echo=text, n=n, echo_ids=ids if echo else None)
