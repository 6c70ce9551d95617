"""NativeKernels: the ctypes face of the built library (build.py), with one-line ValueErrors for bad input.

    nk = NativeKernels.load(path)                      # or rocketllm_cli.native.kernels()
    y = nk.matmul(blocks, "Q4_K", x)                   # uint8 [N, K/256·144], fp32 [M, K] -> fp32 [M, N]
    nk.matmul(blocks, "Q4_K", x, mode="int16")         # x quantized to 16 bits per 32 first (~2e-5 relative)
    nk.matmul(blocks, "Q4_K", x, mode="int8", out=y)   # x quantized to q8 first (lossy, ~5e-3)
    w = nk.dequantize(blocks, "Q4_K", k)               # fp32 [N, K]: exact mode's weights (a prefill's dense path)
    o = nk.attend(q, k, v, scale)                      # a decode step's attention: fp32 [H, D], [KH, L, D] x2

A decode step calls matmul a few hundred times per token, so a call does little in Python: the C function and
its argument types are bound once, the checks are attribute reads, and with `out` given nothing is allocated.
ctypes releases the GIL for the call; the library runs one call at a time (a second caller waits).
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from .build import ISAS, build_id  # the variants, in the library's numbering; later is faster

MODES = {"exact": 0, "int8": 1, "int16": 2}
NO_VARIANT = "no variant this CPU runs"
# name -> GGML type number; the library reports each one's block layout, checked against ggmlblocks.SUPPORTED
# fmt: off
GGML_IDS = {"Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q5_1": 7, "Q8_0": 8, "Q2_K": 10, "Q3_K": 11, "Q4_K": 12, "Q5_K": 13,
            "Q6_K": 14, "IQ4_NL": 20, "IQ4_XS": 23}
# fmt: on
ABI_VERSION = 7
_ERRORS = {
    -1: "unsupported type",
    -2: "variant not runnable on this CPU",
    -3: "shapes do not match",
    -4: "unknown mode",
    -5: "out of memory for the scratch buffers",
}

_i64, _ptr = ctypes.c_int64, ctypes.c_void_p


class NativeKernels:
    """y = x · Wᵀ computed on GGUF's quantized blocks as stored, by the library's `isa` variant."""

    def __init__(
        self,
        lib: ctypes.CDLL,
        isa: str,
        runnable: tuple[str, ...],
        layouts: dict[str, tuple[int, int, int]],
        build: str = "",
    ):
        self._lib = lib
        # the build's key (its cache folder: sources, compiler, flags), so measurements follow an edit
        self.build = build
        self.isa = isa  # the variant in use: "avx512", "avx2" or "scalar"
        self.isas = runnable  # every variant built in that this CPU runs, best first
        self._isa_id = ISAS.index(isa)
        self._layouts = layouts  # name -> (GGML type number, elements per block, bytes per block)
        self._call = lib.rl_matmul
        self.hold_pool = lib.rl_pool_hold  # hold_pool(1): the pool's workers spin between calls until hold_pool(0)

    @classmethod
    def load(cls, path: Path, isa: str | None = None) -> tuple[NativeKernels | None, str]:
        """Load the library at `path`; the best runnable variant not above `isa` (default: the best). (kernels, "")
        or (None, reason)."""
        try:
            lib = ctypes.CDLL(str(path))
            abi = lib.rl_abi_version()
        except (OSError, AttributeError) as exc:  # AttributeError: not our library
            return None, f"cannot load {path.name}: {' '.join(str(exc).split())}"
        if abi != ABI_VERSION:
            return None, f"{path} has ABI {abi}, this code expects {ABI_VERSION}"
        # isa, type, mode, blocks, n, row bytes, x, m, k, out, threads
        lib.rl_matmul.argtypes = [*[ctypes.c_int] * 3, _ptr, _i64, _i64, _ptr, _i64, _i64, _ptr, ctypes.c_int]
        lib.rl_dequantize.argtypes = [ctypes.c_int, ctypes.c_int, _ptr, _i64, _i64, _i64, _ptr, ctypes.c_int]
        lib.rl_quantize.argtypes = [ctypes.c_int, _ptr, _i64, _i64, ctypes.c_int, _ptr, _ptr, _ptr]
        lib.rl_quantize16.argtypes = [ctypes.c_int, _ptr, _i64, _i64, _ptr, _ptr, _ptr]
        # isa, q, heads, q_head, k, kv_heads, length, k_head, k_row, v, v_head, v_row, dim, scale, out, out_head,
        # threads
        lib.rl_attend.argtypes = [ctypes.c_int, _ptr, _i64, _i64, _ptr, *[_i64] * 4, _ptr, _i64, _i64, _i64]
        lib.rl_attend.argtypes += [ctypes.c_float, _ptr, _i64, ctypes.c_int]
        # q, heads, head and position strides, its out and out's strides; k likewise; positions, dim, cos, sin, their
        # row stride
        lib.rl_rope.argtypes = [*[_ptr, _i64, _i64, _i64, _ptr, _i64, _i64] * 2, _i64, _i64, _ptr, _ptr, _i64]
        # x, rows, width, weight, one_plus, eps, lanes, out
        lib.rl_rms_norm.argtypes = [_ptr, _i64, _i64, _ptr, ctypes.c_int, ctypes.c_float, ctypes.c_int, _ptr]
        lib.rl_pool_hold.argtypes, lib.rl_pool_hold.restype = [ctypes.c_int], None
        mask = lib.rl_isas()
        runnable = tuple(name for i, name in reversed(list(enumerate(ISAS))) if mask >> i & 1)
        layouts, reason = _layouts(lib)
        if reason:
            return None, reason
        if isa is not None and isa not in ISAS:
            return None, f"unknown native variant {isa!r}: choose one of {', '.join(ISAS)}"
        ceiling = ISAS.index(isa) if isa is not None else len(ISAS) - 1
        chosen = next((name for name in runnable if ISAS.index(name) <= ceiling), None)
        if chosen is None:  # a build of fewer variants than this CPU's flags promised (build.wanted_variants)
            compiled = ", ".join(runnable) or "none"
            return None, f"{NO_VARIANT} at or below {ISAS[ceiling]} in {Path(path).name} (it runs: {compiled})"
        return cls(lib, chosen, runnable, layouts, build_id(path)), ""

    def with_isa(self, isa: str) -> NativeKernels:
        """The same library driven by variant `isa`, which this CPU must run (tests use it to cover each one)."""
        if isa not in self.isas:
            raise ValueError(
                f"native variant {isa!r} does not run here: this library runs {', '.join(self.isas)} on this CPU "
                "(ROCKETLLM_NATIVE_VARIANTS=all builds every variant)"
            )
        return NativeKernels(self._lib, isa, self.isas, self._layouts, self.build)

    def supported(self, gguf_type) -> bool:
        """Whether `gguf_type` (a name such as "Q4_K", or a gguf.GGMLQuantizationType) has kernels."""
        return str(getattr(gguf_type, "name", gguf_type)) in self._layouts

    def matmul(
        self,
        blocks: torch.Tensor,
        gguf_type,
        x: torch.Tensor,
        mode: str = "exact",
        out: torch.Tensor | None = None,
        threads: int | None = None,
    ) -> torch.Tensor:
        """y [M, N] fp32 = x [M, K] fp32 · Wᵀ, W given as its raw GGUF blocks: uint8 [N, K / QK · block bytes],
        contiguous on the CPU (never copied). mode "exact": W's fp32 values (gguf's dequantization, bit for bit)
        times x in fp32; "int16": x quantized to 16 bits per 32 elements, integer dot products per 16 or 32
        (relative error ~2e-5); "int8": x quantized to 8 bits per 32 (256 for the K-quants) elements, integer dot
        products per block (~5e-3). `out`: a contiguous fp32 [M, N] to write into. `threads`: default torch's."""
        name, type_id = self._type_of(gguf_type)
        mode_id = MODES.get(mode)
        if mode_id is None:
            raise ValueError(f"mode must be one of {', '.join(repr(m) for m in MODES)}, got {mode!r}")
        if not (isinstance(x, torch.Tensor) and x.dtype == torch.float32 and x.dim() == 2 and x.is_cpu):
            raise ValueError(f"x must be a 2-D float32 CPU tensor [M, K], got {_describe(x)}")
        m, k = x.shape
        n, row_bytes = self._check_blocks(name, blocks, k, f"x of shape {tuple(x.shape)}")
        out = _out(out, (m, n))
        if not x.is_contiguous():
            x = x.contiguous()  # activations are small; W is never copied
        threads = torch.get_num_threads() if threads is None else threads
        rc = self._call(self._isa_id, type_id, mode_id, blocks.data_ptr(), n, row_bytes, x.data_ptr(), m, k,
                        out.data_ptr(), threads)  # fmt: skip
        if rc:
            raise RuntimeError(f"native {name} matmul failed: {_ERRORS.get(rc, rc)}")
        return out

    def bound_matmul(self, blocks: torch.Tensor, gguf_type, k: int, mode: str = "exact"):
        """matmul on one weight's blocks, checked once: f(x, m, out, threads) writes out = x · Wᵀ with x the M rows of
        K fp32 values of a contiguous CPU tensor and out a contiguous fp32 CPU tensor of M · N values, neither
        checked (the packed Linear's per call path, whose caller guarantees both: matmul's checks and allocation
        were a third of a small decode product's time). The blocks are held by the call."""
        name, type_id = self._type_of(gguf_type)
        mode_id = MODES.get(mode)
        if mode_id is None:
            raise ValueError(f"mode must be one of {', '.join(repr(m) for m in MODES)}, got {mode!r}")
        n, row_bytes = self._check_blocks(name, blocks, k, f"K = {k}")
        call, isa, held = self._call, self._isa_id, blocks
        at = held.data_ptr()

        def product(x: torch.Tensor, m: int, out: torch.Tensor, threads: int) -> None:
            rc = call(isa, type_id, mode_id, at, n, row_bytes, x.data_ptr(), m, k, out.data_ptr(), threads)
            if rc:
                raise RuntimeError(f"native {name} matmul of {held.shape[0]} rows failed: {_ERRORS.get(rc, rc)}")

        return product

    def dequantize(
        self, blocks: torch.Tensor, gguf_type, k: int, out: torch.Tensor | None = None, threads: int | None = None
    ) -> torch.Tensor:
        """W [N, K] fp32 from its raw GGUF blocks (uint8 [N, K / QK · block bytes], contiguous on the CPU): the
        weights exact mode multiplies by, each a · code + b rounded once (Q8_0's d · code exactly). `out`: a
        contiguous fp32 [N, K] to write into. `threads`: default torch's."""
        name, type_id = self._type_of(gguf_type)
        n, row_bytes = self._check_blocks(name, blocks, k, f"K = {k}")
        out = _out(out, (n, k))
        used = torch.get_num_threads() if threads is None else threads
        rc = self._lib.rl_dequantize(self._isa_id, type_id, blocks.data_ptr(), n, row_bytes, k, out.data_ptr(), used)
        if rc:
            raise RuntimeError(f"native {name} dequantize failed: {_ERRORS.get(rc, rc)}")
        return out

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        scale: float,
        out: torch.Tensor | None = None,
        threads: int | None = None,
    ) -> torch.Tensor:
        """A decode step's attention: out [H, D] fp32 = softmax(scale · q Kᵀ) V for one query position per head,
        q [H, D], k and v [KH, L, D] (H a multiple of KH: query head h reads key/value head h // (H / KH)), all fp32
        on the CPU with each row's D values contiguous (a view of a longer cache is read in place). Exact softmax in
        fp32 (an exponential within ~2 ulp), the cache split in chunks the threads share. `out`: an fp32 [H, D] to
        write into (its rows contiguous). `threads`: default torch's."""
        for name, t, dims in (("q", q, 2), ("k", k, 3), ("v", v, 3)):
            if not (isinstance(t, torch.Tensor) and t.dtype == torch.float32 and t.dim() == dims and t.is_cpu):
                raise ValueError(f"{name} must be a {dims}-D float32 CPU tensor, got {_describe(t)}")
            if t.stride(-1) != 1 and t.shape[-1] > 1:
                raise ValueError(f"{name}'s last dimension must be contiguous, got strides {t.stride()}")
        heads, dim = q.shape
        kv_heads, length, _ = k.shape
        if k.shape[2] != dim or v.shape != k.shape or kv_heads < 1 or heads % kv_heads or length < 1:
            raise ValueError(
                f"attend needs q [H, D] and k, v [KH, L, D] with H a multiple of KH and L >= 1, got q "
                f"{tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
            )
        if out is None:
            out = torch.empty((heads, dim), dtype=torch.float32)
        elif not (
            isinstance(out, torch.Tensor)
            and out.dtype == torch.float32
            and out.is_cpu
            and out.shape == (heads, dim)
            and out.stride(-1) == 1
        ):
            raise ValueError(
                f"out must be a float32 CPU tensor [{heads}, {dim}] with contiguous rows, got {_describe(out)}"
            )
        rc = self._lib.rl_attend(
            self._isa_id,
            q.data_ptr(),
            heads,
            q.stride(0),
            k.data_ptr(),
            kv_heads,
            length,
            k.stride(0),
            k.stride(1),
            v.data_ptr(),
            v.stride(0),
            v.stride(1),
            dim,
            float(scale),
            out.data_ptr(),
            out.stride(0),
            torch.get_num_threads() if threads is None else threads,
        )
        if rc:
            raise RuntimeError(f"native attention failed: {_ERRORS.get(rc, rc)}")
        return out

    def attend_heads(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, threads: int
    ) -> torch.Tensor:
        """attend in transformers' shapes, unchecked: q [1, H, 1, D], k and v [1, KH, L, D] fp32 CPU tensors with
        contiguous last dimensions and H a multiple of KH (the caller has checked them: a decode step's attention,
        decodeattention.py) -> out [1, 1, H, D]. attend's checks and views were two thirds of a small model's
        attention call (22.7 us against 8.1 for the kernel, SmolLM2's shapes)."""
        heads, dim, kv_heads, length = q.shape[1], q.shape[3], k.shape[1], k.shape[2]
        out = torch.empty((1, 1, heads, dim), dtype=torch.float32)
        rc = self._lib.rl_attend(
            self._isa_id,
            q.data_ptr(),
            heads,
            q.stride(1),
            k.data_ptr(),
            kv_heads,
            length,
            k.stride(1),
            k.stride(2),
            v.data_ptr(),
            v.stride(1),
            v.stride(2),
            dim,
            scale,
            out.data_ptr(),
            dim,
            threads,
        )
        if rc:
            raise RuntimeError(f"native attention failed: {_ERRORS.get(rc, rc)}")
        return out

    def rope(
        self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """transformers' rotary embedding, (x · cos) + (rotate_half(x) · sin) for x in q and k, each product and the
        sum rounded apart as torch's ops round them, unchecked: q [1, H, S, D] and k [1, KH, S, D], cos and sin
        [1, S, D] at one stride, fp32 CPU tensors whose last dimensions are contiguous (the caller has checked them:
        stream/rotary.py). The outputs are laid out as empty_like lays out q and k."""
        q_out, k_out = torch.empty_like(q), torch.empty_like(k)
        qs, ks, qos, kos = q.stride(), k.stride(), q_out.stride(), k_out.stride()
        rc = self._lib.rl_rope(
            q.data_ptr(), q.shape[1], qs[1], qs[2], q_out.data_ptr(), qos[1], qos[2],
            k.data_ptr(), k.shape[1], ks[1], ks[2], k_out.data_ptr(), kos[1], kos[2],
            q.shape[2], q.shape[3], cos.data_ptr(), sin.data_ptr(), cos.stride(1),
        )  # fmt: skip
        if rc:
            raise RuntimeError(f"native rotary failed: {_ERRORS.get(rc, rc)}")
        return q_out, k_out

    def rms_norm(self, width: int, eps: float, lanes: int, one_plus: bool):
        """f(x, weight) -> y: transformers' RMS norm of x's rows of WIDTH, x · rsqrt(mean(x²) + EPS) · weight (or
        · (1 + weight) where ONE_PLUS), its sum of squares added as torch's CPU sum adds a row in vectors of LANES
        floats (8 or 16), unchecked: x and weight contiguous fp32 CPU tensors (stream/fusednorms.py checks them and
        probes the bits). y is laid out as x."""
        call, one_plus = self._lib.rl_rms_norm, int(one_plus)

        def norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
            out = torch.empty_like(x)
            rc = call(x.data_ptr(), x.numel() // width, width, weight.data_ptr(), one_plus, eps, lanes, out.data_ptr())
            if rc:
                raise RuntimeError(f"native RMS norm failed: {_ERRORS.get(rc, rc)}")
            return out

        return norm

    def _type_of(self, gguf_type) -> tuple[str, int]:
        name = str(getattr(gguf_type, "name", gguf_type))
        layout = self._layouts.get(name)
        if layout is None:
            raise ValueError(f"no native kernel for GGUF type {name!r}; these have one: {', '.join(self._layouts)}")
        return name, layout[0]

    def _check_blocks(self, name: str, blocks, k: int, what: str) -> tuple[int, int]:
        """(N, row bytes) of `blocks`, checked to be NAME's blocks of rows K long; WHAT names K's source."""
        _, qk, block_bytes = self._layouts[name]
        if not (
            isinstance(blocks, torch.Tensor)
            and blocks.dtype == torch.uint8
            and blocks.dim() == 2
            and blocks.is_cpu
            and blocks.is_contiguous()
        ):
            raise ValueError(f"{name} blocks must be a contiguous 2-D uint8 CPU tensor, got {_describe(blocks)}")
        n, row_bytes = blocks.shape
        if k % qk:
            raise ValueError(f"{name} needs K a multiple of {qk}, got {what}")
        if row_bytes != k // qk * block_bytes:
            raise ValueError(
                f"{name} blocks of {row_bytes} bytes per row do not hold K = {k} "
                f"({k // qk} blocks of {block_bytes} bytes = {k // qk * block_bytes})"
            )
        return n, row_bytes

    def quantize(self, x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """int8 mode's first step, exposed for tests: fp32 x [M, K] -> codes int8 [M, K], scales fp32
        [M, K / block] (max|x| / 127 per `block` = 32 or 256 values), sums of each 16 codes int16 [M, K / 16]."""
        x = x.contiguous()
        m, k = x.shape
        q = torch.empty((m, k), dtype=torch.int8)
        d = torch.empty((m, k // block), dtype=torch.float32)
        bs = torch.empty((m, k // 16), dtype=torch.int16)
        if self._lib.rl_quantize(self._isa_id, x.data_ptr(), m, k, block, q.data_ptr(), d.data_ptr(), bs.data_ptr()):
            raise ValueError(f"cannot quantize x of shape {(m, k)} in blocks of {block}")
        return q, d, bs

    def quantize16(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """int16 mode's first step, exposed for tests: fp32 x [M, K] -> codes int16 [M, K], scales fp32 [M, K / 32]
        (max|x| / 32767 per 32 values), fp32 sums of each 16 values of x [M, K / 16]."""
        x = x.contiguous()
        m, k = x.shape
        q = torch.empty((m, k), dtype=torch.int16)
        d = torch.empty((m, k // 32), dtype=torch.float32)
        xs = torch.empty((m, k // 16), dtype=torch.float32)
        if self._lib.rl_quantize16(self._isa_id, x.data_ptr(), m, k, q.data_ptr(), d.data_ptr(), xs.data_ptr()):
            raise ValueError(f"cannot quantize x of shape {(m, k)} in blocks of 32")
        return q, d, xs


def _layouts(lib: ctypes.CDLL) -> tuple[dict[str, tuple[int, int, int]], str]:
    """name -> (GGML type number, block elements, block bytes) as the library reports them, checked against the
    torch reference's table; ({}, reason) on any disagreement (a stale or foreign library)."""
    from ..checkpoint.ggmlblocks import SUPPORTED

    layouts = {}
    for name, type_id in GGML_IDS.items():
        qk, nbytes = ctypes.c_int(), ctypes.c_int()
        if lib.rl_type_layout(type_id, ctypes.byref(qk), ctypes.byref(nbytes)) != 0:
            return {}, f"the native library has no kernel for {name}"
        if (qk.value, nbytes.value) != SUPPORTED[name]:
            return {}, f"the native library's {name} blocks ({qk.value}, {nbytes.value}) differ from {SUPPORTED[name]}"
        layouts[name] = (type_id, qk.value, nbytes.value)
    return layouts, ""


def _out(out, shape: tuple[int, int]) -> torch.Tensor:
    """`out`, checked to be a contiguous fp32 CPU tensor of SHAPE, or a new one where None."""
    if out is None:
        return torch.empty(shape, dtype=torch.float32)
    if not (
        isinstance(out, torch.Tensor)
        and out.dtype == torch.float32
        and out.is_cpu
        and out.shape == shape
        and out.is_contiguous()
    ):
        raise ValueError(f"out must be a contiguous float32 CPU tensor of shape {shape}, got {_describe(out)}")
    return out


def _describe(value) -> str:
    if not isinstance(value, torch.Tensor):
        return type(value).__name__
    layout = "" if value.is_contiguous() else "non-contiguous "
    return f"{layout}{value.dtype} tensor of shape {tuple(value.shape)} on {value.device}"
