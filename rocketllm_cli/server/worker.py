"""The worker: one thread owns the model and runs jobs first in, first out (no batching across requests).

A job's queue position is the number of jobs ahead of it when it arrived, the running one included, so
the first of two concurrent requests is 0 and the second 1. The request side waits on the job's events
(text pieces, then done or failed) delivered into its asyncio loop; cancelling a job removes it from the
queue, or sets its cancel event so the running generation stops after its current step. When the server
stops, `halt()` refuses new jobs, cancels the queued ones and tells the running one's stream ("stopping"),
which then waits at most STOP_WAIT_S for the step to end rather than as long as a streamed step takes.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import math
import threading
import time
from dataclasses import dataclass, field

from ..text.loop import GenerationOutcome, GenerationRequest, Generator

HISTORY = 256  # finished jobs remembered (for /health and tests)
STOP_WAIT_S = 2.0  # a stopping server waits this long for the running generation step to end
STOP_TIMEOUT_S = 10.0  # how long stop() waits for the worker thread unless told otherwise
SHUTTING_DOWN = "the server is shutting down"
RETRY_AFTER_MAX_S = 600  # the longest retry-after a full queue advises


class QueueFull(Exception):
    """The queue holds its limit of waiting jobs; `retry_after` is the seconds the jobs ahead are expected to take."""

    def __init__(self, limit: int, retry_after: int) -> None:
        super().__init__(f"the queue is full ({limit} requests waiting for the model); retry after {retry_after} s")
        self.limit, self.retry_after = limit, retry_after


@dataclass
class Job:
    """One request: its prompt generated once, or as n rows of one batch (OpenAI's `n` choices, each streaming under
    its index). Events: ("text", (index, piece)), ("logprobs", (index, [TokenLogprob])), then done/cancelled/failed."""

    requests: list[GenerationRequest]
    endpoint: str = ""
    id: int = 0
    position: int = 0
    state: str = "new"  # queued | running | done | cancelled | failed
    outcomes: list[GenerationOutcome] = field(default_factory=list)
    error: BaseException | None = None
    enqueued_at: float = 0.0
    started_at: float | None = None
    finished_at: float | None = None
    _loop: asyncio.AbstractEventLoop | None = field(default=None, repr=False)
    _events: asyncio.Queue | None = field(default=None, repr=False)

    @property
    def request(self) -> GenerationRequest:
        return self.requests[0]

    @property
    def outcome(self) -> GenerationOutcome | None:
        return self.outcomes[0] if self.outcomes else None

    def attach(self, loop: asyncio.AbstractEventLoop, stream: bool) -> None:
        """Deliver events into `loop`; text pieces (and log-probabilities) only when `stream`."""
        self._loop = loop
        self._events = asyncio.Queue()
        if stream:
            for index, request in enumerate(self.requests):
                request.on_text = lambda piece, i=index: self._emit("text", (i, piece))
                if request.logprobs is not None:
                    request.on_logprobs = lambda entries, i=index: self._emit("logprobs", (i, entries))

    async def next_event(self, timeout: float | None = None) -> tuple[str, object]:
        assert self._events is not None
        if timeout is None:
            return await self._events.get()
        return await asyncio.wait_for(self._events.get(), timeout)

    @property
    def finished(self) -> bool:
        return self.state in ("done", "cancelled", "failed")

    def record(self) -> dict:
        o = self.outcome
        return {
            "id": self.id,
            "endpoint": self.endpoint,
            "state": self.state,
            "position": self.position,
            "prompt_tokens": len(self.request.prompt_ids),
            "generated_tokens": sum(x.new_tokens for x in self.outcomes),
            "reused_tokens": o.reused_tokens if o else 0,
            "finish_reason": o.finish_reason if o else None,
            "max_new_tokens": self.request.params.max_new_tokens,
            "waited_s": round((self.started_at or self.finished_at or time.monotonic()) - self.enqueued_at, 4),
            "ran_s": round(self.finished_at - self.started_at, 4) if self.started_at and self.finished_at else None,
            "enqueued_at": self.enqueued_at,
            "started_at": self.started_at,
            "finished_at": self.finished_at,
        }

    def _emit(self, kind: str, payload: object) -> None:
        loop, events = self._loop, self._events
        if loop is None or events is None:
            return
        try:
            loop.call_soon_threadsafe(events.put_nowait, (kind, payload))
        except RuntimeError:  # the loop is closed: nobody is waiting any more
            pass


class Worker:
    def __init__(self, generator: Generator, on_finish=None, max_queue: int | None = None) -> None:
        self.generator = generator
        self.max_queue = max_queue  # waiting jobs beyond which submit() refuses (None: no limit)
        self.on_finish = on_finish or (lambda job: None)
        self._queue: collections.deque[Job] = collections.deque()
        self._cv = threading.Condition()
        self._ids = itertools.count(1)
        self._stopping = False
        self._halted_at: float | None = None
        self.current: Job | None = None
        self.history: collections.deque[dict] = collections.deque(maxlen=HISTORY)
        self._thread = threading.Thread(target=self._loop, name="rocketllm-worker", daemon=True)
        self._thread.start()

    # -- request side -----------------------------------------------------------------------------
    def full(self) -> QueueFull | None:
        """The refusal a job would get now because the queue holds max_queue jobs, else None (submit checks again)."""
        with self._cv:
            if self.max_queue is not None and len(self._queue) >= self.max_queue:
                return QueueFull(self.max_queue, self._retry_after())
        return None

    def submit(self, job: Job) -> int:
        """Queue the job; returns its position (jobs ahead of it, the running one included). Raises QueueFull when
        max_queue jobs wait already."""
        with self._cv:
            if self._stopping:
                raise RuntimeError(SHUTTING_DOWN)
            if self.max_queue is not None and len(self._queue) >= self.max_queue:
                raise QueueFull(self.max_queue, self._retry_after())
            job.id = next(self._ids)
            job.position = len(self._queue) + (1 if self.current is not None else 0)
            job.state = "queued"
            job.enqueued_at = time.monotonic()
            self._queue.append(job)
            self._cv.notify()
            return job.position

    def _retry_after(self) -> int:
        """Whole seconds until the jobs ahead (waiting and running) are expected to be done, from the latest
        finished jobs' run times; at least 1."""
        ran = [h["ran_s"] for h in list(self.history)[-32:] if h["ran_s"] is not None]
        mean = sum(ran) / len(ran) if ran else 1.0
        ahead = len(self._queue) + (1 if self.current is not None else 0)
        return max(1, min(RETRY_AFTER_MAX_S, math.ceil(ahead * mean)))

    def cancel(self, job: Job) -> None:
        """The client went away: drop the job if it waits, stop it after the current step if it runs."""
        job.request.cancel.set()  # the rows of a job share one cancel event
        with self._cv:
            if job.state == "queued" and job in self._queue:
                self._queue.remove(job)
                self._finish(job, "cancelled")

    @property
    def queue_length(self) -> int:
        """Jobs waiting (not the one running)."""
        with self._cv:
            return len(self._queue)

    @property
    def busy(self) -> bool:
        return self.current is not None

    @property
    def stopping(self) -> bool:
        return self._stopping

    def halt(self) -> None:
        """Take no more jobs; cancel the queued ones now and the running one after its current step. Does not
        block (the server's event loop calls it), and the running job's stream hears "stopping" at once."""
        with self._cv:
            if self._halted_at is None:
                self._halted_at = time.monotonic()
            self._stopping = True
            waiting = list(self._queue)
            self._queue.clear()
            running = self.current
            if running is not None:
                running.request.cancel.set()
            self._cv.notify_all()
        for job in waiting:
            job.request.cancel.set()
            self._finish(job, "cancelled")
        if running is not None:
            running._emit("stopping", None)

    def fail_all(self, error: BaseException) -> None:
        """The model cannot run any more (a pipeline rank failed): the queued jobs and the running one fail with ERROR
        now, whether or not the running step ever returns; later submits are refused by the caller."""
        with self._cv:
            waiting = list(self._queue)
            self._queue.clear()
            running = self.current
        for job in waiting:
            job.error = error
            self._finish(job, "failed")
        if running is not None and not running.finished:
            running.request.cancel.set()
            running.error = error
            running._emit("failed", error)

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> bool:
        """halt(), then wait for the worker thread until `timeout` s after the halt; False if it still runs."""
        self.halt()
        self._thread.join(max(0.0, self._halted_at + timeout - time.monotonic()))
        return not self._thread.is_alive()

    # -- worker thread ----------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._queue and not self._stopping:
                    self._cv.wait()
                if self._stopping and not self._queue:
                    return
                job = self._queue.popleft()
                if job.request.cancel.is_set():
                    self._finish(job, "cancelled")
                    continue
                self.current = job
                job.state = "running"
                job.started_at = time.monotonic()
            try:
                job.outcomes = self.generator.run_batch(job.requests)
            except BaseException as exc:  # noqa: BLE001 - reported to the request; the worker keeps serving
                job.error = exc
                with self._cv:
                    self.current = None
                self._finish(job, "failed")
                continue
            with self._cv:
                self.current = None
            self._finish(job, "cancelled" if job.outcome.finish_reason == "cancelled" else "done")

    def _finish(self, job: Job, state: str) -> None:
        job.state = state
        job.finished_at = time.monotonic()
        self.history.append(job.record())
        try:
            self.on_finish(job)
        finally:
            if state == "failed":
                job._emit("failed", job.error)
            elif state == "cancelled":
                job._emit("cancelled", job.outcome)
            else:
                job._emit("done", job.outcome)
