"""`rocketllm bench`: measured vs projected vs the physical limit per regime, with baselines side by side.

    doc = run_bench(BenchRequest(synthetic="llama:1B", baselines=("transformers",)), log=print)
    print(render(doc))

Modules: regimes (knob overrides and our measured row), baselines (+ naive), timing (one method for all),
sources (synthetic cache, Hugging Face copy of a GGUF), accounting (projection, limit, efficiency), report,
defaults (what a run measures unless told).

Importing the package is cheap, so the CLI reads `defaults` at start: each name below loads its module
(and torch) when first used.
"""

from ..lazy import exports

_HOME = {
    "BASELINES": "baselines",
    "REGIMES": "regimes",
    "render": "report",
    "BenchRequest": "suite",
    "run_bench": "suite",
}

__all__ = ["BASELINES", "REGIMES", "BenchRequest", "render", "run_bench"]


__getattr__ = exports(__name__, _HOME)
