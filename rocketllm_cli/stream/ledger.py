"""Bytes served per tier per forward pass, with /proc/self/io as the witness for storage."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from ..iocounts import storage_read_bytes
from ..tiers import TIERS


@dataclass
class Step:
    tokens: int  # positions processed in this pass (prompt length for prefill, 1 per sequence for decode)
    seconds: float = 0.0
    served: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TIERS, 0))
    witnessed_storage: int | None = None  # read_bytes delta over the pass (prefetch for the next pass included)
    # seconds: read (IO threads), wait (compute thread blocked on IO)
    phases: dict[str, float] = field(default_factory=dict)
    experts: int = 0  # expert uses (one per routed expert per layer, all tokens of the pass together)
    expert_lookups: int = 0  # uses that asked the expert cache (experts not resident for good)
    expert_hits: int = 0  # of those, served from the cache


class Ledger:
    """One Step per forward pass of the whole model: bytes served per tier, time per phase, expert cache hits.

    The store and the expert streamer record into it as they serve; each pass's storage reads are also witnessed
    by /proc/self/io, so `--stats` and bench can show what was really read beside what was served."""

    def __init__(self, resident_bytes: int) -> None:
        self.resident_bytes = resident_bytes  # served from the device tier every pass
        self.steps: list[Step] = []
        # unit -> whole-unit reads from its file in this process (loads included; reset keeps them)
        self.reads: dict[str, int] = {}
        self._t0 = 0.0
        self._io0: int | None = None
        self._lock = threading.Lock()
        self._open = False  # a pass begun and not yet ended

    def begin(self, tokens: int) -> None:
        step = Step(tokens)
        step.served["device"] = self.resident_bytes
        self.steps.append(step)
        self._io0 = storage_read_bytes()
        self._t0 = time.perf_counter()
        self._open = True

    def serve(self, tier: str, nbytes: int) -> None:
        if self.steps:
            self.steps[-1].served[tier] += nbytes

    def serve_expert(self, tier: str, nbytes: int, cached: bool | None) -> None:
        """One routed expert's bytes; cached: True a cache hit, False a miss, None the cache was not asked."""
        if self.steps:
            step = self.steps[-1]
            step.served[tier] += nbytes
            step.experts += 1
            if cached is not None:
                step.expert_lookups += 1
                step.expert_hits += int(cached)

    def count_read(self, unit: str) -> None:
        """UNIT's file was read whole (a resident load, or a streamed use); IO threads call this too."""
        with self._lock:
            self.reads[unit] = self.reads.get(unit, 0) + 1

    def add_time(self, phase: str, seconds: float) -> None:
        """Time spent in a phase during the current pass; IO threads call this too."""
        with self._lock:
            if self.steps:
                phases = self.steps[-1].phases
                phases[phase] = phases.get(phase, 0.0) + seconds

    def end(self) -> None:
        if not self.steps:
            return
        self._open = False
        step = self.steps[-1]
        step.seconds = time.perf_counter() - self._t0
        io1 = storage_read_bytes()
        step.witnessed_storage = io1 - self._io0 if io1 is not None and self._io0 is not None else None

    def drop_open(self) -> None:
        """Forget a pass begun but never ended (one opened in advance after the last token; stream/graphs.py)."""
        if self._open and self.steps:
            self.steps.pop()
        self._open = False

    def reset(self) -> None:
        self.steps.clear()
        self._open = False

    def decode_steps(self) -> list[Step]:
        return self.steps[1:]

    def summary(self) -> dict:
        """Per-token figures over the decode passes (the prefill pass reported on its own)."""
        decode = self.decode_steps()
        out: dict = {"passes": len(self.steps)}
        if self.steps:
            first = self.steps[0]
            out["prefill"] = {"tokens": first.tokens, "seconds": round(first.seconds, 4), "served": first.served}
            if first.experts:
                out["prefill"]["experts"] = first.experts
        if decode:
            n = len(decode)
            out["decode_passes"] = n
            out["per_token_served"] = {t: sum(s.served[t] for s in decode) // n for t in TIERS}
            witnessed = [s.witnessed_storage for s in decode if s.witnessed_storage is not None]
            out["per_token_storage_witnessed"] = sum(witnessed) // len(witnessed) if witnessed else None
            out["per_token_seconds"] = sum(s.seconds for s in decode) / n
            if any(s.experts for s in self.steps):
                lookups = sum(s.expert_lookups for s in decode)
                hits = sum(s.expert_hits for s in decode)
                out["per_token_experts"] = sum(s.experts for s in decode) / n
                out["expert_cache"] = {
                    "lookups": lookups,
                    "hits": hits,
                    "hit_rate": round(hits / lookups, 4) if lookups else None,
                }
            names = sorted({p for s in decode for p in s.phases})
            out["per_token_phase_seconds"] = {p: sum(s.phases.get(p, 0.0) for s in decode) / n for p in names}
        return out
