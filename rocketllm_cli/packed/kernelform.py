"""int4 weights in the CPU kernel's own form and back: the form a shard stores, so a bind on a CPU costs nothing.

    to_kernel_form(packed, "lanes64")   # codes shuffled as the kernel reads them; sz [K/group, 2N] fp32 (scale, zero)
    to_portable(packed)                  # codes in rows order, scale and min [N, K/group] fp32

zero = min + 8·scale is computed in fp32: exact for GGUF Q4_0/Q4_1 (fp16 scales: the sum of two fp16 values
fits fp32 exactly unless their exponents are more than 13 apart), one fp32 rounding (2⁻²⁴ relative) for Q4_K.
"""

from __future__ import annotations

import torch

from . import cpulayout
from .format import PackedTensor

MIDPOINT = 8  # the kernels compute (q − 8)·scale + zero


def to_kernel_form(packed: PackedTensor, layout: str) -> PackedTensor:
    """A portable int4 weight with its codes in `layout` and its scales as the kernel takes them."""
    fmt = packed.format
    if fmt.kind != "int4" or layout == "rows":
        return packed
    if fmt.layout != "rows":
        packed = to_portable(packed)
    n = fmt.shape[0]
    scale = packed.parts["scale"].float()
    zero = packed.parts["min"].float() + MIDPOINT * scale
    sz = torch.stack((scale, zero), dim=-1).transpose(0, 1).reshape(fmt.groups, 2 * n).contiguous()
    codes = cpulayout.to_layout(packed.parts["codes"], layout)
    return PackedTensor(fmt.with_layout(layout), {"codes": codes, "sz": sz})


def to_portable(packed: PackedTensor) -> PackedTensor:
    """The inverse: codes in rows order, scale and min [N, K/group] in fp32."""
    fmt = packed.format
    if fmt.kind != "int4" or fmt.layout == "rows":
        return packed
    n = fmt.shape[0]
    sz = packed.parts["sz"].float().reshape(fmt.groups, n, 2).transpose(0, 1)
    scale = sz[..., 0].contiguous()
    minimum = (sz[..., 1] - MIDPOINT * sz[..., 0]).contiguous()
    codes = cpulayout.from_layout(packed.parts["codes"], fmt.layout)
    return PackedTensor(fmt.with_layout("rows"), {"codes": codes, "scale": scale, "min": minimum})


def scales_and_zeros(packed: PackedTensor, dtype: torch.dtype, device) -> torch.Tensor:
    """[K/group, N, 2] in `dtype` on `device` for the kernel: a view of the stored sz when it is already that."""
    fmt = packed.format
    n = fmt.shape[0]
    if fmt.layout != "rows":
        return packed.parts["sz"].view(fmt.groups, n, 2).to(device=device, dtype=dtype)
    scale = packed.parts["scale"].to(device, torch.float32)
    zero = packed.parts["min"].to(device, torch.float32) + MIDPOINT * scale
    return torch.stack((scale, zero), dim=-1).transpose(0, 1).to(dtype).contiguous()
