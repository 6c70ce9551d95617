"""The generation loop's own logits processors, in place on the scores: holding end-of-sequence back until
min_new_tokens, repetition/presence/frequency penalties, and a request's logit bias."""

from __future__ import annotations

import math

import torch
from transformers import LogitsProcessor


class HoldEndOfSequence(LogitsProcessor):
    """A logits processor: end-of-sequence scores at -inf until `count` new tokens exist, written in place.

    transformers' own min_new_tokens costs two processors that each build a vocabulary-sized mask and copy the
    scores at every step, long after the count is reached (about 1 ms a token for a 49k vocabulary on a CPU);
    this one indexes the few end-of-sequence ids, and only while it holds them off."""

    def __init__(self, prompt_width: int, count: int, eos_ids) -> None:
        self.until = prompt_width + count
        self.eos = sorted(eos_ids)
        self._index = torch.tensor(self.eos, dtype=torch.long)  # one index_fill_ a step (bench holds every step)
        self._index_on = {}  # device -> the index there

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if input_ids.shape[-1] < self.until and self.eos:
            index = self._index_on.get(scores.device)
            if index is None:
                index = self._index_on[scores.device] = self._index.to(scores.device)
            scores.index_fill_(-1, index, -math.inf)
        return scores


class Penalties(LogitsProcessor):
    """OpenAI's presence and frequency penalties: each token the reply has used loses `presence` once and `frequency`
    per use from its logit (the prompt's tokens do not count, as vLLM and llama.cpp's server have it)."""

    def __init__(self, prompt_width: int, presence: float, frequency: float) -> None:
        self.width, self.presence, self.frequency = prompt_width, presence, frequency

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        generated = input_ids[:, self.width :]
        if generated.shape[1]:
            counts = torch.zeros_like(scores).scatter_add_(
                1, generated, torch.ones(generated.shape, dtype=scores.dtype, device=scores.device)
            )
            scores = scores - counts * self.frequency - (counts > 0).to(scores.dtype) * self.presence
        return scores


class LogitBias(LogitsProcessor):
    """OpenAI's logit_bias: a fixed amount added to chosen tokens' logits at every step (-100 bans, 100 forces)."""

    def __init__(self, pairs: tuple[tuple[int, float], ...]) -> None:
        self.ids = torch.tensor([t for t, _ in pairs], dtype=torch.long)
        self.bias = torch.tensor([b for _, b in pairs], dtype=torch.float32)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        scores[:, self.ids] += self.bias.to(scores.dtype)
        return scores
