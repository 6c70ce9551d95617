"""OpenAI's Responses API, the subset local servers offer: POST /v1/responses, streamed or not.

A request is translated once into the chat completion it means (input items and instructions into messages, flat
function tools into nested ones, text.format into response_format, max_output_tokens into max_tokens) and prepared by
openai_requests.prepare_chat, so its checks, prompts, constraints and tool calls are the chat endpoint's own. What the
Responses API has and this server cannot keep is a 400 naming it: previous_response_id (nothing is stored), built-in
tools (web search, file search, code interpreter ...), background runs, and store: true.
"""

from __future__ import annotations

from .events import job_events, new_id, now, sse
from .prepared import Prepared


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
