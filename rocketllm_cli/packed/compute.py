"""y = x·Wᵀ + b on a packed W: through a low-bit kernel where the probe found one for the device and dtype,
else by dequantizing W into the scratch buffer just before the matmul. A pass of many rows (a prefill) on a
kernel-bound weight is multiplied densely a block of rows at a time (dense.py) from the row count the probe
measured that to be faster.

    bound = bind(packed, "cpu", torch.bfloat16)     # once per weight: the kernel layout (or the portable parts)
    y = linear(x, bound, bias)                      # every call: x [*, K] -> [*, N]
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import dtypes
from ..checkpoint.packedformat import PackedFormat, PackedTensor
from . import dense, layout
from .bound import BoundWeight, native_kernels
from .dequant import dequantize_into
from .nativeprobe import native_dense_plan
from .probe import capabilities
from .scratch import SCRATCH, Scratch


def kernel_path(fmt: PackedFormat, dtype: torch.dtype, device) -> str:
    """Which of PATHS (bound.py) a weight of this format takes on `device` computing in `dtype`."""
    if native_kernels(fmt, device) is not None:
        return "native"
    caps = capabilities(device)
    if layout.int4_fits(fmt) and caps.supports("int4", dtype):
        return "int4"
    if layout.int8_fits(fmt) and caps.supports("int8", dtype):
        return "int8"
    return "scratch"


def kernel_dtype(fmt: PackedFormat, dtype: torch.dtype, device) -> torch.dtype:
    """The activation dtype this weight's kernel runs fastest in on `device` (measured by the probe), else `dtype`.

    A CPU without native bf16 computes the model in fp32, but torch's int4 kernel is several times faster with
    bf16 activations on every x86 CPU measured: a packed Linear then converts its input and output."""
    caps = capabilities(device)
    kind = "int4" if layout.int4_fits(fmt) else "int8" if layout.int8_fits(fmt) else None
    fastest = caps.fastest(kind) if kind else None
    return dtypes.torch_dtype(fastest) if fastest else dtype


def bind(
    packed: PackedTensor, device="cpu", dtype: torch.dtype = torch.bfloat16, *, kernel: bool = True, mode: str = "exact"
) -> BoundWeight:
    """`packed` ready for linear() on `device` with activations in `dtype` (the kernel's own, see kernel_dtype);
    kernel=False always dequantizes into scratch. `mode` is the native kernels' (bound.py NATIVE_MODES)."""
    device = torch.device(device)
    path = kernel_path(packed.format, dtype, device) if kernel else "scratch"
    if path == "native":  # from the probe's row count on, a pass multiplies exact fp32 weights densely
        rows, later = native_dense_plan(device)
        return BoundWeight(
            packed.format,
            dtype,
            device,
            path,
            portable=packed,
            mode=mode,
            dense_rows=rows,
            dense_dtype=torch.float32,
            dense_rows_later=later,
        )
    if path in ("int4", "int8"):
        rows, in_dtype = dense_plan(path, dtype, device)
        made = layout.for_kernel(path, packed, dtype, device)
        return BoundWeight(packed.format, dtype, device, path, kernel=made, dense_rows=rows, dense_dtype=in_dtype)
    # raw GGUF blocks decode on the device too (ggmlblocks.py): they go there as blocks, fewer bytes than floats
    return BoundWeight(packed.format, dtype, device, path, portable=packed.to(device))


def dense_plan(path: str, dtype: torch.dtype, device) -> tuple[int, torch.dtype | None]:
    """(from how many rows of x a weight bound for `path` in `dtype` is multiplied densely, in which dtype); (0, None):
    never. The probe's crossover, measured for the kernel's fastest dtype, where dense.py can read this device's
    kernel form."""
    caps = capabilities(device)
    if not dense.supported(path, device) or caps.fastest(path) != dtypes.short_name(dtype):
        return 0, None
    rows, in_dtype = caps.dense_from(path)
    return (rows, dtypes.torch_dtype(in_dtype)) if rows else (0, None)


def linear(
    x: torch.Tensor, weight: BoundWeight, bias: torch.Tensor | None = None, scratch: Scratch = SCRATCH
) -> torch.Tensor:
    """x [*, K] in the weight's dtype -> [*, N]. Called once per Linear per pass: kept lean (a decode step of a
    small model is as much this function's overhead as the kernels' time)."""
    n, k = weight.format.shape
    if x.shape[-1] != k or not x.is_floating_point():
        raise ValueError(f"linear on a packed [{n}, {k}] {weight.dtype} weight got x {tuple(x.shape)} {x.dtype}")
    out_dtype = x.dtype
    if out_dtype != weight.dtype:  # the kernel runs in its own fastest dtype: convert in, and back out
        x = x.to(weight.dtype)
        if bias is not None:
            bias = bias.to(weight.dtype)
    path = weight.path
    if path == "native":
        x = x if x.is_contiguous() else x.contiguous()
        rows = x.numel() // k
        if rows and dense.dense_now(weight, rows):  # a prompt's many rows: exact weights, torch's fp32 GEMM
            out = dense.dense_linear(x.view(rows, k), weight, scratch).view(*x.shape[:-1], n)
        else:
            out = weight.fast(x)
        if bias is not None:
            out = out + bias
        return out if out.dtype == out_dtype else out.to(out_dtype)
    if path == "scratch":
        out = F.linear(x, dequantize_into(weight.portable, weight.dtype, scratch, weight.device), bias)
        return out if out.dtype == out_dtype else out.to(out_dtype)
    lead = x.shape[:-1]
    rows = x if x.dim() == 2 and x.is_contiguous() else x.reshape(-1, k).contiguous()
    kernel = weight.kernel
    if rows.shape[0] == 0:
        out = rows.new_zeros((0, n))
    elif dense.dense_now(weight, rows.shape[0]):
        out = dense.dense_linear(rows, weight, scratch)
    elif path == "int4":
        out = layout.int4_mm(rows, kernel, weight.format.group)
    else:
        out = layout.int8_mm(rows, kernel)
    if bias is not None:
        out = out.add_(bias)
    if len(lead) != 1:
        out = out.reshape(*lead, n)
    return out if out.dtype == out_dtype else out.to(out_dtype)
