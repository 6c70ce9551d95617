"""Everything the server holds for its one model: the generator and its worker, prompts, tool family, prefix cache,
metrics."""

from __future__ import annotations

import hashlib
import hmac
import resource
import threading
import time
from typing import Callable

from ..profiles.knobs.derivation import MIN_CONTEXT
from ..replies import DEFAULT_REPLY_TOKENS
from ..stream.context import context_reason, int4_context
from ..text.images import refusal as image_refusal
from ..text.loop import Generator
from ..text.prefix import PrefixCache, decide
from ..text.reuse import reuse_for
from .logprob_shapes import TokenText
from .metrics import Metrics
from .prompts import PromptBuilder
from .structured import lark_literal
from .tools import FAMILIES, choose
from .worker import STOP_TIMEOUT_S, Job, Worker

QUEUE_CAP = 256  # waiting requests at most, whatever the open-file limit allows
FDS_PER_WAITING = 4  # open files a waiting request may cost (its socket, and room for the model's and the server's own)
MIN_BODY_BYTES = 1 << 20
BODY_BYTES_PER_TOKEN = 64  # a context's worth of prompt as JSON text, tools and escapes included, with room to spare
API_KEY_ENV = "ROCKETLLM_API_KEY"


NO_KNOBS_PREFIX = (
    "off: the model has no resolved knobs (it was not opened by AutoModel.from_pretrained), so no kv_cache_bytes to "
    "size stored prefixes by"
)
PIPELINE_PREFIX = (
    "off: the model runs as pipeline stages, each rank keeping the KV cache of its own layers; a stored prefix would "
    "live on rank 0 only"
)


