"""OpenAI's Responses API, the subset local servers offer: POST /v1/responses, streamed or not.

A request is translated once into the chat completion it means (input items and instructions into messages, flat
function tools into nested ones, text.format into response_format, max_output_tokens into max_tokens) and prepared by
openai_requests.prepare_chat, so its checks, prompts, constraints and tool calls are the chat endpoint's own. What the
Responses API has and this server cannot keep is a 400 naming it: previous_response_id (nothing is stored), built-in
tools (web search, file search, code interpreter ...), background runs, and store: true.
"""

from __future__ import annotations

import json

from .events import job_events, new_id, now, sse
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


# -- responses -----------------------------------------------------------------------------------------
def _usage(outcome) -> dict:
    return {
        "input_tokens": outcome.prompt_tokens,
        "input_tokens_details": {"cached_tokens": outcome.reused_tokens},
        "output_tokens": outcome.new_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": outcome.prompt_tokens + outcome.new_tokens,
    }


def _shell(prepared: Prepared, state, rid: str, status: str) -> dict:
    """The response object before its output: what the request asked for, as the API repeats it."""
    return {
        "id": rid,
        "object": "response",
        "created_at": now(),
        "status": status,
        "model": state.model_id,
        "output": [],
        "error": None,
        "incomplete_details": None,
        "metadata": {},
        "usage": None,
        **prepared.settings,
    }


def _items(outcome, prepared: Prepared, state) -> list[dict]:
    text, calls = prepared.reply_text(outcome), []
    if prepared.tools:
        text, calls = state.builder.parser.parse(text)
    items = []
    if text or not calls:
        items.append(
            {
                "type": "message",
                "id": new_id("msg_"),
                "status": "completed",
                "role": "assistant",
                "content": [{"type": "output_text", "text": text, "annotations": []}],
            }
        )
    for call in calls:
        items.append(
            {
                "type": "function_call",
                "id": new_id("fc_"),
                "call_id": call.id,
                "name": call.name,
                "arguments": call.arguments_json,
                "status": "completed",
            }
        )
    return items


def _finished(response: dict, outcome, items: list[dict]) -> dict:
    cut = outcome.finish_reason == "length"
    return {
        **response,
        "status": "incomplete" if cut else "completed",
        "output": items,
        "usage": _usage(outcome),
        "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
    }


def response_body(outcomes: list, prepared: Prepared, state) -> dict:
    outcome = outcomes[0]
    return _finished(_shell(prepared, state, new_id("resp_"), "in_progress"), outcome, _items(outcome, prepared, state))


async def response_stream(job, prepared: Prepared, state):
    """The standard events: response.created, response.in_progress, then a message item whose text streams as
    response.output_text.delta (or function_call items with their argument deltas), then response.completed (whose
    response says "incomplete" when max_output_tokens cut it)."""
    rid = new_id("resp_")
    response = _shell(prepared, state, rid, "in_progress")
    sequence = iter(range(1 << 62))

    def event(kind: str, **data) -> str:
        return sse({"type": kind, "sequence_number": next(sequence), **data}, kind)

    yield event("response.created", response=response)
    yield event("response.in_progress", response=response)
    splitter = prepared.splitter(state.builder.parser)
    message_id, text, opened = new_id("msg_"), "", False

    def message(piece: str) -> list[str]:
        """The events for a piece of the message's text ("" only opens it): the item and its part first, once."""
        nonlocal opened, text
        out = []
        if not opened:
            opened = True
            item = {"type": "message", "id": message_id, "status": "in_progress", "role": "assistant", "content": []}
            out += [
                event("response.output_item.added", output_index=0, item=item),
                event(
                    "response.content_part.added",
                    item_id=message_id,
                    output_index=0,
                    content_index=0,
                    part={"type": "output_text", "text": "", "annotations": []},
                ),
            ]
        if piece:
            text += piece
            out.append(
                event("response.output_text.delta", item_id=message_id, output_index=0, content_index=0, delta=piece)
            )
        return out

    async for kind, payload in job_events(job):
        if kind == "heartbeat":
            yield ": keep-alive\n\n"
        elif kind == "text":
            piece = splitter.feed(payload[1]) if splitter else payload[1]
            for line in message(piece) if piece else []:
                yield line
        elif kind == "failed":
            yield event(
                "response.failed",
                response={
                    **response,
                    "status": "failed",
                    "error": {"code": "server_error", "message": f"generation failed: {payload}"},
                },
            )
        elif kind in ("done", "cancelled"):
            calls = []
            if splitter:
                rest, calls = prepared.finish(splitter, payload)
                for line in message(rest) if rest else []:
                    yield line
            items = []
            if opened or not calls:
                for line in message(""):
                    yield line
                part = {"type": "output_text", "text": text, "annotations": []}
                yield event("response.output_text.done", item_id=message_id, output_index=0, content_index=0, text=text)
                yield event(
                    "response.content_part.done", item_id=message_id, output_index=0, content_index=0, part=part
                )
                item = {
                    "type": "message",
                    "id": message_id,
                    "status": "completed",
                    "role": "assistant",
                    "content": [part],
                }
                yield event("response.output_item.done", output_index=0, item=item)
                items.append(item)
            for call in calls:
                index = len(items)
                item = {
                    "type": "function_call",
                    "id": new_id("fc_"),
                    "call_id": call.id,
                    "name": call.name,
                    "arguments": "",
                    "status": "in_progress",
                }
                yield event("response.output_item.added", output_index=index, item=item)
                yield event(
                    "response.function_call_arguments.delta",
                    item_id=item["id"],
                    output_index=index,
                    delta=call.arguments_json,
                )
                yield event(
                    "response.function_call_arguments.done",
                    item_id=item["id"],
                    output_index=index,
                    arguments=call.arguments_json,
                )
                item = {**item, "arguments": call.arguments_json, "status": "completed"}
                yield event("response.output_item.done", output_index=index, item=item)
                items.append(item)
            # response.completed also when max_output_tokens cut the reply (status "incomplete" says so), as vLLM sends
            # it:
            # the openai SDK's stream helper waits for that event alone
            yield event("response.completed", response=_finished(response, payload, items))
