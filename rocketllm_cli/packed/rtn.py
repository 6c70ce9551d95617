"""Round-to-nearest group-wise quantization of a float weight into the portable packed format.

    int4: per group, min = the smallest weight, scale = (largest − smallest)/15, q = round((w − min)/scale)
          (asymmetric: the 16 levels span exactly the group's range)
    int8: per group, scale = max|w|/127, q = round(w/scale) in −127..127 (symmetric; group None = per row,
          what the int8 kernel takes)

Codes are computed from the scale and min as stored (after rounding to scale_dtype), so each weight is off
by at most half a step plus that rounding: |ŵ − w| ≤ scale/2·(1 + 2⁻⁸) + |min|·ε(scale_dtype).
"""

from __future__ import annotations

import torch

from .. import dtypes
from ..checkpoint.packedformat import PackedFormat, PackedTensor
from ..errors import ParameterError
from . import nibbles

LEVELS = {4: 15, 8: 127}  # int4: codes 0..15 over the range; int8: −127..127 around 0


def quantize_rtn(
    weight: torch.Tensor, bits: int = 4, group: int | None = 32, scale_dtype: str = "fp16"
) -> PackedTensor:
    """weight [N, K] (any float dtype) -> PackedTensor of kind int4 or int8; group None: one group per row."""
    if bits not in LEVELS:
        raise ParameterError(f"{{bits}} must be one of {', '.join(map(str, LEVELS))}, got {bits}", "bits")
    if weight.dim() != 2 or not weight.is_floating_point():
        raise ValueError(f"quantize_rtn takes a 2-D float weight, got {tuple(weight.shape)} {weight.dtype}")
    n, k = weight.shape
    group = k if group is None else int(group)
    if group < 1 or k % group or (bits == 4 and group % 2):
        raise ParameterError(
            f"{{group}} must divide K = {k}{' and be even' if bits == 4 else ''}, got {group}", "group"
        )
    if scale_dtype not in dtypes.NAMES:
        raise ParameterError(
            f"{{scale_dtype}} must be one of {', '.join(dtypes.NAMES)}, got {scale_dtype!r}", "scale_dtype"
        )
    stored = dtypes.torch_dtype(scale_dtype)
    w = weight.detach().float().reshape(n, k // group, group)
    if bits == 4:
        low, high = w.amin(dim=-1), w.amax(dim=-1)
        scale, minimum = _stored((high - low) / LEVELS[4], stored), low.to(stored)
        steps = (w - minimum.float().unsqueeze(-1)) / _nonzero(scale).unsqueeze(-1)
        codes = steps.round().clamp(0, LEVELS[4]).to(torch.uint8).reshape(n, k)
        fmt = PackedFormat("int4", (n, k), group, scale_dtype=scale_dtype)
        return PackedTensor(fmt, {"codes": nibbles.pack(codes), "scale": scale, "min": minimum})
    scale = _stored(w.abs().amax(dim=-1) / LEVELS[8], stored)
    codes = (w / _nonzero(scale).unsqueeze(-1)).round().clamp(-LEVELS[8], LEVELS[8]).to(torch.int8).reshape(n, k)
    return PackedTensor(PackedFormat("int8", (n, k), group, scale_dtype=scale_dtype), {"codes": codes, "scale": scale})


def _stored(scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    out = scale.to(dtype)
    if not bool(torch.isfinite(out).all()):
        name = dtypes.short_name(dtype)
        raise ParameterError(
            f"{{scale_dtype}} {name} cannot hold this weight's scales (too large): use fp32", "scale_dtype"
        )
    return out


def _nonzero(scale: torch.Tensor) -> torch.Tensor:
    """The stored scale in fp32, with 1 where a group is constant (its codes are then all 0: w = min, or 0)."""
    scale = scale.float()
    return torch.where(scale == 0, torch.ones_like(scale), scale)
