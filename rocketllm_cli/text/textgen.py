"""Text in, text out: prompt building, sampling settings, streamed output and the stats generate/bench print.

Layered as mlx-lm does: transformers' generate yields tokens, a streamer turns them
into text pieces with timestamps, and the result carries the same numbers bench reports.
"""

from __future__ import annotations

import resource
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from ..errors import RocketError


@dataclass
class SamplingParams:
    """Per-request settings; temperature 0 means greedy."""

    max_new_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    repetition_penalty: float = 1.0

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise RocketError(f"--max-new-tokens must be at least 1 (got {self.max_new_tokens})")
        if self.temperature < 0:
            raise RocketError(f"--temperature must be >= 0 (got {self.temperature}); use 0 for greedy")
        if not 0 < self.top_p <= 1:
            raise RocketError(f"--top-p must be in (0, 1] (got {self.top_p})")
        if self.top_k < 0:
            raise RocketError(f"--top-k must be >= 0 (got {self.top_k}); 0 disables it")
        if self.repetition_penalty <= 0:
            raise RocketError(f"--repetition-penalty must be > 0 (got {self.repetition_penalty})")

    def generate_kwargs(self) -> dict:
        if self.temperature == 0:
            return {"do_sample": False, "temperature": None, "top_p": None, "top_k": None, "repetition_penalty": self.repetition_penalty}
        return {
            "do_sample": True, "temperature": self.temperature, "top_p": self.top_p,
            "top_k": self.top_k or None, "repetition_penalty": self.repetition_penalty,
        }


@dataclass
class GenerationResult:
    text: str
    prompt_tokens: int
    new_tokens: int
    token_ids: list[int]
    stats: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {"text": self.text, "prompt_tokens": self.prompt_tokens, "new_tokens": self.new_tokens, "stats": self.stats}


def encode_prompt(tokenizer, prompt: str, chat: bool | None = None, system: str | None = None) -> torch.Tensor:
    """Token ids [1, S]; the chat template is used by default when the tokenizer has one."""
    if tokenizer is None:
        raise RocketError("this model has no tokenizer in its shard directory; re-shard from a model directory that includes one")
    use_chat = bool(getattr(tokenizer, "chat_template", None)) if chat is None else chat
    if chat and not getattr(tokenizer, "chat_template", None):
        raise RocketError("this model's tokenizer has no chat template; use --raw")
    if use_chat:
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
    else:
        if system:
            prompt = f"{system}\n\n{prompt}"
        ids = tokenizer(prompt, return_tensors="pt").input_ids
    return ids


def check_context(prompt_tokens: int, max_new_tokens: int, max_context: int) -> None:
    if prompt_tokens + max_new_tokens > max_context:
        raise RocketError(
            f"prompt is {prompt_tokens} tokens and --max-new-tokens {max_new_tokens}, but the context allows {max_context}; "
            "shorten the prompt or lower --max-new-tokens"
        )


class _Streamer:
    """transformers streamer protocol (put/end): decodes incrementally and timestamps every token."""

    def __init__(self, tokenizer, on_text: Callable[[str], None] | None) -> None:
        self.tokenizer = tokenizer
        self.on_text = on_text
        self.ids: list[int] = []
        self.times: list[float] = []
        self._printed = 0
        self._prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if not self._prompt_seen:  # the first call carries the prompt
            self._prompt_seen = True
            return
        self.times.append(time.perf_counter())
        self.ids.extend(int(v) for v in value.reshape(-1).tolist())
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        # Hold back an incomplete multi-byte character until the next token completes it.
        if text.endswith("\ufffd"):
            return
        if self.on_text and len(text) > self._printed:
            self.on_text(text[self._printed :])
        self._printed = len(text)

    def end(self) -> None:
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if self.on_text and len(text) > self._printed:
            self.on_text(text[self._printed :])
        self._printed = len(text)


