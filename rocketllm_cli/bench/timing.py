"""What bench adds to the one generation loop (text/loop.py): the fixed prompt, the warm-up, exact token counts,
percentiles.

A run generates 1 (prefill) + `warmup` + `tokens` tokens with end-of-sequence held off (min_new_tokens), so every
run of every engine and baseline generates the same count; the first `warmup` decode steps are left out of the
figures, which are then steady-state decode. A speculative run makes those tokens in fewer steps (passes).
"""

from __future__ import annotations

WARMUP = 1  # decode tokens excluded: the first pass after prefill pays one-off costs (page faults, allocator growth)
PROMPT_TEXT = (
    "The history of computing is a story of moving data closer to where it is used. Early machines read their "
    "programs from punched cards, later ones from magnetic drums, disks and finally memory chips stacked beside "
    "the processor. Every generation made the slowest step a little faster, and every program learned to hide it. "
)


def fixed_prompt(tokenizer, n: int) -> list[int]:
    """n token ids from a fixed English text, repeated as needed: the same prompt on every machine."""
    ids = tokenizer(PROMPT_TEXT, add_special_tokens=False).input_ids
    if not ids:
        raise ValueError("the tokenizer encodes the fixed benchmark text to no tokens")
    return (ids * (n // len(ids) + 1))[:n]


def timed_batch(model, prompts: list[list[int]], tokens: int, warmup: int = WARMUP):
    """Greedy-generate 1 + warmup + tokens tokens for every prompt in one batch with any transformers-compatible
    model; returns the loop's GenerationStats with the warm-up steps left out."""
    from ..text.loop import GenerationRequest, Generator
    from ..text.sampling import SamplingParams
    from ..text.stats import measure

    new = 1 + warmup + tokens
    params = SamplingParams(max_new_tokens=new, min_new_tokens=new)
    record = Generator(model).run_batch([GenerationRequest(p, params) for p in prompts])[0].record
    made = sum(record.counts) if len(record.counts) == len(record.times) else len(record.times)
    if len(record.times) < 2 + warmup or made < new:  # not one measured step, or fewer tokens than asked
        raise RuntimeError(f"generation stopped after {made} tokens; expected {new}")
    return measure(record, warmup)


def timed_run(model, prompt_ids: list[int], tokens: int, warmup: int = WARMUP):
    """timed_batch for one prompt."""
    return timed_batch(model, [prompt_ids], tokens, warmup)


def ms_summary(seconds: list[float]) -> dict:
    """Median, p10 and p90 in milliseconds, and the count."""
    ms = sorted(1000 * s for s in seconds)
    return {
        "median": round(percentile(ms, 50), 2),
        "p10": round(percentile(ms, 10), 2),
        "p90": round(percentile(ms, 90), 2),
        "n": len(ms),
    }


def percentile(sorted_values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    if not sorted_values:
        return float("nan")
    pos = (len(sorted_values) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)
