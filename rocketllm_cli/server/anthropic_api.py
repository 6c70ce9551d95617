"""The Anthropic Messages API: POST /v1/messages (and count_tokens), in Anthropic's request, response,
stream-event and error shapes.

Stream: message_start, then per content block content_block_start / content_block_delta (text_delta, or
input_json_delta for a tool_use block) / content_block_stop, then message_delta (stop_reason, usage) and
message_stop; ping events keep a quiet stream alive."""

from __future__ import annotations

import json

from .events import job_events, new_id, sse
from .prepared import Prepared
from .refusals import APIError

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    529: "overloaded_error",
}


def error_body(err: APIError) -> dict:
    return {
        "type": "error",
        "error": {
            "type": ERROR_TYPES.get(err.status, "api_error" if err.status >= 500 else "invalid_request_error"),
            "message": err.message,
        },
    }


def models(state) -> dict:
    from datetime import datetime, timezone

    created = datetime.fromtimestamp(state.created, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    card = {
        "type": "model",
        "id": state.model_id,
        "display_name": state.model_id,
        "created_at": created,
        "max_input_tokens": state.max_context,
        "max_tokens": state.max_context,
    }
    return {"data": [card], "has_more": False, "first_id": state.model_id, "last_id": state.model_id}


# -- responses -----------------------------------------------------------------------------------------
def _stop_reason(outcome, calls) -> str:
    if calls:
        return "tool_use"
    if outcome.stop_sequence is not None:
        return "stop_sequence"
    if outcome.finish_reason == "length":
        return "max_tokens"
    return "end_turn"


def usage(outcome) -> dict:
    return {
        "input_tokens": outcome.prompt_tokens - outcome.reused_tokens,
        "output_tokens": outcome.new_tokens,
        "cache_read_input_tokens": outcome.reused_tokens,
        "cache_creation_input_tokens": 0,
    }


def _tool_id(call) -> str:
    return "toolu_" + call.id.removeprefix("call_")


def message_response(outcomes: list, prepared: Prepared, state) -> dict:
    outcome = outcomes[0]
    text, calls = prepared.reply_text(outcome), []
    if prepared.tools:
        text, calls = state.builder.parser.parse(text)
    content: list[dict] = [{"type": "text", "text": text}] if text or not calls else []
    content += [{"type": "tool_use", "id": _tool_id(c), "name": c.name, "input": c.arguments} for c in calls]
    return {
        "id": new_id("msg_"),
        "type": "message",
        "role": "assistant",
        "model": state.model_id,
        "content": content,
        "stop_reason": _stop_reason(outcome, calls),
        "stop_sequence": outcome.stop_sequence,
        "usage": usage(outcome),
    }


async def message_stream(job, prepared: Prepared, state):
    message = {
        "id": new_id("msg_"),
        "type": "message",
        "role": "assistant",
        "model": state.model_id,
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
        "usage": {"input_tokens": len(prepared.request.prompt_ids), "output_tokens": 0},
    }
    yield sse({"type": "message_start", "message": message}, "message_start")
    splitter = prepared.splitter(state.builder.parser)
    index = -1
    text_open = False

    def open_text():
        nonlocal index, text_open
        index += 1
        text_open = True
        return sse(
            {"type": "content_block_start", "index": index, "content_block": {"type": "text", "text": ""}},
            "content_block_start",
        )

    def text_delta(text: str) -> str:
        return sse(
            {"type": "content_block_delta", "index": index, "delta": {"type": "text_delta", "text": text}},
            "content_block_delta",
        )

    def close_text() -> str:
        nonlocal text_open
        text_open = False
        return sse({"type": "content_block_stop", "index": index}, "content_block_stop")

    yield sse({"type": "ping"}, "ping")
    async for kind, payload in job_events(job):
        if kind == "heartbeat":
            yield sse({"type": "ping"}, "ping")
        elif kind == "text":
            piece = payload[1]
            text = splitter.feed(piece) if splitter else piece
            if text:
                if not text_open:
                    yield open_text()
                yield text_delta(text)
        elif kind == "failed":
            yield sse(
                {"type": "error", "error": {"type": "api_error", "message": f"generation failed: {payload}"}}, "error"
            )
        elif kind in ("done", "cancelled"):  # cancelled: the server is stopping; the stream still ends as the API says
            calls = []
            if splitter:
                rest, calls = prepared.finish(splitter, payload)
                if rest:
                    if not text_open:
                        yield open_text()
                    yield text_delta(rest)
            if index < 0 and not calls:  # an empty reply is one empty text block
                yield open_text()
            if text_open:
                yield close_text()
            for call in calls:
                index += 1
                block = {"type": "tool_use", "id": _tool_id(call), "name": call.name, "input": {}}
                yield sse(
                    {"type": "content_block_start", "index": index, "content_block": block}, "content_block_start"
                )
                yield sse(
                    {
                        "type": "content_block_delta",
                        "index": index,
                        "delta": {
                            "type": "input_json_delta",
                            "partial_json": json.dumps(call.arguments, ensure_ascii=False),
                        },
                    },
                    "content_block_delta",
                )
                yield sse({"type": "content_block_stop", "index": index}, "content_block_stop")
            yield sse(
                {
                    "type": "message_delta",
                    "delta": {"stop_reason": _stop_reason(payload, calls), "stop_sequence": payload.stop_sequence},
                    "usage": usage(payload),
                },
                "message_delta",
            )
            yield sse({"type": "message_stop"}, "message_stop")
