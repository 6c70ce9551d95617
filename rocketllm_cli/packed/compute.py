"""y = x·Wᵀ + b on a packed W: through a low-bit kernel where the probe found one for the device and dtype,
else by dequantizing W into the scratch buffer just before the matmul.

    bound = bind(packed, "cpu", torch.bfloat16)     # once per weight: the kernel layout (or the portable parts)
    y = linear(x, bound, bias)                      # every call: x [*, K] -> [*, N]
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from . import layout
from .dequant import dequantize_into
from .format import PackedFormat, PackedTensor
from .probe import capabilities
from .scratch import SCRATCH, Scratch

PATHS = ("int4", "int8", "scratch")  # int4/int8: that kernel computes on the packed weight; scratch: dequantize


@dataclass
class BoundWeight:
    """A packed weight made ready for one device and compute dtype."""

    format: PackedFormat
    dtype: torch.dtype
    device: torch.device
    path: str  # one of PATHS
    kernel: dict = field(default_factory=dict)  # the kernel's tensors (path int4/int8)
    portable: PackedTensor | None = None  # path scratch: the parts on the device (raw GGUF blocks: on the host)

    @property
    def nbytes(self) -> int:
        """Device bytes this weight holds (the kernel layout or the portable parts)."""
        tensors = self.portable.parts.values() if self.portable is not None else self.kernel.values()
        return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def kernel_path(fmt: PackedFormat, dtype: torch.dtype, device) -> str:
    """Which of PATHS a weight of this format takes on `device` computing in `dtype`."""
    caps = capabilities(device)
    if layout.int4_fits(fmt) and caps.supports("int4", dtype):
        return "int4"
    if layout.int8_fits(fmt) and caps.supports("int8", dtype):
        return "int8"
    return "scratch"


def bind(packed: PackedTensor, device="cpu", dtype: torch.dtype = torch.bfloat16, *, kernel: bool = True) -> BoundWeight:
    """`packed` ready for linear() on `device` in `dtype`; kernel=False always dequantizes into scratch."""
    device = torch.device(device)
    path = kernel_path(packed.format, dtype, device) if kernel else "scratch"
    if path == "int4":
        return BoundWeight(packed.format, dtype, device, path, kernel=layout.int4_for_kernel(packed, dtype, device))
    if path == "int8":
        return BoundWeight(packed.format, dtype, device, path, kernel=layout.int8_for_kernel(packed, dtype, device))
    # gguf's dequantize runs on the host, so raw blocks stay there; only the float weight goes to the device
    portable = packed if packed.format.kind == "gguf" else packed.to(device)
    return BoundWeight(packed.format, dtype, device, path, portable=portable)


def linear(x: torch.Tensor, weight: BoundWeight, bias: torch.Tensor | None = None, scratch: Scratch = SCRATCH) -> torch.Tensor:
    """x [*, K] in the weight's dtype -> [*, N]."""
    n, k = weight.format.shape
    if x.shape[-1] != k or x.dtype != weight.dtype:
        raise ValueError(f"linear on a packed [{n}, {k}] {weight.dtype} weight got x {tuple(x.shape)} {x.dtype}")
    if weight.path == "scratch":
        return F.linear(x, dequantize_into(weight.portable, weight.dtype, scratch, weight.device), bias)
    rows = x.reshape(-1, k).contiguous()
    if rows.shape[0] == 0:
        out = rows.new_zeros((0, n))
    elif weight.path == "int4":
        out = layout.int4_mm(rows, weight.kernel, weight.format.group)
    else:
        out = layout.int8_mm(rows, weight.kernel)
    if bias is not None:
        out = out.add_(bias)
    return out.reshape(*x.shape[:-1], n)
