"""One row of a plan: a whole configuration (format, dtypes, residency, context, batch, speculation, hosts), the
flags that run it, its memory per tier and its projected speed with the formula and inputs behind it."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..sizes import format_bytes
from .formats import WeightFormat


@dataclass
class Row:
    format: WeightFormat
    compute_dtype: str
    kv_dtype: str
    residency: str  # auto | resident | host | storage | stages
    context: int | None  # tokens per sequence
    batch: int
    speculate: str
    hosts: int
    flags: dict  # knob -> value: what differs from the defaults (and what a capped plan must spell out)
    tokens_per_s: float | None
    formula: str
    inputs: dict
    memory: dict  # per tier: device (weights, KV, buffers), host (weights), storage (the set); budget, used
    tiers: dict  # bytes served per tier per pass
    stages: str = ""  # --stages layer counts
    notes: list[str] = field(default_factory=list)
    default: bool = False
    why: str = ""  # the first row: why the defaults differ from it
    rank: int = 0

    def __post_init__(self) -> None:
        if self.speculate != "off" and not any(n.startswith("speculation") for n in self.notes):
            from .projection import speculation_note

            self.notes.append(speculation_note(self.speculate, self.format.speculation.get(self.speculate)))

    def key(self) -> tuple:
        return (
            self.format.name,
            self.compute_dtype,
            self.kv_dtype,
            self.memory["device"]["weights"],
            self.memory["host"]["weights"],
            self.context,
            self.batch,
            self.speculate,
            self.hosts,
            self.stages,
        )

    def residency_text(self) -> str:
        if self.stages:
            return f"{self.hosts} hosts, layers {self.stages.replace(',', '/')}"
        total, m = self.format.facts.total_bytes, self.memory
        device, host = m["device"]["weights"], m["host"]["weights"]
        if device >= total:
            return "all resident"
        parts = [
            f"{name} {format_bytes(b)}"
            for name, b in (("device", device), ("host", host), ("storage", total - device - host))
            if b
        ]
        return (
            "all in host tier"
            if host >= total
            else "all from storage"
            if not device and not host
            else " + ".join(parts)
        )

    def short(self) -> str:
        speed = f"{self.tokens_per_s:.3g} tokens/s" if self.tokens_per_s else "speed unavailable"
        return (
            f"#{self.rank} {speed}: {self.format.label}, compute {self.compute_dtype}, KV {self.kv_dtype}, "
            f"{self.context if self.context is not None else '?'} tokens, {self.residency_text()}, "
            f"{format_bytes(self.memory['used'])} memory"
        )

    def to_dict(self) -> dict:
        return {
            "rank": self.rank,
            "default": self.default,
            "why_defaults_differ": self.why or None,
            "tokens_per_s": self.tokens_per_s,
            "format": {
                "name": self.format.name,
                "quantize": self.format.quantize,
                "label": self.format.label,
                "total_bytes": self.format.facts.total_bytes,
                "kl": self.format.kl,
                "kl_note": self.format.kl_note,
            },
            "compute_dtype": self.compute_dtype,
            "kv_cache_dtype": self.kv_dtype,
            "residency": self.residency,
            "residency_text": self.residency_text(),
            "context": self.context,
            "batch": self.batch,
            "speculate": self.speculate,
            "hosts": self.hosts,
            "stages": self.stages or None,
            "flags": self.flags,
            "formula": self.formula,
            "inputs": self.inputs,
            "memory": self.memory,
            "bytes_per_pass": self.tiers,
            "notes": self.notes,
        }
