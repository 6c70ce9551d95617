"""The portable layout -> what torch's low-bit matmul ops take, and the calls themselves.

Found by running the ops (torch 2.13, see docs/ARCHITECTURE.md "Packed weights"):
- int4 (`_weight_int4pack_mm_for_cpu` on a CPU, `_weight_int4pack_mm` elsewhere) computes with
  w = (q − 8)·scale + zero, so zero = min + 8·scale. scales_and_zeros is [K/group, N, 2] ([..., 0] scale,
  [..., 1] zero) in the activation dtype (fp32, bf16 and fp16 all run on a CPU; a mixed pair is refused);
  group 32, 64, 128 or 256; N a multiple of 16; x 2-D and contiguous.
- The CPU packed layout (`_convert_weight_to_int4pack_for_cpu`, int32 codes [N, K] in) differs between AVX512
  and AVX2 builds of the same kernel: cpulayout.py finds which one runs and makes it with tensor ops, so a
  shard can store it and a bind uses the stored codes as they are. The other devices' op
  takes uint8 [N, K/2] with column 2j in the high nibble.
- int8 (`_weight_int8pack_mm`): codes int8 [N, K], one scale per output row [N] in the activation dtype:
  w = q·scale.
"""

from __future__ import annotations

import torch

from ..checkpoint.packedformat import PackedFormat, PackedTensor
from . import cpulayout, kernelform, nibbles

INT4_GROUPS = (32, 64, 128, 256)  # the group sizes the int4 kernels accept
INT4_ROW_MULTIPLE = 16  # N must be a multiple of this for the CPU op (8 elsewhere: 16 serves both)
INT4_MIDPOINT = 8  # the kernels subtract it from every code
INNER_K_TILES = (8, 4, 2)  # the non-CPU op's tiling choices, largest first (K must be a multiple of 16·tiles)


def int4_fits(fmt: PackedFormat) -> bool:
    """Whether the int4 kernels take a weight of this shape and group."""
    return fmt.kind == "int4" and fmt.group in INT4_GROUPS and fmt.shape[0] % INT4_ROW_MULTIPLE == 0


def int8_fits(fmt: PackedFormat) -> bool:
    """Whether the int8 kernel takes it: one scale per output row."""
    return fmt.kind == "int8" and fmt.group == fmt.shape[1]


def inner_k_tiles(k: int) -> int:
    """The non-CPU op's tiling for K: the largest choice K is a multiple of 16 times."""
    return next((t for t in INNER_K_TILES if k % (16 * t) == 0), INNER_K_TILES[-1])


def int4_for_kernel(packed: PackedTensor, dtype: torch.dtype, device) -> dict:
    """{"weight", "scales_and_zeros", "tiles"} for int4_mm on `device` computing in `dtype`. A weight stored in the
    kernel's form (kernelform.py, the layout this CPU's kernel reads) is used as it is: no copy, no conversion."""
    fmt, parts = packed.format, packed.parts
    device = torch.device(device)
    codes = parts["codes"].to(device)
    k = fmt.shape[1]
    tiles = inner_k_tiles(k)
    kernel_layout = cpulayout.cpu_layout() if device.type == "cpu" else None
    if kernel_layout is not None:
        weight = (
            codes
            if fmt.layout == kernel_layout
            else cpulayout.to_layout(cpulayout.from_layout(codes, fmt.layout), kernel_layout)
        )
    elif device.type == "cpu":
        rows = cpulayout.from_layout(codes, fmt.layout)
        weight = torch.ops.aten._convert_weight_to_int4pack_for_cpu(nibbles.unpack(rows).to(torch.int32), tiles)
    else:
        rows = cpulayout.from_layout(codes, fmt.layout)
        high_first = (rows << 4) | (rows >> 4)  # swap nibbles: this op wants column 2j in the high one
        weight = torch.ops.aten._convert_weight_to_int4pack(high_first, tiles)
    return {"weight": weight, "scales_and_zeros": kernelform.scales_and_zeros(packed, dtype, device), "tiles": tiles}


def _overload(name: str):
    """The op's default overload, called without the packet's overload resolution (6 of a small matvec's ~35 us)."""
    packet = getattr(torch.ops.aten, name)
    return getattr(packet, "default", packet)


_INT4_CPU = _overload("_weight_int4pack_mm_for_cpu")
_INT4 = _overload("_weight_int4pack_mm")
_INT8 = _overload("_weight_int8pack_mm")


INT8_MM = _INT8


def int4_op(device: torch.device):
    """The int4 kernel for `device`: (x [M, K], weight, group, scales_and_zeros) -> [M, N]."""
    return _INT4_CPU if device.type == "cpu" else _INT4


def int4_mm(x: torch.Tensor, kernel: dict, group: int) -> torch.Tensor:
    """x [M, K] contiguous -> [M, N]."""
    return int4_op(x.device)(x, kernel["weight"], group, kernel["scales_and_zeros"])


def int8_for_kernel(packed: PackedTensor, dtype: torch.dtype, device) -> dict:
    """{"weight", "scales"} for int8_mm on `device` computing in `dtype`."""
    return {
        "weight": packed.parts["codes"].to(device).contiguous(),
        "scales": packed.parts["scale"].to(device).reshape(-1).to(dtype),
    }


def int8_mm(x: torch.Tensor, kernel: dict) -> torch.Tensor:
    """x [M, K] contiguous -> [M, N]."""
    return INT8_MM(x, kernel["weight"], kernel["scales"])


def for_kernel(kind: str, packed: PackedTensor, dtype: torch.dtype, device) -> dict:
    """The kernel form of `packed` for `kind` ("int4" or "int8") on `device` computing in `dtype`."""
    return int4_for_kernel(packed, dtype, device) if kind == "int4" else int8_for_kernel(packed, dtype, device)


def kernel_mm(kind: str, x: torch.Tensor, kernel: dict, group: int | None) -> torch.Tensor:
    """x [M, K] contiguous -> [M, N] through `kind`'s kernel (group: the int4 weight's; unused for int8)."""
    return int4_mm(x, kernel, group) if kind == "int4" else int8_mm(x, kernel)
