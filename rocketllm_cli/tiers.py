"""The memory tiers of the performance model, fastest first: time per token = Σ bytes from a tier / its bandwidth.

device  - weights resident on the compute device (bound once)
host    - host RAM / page cache between uses (pinned RAM on a GPU machine)
storage - read from the shard files on each use
"""

TIERS = ("device", "host", "storage")
