"""HardwareProfile probe, knobs and cost model: every tuning value derived from this machine's measurements.

Importing this package is cheap: its names load on first use (a command line that only parses its flags reads the
knob table alone), and torch is imported only when something is measured.
"""

from __future__ import annotations

from ..lazy import exports

_HOMES = {
    "ModelFacts": "..checkpoint.modelfacts",
    "model_facts_from_path": "..checkpoint.modelfacts",
    "parse_param_count": "..checkpoint.configreads",
    "cache_dir": "..cachehome",
    "Projection": ".cost",
    "TierCost": ".cost",
    "plan_tier_bytes": ".cost",
    "project": ".cost",
    "HardwareProfile": ".hardware",
    "Knob": ".knobs.resolve",
    "Knobs": ".knobs.resolve",
    "resolve_knobs": ".knobs.resolve",
    "Capability": ".records",
    "Measurement": ".records",
}
__all__ = sorted(_HOMES)


__getattr__ = exports(__name__, _HOMES)
