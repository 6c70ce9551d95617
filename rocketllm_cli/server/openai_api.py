"""The OpenAI API: /v1/chat/completions, /v1/completions and /v1/models, in OpenAI's request, response,
stream-chunk and error shapes."""

from __future__ import annotations

from .events import job_events, new_id, now, outcomes_of, sse
from .logprob_shapes import chat_content, chat_logprobs, completion_logprobs, echoed
from .prepared import Prepared
from .refusals import APIError

FINISH = {"stop": "stop", "length": "length", "cancelled": "stop"}


ERROR_TYPES = {429: "rate_limit_error"}


def error_body(err: APIError) -> dict:
    kind = ERROR_TYPES.get(err.status, "invalid_request_error" if err.status < 500 else "server_error")
    return {"error": {"message": err.message, "type": kind, "param": err.param, "code": err.code}}


def model_card(state) -> dict:
    return {
        "id": state.model_id,
        "object": "model",
        "created": state.created,
        "owned_by": "rocketllm",
        "multimodal": state.multimodal,
        "max_context": state.max_context,
    }


def models(state) -> dict:
    return {"object": "list", "data": [model_card(state)]}


# -- responses -----------------------------------------------------------------------------------------
def engine_stats(outcomes: list, prepared: Prepared, state) -> dict:
    """{"x_rocketllm_stats": the figures a local `generate --stats` prints} for a caller that asked with STATS_HEADER
    (generate through a warm model or --server); {} for everyone else. Jobs run one at a time, so a request's bytes
    per tier are its own."""
    if not prepared.stats or not outcomes or outcomes[0].stats is None:
        return {}
    model = state.model
    return {
        "x_rocketllm_stats": {
            **outcomes[0].stats.to_dict(),
            "residency": state.residency,
            "device": str(model.device),
            "compute_dtype": str(model.dtype).replace("torch.", ""),
        }
    }


def usage(outcomes: list) -> dict:
    first = outcomes[0]
    generated = sum(o.new_tokens for o in outcomes)
    return {
        "prompt_tokens": first.prompt_tokens,
        "completion_tokens": generated,
        "total_tokens": first.prompt_tokens + generated,
        "prompt_tokens_details": {"cached_tokens": first.reused_tokens},
    }


def _tool_call(call, index: int | None = None) -> dict:
    out = {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments_json}}
    return out if index is None else {"index": index, **out}


def _reply_message(outcome, prepared: Prepared, state) -> tuple[dict, str]:
    content, calls = prepared.reply_text(outcome), []
    if prepared.tools:
        content, calls = state.builder.parser.parse(content)
    message: dict = {"role": "assistant", "content": content if (content or not calls) else None}
    if calls:
        message["tool_calls"] = [_tool_call(c) for c in calls]
    return message, "tool_calls" if calls else FINISH[outcome.finish_reason]


def chat_response(outcomes: list, prepared: Prepared, state) -> dict:
    choices = []
    for index, outcome in enumerate(outcomes):
        message, finish = _reply_message(outcome, prepared, state)
        choices.append(
            {
                "index": index,
                "message": message,
                "finish_reason": finish,
                "logprobs": chat_logprobs(outcome.logprobs, state.token_text),
            }
        )
    return {
        "id": new_id("chatcmpl-"),
        "object": "chat.completion",
        "created": now(),
        "model": state.model_id,
        "choices": choices,
        "usage": usage(outcomes),
        "system_fingerprint": None,
    }


def _completion_logprobs(outcome, prepared: Prepared, state) -> dict | None:
    if outcome.logprobs is None:
        return None
    entries = (echoed(prepared.echo_ids, outcome.prompt_logprobs) if prepared.echo_ids is not None else []) + list(
        outcome.logprobs
    )
    return completion_logprobs(entries, state.token_text)


def completion_response(outcomes: list, prepared: Prepared, state) -> dict:
    choices = [
        {
            "index": index,
            "text": prepared.echo + outcome.text,
            "logprobs": _completion_logprobs(outcome, prepared, state),
            "finish_reason": FINISH[outcome.finish_reason],
        }
        for index, outcome in enumerate(outcomes)
    ]
    return {
        "id": new_id("cmpl-"),
        "object": "text_completion",
        "created": now(),
        "model": state.model_id,
        "choices": choices,
        "usage": usage(outcomes),
    }


def _failed(payload) -> tuple[str, str]:
    """A stream whose generation failed ends with an error event, then [DONE], as OpenAI's streams do."""
    error = {"message": f"generation failed: {payload}", "type": "server_error", "param": None, "code": None}
    return sse({"error": error}), sse("[DONE]")


