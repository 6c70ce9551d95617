"""RocketLLM: stream language models larger than memory through the compute device."""

import os

__version__ = "0.1.0"

# OpenMP worker threads spin for a while after each parallel region by default. Streaming keeps IO
# threads busy beside the compute threads, and on a machine with few cores the spinning threads take
# the cores those reads need: measured on 2 cores, a tiny bf16 model streamed from storage ran at
# 199 ms/token spinning and 6 ms/token with passive waits (docs/HARDWARE.md). Set before torch is
# imported, and only when the user has not chosen.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
