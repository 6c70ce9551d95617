"""Two 4-bit codes a byte, in the portable order: column 2j in the low nibble of byte j, 2j+1 in the high one."""

from __future__ import annotations

import torch


def pack(codes: torch.Tensor) -> torch.Tensor:
    """[N, K] integers in 0..15 -> uint8 [N, K/2]."""
    codes = codes.to(torch.uint8)
    return codes[:, 0::2] | (codes[:, 1::2] << 4)


def unpack(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K/2] -> uint8 [N, K] in 0..15."""
    return torch.stack((packed & 0x0F, packed >> 4), dim=-1).reshape(packed.shape[0], -1)
