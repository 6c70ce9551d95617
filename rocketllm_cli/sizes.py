"""Human byte sizes: parse '2GB', '512MiB', '1e9'; format 1.50 GiB."""

from __future__ import annotations

import re

ALIGN = 4096  # O_DIRECT's alignment of offsets, lengths and buffers; where a unit file's data starts (stfile.py)


def round_up(n: int, to: int = ALIGN) -> int:
    """N rounded up to a multiple of TO."""
    return -(-n // to) * to


_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}
_PATTERN = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-z]*)\s*$", re.IGNORECASE)
ACCEPTED = "a byte count such as 1073741824, 1e9, 2GB, 1.5GiB or 512MiB"


def parse_bytes(text: str | int | float) -> int:
    """Parse a byte size; raises ValueError naming the accepted forms."""
    if isinstance(text, bool):
        raise ValueError(f"expected {ACCEPTED}")
    if isinstance(text, (int, float)):
        if text < 0:
            raise ValueError(f"negative size {text}; expected {ACCEPTED}")
        return int(text)
    match = _PATTERN.match(str(text))
    if not match or match.group(2).lower() not in _UNITS:
        raise ValueError(f"cannot read {text!r} as a size; expected {ACCEPTED}")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def format_bytes(n: float | int | None) -> str:
    if n is None:
        return "n/a"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    return f"{value:.2f} TiB"


def format_rate(bytes_per_second: float | None) -> str:
    if not bytes_per_second:
        return "unavailable"
    return f"{bytes_per_second / 1e9:.2f} GB/s"


_DURATION_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600}


def parse_duration(text: str) -> float:
    """Seconds from '300', '30s', '5m', '1.5h' (ollama's keep-alive spelling); ValueError otherwise."""
    raw = str(text).strip().lower()
    unit = raw[-1:] if raw[-1:] in ("s", "m", "h") else ""
    number = float(raw[: len(raw) - len(unit)])
    if number < 0 or number != number:
        raise ValueError(text)
    return number * _DURATION_UNITS[unit]


def format_duration(seconds: float) -> str:
    """'1h', '5m', '4m42s', '30s', '0.5s': the largest units that say it exactly, to the second."""
    if seconds < 60:
        return f"{round(seconds, 1):g}s"
    whole = round(seconds)
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    return "".join(f"{n}{unit}" for n, unit in ((hours, "h"), (minutes, "m"), (secs, "s")) if n)
