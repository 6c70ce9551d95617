"""OpenAI Responses requests as the chat completion they mean: input items become messages, its tools and
tool_choice and text.format the chat fields, so openai_requests.prepare_chat checks and prepares them."""

from __future__ import annotations

import json

from .openai_requests import prepare_chat
from .prepared import Prepared
from .refusals import bad

FIELDS = frozenset(
    {
        "model",
        "input",
        "instructions",
        "max_output_tokens",
        "temperature",
        "top_p",
        "top_k",
        "seed",
        "stream",
        "stream_options",
        "tools",
        "tool_choice",
        "parallel_tool_calls",
        "text",
        "store",
        "truncation",
        "top_logprobs",
        "include",
        "reasoning",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
    }
)


REFUSED = {
    "previous_response_id": "this server stores no responses; send the whole conversation in 'input'",
    "conversation": "this server stores no conversations; send the whole conversation in 'input'",
    "background": "this server runs requests in the foreground only",
    "prompt": "stored prompts are not kept here",
    "max_tool_calls": "not implemented",
}


# chat field -> ours
PARAMS = {"response_format": "text.format", "max_tokens": "max_output_tokens", "messages": "input"}


def prepare_response(body: dict, state) -> Prepared:
    """The Responses request as a prepared chat completion (its errors naming the Responses fields)."""
    from .fields import check_fields
    from .refusals import APIError

    check_fields(body, FIELDS, REFUSED)
    for name, allowed in (("store", (None, False)), ("background", (None, False)), ("truncation", (None, "disabled"))):
        if body.get(name) not in allowed:
            raise bad(
                f"'{name}' is not supported here (it may be "
                f"{' or '.join(json.dumps(a) for a in allowed if a is not None)})",
                name,
            )
    reasoning = body.get("reasoning")
    if reasoning not in (None, {}) and not (
        isinstance(reasoning, dict) and reasoning.get("effort") in (None, "none", "minimal")
    ):
        raise bad("'reasoning' is not supported: the model has no reasoning setting", "reasoning")
    if body.get("include"):
        raise bad(f"'include' is not supported (got {body['include']!r})", "include")
    chat = {"model": body.get("model"), "messages": _messages(body), "stream": False}
    for ours, theirs in (
        ("max_output_tokens", "max_tokens"),
        ("temperature", "temperature"),
        ("top_p", "top_p"),
        ("top_k", "top_k"),
        ("seed", "seed"),
        ("parallel_tool_calls", "parallel_tool_calls"),
        ("presence_penalty", "presence_penalty"),
        ("frequency_penalty", "frequency_penalty"),
        ("repetition_penalty", "repetition_penalty"),
    ):
        if body.get(ours) is not None:
            chat[theirs] = body[ours]
    if body.get("tools") is not None:
        chat["tools"] = _tools(body["tools"])
    if body.get("tool_choice") is not None:
        chat["tool_choice"] = _tool_choice(body["tool_choice"])
    fmt = _format(body.get("text"))
    if fmt is not None:
        chat["response_format"] = fmt
    try:
        prepared = prepare_chat(chat, state)
    except APIError as err:
        if err.param in PARAMS:
            err = APIError(
                err.status, err.message.replace(f"'{err.param}'", f"'{PARAMS[err.param]}'"), PARAMS[err.param], err.code
            )
        raise err from None
    prepared.stream = body.get("stream") is True
    prepared.settings = {
        "instructions": body.get("instructions"),
        "max_output_tokens": body.get("max_output_tokens"),
        "temperature": body.get("temperature"),
        "top_p": body.get("top_p"),
        "tools": body.get("tools") or [],
        "tool_choice": body.get("tool_choice") or "auto",
        "parallel_tool_calls": body.get("parallel_tool_calls", True),
        "text": body.get("text") or {"format": {"type": "text"}},
    }
    return prepared


def _messages(body: dict) -> list[dict]:
    """input (a string, or message and function-call items) and instructions as chat messages."""
    messages: list[dict] = []
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise bad("'instructions' must be a string", "instructions")
        messages.append({"role": "system", "content": instructions})
    given = body.get("input")
    if given is None:
        raise bad("missing required field 'input'", "input")
    if isinstance(given, str):
        return messages + [{"role": "user", "content": given}]
    if not isinstance(given, list) or not given:
        raise bad("'input' must be a string or a non-empty list of items", "input")
    for i, item in enumerate(given):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise bad(f"'{where}' must be an object", "input")
        kind = item.get("type", "message")
        if kind == "message":
            messages.append({"role": item.get("role"), "content": _content(item.get("content"), where)})
        elif kind == "function_call":
            call = {
                "id": item.get("call_id") or "",
                "type": "function",
                "function": {"name": item.get("name"), "arguments": item.get("arguments") or "{}"},
            }
            if messages and messages[-1]["role"] == "assistant" and messages[-1].get("tool_calls") is not None:
                messages[-1]["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            messages.append(
                {
                    "role": "tool",
                    "tool_call_id": item.get("call_id") or "",
                    "content": output if isinstance(output, str) else json.dumps(output),
                }
            )
        elif kind == "reasoning":
            continue
        else:
            raise bad(
                f"'{where}.type' {kind!r} is not supported (message, function_call and function_call_output are)",
                "input",
            )
    return messages


def _content(content: object, where: str) -> object:
    if isinstance(content, str) or content is None:
        return content
    if not isinstance(content, list):
        raise bad(f"'{where}.content' must be a string or a list of content parts", "input")
    parts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text"):
            parts.append({"type": "text", "text": part.get("text")})
        elif kind == "input_image":
            url = part.get("image_url")
            parts.append({"type": "image_url", "image_url": {"url": url.get("url") if isinstance(url, dict) else url}})
        else:
            raise bad(
                f"'{where}.content[{j}].type' must be input_text, output_text or input_image (got {kind!r})", "input"
            )
    return parts


def _tools(tools: object) -> list:
    if not isinstance(tools, list):
        raise bad("'tools' must be a list of function tools", "tools")
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else None
            raise bad(
                f"'tools[{i}]' is a {kind!r} tool; this server has function tools only (no built-in tools)", "tools"
            )
        fn = {k: tool[k] for k in ("name", "description", "parameters", "strict") if k in tool}
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(choice: object) -> object:
    if isinstance(choice, dict):
        if choice.get("type") != "function":
            raise bad(
                f"'tool_choice' must be none, auto, required or {{\"type\": \"function\", \"name\": ...}} (got "
                f"{choice!r})",
                "tool_choice",
            )
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice


def _format(text: object) -> dict | None:
    if text is None:
        return None
    if not isinstance(text, dict) or set(text) - {"format", "verbosity"}:
        raise bad("'text' must be an object with 'format'", "text")
    fmt = text.get("format")
    if fmt is None or (isinstance(fmt, dict) and fmt.get("type") == "text"):
        return None
    if not isinstance(fmt, dict):
        raise bad("'text.format' must be an object", "text.format")
    if fmt.get("type") == "json_schema":
        return {
            "type": "json_schema",
            "json_schema": {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt},
        }
    return fmt
