"""The one set of figures every caller reports: generate --stats/--json, bench rows and the server's /metrics.

A Record is what one generation saw (the streamer's timestamp and /proc/self/io read_bytes at each step
boundary, and the ledger's passes for a model that has one); measure() turns it into GenerationStats,
leaving out the first `warmup` decode steps when asked (bench reports steady-state decode).

A step is one pass of the model. Without speculation it makes one token per sequence; a speculative pass makes the
tokens it accepted plus one, so the per-token figures divide each pass's time and bytes by the tokens it made, and
`speculation` says how many tokens were proposed and accepted and how many each pass made.
"""

from __future__ import annotations

import resource
from dataclasses import dataclass, field

from ..stream.ledger import Ledger


@dataclass
class Record:
    start: float = 0.0  # before the prompt went in (restoring a cached prefix included)
    end: float = 0.0  # generate returned
    times: list[float] = field(default_factory=list)  # after each step's token; times[0] ends the prefill
    marks: list[int | None] = field(default_factory=list)  # read_bytes as the prompt went in, then after each step
    steps: list = field(default_factory=list)  # the ledger's Steps, [prefill, decode...]; empty for a model without one
    # tokens each step made per sequence (1, or more for a speculative pass)
    counts: list[int] = field(default_factory=list)
    # positions each pass of the target computed (counted when speculating)
    pass_tokens: list[int] = field(default_factory=list)
    prompt_new: int = 0  # prompt tokens the first pass computed (those after a reused prefix)
    speculation: dict = field(default_factory=dict)  # mode and reason (text/speculate.py)
    # constrained rows: masks applied, time the generating thread spent on them
    grammar: dict = field(default_factory=dict)


@dataclass
class GenerationStats:
    """Figures of one generation. A decode step is one pass: one token per sequence, or several for a speculative
    pass."""

    ttft_s: float | None = None  # prompt in -> first token(s) out
    gaps_s: list[float] = field(default_factory=list)  # between successive steps, the warm-up steps left out
    step_tokens: list[int] = field(default_factory=list)  # tokens each of those steps made (per sequence)
    total_s: float = 0.0
    ledger: dict = field(default_factory=dict)  # Ledger.summary() over the prefill and the measured decode passes
    # /proc/self/io over the measured steps (the witness a model without a ledger has)
    read_bytes_per_step: int | None = None
    served_bytes: dict = field(default_factory=dict)  # tier -> bytes over every pass, warm-up included
    peak_rss_bytes: int | None = None
    speculation: dict = field(default_factory=dict)  # mode, reason; proposed, accepted, passes, tokens_per_pass when on
    grammar: dict = field(default_factory=dict)  # masks, blocking_ms (the generating thread's wait on them), per step

    @property
    def decode_tokens(self) -> int:
        """Tokens (per sequence) the measured steps made."""
        return sum(self.step_tokens) if len(self.step_tokens) == len(self.gaps_s) else len(self.gaps_s)

    @property
    def token_gaps_s(self) -> list[float]:
        """The time of each measured token: a step's gap shared among the tokens it made (the step gaps without
        speculation)."""
        if len(self.step_tokens) != len(self.gaps_s):
            return list(self.gaps_s)
        return [gap / n for gap, n in zip(self.gaps_s, self.step_tokens) for _ in range(n)]

    @property
    def per_token_ms(self) -> float | None:
        return 1000 * sum(self.gaps_s) / self.decode_tokens if self.gaps_s else None

    @property
    def tokens_per_s(self) -> float | None:
        return self.decode_tokens / sum(self.gaps_s) if self.gaps_s and sum(self.gaps_s) > 0 else None

    @property
    def bytes_per_token(self) -> dict | None:
        """Tier -> weight bytes served per decode step (None without a ledger or a measured step)."""
        return self.ledger.get("per_token_served")

    @property
    def storage_witnessed_per_token(self) -> int | None:
        """Bytes really read from storage per decode step: the ledger's witness, else /proc/self/io around the steps."""
        witnessed = self.ledger.get("per_token_storage_witnessed")
        return witnessed if witnessed is not None else self.read_bytes_per_step

    @property
    def phase_seconds_per_token(self) -> dict | None:
        return self.ledger.get("per_token_phase_seconds")

    @property
    def experts_per_token(self) -> float | None:
        return self.ledger.get("per_token_experts")

    @property
    def expert_cache(self) -> dict | None:
        return self.ledger.get("expert_cache")

    def to_dict(self) -> dict:
        """The figures as `generate --json` reports them under "stats"."""
        return {
            "time_to_first_token_s": round(self.ttft_s, 4) if self.ttft_s is not None else None,
            "decode_tokens_per_s": round(self.tokens_per_s, 2) if self.tokens_per_s is not None else None,
            "per_token_ms": round(self.per_token_ms, 2) if self.per_token_ms is not None else None,
            "total_s": round(self.total_s, 3),
            "bytes_per_token": self.bytes_per_token,
            "storage_bytes_per_token_witnessed": self.storage_witnessed_per_token,
            "phase_seconds_per_token": self.phase_seconds_per_token,
            "prefill": self.ledger.get("prefill"),
            "experts_per_token": self.experts_per_token,
            "expert_cache": self.expert_cache,
            "peak_rss_bytes": self.peak_rss_bytes,
            "speculation": self.speculation or None,
            "grammar": self.grammar or None,
        }


