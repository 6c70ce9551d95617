"""Which attention kernels a forward pass on a CUDA GPU may use.

torch's scaled_dot_product_attention may pick cuDNN's kernel, which builds an execution plan for each new shape of
query and keys. A decode's keys grow by one token a step, so every step of a fresh process is a new shape: on an H200
(torch 2.11) a resident 1B decode took 48 ms/token the first time through each length and 11 ms the second
(docs/HARDWARE.md), and a streamed one pays it on every token. Flash and memory-efficient attention need no plan;
math is the fallback for what they do not cover. Scoped to the engine's own calls: the process's setting is left as is.
"""

from __future__ import annotations

import contextlib

import torch

try:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    _PLANLESS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
except ImportError:  # an older torch: no cuDNN attention to avoid either
    sdpa_kernel = None


def planless_attention(device: torch.device):
    """A context in which SDPA on DEVICE skips cuDNN's per-shape plans (nothing changes off a CUDA device)."""
    if sdpa_kernel is None or device.type != "cuda":
        return contextlib.nullcontext()
    return sdpa_kernel(_PLANLESS)
