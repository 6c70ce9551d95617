"""y = x·Wᵀ + b on a packed W: through a low-bit kernel where the probe found one for the device and dtype,
else by dequantizing W into the scratch buffer just before the matmul. A pass of many rows (a prefill) on a
kernel-bound weight is multiplied densely a block of rows at a time (dense.py) from the row count the probe
measured that to be faster.

    bound = bind(packed, "cpu", torch.bfloat16)     # once per weight: the kernel layout (or the portable parts)
    y = linear(x, bound, bias)                      # every call: x [*, K] -> [*, N]
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from .. import dtypes
from ..checkpoint.packedformat import PackedFormat, PackedTensor
from ..threads import COMPUTE_THREADS
from . import dense, layout
from .dequant import dequantize_into
from .probe import capabilities
from .scratch import SCRATCH, Scratch

# int4/int8: torch's kernel computes on the packed weight; native: the native kernels compute on a GGUF type's own
# blocks (rocketllm_cli/native); scratch: dequantize into the scratch buffer, then F.linear
PATHS = ("int4", "int8", "native", "scratch")
NATIVE_MODES = ("exact", "int8")  # native: fp32 activations (exact), or activations quantized to 8 bits per block
# native, one row, where the thread follower is off (OMP_NUM_THREADS, a caller's own count: threads.py native_pass gives
# a decode's products every free core otherwise): a weight of fewer bytes runs on the calling thread (SmolLM2's products:
# 27-35 ms/token on the pool beside torch's spinning threads, 23-25 on one thread; its 30 MiB head still gains from two)
ONE_THREAD_BYTES = 4 << 20


@dataclass
class BoundWeight:
    """A packed weight made ready for one device and compute dtype."""

    format: PackedFormat
    dtype: torch.dtype
    device: torch.device
    path: str  # one of PATHS
    kernel: dict = field(default_factory=dict)  # the kernel's tensors (path int4/int8)
    portable: PackedTensor | None = None  # path scratch: the parts on the device (raw GGUF blocks: on the host)
    # x [*, K] contiguous, non-empty, in `dtype`, no bias -> the kernel's [*, N]: the packed Linear's per-call path
    # (linear()'s checks and branches are a quarter of a small matvec's time)
    fast: object = field(default=None, repr=False)
    dense_rows: int = 0  # from this many rows of x on, dequantize a block at a time and multiply densely (0: never)
    dense_dtype: torch.dtype | None = None  # the dtype that dense multiply runs in (None: `dtype`)
    fast_numel: int = field(default=sys.maxsize, repr=False)  # x.numel() below which `fast` serves (dense_rows · K)
    mode: str = "exact"  # path native: one of NATIVE_MODES

    def __post_init__(self) -> None:
        if self.fast is None and self.path in ("int4", "int8", "native"):
            self.fast = _fast_call(self)
        if self.dense_rows:
            self.fast_numel = self.dense_rows * self.format.shape[1]

    @property
    def nbytes(self) -> int:
        """Device bytes this weight holds (the kernel layout or the portable parts)."""
        tensors = self.portable.parts.values() if self.portable is not None else self.kernel.values()
        return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def native_kernels(fmt: PackedFormat, device):
    """The native kernels where they compute on this format on `device` (a GGUF type's blocks on a CPU), else None."""
    if fmt.kind != "gguf" or torch.device(device).type != "cpu":
        return None
    from ..native import kernels

    found = kernels()
    return found if found is not None and found.supported(fmt.gguf_type) else None


def kernel_path(fmt: PackedFormat, dtype: torch.dtype, device) -> str:
    """Which of PATHS a weight of this format takes on `device` computing in `dtype`."""
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


def bind(packed: PackedTensor, device="cpu", dtype: torch.dtype = torch.bfloat16, *, kernel: bool = True,
         mode: str = "exact") -> BoundWeight:
    """`packed` ready for linear() on `device` with activations in `dtype` (the kernel's own, see kernel_dtype);
    kernel=False always dequantizes into scratch. `mode` is the native kernels' (NATIVE_MODES)."""
    device = torch.device(device)
    path = kernel_path(packed.format, dtype, device) if kernel else "scratch"
    if path == "native":
        return BoundWeight(packed.format, dtype, device, path, portable=packed, mode=mode)
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


def _fast_call(weight: BoundWeight):
    n, k = weight.format.shape
    kernel, tail = weight.kernel, (n,)
    if weight.path == "native":
        # fp32 activations in, fp32 out: the kernels' own precision; a bf16 forward converts at the boundary
        nk, blocks, kind, mode = native_kernels(weight.format, weight.device), weight.portable.parts["blocks"], \
            weight.format.gguf_type, weight.mode

        # A weight this small is computed on the calling thread: waking the pool's workers (and competing with
        # torch's spinning OpenMP threads for the cores) cost ~0.3 ms a call, more than the product itself.
        threads = 1 if blocks.numel() < ONE_THREAD_BYTES else None

        def native(x):
            rows = x.reshape(-1, k)
            # a decode the model runs on these kernels: the free cores are theirs (threads.py, native_pass)
            used = COMPUTE_THREADS.native_threads() if COMPUTE_THREADS.native_pass else threads if rows.shape[0] == 1 else None
            out = nk.matmul(blocks, kind, rows if rows.dtype == torch.float32 else rows.float(), mode=mode, threads=used)
            return (out if x.dtype == torch.float32 else out.to(x.dtype)).view(x.shape[:-1] + tail)

        return native
    if weight.path == "int4":
        op, w, group, sz = layout.int4_op(weight.device), kernel["weight"], weight.format.group, kernel["scales_and_zeros"]
        return lambda x: op(x.view(-1, k), w, group, sz).view(x.shape[:-1] + tail)
    op, w, scales = layout.INT8_MM, kernel["weight"], kernel["scales"]
    return lambda x: op(x.view(-1, k), w, scales).view(x.shape[:-1] + tail)


def linear(x: torch.Tensor, weight: BoundWeight, bias: torch.Tensor | None = None, scratch: Scratch = SCRATCH) -> torch.Tensor:
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
        out = weight.fast(x if x.is_contiguous() else x.contiguous())
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
    elif weight.dense_rows and rows.shape[0] >= weight.dense_rows:
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
