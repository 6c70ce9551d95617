"""A packed weight multiplied as a dense one, a block of rows at a time: for a pass of many positions (a prompt's
prefill, a perplexity window), where the low-bit kernel's time grows with every position.

torch's CPU int4 kernel is a matrix-vector kernel run once per row of x: on an AMX Xeon a [1536, 576] weight costs
~11 us a row (5.7 ms for 512 rows), while dequantizing it (0.7 ms) and multiplying in bf16 (0.5 ms for 512 rows)
is ~5x faster. The probe (probe.py) measures from how many rows that holds on this machine (`dense_rows`);
below it the kernel runs, as it does for every decode step.

    out = dense_linear(x, bound)    # x [M, K] contiguous in bound.dtype -> [M, N], multiplied in bound.dense_dtype

The weight never exists whole in float: CHUNK_VALUES of it at a time are dequantized into the scratch buffer and
multiplied, so the extra memory is a few MiB whatever the layer's size.

GGUF blocks on the native kernels (path native) too: a chunk of rows dequantized by the kernels' own decoder to
exact mode's fp32 weights (gguf's, bit for bit) and multiplied by torch's fp32 GEMM. That product is exact mode's
up to the order of its sums, whatever the kernel mode: a prompt computed densely is never less exact than its
decode steps. `kernel_passes()` keeps every pass on the kernel mode instead, for a measurement of what that mode
costs (bench --perplexity scores whole windows in one pass).
"""

from __future__ import annotations

import threading
from contextlib import contextmanager

import torch
import torch.nn.functional as F

from . import cpulayout
from .kernelform import MIDPOINT
from .scratch import SCRATCH, Scratch

CHUNK_VALUES = 1 << 20  # weight values dequantized at a time (4 MiB in fp32)
ROW_ALIGN = 64  # row blocks start at multiples of every CPU int4 layout's block of rows, so each is a weight of its own


_KERNEL_ONLY = threading.local()  # kernel_passes() in force on this thread


def supported(path: str, device: torch.device) -> bool:
    """Whether a weight bound for `path` (int4/int8/native) on `device` can be dequantized from its kernel form here:
    the CPU int4 kernel's code order must be one cpulayout knows (other devices' kernels keep their own)."""
    if torch.device(device).type != "cpu":
        return False
    return path in ("int8", "native") or (path == "int4" and cpulayout.cpu_layout() is not None)


@contextmanager
def kernel_passes():
    """Within it, this thread's passes of many rows over GGUF blocks run on the native kernel's mode, not densely."""
    before = getattr(_KERNEL_ONLY, "on", False)
    _KERNEL_ONLY.on = True
    try:
        yield
    finally:
        _KERNEL_ONLY.on = before


def dense_now(weight, rows: int) -> bool:
    """Whether ROWS rows of x multiply by WEIGHT densely: as many as its dense_rows (for GGUF blocks on the native
    kernels, outside kernel_passes())."""
    if not weight.dense_rows or rows < weight.dense_rows:
        return False
    if weight.dense_rows_later is not None:  # as many rows as the crossover can be: measure it now
        weight.settle_dense_rows()
        if not weight.dense_rows or rows < weight.dense_rows:
            return False
    return weight.path != "native" or not getattr(_KERNEL_ONLY, "on", False)


def dense_linear(x: torch.Tensor, weight, scratch: Scratch = SCRATCH) -> torch.Tensor:
    """x [M, K] contiguous in weight.dtype -> x·Wᵀ [M, N] in weight.dtype for a weight bound for the int4 or int8 kernel
    (bound.BoundWeight), multiplied in weight.dense_dtype (fp32 where the probe found bf16 matmuls slow)."""
    dtype = weight.dense_dtype or weight.dtype
    if x.dtype != dtype:  # one call either way (the probe's dense dtype is fp32 where bf16 matmuls are slow)
        return _dense(x.to(dtype), weight, scratch, dtype).to(x.dtype)
    return _dense(x, weight, scratch, dtype)


def _dense(x: torch.Tensor, weight, scratch: Scratch, dtype: torch.dtype) -> torch.Tensor:
    n, k = weight.format.shape
    device = x.device
    rows = min(n, max(ROW_ALIGN, CHUNK_VALUES // k // ROW_ALIGN * ROW_ALIGN))
    groups = k // weight.format.group if weight.path == "int4" else 1
    wide = dtype == torch.float32
    work, narrow, scale, shift = scratch.take(
        device,
        (rows * k, torch.float32),
        (0 if wide else rows * k, dtype),
        (rows * groups, torch.float32),
        (rows * groups, torch.float32),
    )
    out = None if rows == n else torch.empty((x.shape[0], n), dtype=dtype, device=device)
    for start in range(0, n, rows):
        stop = min(n, start + rows)
        count = stop - start
        block = work[: count * k].view(count, k)
        if weight.path == "native":
            _native_rows(weight, start, stop, block)
        elif weight.path == "int4":
            _int4_rows(
                weight,
                start,
                stop,
                block,
                scale[: count * groups].view(count, groups),
                shift[: count * groups].view(count, groups),
            )
        else:
            _int8_rows(weight, start, stop, block)
        if not wide:
            block = narrow[: count * k].view(count, k).copy_(block)  # the one rounding to the compute dtype
        if out is None:
            return F.linear(x, block)
        out[:, start:stop] = F.linear(x, block)
    return out


def _int4_rows(weight, start: int, stop: int, block: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor) -> None:
    """Rows start:stop of an int4 kernel-form weight as fp32 into `block`: w = (q − 8)·scale + zero = q·scale +
    shift."""
    kernel = weight.kernel
    block.copy_(cpulayout.codes(kernel["weight"][start:stop], cpulayout.cpu_layout()))
    sz = kernel["scales_and_zeros"]  # [K/group, N, 2] in the kernel's dtype
    scale.copy_(sz[:, start:stop, 0].t())
    shift.copy_(sz[:, start:stop, 1].t()).sub_(scale, alpha=MIDPOINT)
    grouped = block.view(block.shape[0], scale.shape[1], -1)
    grouped.mul_(scale.unsqueeze(-1)).add_(shift.unsqueeze(-1))


def _native_rows(weight, start: int, stop: int, block: torch.Tensor) -> None:
    """Rows start:stop of a GGUF type's blocks as exact mode's fp32 weights into `block`, by the native kernels, on
    this thread: their pool's workers woken between torch's GEMMs fought its spinning OpenMP threads for the cores
    (the 2.5 B's 256-token prompt: 7.6 s with both pools, 5.5-6.4 s with the decoder on one thread)."""
    from .bound import native_kernels

    blocks = weight.portable.parts["blocks"][start:stop]
    native_kernels(weight.format, weight.device).dequantize(
        blocks, weight.format.gguf_type, weight.format.shape[1], out=block, threads=1
    )


def _int8_rows(weight, start: int, stop: int, block: torch.Tensor) -> None:
    """Rows start:stop of an int8 weight as fp32 into `block`: w = q·scale (one scale a row)."""
    kernel = weight.kernel
    block.copy_(kernel["weight"][start:stop])
    block.mul_(kernel["scales"][start:stop].float().unsqueeze(-1))
