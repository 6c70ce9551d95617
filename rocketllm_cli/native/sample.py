"""Well-formed random GGUF blocks for timing and checking the kernels: random codes, modest fp16 scales.

A kernel's speed does not depend on the values; its error is measured on weights of a realistic spread (scales of
1e-3 to 1e-2, no subnormal or infinite fp16), which random bytes would not give.
"""

from __future__ import annotations

import numpy as np
import torch

# byte offsets of each native type's fp16 fields (d, and dmin where there is one) inside a block
F16_FIELDS = {
    "Q4_0": (0,),
    "Q4_1": (0, 2),
    "Q5_0": (0,),
    "Q5_1": (0, 2),
    "Q8_0": (0,),
    "IQ4_NL": (0,),
    "Q2_K": (80, 82),
    "Q3_K": (108,),
    "Q4_K": (0, 2),
    "Q5_K": (0, 2),
    "Q6_K": (208,),
    "IQ4_XS": (0,),
}


def sample_blocks(name: str, rows: int, k: int, seed: int = 0) -> torch.Tensor:
    """uint8 [rows, k / block elements · block bytes] of type NAME (one of F16_FIELDS)."""
    from ..checkpoint.ggmlblocks import SUPPORTED

    rng = np.random.default_rng(seed)
    qk, nbytes = SUPPORTED[name]
    raw = rng.integers(0, 256, size=(rows, k // qk, nbytes), dtype=np.uint8)
    for at in F16_FIELDS[name]:
        raw[..., at : at + 2] = rng.uniform(1e-3, 1e-2, (rows, k // qk, 1)).astype(np.float16).view(np.uint8)
    return torch.from_numpy(raw.reshape(rows, -1))