async def chat_stream(job, prepared: Prepared, state):
    """chat.completion.chunk events: each choice's role, content pieces (with the log-probabilities of the tokens they
    carry), tool calls whole at the end, finish_reason; then usage and [DONE]."""
    base = {
        "id": new_id("chatcmpl-"),
        "object": "chat.completion.chunk",
        "created": now(),
        "model": state.model_id,
        "system_fingerprint": None,
    }
    n = prepared.n
    splitters = [prepared.splitter(state.builder.parser) for _ in range(n)]
    pending: list[list] = [[] for _ in range(n)]  # log-probabilities of tokens whose text has not gone out yet
    wants = prepared.request.logprobs is not None

    def chunk(index: int, delta: dict, finish: str | None = None, **extra) -> str:
        entries, pending[index] = pending[index], []
        logprobs = (
            {"content": chat_content(entries, state.token_text), "refusal": None}
            if wants and (entries or finish)
            else None
        )
        return sse(
            {
                **base,
                "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}],
                **extra,
            }
        )

    for index in range(n):
        yield chunk(index, {"role": "assistant", "content": ""})
    async for kind, payload in job_events(job):
        if kind == "heartbeat":
            yield ": keep-alive\n\n"
        elif kind == "logprobs":
            pending[payload[0]].extend(payload[1])
        elif kind == "text":
            index, piece = payload
            text = splitters[index].feed(piece) if splitters[index] else piece
            if text:
                yield chunk(index, {"content": text})
        elif kind == "failed":
            for event in _failed(payload):
                yield event
        elif kind in ("done", "cancelled"):  # cancelled: the server is stopping; the stream still ends as the API says
            outcomes = outcomes_of(job, payload)
            for index, outcome in enumerate(outcomes):
                calls, splitter = [], splitters[index]
                if splitter:
                    rest, calls = prepared.finish(splitter, outcome)
                    if rest:
                        yield chunk(index, {"content": rest})
                    if calls:
                        yield chunk(index, {"tool_calls": [_tool_call(c, i) for i, c in enumerate(calls)]})
                finish = "tool_calls" if calls else FINISH[outcome.finish_reason]
                last = index == n - 1 and not prepared.include_usage
                yield chunk(index, {}, finish, **({"usage": usage(outcomes)} if last else {}))
            if prepared.include_usage:
                yield sse({**base, "choices": [], "usage": usage(outcomes), **engine_stats(outcomes, prepared, state)})
            yield sse("[DONE]")


async def completion_stream(job, prepared: Prepared, state):
    """text_completion chunks: an echoed prompt first, then each choice's pieces with the log-probabilities of the
    tokens they carry, finish_reason, usage, [DONE]. An echo with log-probabilities waits for the prompt's, which come
    with the outcome: its choices are then sent whole at the end, the echo first."""
    base = {"id": new_id("cmpl-"), "object": "text_completion", "created": now(), "model": state.model_id}
    n = prepared.n
    pending: list[list] = [[] for _ in range(n)]
    offsets = [len(prepared.echo)] * n  # text_offset of the next token, per choice
    wants = prepared.request.logprobs is not None
    whole = bool(prepared.echo) and wants  # the echo's log-probabilities come with the outcome: send each choice whole

    def chunk(index: int, text: str, finish: str | None = None, **extra) -> str:
        entries, pending[index] = pending[index], []
        logprobs = None
        if wants and entries:
            logprobs = completion_logprobs(entries, state.token_text, offsets[index])
            offsets[index] += sum(len(t or "") for t in logprobs["tokens"])
        return sse(
            {
                **base,
                "choices": [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}],
                **extra,
            }
        )

    if prepared.echo and not whole:
        for index in range(n):
            yield chunk(index, prepared.echo)
    async for kind, payload in job_events(job):
        if kind == "heartbeat":
            yield ": keep-alive\n\n"
        elif kind == "logprobs" and not whole:
            pending[payload[0]].extend(payload[1])
        elif kind == "text" and not whole:
            yield chunk(*payload)
        elif kind == "failed":
            for event in _failed(payload):
                yield event
        elif kind in ("done", "cancelled"):  # cancelled: the server is stopping; the stream still ends as the API says
            outcomes = outcomes_of(job, payload)
            for index, outcome in enumerate(outcomes):
                if whole:
                    echo = (
                        completion_logprobs(echoed(prepared.echo_ids, outcome.prompt_logprobs), state.token_text)
                        if outcome.prompt_logprobs
                        else None
                    )
                    yield sse(
                        {
                            **base,
                            "choices": [
                                {"index": index, "text": prepared.echo, "logprobs": echo, "finish_reason": None}
                            ],
                        }
                    )
                    pending[index] = list(outcome.logprobs or [])
                    if outcome.text or pending[index]:
                        yield chunk(index, outcome.text)
                last = index == n - 1 and not prepared.include_usage
                yield chunk(index, "", FINISH[outcome.finish_reason], **({"usage": usage(outcomes)} if last else {}))
            if prepared.include_usage:
                yield sse({**base, "choices": [], "usage": usage(outcomes), **engine_stats(outcomes, prepared, state)})
            yield sse("[DONE]")
