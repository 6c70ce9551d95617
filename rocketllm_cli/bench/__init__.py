"""`rocketllm bench`: measured vs projected vs the physical limit per regime, with baselines side by side.

    doc = run_bench(BenchRequest(synthetic="llama:1B", baselines=("transformers",)), log=print)
    print(render(doc))

Modules: regimes (knob overrides and our measured row), baselines (+ naive), timing (one method for all),
sources (synthetic cache, Hugging Face copy of a GGUF), accounting (projection, limit, efficiency), report.
"""

from .baselines import BASELINES
from .regimes import REGIMES
from .report import render
from .suite import BenchRequest, run_bench

__all__ = ["BASELINES", "REGIMES", "BenchRequest", "render", "run_bench"]
