"""A job's events as a response streams them, SSE framing, and the ids and times responses carry."""

from __future__ import annotations

import json
import time
import uuid

from ..text.loop import GenerationOutcome
from .worker import STOP_WAIT_S


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
    return GenerationOutcome(
        text="", token_ids=[], prompt_tokens=len(job.request.prompt_ids), finish_reason="cancelled"
    )
