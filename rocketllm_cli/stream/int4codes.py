"""The int4 KV cache's codes: keys quantized per channel and values per token in groups, two codes a byte, and
back into a buffer of the compute dtype."""

from __future__ import annotations

import torch

SCALE_DTYPE = torch.float16  # KV_INT4_SCALE_BYTES: what dtypes.int4_kv_value_bytes counts


def _codes(x: torch.Tensor, low: torch.Tensor, high: torch.Tensor):
    """Asymmetric 4-bit codes of x [..., D] for broadcastable minima/maxima; returns (packed codes, scale, min)."""
    scale = ((high - low) / 15).to(SCALE_DTYPE)
    low = low.to(SCALE_DTYPE)
    s, m = scale.float(), low.float()  # quantize with the rounded scale and minimum the dequantization will use
    inv = torch.where(s > 0, 1 / s, torch.zeros_like(s))
    codes = ((x - m) * inv).round_().clamp_(0, 15).to(torch.uint8)
    return codes[..., 0::2] | (codes[..., 1::2] << 4), scale, low


def quantize_keys(k: torch.Tensor, group: int):
    """Per channel over `group` tokens: k [B, H, n*G, D] -> codes [B, H, n*G, D/2], scale/min [B, H, n, D]."""
    b, h, t, d = k.shape
    x = k.float().reshape(b, h, t // group, group, d)
    packed, scale, low = _codes(x, x.amin(dim=-2, keepdim=True), x.amax(dim=-2, keepdim=True))
    return packed.reshape(b, h, t, d // 2), scale.squeeze(-2), low.squeeze(-2)


def quantize_values(v: torch.Tensor, group: int):
    """Per token over `group` channels: v [B, H, T, D] -> codes [B, H, T, D/2], scale/min [B, H, T, D/g]."""
    b, h, t, d = v.shape
    x = v.float().reshape(b, h, t, d // group, group)
    packed, scale, low = _codes(x, x.amin(dim=-1, keepdim=True), x.amax(dim=-1, keepdim=True))
    return packed.reshape(b, h, t, d // 2), scale.squeeze(-1), low.squeeze(-1)


def _unpack_into(out: torch.Tensor, codes: torch.Tensor) -> None:
    out[..., 0::2] = codes & 15
    out[..., 1::2] = codes >> 4


def dequantize_keys(out: torch.Tensor, codes, scale, low, group: int) -> None:
    b, h, t, d = out.shape
    _unpack_into(out, codes)
    blocks = out.view(b, h, t // group, group, d)
    blocks.mul_(scale.unsqueeze(-2)).add_(low.unsqueeze(-2))


def dequantize_values(out: torch.Tensor, codes, scale, low, group: int) -> None:
    b, h, t, d = out.shape
    _unpack_into(out, codes)
    groups = out.view(b, h, t, d // group, group)
    groups.mul_(scale.unsqueeze(-1)).add_(low.unsqueeze(-1))
