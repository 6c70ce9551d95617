"""A packed weight bound for one device and compute dtype, and the call that multiplies by it: torch's int4/int8
kernel on its kernel layout, the native kernels on a GGUF type's own blocks, or (path scratch) compute.linear's
dequantize-then-matmul. compute.bind makes one; the probe times one."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

import torch

from ..checkpoint.packedformat import PackedFormat, PackedTensor
from ..profiles.knobs.table import NATIVE_KERNELS
from ..threads import COMPUTE_THREADS
from . import layout

# int4/int8: torch's kernel computes on the packed weight; native: the native kernels compute on a GGUF type's own
# blocks (rocketllm_cli/native); scratch: dequantize into the scratch buffer, then F.linear
PATHS = ("int4", "int8", "native", "scratch")
# native: fp32 activations (exact), or activations quantized to 16 bits per 32 (int16) or 8 bits per block (int8)
NATIVE_MODES = NATIVE_KERNELS
# native, one row, where the thread follower is off (OMP_NUM_THREADS, a caller's own count: threads.py native_pass gives
# a decode's products every free core otherwise): a weight of fewer bytes runs on the calling thread (SmolLM2's
# products:
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
    # the crossover still to be measured: dense_rows is then the fewest rows it can be, and a pass of as many settles
    # it (settle_dense_rows) before choosing
    dense_rows_later: object = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.fast is None and self.path in ("int4", "int8", "native"):
            self.fast = _fast_call(self)
        if self.dense_rows:
            self.fast_numel = self.dense_rows * self.format.shape[1]

    def settle_dense_rows(self) -> None:
        """Measure the crossover this weight was bound before (once per process: the probe keeps it)."""
        later, self.dense_rows_later = self.dense_rows_later, None
        if later is not None:
            self.dense_rows = later()
            self.fast_numel = self.dense_rows * self.format.shape[1] if self.dense_rows else sys.maxsize

    def serves_fast(self, x) -> bool:
        """Whether the fast call computes this input as it is: its dtype, K wide, contiguous, few enough rows."""
        return (
            self.fast is not None
            and x.dtype == self.dtype
            and x.shape[-1] == self.format.shape[1]
            and x.is_contiguous()
            and 0 < x.numel() < self.fast_numel
        )

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


def _fast_call(weight: BoundWeight):
    n, k = weight.format.shape
    kernel, tail = weight.kernel, (n,)
    if weight.path == "native":
        # fp32 activations in, fp32 out: the kernels' own precision; a bf16 forward converts at the boundary
        nk, blocks, kind, mode = (
            native_kernels(weight.format, weight.device),
            weight.portable.parts["blocks"],
            weight.format.gguf_type,
            weight.mode,
        )

        # A weight this small is computed on the calling thread: waking the pool's workers (and competing with
        # torch's spinning OpenMP threads for the cores) cost ~0.3 ms a call, more than the product itself.
        threads = 1 if blocks.numel() < ONE_THREAD_BYTES else None
        product = nk.bound_matmul(blocks, kind, k, mode)

        def native(x):  # x K wide (serves_fast, linear())
            rows = x if x.dtype == torch.float32 else x.float()
            if not rows.is_contiguous():  # the kernel reads rows by pointer
                rows = rows.contiguous()
            m = rows.numel() // k
            # a decode the model runs on these kernels: the free cores are theirs (threads.py, native_pass)
            used = COMPUTE_THREADS.native_threads() if COMPUTE_THREADS.native_pass else threads if m == 1 else None
            out = torch.empty(x.shape[:-1] + tail, dtype=torch.float32)
            product(rows, m, out, torch.get_num_threads() if used is None else used)
            return out if x.dtype == torch.float32 else out.to(x.dtype)

        return native
    if weight.path == "int4":
        op, w, group, sz = (
            layout.int4_op(weight.device),
            kernel["weight"],
            weight.format.group,
            kernel["scales_and_zeros"],
        )
        return lambda x: op(x.view(-1, k), w, group, sz).view(x.shape[:-1] + tail)
    op, w, scales = layout.INT8_MM, kernel["weight"], kernel["scales"]
    return lambda x: op(x.view(-1, k), w, scales).view(x.shape[:-1] + tail)