def generate_text(model, prompt_ids: torch.Tensor, params: SamplingParams, on_text: Callable[[str], None] | None = None) -> GenerationResult:
    """Generate from one prompt, streaming text pieces to on_text; returns text, counts and stats."""
    tokenizer = model.tokenizer
    if params.seed is not None:
        torch.manual_seed(params.seed)
    streamer = _Streamer(tokenizer, on_text)
    pad = _pad_id(model)
    model.ledger.reset()
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            prompt_ids.to(model.device), attention_mask=torch.ones_like(prompt_ids).to(model.device),
            max_new_tokens=params.max_new_tokens, streamer=streamer, pad_token_id=pad, **params.generate_kwargs(),
        )
    total = time.perf_counter() - start
    new_ids = out[0, prompt_ids.shape[1] :].tolist()
    text = tokenizer.decode(new_ids, skip_special_tokens=True)
    return GenerationResult(text, int(prompt_ids.shape[1]), len(new_ids), new_ids, collect_stats(model, streamer.times, start, total))


def generate_batch(model, prompts: list[torch.Tensor], params: SamplingParams) -> list[GenerationResult]:
    """Generate for several prompts in one batch: every streaming pass serves all sequences.

    Prompts are left-padded so new tokens line up; results come back in input order.
    """
    tokenizer = model.tokenizer
    if params.seed is not None:
        torch.manual_seed(params.seed)
    pad = _pad_id(model)
    width = max(p.shape[1] for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, p in enumerate(prompts):
        ids[row, width - p.shape[1] :] = p[0]
        mask[row, width - p.shape[1] :] = 1
    streamer = _Streamer(tokenizer, None)
    model.ledger.reset()
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(ids.to(model.device), attention_mask=mask.to(model.device), max_new_tokens=params.max_new_tokens,
                             streamer=_BatchTimer(streamer), pad_token_id=pad, **params.generate_kwargs())
    total = time.perf_counter() - start
    stats = collect_stats(model, streamer.times, start, total)
    stats["batch"] = len(prompts)
    eos = _eos_ids(model)
    results = []
    for row, p in enumerate(prompts):
        new = out[row, width:].tolist()
        cut = next((i for i, t in enumerate(new) if t in eos), None)
        new = new[: cut + 1] if cut is not None else new  # what a lone run would have stopped at
        results.append(GenerationResult(tokenizer.decode(new, skip_special_tokens=True), int(p.shape[1]), len(new), new, stats))
    return results


class _BatchTimer:
    """Timestamps each generation step of a batch (transformers' streamers take batch size 1 only)."""

    def __init__(self, streamer: _Streamer) -> None:
        self.streamer = streamer
        self._prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if self._prompt_seen:
            self.streamer.times.append(time.perf_counter())
        self._prompt_seen = True

    def end(self) -> None:
        pass


def _pad_id(model) -> int:
    pad = model.generation_config.pad_token_id
    if pad is None:
        pad = _eos_ids(model)[0] if _eos_ids(model) else 0
    return int(pad)


def _eos_ids(model) -> list[int]:
    eos = model.generation_config.eos_token_id
    return [] if eos is None else [int(e) for e in (eos if isinstance(eos, list) else [eos])]


def collect_stats(model, times: list[float], start: float, total: float) -> dict:
    gaps = [b - a for a, b in zip(times, times[1:])]
    ledger = model.ledger.summary()
    return {
        "time_to_first_token_s": round(times[0] - start, 4) if times else None,
        "decode_tokens_per_s": round(len(gaps) / sum(gaps), 2) if gaps and sum(gaps) > 0 else None,
        "per_token_ms": round(1000 * sum(gaps) / len(gaps), 2) if gaps else None,
        "total_s": round(total, 3),
        "bytes_per_token": ledger.get("per_token_served"),
        "storage_bytes_per_token_witnessed": ledger.get("per_token_storage_witnessed"),
        "phase_seconds_per_token": ledger.get("per_token_phase_seconds"),
        "prefill": ledger.get("prefill"),
        "experts_per_token": ledger.get("per_token_experts"),
        "expert_cache": ledger.get("expert_cache"),
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "residency": model.plan.describe(model.manifest),
        "device": str(model.device),
        "compute_dtype": str(model.dtype).replace("torch.", ""),
    }
