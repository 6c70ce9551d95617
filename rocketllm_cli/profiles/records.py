"""The two record types a profile is made of: what was measured, and what was decided."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class Measurement:
    """One timed measurement. `value` is in `unit` (B/s unless said); unavailable ones carry the reason."""

    name: str
    value: float | None
    method: str
    bytes_moved: int = 0
    seconds: float = 0.0
    available: bool = True
    reason: str = ""
    unit: str = "B/s"
    cpu_seconds: float = 0.0  # process CPU time the measurement used (a read's cost to compute that shares the cores)

    @classmethod
    def unavailable(cls, name: str, method: str, reason: str, unit: str = "B/s") -> "Measurement":
        return cls(name, None, method, 0, 0.0, False, reason, unit)

    @property
    def value_bps(self) -> float | None:
        return self.value if self.available and self.unit == "B/s" else None

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, doc: dict) -> "Measurement":
        return cls(**doc)


@dataclass(frozen=True)
class Capability:
    """A decision about what this machine can do; `fallback_taken` names the second choice when the first was
    refused."""

    name: str
    value: object
    fallback_taken: str | None = None
    reason: str = ""

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, doc: dict) -> "Capability":
        return cls(**doc)
