"""Packed weight -> float weight, written into the scratch buffer (or a fresh tensor), on the parts' device.

Each weight is computed in fp32 and rounded once to the requested dtype (`addcmul`/`mul_` with the fp16/fp32
scales promote to fp32), so an fp32 result of a GGUF conversion is gguf's own dequantization bit for bit and a
bf16 result is that rounded to bf16: the same weight a bf16 shard of the file holds.
"""

from __future__ import annotations

import torch

from ..shard.ggufsource import CHUNK_BYTES
from .format import PackedTensor
from .scratch import SCRATCH, Scratch


def dequantize(packed: PackedTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A new [N, K] tensor of `dtype` (for tests and conversions; layers use dequantize_into)."""
    return dequantize_into(packed, dtype, Scratch()).clone()


def dequantize_into(packed: PackedTensor, dtype: torch.dtype, scratch: Scratch = SCRATCH) -> torch.Tensor:
    """The [N, K] weight as a view of `scratch`'s buffer on the parts' device, valid until its next take."""
    fmt, parts = packed.format, packed.parts
    n, k = fmt.shape
    device = next(iter(parts.values())).device
    if fmt.kind == "int4":
        flat, stage = scratch.take(device, (n * k, dtype), (n * k // 2, torch.uint8))
        _int4_into(flat.view(n, k), stage.view(n, k // 2), parts, fmt.group)
    elif fmt.kind == "int8":
        (flat,) = scratch.take(device, (n * k, dtype))
        grouped = flat.view(n, fmt.groups, fmt.group)
        grouped.copy_(parts["codes"].view(n, fmt.groups, fmt.group))  # int8 codes are exact in every float dtype
        grouped.mul_(parts["scale"].unsqueeze(-1))
    else:
        (flat,) = scratch.take(device, (n * k, dtype))
        _gguf_into(flat.view(n, k), parts["blocks"], fmt.gguf_type)
    return flat.view(n, k)


def _int4_into(out: torch.Tensor, stage: torch.Tensor, parts: dict, group: int) -> None:
    """Codes to out through the uint8 staging area (no temporaries), then out = q·scale + min in place."""
    n, k = out.shape
    pairs = out.view(n, k // 2, 2)
    torch.bitwise_and(parts["codes"], 0x0F, out=stage)
    pairs[..., 0].copy_(stage)
    torch.bitwise_right_shift(parts["codes"], 4, out=stage)
    pairs[..., 1].copy_(stage)
    grouped = out.view(n, k // group, group)
    torch.addcmul(parts["min"].unsqueeze(-1), grouped, parts["scale"].unsqueeze(-1), out=grouped)


def _gguf_into(out: torch.Tensor, blocks: torch.Tensor, gguf_type: str) -> None:
    """Raw blocks through gguf's own (numpy, CPU) dequantize, a bounded number of rows at a time."""
    from gguf import GGMLQuantizationType
    from gguf import dequantize as gguf_dequantize

    qtype = GGMLQuantizationType[gguf_type]
    host = blocks.cpu().numpy()
    n, k = out.shape
    step = max(1, CHUNK_BYTES // (4 * k))
    for start in range(0, n, step):
        rows = gguf_dequantize(host[start : start + step], qtype).reshape(-1, k)
        out[start : start + rows.shape[0]].copy_(torch.from_numpy(rows))
