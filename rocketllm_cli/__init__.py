"""RocketLLM: stream language models larger than memory through the compute device."""

from .threads import apply_wait_policy

__version__ = "0.1.0"

# Before anything imports torch: how its OpenMP threads wait is fixed when torch loads (see threads.py).
apply_wait_policy()
