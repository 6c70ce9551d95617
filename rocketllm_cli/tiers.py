"""The memory tiers of the performance model, fastest first: time per token = Σ bytes from a tier / its bandwidth.

device  - weights resident on the compute device (bound once)
host    - host RAM / page cache between uses (pinned RAM on a GPU machine)
storage - read from the shard files on each use
"""

TIERS = ("device", "host", "storage")
# unit kinds always on the device, their bytes taken from the device budget first (stream/residency.py); every other
# kind is placed by the residency plan, and a probe sampling what streams (profiles/probe/unitreads.py) leaves these out
RESIDENT_KINDS = ("root", "vision")