def measure(record: Record, warmup: int = 0) -> GenerationStats:
    """The figures of `record`, its first `warmup` decode steps left out (the time to first token keeps them)."""
    times = record.times
    gaps = [b - a for a, b in zip(times, times[1:])][warmup:]
    counts = record.counts[1 + warmup :] if len(record.counts) == len(times) else [1] * len(gaps)
    tokens = sum(counts)
    # marks[0] is the prompt, marks[1 + k] follows step k + 1: the measured steps run from mark 1 + warmup to the last.
    first, last = (record.marks[1 + warmup], record.marks[-1]) if len(record.marks) > 1 + warmup else (None, None)
    witnessed = (last - first) // tokens if first is not None and last is not None and tokens else None
    ledger = {}
    if record.steps:
        view = Ledger(0)  # the ledger's own per-pass figures, over the prefill and the measured passes only
        view.steps = [record.steps[0], *record.steps[1 + warmup :]]
        ledger = per_token(view.summary(), len(gaps), tokens)
    served: dict[str, int] = {}
    for step in record.steps:
        for tier, n in step.served.items():
            served[tier] = served.get(tier, 0) + n
    speculation = speculation_figures(record)
    if "passes" in speculation and gaps:  # the measured decode passes alone: what the decode rate is made of
        speculation.update(
            decode_passes=len(gaps), decode_tokens=tokens, decode_tokens_per_pass=round(tokens / len(gaps), 3)
        )
        # the positions each measured decode pass computed: its last token and the drafts it verified
        positions = record.pass_tokens[1 + warmup :]
        if positions:
            speculation["decode_positions_per_pass"] = round(sum(positions) / len(positions), 3)
    return GenerationStats(
        ttft_s=times[0] - record.start if times else None,
        gaps_s=gaps,
        total_s=record.end - record.start,
        ledger=ledger,
        read_bytes_per_step=witnessed,
        served_bytes=served,
        peak_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        step_tokens=counts,
        speculation=speculation,
        grammar=dict(record.grammar),
    )


PER_PASS = (
    "per_token_served",
    "per_token_storage_witnessed",
    "per_token_seconds",
    "per_token_experts",
    "per_token_phase_seconds",
)


def per_token(summary: dict, passes: int, tokens: int) -> dict:
    """The ledger's per-pass figures as per-token ones where passes made several tokens (the per-pass ones kept
    beside)."""
    if not passes or tokens == passes:
        return summary
    out = dict(summary)
    out["per_pass_served"] = summary.get("per_token_served")
    for key in PER_PASS:
        value = summary.get(key)
        if isinstance(value, dict):
            out[key] = {
                k: (v * passes // tokens if isinstance(v, int) else v * passes / tokens) for k, v in value.items()
            }
        elif isinstance(value, int):
            out[key] = value * passes // tokens
        elif isinstance(value, float):
            out[key] = value * passes / tokens
    return out


def speculation_figures(record: Record) -> dict:
    """Mode and reason; when on, tokens proposed (drafted) and accepted, passes of the target, and tokens per pass.

    A pass computes the positions after what the cache holds: the first one the new prompt tokens, each later one the
    last token made; every other position it computed was a drafted token. Each pass makes its accepted tokens plus
    one."""
    info = dict(record.speculation)
    if info.get("mode", "off") == "off" or not record.pass_tokens or not record.counts:
        return info
    passes = len(record.pass_tokens)
    proposed = max(0, record.pass_tokens[0] - record.prompt_new) + sum(max(0, n - 1) for n in record.pass_tokens[1:])
    made = sum(record.counts)
    accepted = made - len(record.counts)
    info.update(
        proposed=proposed,
        accepted=accepted,
        acceptance=round(accepted / proposed, 4) if proposed else None,
        passes=passes,
        tokens=made,
        tokens_per_pass=round(made / passes, 3),
    )
    return info
