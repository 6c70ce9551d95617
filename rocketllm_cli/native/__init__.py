"""Native CPU kernels: y = x · Wᵀ straight from GGUF's quantized blocks, built from the C++ in ./src at install.

    from rocketllm_cli.native import kernels, why_not
    nk = kernels()                       # NativeKernels, or None (then why_not() says why in one line)
    if nk is not None and nk.supported("Q4_K"):
        y = nk.matmul(blocks, "Q4_K", x)  # uint8 [N, K/256·144], fp32 [M, K] -> fp32 [M, N]

Types: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS; everything else stays with
packed.ggmlblocks (the torch reference these kernels are tested against). Modes: "exact" (gguf's fp32 weights,
bit for bit, times fp32 x), "int16" (x held to 16 bits per 32 values; integer dot products, ~2e-5 relative) and
"int8" (x quantized to q8 per block as llama.cpp does; integer dot products). `dequantize` writes exact mode's fp32
weights, for a prefill's dense multiply (packed/dense.py).

Variants: AVX-512 (F, BW, VL, VNNI), AVX2 (+FMA, F16C) and a portable scalar one, chosen at run time by the CPU's
capabilities; ROCKETLLM_NATIVE_ISA=avx2 or =scalar caps the choice. The library builds with g++ (no -march, no
OpenMP: a small thread pool of its own). An install compiles every variant into this package (setup.py), keyed by a
hash of the sources and flags; where that build is missing or stale (sources edited since), the first use builds
into the cache folder, keyed by the sources, the compiler, the flags and the variants compiled in: by default the
best this CPU runs and the capped one (build.py; ROCKETLLM_NATIVE_VARIANTS=all builds all three). Without either
library and without g++ there are no kernels.
"""

from __future__ import annotations

import os
import threading

from .build import ISA_ENV
from .kernels import ISAS, MODES, NO_VARIANT, NativeKernels

__all__ = ["ISAS", "ISA_ENV", "MODES", "NativeKernels", "build_in_background", "kernels", "loaded", "why_not"]

_lock = threading.Lock()
_loaded: tuple[NativeKernels | None, str] | None = None  # the library, loaded once per process
_capped: dict[str, NativeKernels] = {}  # variant -> the loaded library driven by it, under an ISA cap
_background: threading.Thread | None = None  # build_in_background's thread


def kernels(isa: str | None = None) -> NativeKernels | None:
    """The kernels, built and loaded on first call (seconds, then cached on disk), or None (see why_not()).
    `isa` (default $ROCKETLLM_NATIVE_ISA) caps the variant: "avx512", "avx2" or "scalar"."""
    return _resolve(isa)[0]


def loaded() -> NativeKernels | None:
    """The kernels where this process has loaded them already (and $ROCKETLLM_NATIVE_ISA allows), else None: never
    builds or waits, for a path that has a correct fallback and must not stall on a compiler run."""
    return _resolve(None)[0] if _loaded is not None else None


def build_in_background() -> None:
    """Load (building it first where needed: seconds of g++) on a thread of its own, so the build runs beside what
    comes first (a first run's sharding); kernels() then waits for it. Once per process."""
    global _background
    with _lock:
        if _loaded is not None or _background is not None:
            return
        _background = threading.Thread(target=_resolve, args=(None,), name="rocketllm-native-build", daemon=True)
    _background.start()


def why_not(isa: str | None = None) -> str:
    """ "" when kernels(isa) gives kernels, else the one-line reason (no compiler, build failed: ..., platform)."""
    return _resolve(isa)[1]


def _resolve(isa: str | None) -> tuple[NativeKernels | None, str]:
    global _loaded
    with _lock:
        if _loaded is None:
            from .build import library

            path, reason = library()
            _loaded = NativeKernels.load(path) if path is not None else (None, reason)
            if _loaded[0] is None and NO_VARIANT in _loaded[1]:  # the CPU's flags promised a variant it does not run
                path, reason = library(every=True)
                _loaded = NativeKernels.load(path) if path is not None else (None, reason)
    best, reason = _loaded
    if best is None:
        return None, reason
    cap = isa if isa is not None else os.environ.get(ISA_ENV) or None
    if cap is None:
        return best, ""
    if cap not in ISAS:
        return None, f"{ISA_ENV}={cap!r} is not one of {', '.join(ISAS)}"
    capped = next((name for name in best.isas if ISAS.index(name) <= ISAS.index(cap)), None)
    if capped is None:  # a library built before the cap was asked for (build.py builds the capped variant too)
        return None, f"{ISA_ENV}={cap}: this process's native library has only {', '.join(best.isas)}"
    if capped == best.isa:
        return best, ""
    held = _capped.get(capped)
    if held is None or held._lib is not best._lib:  # one capped copy per library and variant: a lookup asks per token
        held = _capped[capped] = best.with_isa(capped)
    return held, ""
