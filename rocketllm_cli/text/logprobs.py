"""Log-probabilities, read from the same logits the sampler sees: of each generated token (with the K most likely at
its step) and, for an echoed prompt, of each prompt token given the ones before it.

They are the model's own distribution: log-softmax of the logits before temperature, top-k, top-p, the presence and
frequency penalties, logit_bias and any grammar mask (vLLM's default, "raw" log-probabilities; transformers'
repetition_penalty, when one is set, comes before them). Computed in fp32 from the compute dtype's logits.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers import LogitsProcessor

MAX_TOP = 20  # OpenAI's limit for chat top_logprobs; completions allow 5


@dataclass
class TokenLogprob:
    token: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)  # the most likely tokens at this position, best first

    def trimmed(self, top: int) -> TokenLogprob:
        """The same with only the TOP most likely (a batch records as many as its most demanding row asked for)."""
        return self if len(self.top) <= top else TokenLogprob(self.token, self.logprob, self.top[:top])


class LogprobRecorder(LogitsProcessor):
    """First of the loop's processors: keeps the log-softmax of the step's scores (one row per sequence); `chosen` then
    reads the sampled token's and the top ones (the streamer calls it with each step's tokens)."""

    def __init__(self, top: int) -> None:
        self.top = top
        self._last: torch.Tensor | None = None  # [B, V] log-probabilities of the latest step

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self._last = torch.log_softmax(scores.float(), dim=-1)
        return scores

    def chosen(self, tokens: list[int]) -> list[TokenLogprob]:
        if self._last is None:
            raise RuntimeError("a token came before any scores")
        logp, self._last = self._last, None
        return [entry(logp[b], int(token), self.top) for b, token in enumerate(tokens)]


def entry(logp: torch.Tensor, token: int, top: int) -> TokenLogprob:
    """TOKEN's log-probability in the distribution LOGP [V], with the TOP most likely tokens."""
    best = []
    if top:
        values, ids = logp.topk(min(top, logp.shape[-1]))
        best = list(zip(ids.tolist(), values.tolist()))
    return TokenLogprob(token, float(logp[token]), best)


CHUNK = 256  # prompt positions turned into log-probabilities at a time: [CHUNK, V] fp32, 48 MiB for a 49k vocabulary


def prompt_logprobs(model, ids: list[int], top: int) -> list[TokenLogprob | None]:
    """Each prompt token's log-probability given the tokens before it (None for the first, which has none): one forward
    pass over the prompt with every position's logits kept."""
    with torch.inference_mode():
        device = getattr(model, "device", None) or torch.device("cpu")
        logits = model(input_ids=torch.tensor([ids], device=device), use_cache=False).logits[0]  # [S, V]
        out: list[TokenLogprob | None] = [None]
        for start in range(0, len(ids) - 1, CHUNK):
            logp = torch.log_softmax(logits[start : start + CHUNK].float(), dim=-1)
            for i in range(logp.shape[0]):
                position = start + i
                if position + 1 < len(ids):
                    out.append(entry(logp[i], ids[position + 1], top))
        return out
