"""HardwareProfile probe, knobs and cost model: every tuning value derived from this machine's measurements.

Importing this package is cheap: torch is imported only when something is measured.
"""

from ..shard.modelfacts import ModelFacts, model_facts_from_path, parse_param_count
from .cache import cache_dir
from .cost import Projection, TierCost, plan_tier_bytes, project
from .hardware import HardwareProfile
from .knobs.resolve import Knob, Knobs, resolve_knobs
from .records import Capability, Measurement

__all__ = [
    "Capability", "HardwareProfile", "Knob", "Knobs", "Measurement", "ModelFacts", "Projection", "TierCost",
    "cache_dir", "model_facts_from_path", "parse_param_count", "plan_tier_bytes", "project", "resolve_knobs",
]
