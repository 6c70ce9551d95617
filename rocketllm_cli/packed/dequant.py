"""Packed weight -> float weight, written into the scratch buffer (or a fresh tensor), on the parts' device.

Each weight is computed in fp32 (q·scale is exact for GGUF's scales, then + min rounds once) and rounded once
to the requested dtype, so an fp32 result of a GGUF conversion is gguf's own dequantization bit for bit and a
bf16 result is that rounded to bf16: the same weight a bf16 shard of the file holds. All of it, staging
included, lives in the scratch buffer: same-dtype fp32 ops on cache-sized row blocks, because torch's
mixed-dtype broadcasting ops (bf16 out, fp16 scales) are several times slower on a CPU.
"""

from __future__ import annotations

import torch

from ..checkpoint.packedformat import PackedTensor
from .kernelform import to_portable
from .scratch import SCRATCH, Scratch

CPU_BLOCK = 1 << 18  # fp32 values (1 MiB) dequantized at a time on a CPU


def dequantize(packed: PackedTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A new [N, K] tensor of `dtype` (for tests and conversions; layers use dequantize_into)."""
    return dequantize_into(packed, dtype, Scratch()).clone()


def dequantize_into(packed: PackedTensor, dtype: torch.dtype, scratch: Scratch = SCRATCH, device=None) -> torch.Tensor:
    """The [N, K] weight as a view of `scratch`'s buffer on `device` (default: the parts'), valid until its next
    take. int4/int8 parts must be on that device; raw GGUF blocks may stay on the host (they are read there)."""
    if packed.format.kind == "int4" and packed.format.layout != "rows":
        packed = to_portable(packed)  # the kernel's form (only where no kernel runs it: the slow path anyway)
    fmt, parts = packed.format, packed.parts
    n, k = fmt.shape
    device = next(iter(parts.values())).device if device is None else torch.device(device)
    if fmt.kind == "gguf":
        (flat,) = scratch.take(device, (n * k, dtype))
        _gguf_into(flat.view(n, k), parts["blocks"], fmt.gguf_type)
        return flat.view(n, k)
    codes_part = parts["codes"]
    # row blocks of about CPU_BLOCK fp32 values stay in cache; elsewhere one block (each op is a launch)
    rows = max(1, min(n, CPU_BLOCK // k)) if device.type == "cpu" else n
    wide, int4 = dtype == torch.float32, fmt.kind == "int4"
    flat, codes, work, scale, minimum = scratch.take(
        device,
        (n * k, dtype),
        (rows * k if int4 else 0, torch.uint8),
        (0 if wide else rows * k, torch.float32),
        (rows * fmt.groups, torch.float32),
        (rows * fmt.groups if int4 else 0, torch.float32),
    )
    out = flat.view(n, k)
    for start in range(0, n, rows):
        stop = min(n, start + rows)
        count = stop - start
        block = out[start:stop] if wide else work[: count * k].view(count, k)
        _codes_into(block, codes[: count * k].view(count, k) if int4 else None, codes_part[start:stop])
        grouped = block.view(count, fmt.groups, fmt.group)
        grouped.mul_(
            scale[: count * fmt.groups].view(count, fmt.groups, 1).copy_(parts["scale"][start:stop].unsqueeze(-1))
        )
        if int4:
            grouped.add_(
                minimum[: count * fmt.groups].view(count, fmt.groups, 1).copy_(parts["min"][start:stop].unsqueeze(-1))
            )
        if not wide:
            out[start:stop].copy_(block)  # the one rounding to dtype
    return out


def _codes_into(block: torch.Tensor, stage: torch.Tensor | None, codes: torch.Tensor) -> None:
    """The block's integer codes as fp32 values; int4 nibbles (stage given) are split in uint8 first: strided
    writes of bytes are cheap, of floats not."""
    if stage is not None:
        pairs = stage.view(stage.shape[0], -1, 2)
        torch.bitwise_and(codes, 0x0F, out=pairs[..., 0])
        torch.bitwise_right_shift(codes, 4, out=pairs[..., 1])
        codes = stage
    block.copy_(codes)


def _gguf_into(out: torch.Tensor, blocks: torch.Tensor, gguf_type: str) -> None:
    """Raw blocks through the exact torch decoder of their type (ggmlblocks.py: gguf's own numbers, bit for bit), on
    OUT's device: blocks kept on the host travel there once per use, a bounded tile at a time."""
    from ..checkpoint.ggmlblocks import dequantize_blocks

    dequantize_blocks(blocks if blocks.device == out.device else blocks.to(out.device), gguf_type, out=out)
