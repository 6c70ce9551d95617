"""Everything the server holds for its one model: the generator and its worker, prompts, tool family, prefix cache, metrics."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Callable

from ..text.loop import Generator
from ..text.prefix import PrefixCache, decide
from ..text.prompts import context_reason
from ..text.reuse import reuse_for
from .metrics import Metrics
from .prompts import PromptBuilder
from .tools import FAMILIES, choose
from .worker import STOP_TIMEOUT_S, Job, Worker


def default_model_id(model: str) -> str:
    """The name clients use: the model directory's name, a .gguf file's name without the suffix, or the hub id."""
    path = Path(str(model)).expanduser()
    if path.exists():
        path = path.resolve()
        return path.stem if path.is_file() else path.name
    return str(model)


class ServerState:
    def __init__(self, model, model_id: str, tool_parser: str | None = None, log: Callable[[str], None] = lambda m: None) -> None:
        self.model = model
        self.model_id = model_id
        self.log = log
        self.created = int(time.time())  # what /v1/models reports as the model's creation time
        if model.tokenizer is None:
            from ..errors import RocketError

            raise RocketError("this model has no tokenizer in its shard directory; re-shard from a model directory that includes one")
        self.family, self.family_reason = choose(model.tokenizer, tool_parser)
        self.builder = PromptBuilder(model.tokenizer, self.family)
        knobs = model.knobs
        # 0 is a real answer (the memory holds no context: every request is refused with the numbers), None is none
        self.max_context = int(knobs.value("max_context")) if knobs is not None and knobs.value("max_context") is not None else \
            int(getattr(model.config, "max_position_embeddings", 2048) or 2048)
        self.context_why = context_reason(knobs)
        setting = str(knobs.value("prefix_cache")) if knobs is not None else "auto"
        self.prefix_on, self.prefix_reason = decide(setting, model.plan, model.manifest)
        kv_cache = getattr(model, "new_kv_cache", lambda: None)()
        if self.prefix_on and kv_cache is not None:  # int4 (or another dtype's) KV: the prefix cache says why not
            from ..text.prefix import supported

            self.prefix_on, self.prefix_reason = False, f"off: {supported(kv_cache)[1]}"
        self.prefix_mode = None  # blocks | extend: what the model's cache allows (text/reuse.py)
        if self.prefix_on:
            reuse = reuse_for(model)
            if reuse.mode is None:
                self.prefix_on, self.prefix_reason = False, f"off: {reuse.reason}"
            else:
                self.prefix_mode = reuse.mode
                self.prefix_reason += f"; {reuse.reason}" if reuse.reason else ""
        budget = int(knobs.value("kv_cache_bytes")) if knobs is not None else 1 << 30
        self.prefix_cache = PrefixCache(budget, mode=self.prefix_mode) if self.prefix_on else None
        self.generator = Generator(model, self.prefix_cache)
        self.metrics = Metrics()
        self.multimodal = any(getattr(model.config, key, None) is not None for key in ("vision_config", "audio_config"))
        self.residency = model.plan.describe(model.manifest)
        self._noticed: set[str] = set()
        self._notice_lock = threading.Lock()
        self.worker = Worker(self.generator, on_finish=self._finished)

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
        tool_note = "rendered by the chat template" if self.builder.native_tools else \
            "described in a system message (the chat template does not render tools)"
        lines = [
            f"model: {self.model_id} ({self.model.manifest.model_type}, {len(self.model.manifest.layers)} layers, "
            f"{self.model.manifest.dtype}), context {self.max_context} tokens",
            self.residency,
            f"tool parser: {self.family} ({self.family_reason}); tools {tool_note}",
            f"prefix cache: {self.prefix_reason}",
        ]
        if url:
            lines.append(f"listening on {url} (OpenAI: {url}/v1, Anthropic: {url}); Ctrl-C stops")
        return lines

    def health(self) -> dict:
        return {
            "status": "ok",
            "model": self.model_id,
            "residency": self.residency,
            "residency_plan": self.model.plan.to_dict()["tier"],
            "tool_parser": self.family,
            "tool_parser_reason": self.family_reason,
            "tool_parsers": sorted(FAMILIES),
            "tools_in_template": self.builder.native_tools,
            "queue_length": self.worker.queue_length,
            "busy": self.worker.busy,
            "max_context": self.max_context,
            "prefix_cache": {"enabled": self.prefix_on, "reason": self.prefix_reason, "mode": self.prefix_mode,
                             **(self.prefix_cache.to_dict() if self.prefix_cache is not None else {})},
        }

    def metrics_text(self) -> str:
        return self.metrics.render(self.worker.queue_length, self.worker.busy, self.model_id,
                                   self.prefix_cache.to_dict() if self.prefix_cache is not None else None)

    @property
    def stopping(self) -> bool:
        return self.worker.stopping

    def stop(self) -> None:
        """The server is stopping: no new generations; queued and running ones end (see Worker.halt)."""
        self.worker.halt()

    def close(self, timeout: float = STOP_TIMEOUT_S) -> bool:
        """Stop, and wait up to `timeout` s from the stop for the worker thread; False if a step still runs."""
        return self.worker.stop(timeout)

    def _finished(self, job: Job) -> None:
        if job.outcome is not None:
            self.metrics.generation(job.outcome)
        if job.error is not None:
            self.log(f"error: generation failed ({type(job.error).__name__}: {job.error}); the server goes on serving")
        if self.prefix_cache is not None and self.prefix_cache.disabled_reason and self.prefix_on:
            self.prefix_on = False
            self.prefix_reason = f"off: {self.prefix_cache.disabled_reason}"
            self.log(f"note: prefix cache turned off: {self.prefix_cache.disabled_reason}")
