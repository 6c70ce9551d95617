"""One generation on the streaming model: transformers' generate, with stop strings, cancellation and prefix reuse.

The text a request sees is decoded from the generated ids as they come. A piece is handed on only once it
cannot turn out to be the start of a stop string or half of a multi-byte character; generation stops at the
first stop string (trimmed from the reply), at an end-of-sequence token, at max_new_tokens, or when the job's
cancel event is set (checked after every token, so a client that went away frees the model within one step).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
from transformers import StoppingCriteria, StoppingCriteriaList

from .textgen import SamplingParams


@dataclass
class GenerationRequest:
    prompt_ids: list[int]
    params: SamplingParams
    stop: tuple[str, ...] = ()
    cancel: threading.Event = field(default_factory=threading.Event)
    on_text: Callable[[str], None] | None = None  # called on the worker thread with each safe piece of text
    use_prefix_cache: bool = True
    keep_prefix: bool = True  # store this generation's KV for later prompts (bench times repeats without it)


@dataclass
class GenerationOutcome:
    text: str  # the reply, trimmed at the stop string
    token_ids: list[int]  # every generated id (an end-of-sequence id included)
    prompt_tokens: int
    finish_reason: str  # stop | length | cancelled
    stop_sequence: str | None = None  # the stop string that ended it, if one did
    reused_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    prefill_s: float | None = None  # prompt in -> first token out (restoring a cached prefix included)
    token_gaps_s: list[float] = field(default_factory=list)  # between successive tokens
    total_s: float = 0.0
    served_bytes: dict = field(default_factory=dict)  # tier -> bytes over every pass of this generation
    ledger: dict = field(default_factory=dict)

    @property
    def completion_tokens(self) -> int:
        return len(self.token_ids)


class _Tracker:
    """transformers' streamer protocol: decodes the new ids, finds stop strings, hands on safe text."""

    def __init__(self, tokenizer, stop: tuple[str, ...], on_text, cancel: threading.Event) -> None:
        self.tokenizer, self.stop, self.on_text, self.cancel = tokenizer, tuple(s for s in stop if s), on_text, cancel
        self.ids: list[int] = []
        self.times: list[float] = []
        self.text = ""
        self.sent = 0
        self.stop_at: int | None = None
        self.stop_sequence: str | None = None
        self._prompt_seen = False
        self._longest = max((len(s) for s in self.stop), default=0)

    def put(self, value: torch.Tensor) -> None:
        if not self._prompt_seen:  # the first call carries the prompt
            self._prompt_seen = True
            return
        self.times.append(time.perf_counter())
        if self.stop_at is not None:
            return  # a stop string ended it; the ids of this last step are not part of the reply
        self.ids.extend(int(v) for v in value.reshape(-1).tolist())
        self.text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if self.stop:
            self._find_stop()
        self._send(final=False)

    def end(self) -> None:
        self._send(final=True)

    def should_stop(self) -> bool:
        return self.stop_at is not None or self.cancel.is_set()

    def reply(self) -> str:
        return self.text[: self.stop_at] if self.stop_at is not None else self.text

    def _find_stop(self) -> None:
        start = max(0, self.sent - self._longest)
        found = [(i, s) for s in self.stop if (i := self.text.find(s, start)) >= 0]
        if found:
            self.stop_at, self.stop_sequence = min(found)

    def _send(self, final: bool) -> None:
        text = self.reply()
        end = len(text)
        if not final:
            if text.endswith("\ufffd"):  # half of a multi-byte character: wait for the rest
                end = len(text.rstrip("\ufffd"))
            if self.stop_at is None:
                end -= _held_back(text[:end], self.stop)
        if end > self.sent:
            piece, self.sent = text[self.sent : end], end
            if self.on_text is not None:
                self.on_text(piece)


def _held_back(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest end of `text` that is the beginning of a stop string (it may yet become one)."""
    best = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:n]):
                best = n
                break
    return best


class _StopWhen(StoppingCriteria):
    """A StoppingCriteria: true for every sequence once the tracker found a stop string or the job was cancelled."""

    def __init__(self, tracker: _Tracker) -> None:
        self.tracker = tracker

    def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
        return torch.full((input_ids.shape[0],), self.tracker.should_stop(), dtype=torch.bool, device=input_ids.device)


class Engine:
    """Runs one GenerationRequest at a time on a StreamingModel (the worker thread is its only caller)."""

    def __init__(self, model, prefix_cache=None) -> None:
        from .prefix import generate_cache_kwarg

        self.model = model
        self.tokenizer = model.tokenizer
        self.prefix_cache = prefix_cache
        self._cache_kwarg = generate_cache_kwarg(model)
        config = model.generation_config
        eos = config.eos_token_id
        self.eos_ids = set() if eos is None else {int(e) for e in (eos if isinstance(eos, list) else [eos])}
        pad = config.pad_token_id
        self.pad_id = int(pad) if pad is not None else (min(self.eos_ids) if self.eos_ids else 0)

    def run(self, req: GenerationRequest) -> GenerationOutcome:
        from .prefix import output_cache

        model = self.model
        prompt = list(req.prompt_ids)
        tracker = _Tracker(self.tokenizer, req.stop, req.on_text, req.cancel)
        if req.cancel.is_set():
            return GenerationOutcome("", [], len(prompt), "cancelled")
        start = time.perf_counter()  # the prefill time includes restoring a cached prefix
        hit = self.prefix_cache.lookup(prompt) if (self.prefix_cache is not None and req.use_prefix_cache) else None
        extra = {self._cache_kwarg: hit.cache} if hit is not None else {}
        if req.params.seed is not None:
            torch.manual_seed(req.params.seed)
        criteria = StoppingCriteriaList([_StopWhen(tracker)])
        ids = torch.tensor([prompt], dtype=torch.long, device=model.device)
        model.ledger.reset()
        with torch.inference_mode():
            out = model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=req.params.max_new_tokens, streamer=tracker,
                stopping_criteria=criteria, pad_token_id=self.pad_id, return_dict_in_generate=True,
                **req.params.generate_kwargs(), **extra,
            )
        total = time.perf_counter() - start
        new_ids = out.sequences[0, len(prompt) :].tolist()
        if self.prefix_cache is not None and req.use_prefix_cache and req.keep_prefix:
            cache = output_cache(out)
            if cache is not None:
                self.prefix_cache.store(prompt + new_ids, cache)  # the last id has no KV yet: store() crops to what the cache holds
        del out
        if tracker.stop_at is not None:
            finish = "stop"
        elif req.cancel.is_set():
            finish = "cancelled"
        elif new_ids and new_ids[-1] in self.eos_ids:
            finish = "stop"
        elif len(new_ids) >= req.params.max_new_tokens:
            finish = "length"
        else:
            finish = "stop"
        steps = model.ledger.steps
        served: dict[str, int] = {}
        for step in steps:
            for tier, n in step.served.items():
                served[tier] = served.get(tier, 0) + n
        times = tracker.times
        return GenerationOutcome(
            text=tracker.reply(), token_ids=new_ids, prompt_tokens=len(prompt), finish_reason=finish,
            stop_sequence=tracker.stop_sequence, reused_tokens=hit.tokens if hit is not None else 0,
            prefill_s=(times[0] - start) if times else None, token_gaps_s=[b - a for a, b in zip(times, times[1:])],
            total_s=total, served_bytes=served, ledger=model.ledger.summary(),
        )