def derive_max_queue() -> tuple[int, str]:
    """The queue limit and its formula: a waiting request holds a connection, so the open-file limit bounds the
    queue."""
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    nofile = 1 << 20 if soft == resource.RLIM_INFINITY else int(soft)
    value = max(1, min(QUEUE_CAP, nofile // FDS_PER_WAITING))
    return value, f"min({QUEUE_CAP}, open-file limit {nofile} // {FDS_PER_WAITING})"


def body_limit(max_context: int) -> tuple[int, str]:
    value = max(MIN_BODY_BYTES, BODY_BYTES_PER_TOKEN * max_context)
    return value, f"max(1 MiB, {BODY_BYTES_PER_TOKEN} B x context {max_context})"


def is_loopback(host: str) -> bool:
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()


def _inputs(inputs: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in inputs.items())


def one_line(text: str, limit: int = 300) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


class ServerState:
    def __init__(
        self,
        model,
        model_id: str,
        tool_parser: str | None = None,
        log: Callable[[str], None] = lambda m: None,
        *,
        api_key: str | None = None,
        max_queue: int | None = None,
        host: str = "127.0.0.1",
    ) -> None:
        self.model = model
        self.model_id = model_id
        self.log = log
        self.created = int(time.time())  # what /v1/models reports as the model's creation time
        if model.tokenizer is None:
            from ..errors import RocketError

            raise RocketError(
                "this model has no tokenizer in its shard directory; re-shard from a model directory that includes one"
            )
        self.family, self.family_reason = choose(model.tokenizer, tool_parser)
        self.image_refusal = image_refusal(model)  # None: the model takes pictures (its tower and processor are here)
        self.builder = PromptBuilder(
            model.tokenizer, self.family, getattr(model, "processor", None) if self.image_refusal is None else None
        )
        self.lark_literal = lark_literal(model.tokenizer)  # the family's markers in grammars (server/structured.py)
        self.token_text = TokenText(self.builder.tokenizer)  # each token's text, for log-probabilities
        knobs = model.knobs
        # 0 is a real answer (the memory holds no context: every request is refused with the numbers), None is none
        self.max_context = (
            int(knobs.value("max_context"))
            if knobs is not None and knobs.value("max_context") is not None
            else int(getattr(model.config, "max_position_embeddings", 0) or MIN_CONTEXT)
        )
        self.context_why = context_reason(knobs)
        # the reply length of a request that sets none: what the projected speed fits in a minute (the knob's formula)
        knob = knobs["default_max_tokens"] if knobs is not None else None
        self.default_max_tokens = (
            int(knob.value) if knob is not None and knob.value is not None else DEFAULT_REPLY_TOKENS
        )
        self.default_max_tokens_why = (
            (f"from {knob.source}" if knob.overridden else f"= {knob.formula} with {_inputs(knob.inputs)}")
            if knob is not None
            else "generate's default"
        )
        # what an int4 KV cache would admit instead
        self.context_int4 = int4_context(knobs, getattr(model, "config", None))
        setting = str(knobs.value("prefix_cache")) if knobs is not None else "auto"
        self.prefix_on, self.prefix_reason = decide(setting, model.plan, model.manifest)
        self.stage = getattr(model, "stage", None)  # under torchrun: the pipeline this server's model is rank 0 of
        if knobs is None:  # no kv_cache_bytes to size the stored prefixes by
            self.prefix_on, self.prefix_reason = False, NO_KNOBS_PREFIX
        if self.stage is not None:
            self.prefix_on, self.prefix_reason = False, PIPELINE_PREFIX
            self.stage.group.on_failure = self.pipeline_failed
        self.prefix_mode = None  # blocks | extend | exact: what the model's cache allows (text/reuse.py)
        if self.prefix_on:
            reuse = reuse_for(model)
            if reuse.mode is None:
                self.prefix_on, self.prefix_reason = False, f"off: {reuse.reason}"
            else:
                self.prefix_mode = reuse.mode
                self.prefix_reason += f"; {reuse.reason}" if reuse.reason else ""
        self.prefix_cache = (
            PrefixCache(int(knobs.value("kv_cache_bytes")), mode=self.prefix_mode) if self.prefix_on else None
        )
        self.generator = Generator(model, self.prefix_cache)
        self.metrics = Metrics()
        # The key itself is not kept: only its digest, compared in constant time with each request's.
        self._key_digest = _digest(api_key) if api_key else None
        self.host = host
        self.warnings: list[str] = []
        if not is_loopback(host) and self._key_digest is None:
            self.warnings.append(
                f"listening on {host} without an API key: anyone who can reach this machine can use the model; pass "
                f"--api-key or set {API_KEY_ENV}"
            )
        if max_queue is None:
            self.max_queue, self.max_queue_formula = derive_max_queue()
        else:
            self.max_queue, self.max_queue_formula = int(max_queue), "from --max-queue"
        self.max_body, self.max_body_formula = body_limit(self.max_context)
        self.last_error: dict | None = None  # the latest failed generation, until one succeeds
        self.multimodal = self.image_refusal is None
        self.residency = model.residency_text()
        self._noticed: set[str] = set()
        self._notice_lock = threading.Lock()
        self.worker = Worker(self.generator, on_finish=self._finished, max_queue=self.max_queue)
        self.idle_s: float | None = None  # stop after this long without a request (a warm model's keep-alive)
        self.last_active = time.monotonic()

    # -- keep-alive ------------------------------------------------------------------------------
    def keep_alive(self, idle_s: float, server) -> None:
        """Stop SERVER once nothing has run or waited for IDLE_S seconds; each request starts the wait again."""
        self.idle_s = idle_s
        self.last_active = time.monotonic()  # loading took its time: the wait starts as it begins to listen

        def watch() -> None:
            while not server.should_exit:
                if self.worker.busy or self.worker.queue_length:
                    self.last_active = time.monotonic()
                elif time.monotonic() - self.last_active > self.idle_s:  # a request may have set another keep-alive
                    self.log(f"idle for {self.idle_s:g} s (keep-alive): stopping")
                    server.should_exit = True
                    return
                time.sleep(0.2)

        threading.Thread(target=watch, name="rocketllm-keep-alive", daemon=True).start()

    def set_keep_alive(self, value: str | None) -> None:
        """A request's keep-alive (KEEP_ALIVE_HEADER, seconds), as ollama takes one per request: from now on the server
        stops that long after its last request (0: once this one is answered). Only a server that has a keep-alive
        takes it; a malformed value is ignored (the client parsed it already)."""
        if value is None or self.idle_s is None:
            return
        try:
            seconds = float(value)
        except ValueError:
            return
        if seconds >= 0 and seconds == seconds and seconds != self.idle_s:
            self.log(f"keep-alive now {seconds:g} s (set by a request)")
            self.idle_s = seconds
        self.last_active = time.monotonic()

    def expires_in(self) -> float | None:
        if self.idle_s is None:
            return None
        return round(max(0.0, self.idle_s - (0 if self.worker.busy else time.monotonic() - self.last_active)), 1)

    # -- the key ---------------------------------------------------------------------------------
    @property
    def auth_required(self) -> bool:
        return self._key_digest is not None

    def key_matches(self, given: str | None) -> bool:
        """Whether `given` is the server's key, compared in constant time (digests of equal length)."""
        if self._key_digest is None:
            return True
        return given is not None and hmac.compare_digest(_digest(given), self._key_digest)

    # -- what the server says once --------------------------------------------------------------
    def notice_once(self, key: str, message: str) -> bool:
        """Log `message` the first time `key` comes up in this server's life; True that first time."""
        with self._notice_lock:
            if key in self._noticed:
                return False
            self._noticed.add(key)
        self.log(f"note: {message}")
        return True

    def startup_lines(self, url: str | None = None) -> list[str]:
        tool_note = (
            "rendered by the chat template"
            if self.builder.native_tools
            else "described in a system message (the chat template does not render tools)"
        )
        layers = self.stage.plan.inputs["layers"] if self.stage is not None else len(self.model.manifest.layers)
        lines = [
            f"model: {self.model_id} ({self.model.manifest.model_type}, {layers} layers, "
            f"{self.model.manifest.dtype}), context {self.max_context} tokens",
            *(
                [self.stage.describe(), f"rank 0's share: {self.residency}"]
                if self.stage is not None
                else [self.residency]
            ),
            f"tool parser: {self.family} ({self.family_reason}); tools {tool_note}",
            f"prefix cache: {self.prefix_reason}",
            f"speculative decoding: {self.generator.speculation.reason}",
            f"default max_tokens: {self.default_max_tokens} ({self.default_max_tokens_why}); a request's max_tokens "
            f"wins",
            (
                f"queue: at most {self.max_queue} requests waiting (= {self.max_queue_formula}); more get 429 with "
                f"retry-after; request bodies up to {self.max_body} bytes (= {self.max_body_formula}), larger get 413"
            ),
            "api key: "
            + (
                "required (OpenAI: Authorization: Bearer, Anthropic: x-api-key; every endpoint but /health)"
                if self.auth_required
                else "none (every client is served)"
            ),
        ]
        if self.multimodal or self.model.manifest.vision:
            lines.append(
                "images: "
                + (
                    "accepted (data: URLs and paths this machine can read; prefix cache off for prompts with images)"
                    if self.multimodal
                    else f"refused, the model {self.image_refusal}"
                )
            )
        if url:
            lines.append(f"listening on {url} (OpenAI: {url}/v1, Anthropic: {url}); Ctrl-C stops")
        return lines

    @property
    def pipeline_failure(self) -> str | None:
        """Under torchrun: why the pipeline is down (a rank exited or hung), once it is; None while it serves."""
        return self.stage.group.failure if self.stage is not None else None

    def pipeline_failed(self, line: str) -> None:
        """A rank failed (from the watchdog thread, or the worker's failed receive): every job waiting or running fails
        with it, and every request from now on gets 503 (app.py); the process stays up to say so."""
        from ..distributed.torchrun import StageError

        self.log(f"error: {line}; answering 503 until the stages are restarted")
        error = StageError(line)
        self.worker.fail_all(error)

    def health(self) -> dict:
        """What /health reports; lock-free but for the queue's length, so it never waits behind a generation."""
        failing = self.last_error is not None and self.last_error.get("current")
        down = self.pipeline_failure
        return {
            "status": "failed" if down else "degraded" if failing else "ok",
            **(
                {"stages": self.stage.plan.to_dict(), "stages_plan": self.stage.describe()}
                if self.stage is not None
                else {}
            ),
            **({"pipeline_error": down} if down else {}),
            "model": self.model_id,
            "residency": self.residency,
            "residency_plan": self.model.plan.to_dict()["tier"],
            "tool_parser": self.family,
            "tool_parser_reason": self.family_reason,
            "tool_parsers": sorted(FAMILIES),
            "tools_in_template": self.builder.native_tools,
            "queue_length": self.worker.queue_length,
            "busy": self.worker.busy,
            "max_queue": self.max_queue,
            "max_body_bytes": self.max_body,
            "auth": "api key required" if self.auth_required else "none",
            "warnings": list(self.warnings),
            "last_error": {k: v for k, v in self.last_error.items() if k != "current"} if self.last_error else None,
            "error": self.last_error["message"] if failing else None,
            "max_context": self.max_context,
            "default_max_tokens": self.default_max_tokens,
            "keep_alive_s": self.idle_s,
            "expires_in_s": self.expires_in(),
            "speculation": {"mode": self.generator.speculation.mode, "reason": self.generator.speculation.reason},
            "prefix_cache": {
                "enabled": self.prefix_on,
                "reason": self.prefix_reason,
                "mode": self.prefix_mode,
                **(self.prefix_cache.to_dict() if self.prefix_cache is not None else {}),
            },
        }

    def metrics_text(self) -> str:
        return self.metrics.render(
            self.worker.queue_length,
            self.worker.busy,
            self.model_id,
            self.prefix_cache.to_dict() if self.prefix_cache is not None else None,
        )

    @property
    def stopping(self) -> bool:
        return self.worker.stopping

    def stop(self) -> None:
        """The server is stopping: no new generations; queued and running ones end (see Worker.halt)."""
        self.worker.halt()

    def close(self, timeout: float = STOP_TIMEOUT_S) -> bool:
        """Stop, and wait up to `timeout` s from the stop for the worker thread; False if a step still runs."""
        pool = getattr(self, "prepare_pool", None)
        if pool is not None:
            pool.shutdown(wait=False)
        return self.worker.stop(timeout)

    def _finished(self, job: Job) -> None:
        self.last_active = time.monotonic()
        if job.outcome is not None:
            self.metrics.generation(job.outcome, sum(o.new_tokens for o in job.outcomes[1:]))
        if job.error is not None:
            message = one_line(f"{type(job.error).__name__}: {job.error}")
            self.last_error = {
                "message": f"the latest generation failed: {message}",
                "endpoint": job.endpoint,
                "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "current": True,
            }
            self.log(f"error: generation failed ({message}); the server goes on serving")
        elif job.state == "done" and self.last_error is not None:
            self.last_error["current"] = False  # a generation succeeded since: kept in /health as history
        if self.prefix_cache is not None and self.prefix_cache.disabled_reason and self.prefix_on:
            self.prefix_on = False
            self.prefix_reason = f"off: {self.prefix_cache.disabled_reason}"
            self.log(f"note: prefix cache turned off: {self.prefix_cache.disabled_reason}")
