"""The one set of figures every caller reports: generate --stats/--json, bench rows and the server's /metrics.

A Record is what one generation saw (the streamer's timestamp and /proc/self/io read_bytes at each step
boundary, and the ledger's passes for a model that has one); measure() turns it into GenerationStats,
leaving out the first `warmup` decode steps when asked (bench reports steady-state decode).
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


@dataclass
class GenerationStats:
    """Figures of one generation. A decode step produces one token per sequence (of a batch of one: one token)."""

    ttft_s: float | None = None  # prompt in -> first token out
    gaps_s: list[float] = field(default_factory=list)  # between successive tokens, the warm-up steps left out
    total_s: float = 0.0
    ledger: dict = field(default_factory=dict)  # Ledger.summary() over the prefill and the measured decode passes
    read_bytes_per_step: int | None = None  # /proc/self/io over the measured steps (the witness a model without a ledger has)
    served_bytes: dict = field(default_factory=dict)  # tier -> bytes over every pass, warm-up included
    peak_rss_bytes: int | None = None

    @property
    def per_token_ms(self) -> float | None:
        return 1000 * sum(self.gaps_s) / len(self.gaps_s) if self.gaps_s else None

    @property
    def tokens_per_s(self) -> float | None:
        return len(self.gaps_s) / sum(self.gaps_s) if self.gaps_s and sum(self.gaps_s) > 0 else None

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
        }


def measure(record: Record, warmup: int = 0) -> GenerationStats:
    """The figures of `record`, its first `warmup` decode steps left out (the time to first token keeps them)."""
    times = record.times
    gaps = [b - a for a, b in zip(times, times[1:])][warmup:]
    # marks[0] is the prompt, marks[1 + k] follows token k + 1: the measured steps run from mark 1 + warmup to the last.
    first, last = (record.marks[1 + warmup], record.marks[-1]) if len(record.marks) > 1 + warmup else (None, None)
    witnessed = (last - first) // len(gaps) if first is not None and last is not None and gaps else None
    ledger = {}
    if record.steps:
        view = Ledger(0)  # the ledger's own per-token figures, over the prefill and the measured passes only
        view.steps = [record.steps[0], *record.steps[1 + warmup :]]
        ledger = view.summary()
    served: dict[str, int] = {}
    for step in record.steps:
        for tier, n in step.served.items():
            served[tier] = served.get(tier, 0) + n
    return GenerationStats(
        ttft_s=times[0] - record.start if times else None, gaps_s=gaps, total_s=record.end - record.start, ledger=ledger,
        read_bytes_per_step=witnessed, served_bytes=served, peak_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    )
