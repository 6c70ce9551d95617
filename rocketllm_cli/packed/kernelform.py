"""int4 weights in the CPU kernel's own form and back: the form a shard stores, so a bind on a CPU costs nothing.

    to_kernel_form(packed, "lanes64", "bf16")  # codes shuffled as the kernel reads them; sz [K/group, 2N] (scale, zero)
    to_portable(packed)                         # codes in rows order, scale and min [N, K/group] fp32

zero = min + 8·scale is computed in fp32 and stored in the dtype asked for. In fp32 that is exact for GGUF Q4_0/Q4_1
(the sum of two fp16 values fits fp32 unless their exponents are more than 13 apart) and one fp32 rounding
(2⁻²⁴ relative) for Q4_K. In bf16 each is rounded once, as the bf16 kernel would round them anyway: a bf16 set
stores what its kernel computes with, in half the bytes, and binds without converting.
"""

from __future__ import annotations

import torch

from ..checkpoint.packedformat import PackedTensor
from . import cpulayout

MIDPOINT = 8  # the kernels compute (q − 8)·scale + zero


def to_kernel_form(packed: PackedTensor, layout: str, scale_dtype: str = "fp32") -> PackedTensor:
    """A portable int4 weight with its codes in `layout` and its scales as the kernel takes them, in `scale_dtype`."""
    from .. import dtypes

    fmt = packed.format
    if fmt.kind != "int4" or layout == "rows":
        return packed
    if fmt.layout != "rows":
        packed = to_portable(packed)
    n = fmt.shape[0]
    scale = packed.parts["scale"].float()
    zero = packed.parts["min"].float() + MIDPOINT * scale
    sz = (
        torch.stack((scale, zero), dim=-1)
        .transpose(0, 1)
        .reshape(fmt.groups, 2 * n)
        .to(dtypes.torch_dtype(scale_dtype))
        .contiguous()
    )
    codes = cpulayout.to_layout(packed.parts["codes"], layout)
    return PackedTensor(fmt.with_layout(layout, scale_dtype), {"codes": codes, "sz": sz})


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
    return PackedTensor(fmt.with_layout("rows", "fp32"), {"codes": codes, "scale": scale, "min": minimum})


def scales_and_zeros(packed: PackedTensor, dtype: torch.dtype, device) -> torch.Tensor:
    """[K/group, N, 2] in `dtype` on `device` for the kernel: a view of the stored sz when it is already that."""
    fmt = packed.format
    n = fmt.shape[0]
    if fmt.layout != "rows":
        return packed.parts["sz"].view(fmt.groups, n, 2).to(device=device, dtype=dtype)
    scale = packed.parts["scale"].to(device, torch.float32)
    zero = packed.parts["min"].to(device, torch.float32) + MIDPOINT * scale
    return torch.stack((scale, zero), dim=-1).transpose(0, 1).to(dtype).contiguous()
