"""How torch's OpenMP threads wait between parallel regions: decided once per process, before torch is imported.

GNU OpenMP (the runtime torch's CPU build ships) spins a thread for GOMP_SPINCOUNT iterations after each parallel
region before it sleeps. Spinning long is fastest on an idle machine and collapses when anything else wants the
cores (the streaming IO threads, another process): measured in docs/HARDWARE.md. A short spin keeps most of the
idle speed and yields the cores under contention, so it is the default; a user's OMP_WAIT_POLICY or
GOMP_SPINCOUNT always wins.
"""

from __future__ import annotations

import os
import sys

SPIN_COUNT = 1_000  # iterations, about a microsecond: docs/HARDWARE.md, "OpenMP wait policy"
USER_VARIABLES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
_decision: str | None = None


def apply_wait_policy() -> str:
    """Set GOMP_SPINCOUNT unless the user chose a policy or torch is already loaded; returns the decision, worded."""
    global _decision
    if _decision is None:
        chosen = [f"{n}={os.environ[n]}" for n in USER_VARIABLES if n in os.environ]
        if chosen:
            _decision = f"{', '.join(chosen)}, set by the user"
        elif "torch" in sys.modules:
            _decision = "OpenMP's own default (torch was imported before rocketllm, so its threads' wait was already fixed)"
        else:
            os.environ["GOMP_SPINCOUNT"] = str(SPIN_COUNT)
            _decision = (f"GOMP_SPINCOUNT={SPIN_COUNT}, set by rocketllm: spin briefly after each parallel region, then sleep "
                         "(near the spinning default's speed when idle, no collapse when other work wants the cores)")
    return _decision
