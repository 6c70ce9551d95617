"""One timing method for every engine and baseline: timestamps from the streamer of transformers' generate.

A run generates 1 (prefill) + `warmup` + `tokens` tokens; the first `warmup` decode gaps are dropped,
so the figures are steady-state decode. EOS is held off (min_new_tokens) so every run generates the same count.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from ..stream.ledger import storage_read_bytes

WARMUP = 1  # decode tokens excluded: the first pass after prefill pays one-off costs (page faults, allocator growth)
PROMPT_TEXT = (
    "The history of computing is a story of moving data closer to where it is used. Early machines read their "
    "programs from punched cards, later ones from magnetic drums, disks and finally memory chips stacked beside "
    "the processor. Every generation made the slowest step a little faster, and every program learned to hide it. "
)


def fixed_prompt(tokenizer, n: int) -> torch.Tensor:
    """Token ids [1, n] from a fixed English text, repeated as needed: the same prompt on every machine."""
    ids = tokenizer(PROMPT_TEXT, add_special_tokens=False).input_ids
    if not ids:
        raise ValueError("the tokenizer encodes the fixed benchmark text to no tokens")
    ids = (ids * (n // len(ids) + 1))[:n]
    return torch.tensor([ids], dtype=torch.long)


class _Timer:
    """transformers streamer protocol: a timestamp per generation step (the first put carries the prompt)."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._prompt_seen = False

    def put(self, value) -> None:
        if self._prompt_seen:
            self.times.append(time.perf_counter())
        self._prompt_seen = True

    def end(self) -> None:
        pass


@dataclass
class Timing:
    ttft_s: float  # prompt in -> first new token out
    gaps_s: list[float]  # steady-state decode gaps, warm-up dropped
    storage_bytes: int | None  # /proc/self/io read_bytes over the measured decode steps
    extra: dict = field(default_factory=dict)

    def summary(self) -> dict:
        ms = sorted(1000 * g for g in self.gaps_s)
        return {
            "median": round(percentile(ms, 50), 2), "p10": round(percentile(ms, 10), 2), "p90": round(percentile(ms, 90), 2),
            "n": len(ms),
        }

    @property
    def median_s(self) -> float:
        return percentile(sorted(self.gaps_s), 50)


def percentile(sorted_values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    if not sorted_values:
        return float("nan")
    pos = (len(sorted_values) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


class _IoMarks:
    """Storage read_bytes at each step boundary, so the warm-up steps' reads can be left out."""

    def __init__(self, timer: _Timer) -> None:
        self.timer = timer
        self.marks: list[int | None] = []

    def put(self, value) -> None:
        self.timer.put(value)
        self.marks.append(storage_read_bytes())

    def end(self) -> None:
        self.timer.end()


def timed_generate(model, prompt_ids: torch.Tensor, tokens: int, warmup: int = WARMUP, pad_token_id: int | None = None) -> Timing:
    """Greedy-generate 1 + warmup + tokens tokens with any transformers-compatible model; time each step."""
    timer = _Timer()
    io = _IoMarks(timer)
    new = 1 + warmup + tokens
    device = getattr(model, "device", torch.device("cpu"))
    ids = prompt_ids.to(device)
    start = time.perf_counter()
    with torch.inference_mode():
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new, do_sample=False,
                       temperature=None, top_p=None, top_k=None, streamer=io, pad_token_id=pad_token_id)
    times = timer.times
    if len(times) < 2 + warmup:
        raise RuntimeError(f"generation stopped after {len(times)} tokens; expected {new}")
    gaps = [b - a for a, b in zip(times, times[1:])][warmup:]
    # marks[0] is the prompt; marks[1 + k] follows token k+1. Measured steps run from token 1+warmup to the end.
    first, last = io.marks[1 + warmup], io.marks[-1]
    storage = (last - first) // len(gaps) if first is not None and last is not None and gaps else None
    return Timing(times[0] - start, gaps, storage)
