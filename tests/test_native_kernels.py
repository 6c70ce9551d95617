"""rocketllm_cli.native: the C++ kernels against the torch reference (packed.ggmlblocks) and against each other.

Every supported type × every variant this CPU runs (scalar always) × both modes, on odd shapes: K not a multiple
of 256 for the 32-element types, N = 1, 7 and 4096, M = 1, 3 and 17 (tiles of 4 or 2 rows and the rest one by one);
each SIMD variant also against the scalar one.
  exact: against x @ dequantize_blocks(W).T in fp64, to 1e-6 of Σ|x|·|w| (fp32 accumulation order; a wrong code
         or scale shows at ~1/K and above)
  int8:  against the same product with x replaced by its q8 round trip, computed here in torch (to 1e-6 of the
         sums of |x̂|·|a·code| and |x̂|·|b|: the integer dot products are exact, only fp32 sums of per-block
         products round, the integer and the min parts apart), and within the hard bound
         Σ_i |w_i| · d_i / 2 of the exact result (|x − q·d| ≤ d / 2 per element)
  int16: as int8, with x's 16-bit round trip per 32 elements for the codes' part and x itself for a min's part
Plus: the quantizer bit for bit, threads and variants agreeing, one-line errors, no compiler -> None, and the
install's build (setup.py) found and used with no compiler. The tests take the install's library; an edited source
builds once per session into the test cache (~10 s on 2 cores).
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from rocketllm_cli import native
from rocketllm_cli.checkpoint.ggmlblocks import SUPPORTED, dequantize_blocks
from rocketllm_cli.native import build
from rocketllm_cli.native.kernels import GGML_IDS, NO_VARIANT, NativeKernels

TYPES = list(GGML_IDS)  # Q4_0 ... IQ4_XS
GGUF_QUANTIZES = {"Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"}  # the rest: random codes, modest scales
F16_FIELDS = {
    "Q4_0": (0,),
    "Q4_1": (0, 2),
    "Q5_0": (0,),
    "Q5_1": (0, 2),
    "Q8_0": (0,),
    "IQ4_NL": (0,),
    "Q2_K": (80, 82),
    "Q3_K": (108,),
    "Q4_K": (0, 2),
    "Q5_K": (0, 2),
    "Q6_K": (208,),
    "IQ4_XS": (0,),
}
VARIANTS = ("avx512", "avx2", "scalar")  # each runs where the CPU can, the scalar one everywhere
# types whose int8 kernels sum w = a·code + b as its two parts (b = m, −dmin·mn, Q4_0 / Q5_0's −OFF·d, or on AVX2
# Q3_K / Q6_K's −OFF·d·sc): where their code bytes are, to find b by zeroing them
MIN_CODE_BYTES = {
    "Q4_0": (2, 18),
    "Q4_1": (4, 20),
    "Q5_0": (2, 22),
    "Q5_1": (4, 24),
    "Q2_K": (16, 80),
    "Q3_K": (0, 96),
    "Q4_K": (16, 144),
    "Q5_K": (16, 176),
    "Q6_K": (0, 192),
}
WITH_MIN = ("Q4_1", "Q5_1", "Q2_K", "Q4_K", "Q5_K")  # int16 sums b = m or −dmin·mn against x's own fp32 sums


def variants(nk: NativeKernels) -> list[NativeKernels]:
    return [nk.with_isa(isa) for isa in nk.isas]


def shapes(name: str) -> list[tuple[int, int, int]]:
    """(M, N, K): K = 11 blocks (352, not a multiple of 256; AVX-512 takes blocks in pairs, and the odd one alone;
    int16 takes a min's part eight blocks at a time, and the other three one by one) for the 32-element types,
    3 · 256 for the K-quants; N = 4096 with one block per row, to stay fast."""
    qk = SUPPORTED[name][0]
    k, k_small = (352, 32) if qk == 32 else (768, 256)
    return [(1, 7, k), (3, 1, k), (17, 7, k), (1, 4096, k_small), (17, 4096, k_small)]


def make_blocks(name: str, n: int, k: int, seed: int) -> torch.Tensor:
    """uint8 [n, k / QK · bytes]: gguf's own quantization of Gaussian weights where gguf has one, else random
    codes with finite fp16 scales of either sign, magnitudes 1e-3 .. 1."""
    rng = np.random.default_rng(seed)
    qk, nbytes = SUPPORTED[name]
    if name in GGUF_QUANTIZES:
        from gguf import GGMLQuantizationType
        from gguf.quants import quantize

        weights = (rng.standard_normal((n, k)) * 0.05).astype(np.float32)
        return torch.from_numpy(np.ascontiguousarray(quantize(weights, GGMLQuantizationType[name])))
    raw = rng.integers(0, 256, size=(n, k // qk, nbytes), dtype=np.uint8)
    for at in F16_FIELDS[name]:
        scale = (rng.uniform(1e-3, 1.0, (n, k // qk)) * rng.choice([-1.0, 1.0], (n, k // qk))).astype(np.float16)
        raw[..., at : at + 2] = scale.view(np.uint8).reshape(n, k // qk, 2)
    return torch.from_numpy(raw.reshape(n, -1))


def activations(m: int, k: int, seed: int) -> torch.Tensor:
    """fp32 [m, k]: Gaussian, with an all-zero block and a few outliers, as hidden states have."""
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed))
    x[:, :32] = 0 if k > 64 else x[:, :32]
    x[:, -1] *= 20
    return x


def code_reference(x: torch.Tensor, qx: int, max_code: int, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """A quantizer's codes in torch: per qx values d = max|x| / max_code, q = round-half-even(x · (1 / d)); a block
    with max under 1e-30 has d = 0 and one with inf or NaN d = NaN, both all codes 0. Codes [M, K] of `dtype`,
    scales [M, K / qx]."""
    m, k = x.shape
    xb = x.view(m, k // qx, qx)
    amax = xb.abs().amax(-1, keepdim=True)
    finite = xb.isfinite().all(-1, keepdim=True)
    zero = ~(amax >= 1e-30) | ~finite
    d = torch.where(zero, torch.zeros_like(amax), amax / max_code)
    inv = torch.where(zero, torch.zeros_like(amax), 1 / torch.where(zero, torch.ones_like(d), d))
    q = torch.where(finite, torch.round(xb * inv), 0).to(dtype).view(m, k)
    return q, torch.where(finite, d, float("nan")).view(m, -1)


def q8_reference(x: torch.Tensor, qx: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The int8 mode's quantization in torch: codes int8 [M, K] and scales [M, K / qx] (max|x| / 127 per qx
    values), sums of 16 codes int16 [M, K / 16]."""
    m, k = x.shape
    q, d = code_reference(x, qx, 127, torch.int8)
    return q, d, q.view(m, k // 16, 16).sum(-1, dtype=torch.int32).to(torch.int16)


def q16_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The int16 mode's quantization in torch: codes int16 [M, K] and scales [M, K / 32] (max|x| / 32767 per 32
    values), fp64 sums of each 16 values of x [M, K / 16]."""
    m, k = x.shape
    q, d = code_reference(x, 32, 32767, torch.int16)
    return q, d, x.double().view(m, k // 16, 16).sum(-1)


def min_terms(blocks: torch.Tensor, name: str) -> torch.Tensor:
    """fp64 [N, K]: each weight's min term b (0 for types without one): the weights with every code zeroed."""
    if name not in MIN_CODE_BYTES:
        return torch.zeros(1, dtype=torch.float64)
    nbytes = SUPPORTED[name][1]
    zeroed = blocks.clone().view(blocks.shape[0], -1, nbytes)
    start, end = MIN_CODE_BYTES[name]
    zeroed[..., start:end] = 0
    return dequantize_blocks(zeroed.view(blocks.shape), name).double()


# AVX-512's int8 kernels multiply these signed weights as unsigned codes w / d + 128 and add the offset -128 · d apart
SIGNED_AS_UNSIGNED = ("Q8_0", "IQ4_NL")


def int8_offsets(blocks: torch.Tensor, name: str, isa: str) -> torch.Tensor:
    """fp64 [N, K]: the offset term a variant's int8 kernel sums apart from the codes' part, |−128 · d|, else 0."""
    if isa != "avx512" or name not in SIGNED_AS_UNSIGNED:
        return torch.zeros(1, dtype=torch.float64)
    n, nbytes = blocks.shape[0], SUPPORTED[name][1]
    d = blocks.view(n, -1, nbytes)[..., 0:2].contiguous().view(torch.float16).double().squeeze(-1)  # [N, blocks]
    return (128 * d.abs()).repeat_interleave(32, dim=1)


def relative(y: torch.Tensor, ref: torch.Tensor, magnitude: torch.Tensor) -> float:
    return ((y.double() - ref).abs() / magnitude.clamp_min(1e-300)).max().item()


@pytest.mark.parametrize("mode", ["exact", "int16", "int8"])
@pytest.mark.parametrize("isa", VARIANTS)
@pytest.mark.parametrize("name", TYPES)
def test_matches_reference(nk, name, isa, mode):
    if isa not in nk.isas:
        pytest.skip(f"this CPU does not run {isa} (it runs {', '.join(nk.isas)})")
    kern, scalar = nk.with_isa(isa), nk.with_isa("scalar")
    qk = SUPPORTED[name][0]
    for seed, (m, n, k) in enumerate(shapes(name)):
        blocks = make_blocks(name, n, k, seed)
        x = activations(m, k, seed)
        w = dequantize_blocks(blocks, name).double()  # [N, K], gguf's values exactly
        magnitude = x.abs().double() @ w.abs().T  # Σ|x|·|w| per output
        ref = x.double() @ w.T
        y = kern.matmul(blocks, name, x, mode=mode)
        assert y.shape == (m, n) and y.dtype == torch.float32
        where = f"{name} {isa} {mode} M={m} N={n} K={k}"
        if mode == "exact":
            assert relative(y, ref, magnitude) < 1e-6, where
        elif mode == "int16":
            q, d, _ = q16_reference(x)
            dx = d.double().repeat_interleave(32, dim=1)  # [M, K]
            x_hat = q.double() * dx
            b = min_terms(blocks, name) if name in WITH_MIN else torch.zeros_like(w)  # [N, K]
            parts = x_hat.abs() @ (w - b).abs().T + x.abs().double() @ b.abs().T
            assert relative(y, x_hat @ (w - b).T + x.double() @ b.T, parts) < 1e-6, where
            magnitude = parts
            bound = (dx / 2) @ (w - b).abs().T * (1 + 1e-5) + 1e-6 * magnitude
            assert ((y.double() - ref).abs() <= bound).all(), where
        else:
            q, d, _ = q8_reference(x, qx=qk)
            dx = d.double().repeat_interleave(qk, dim=1)  # [M, K]
            x_hat = q.double() * dx
            # fp32 sums the integer part a·code and the min part b of each weight apart; they may cancel
            split = min_terms(blocks, name).abs() + int8_offsets(blocks, name, isa)
            parts = x_hat.abs() @ (w.abs() + 2 * split).T  # ≥ Σ|x̂|·(|a·code| + |b|)
            assert relative(y, x_hat @ w.T, parts) < 1e-6, where
            magnitude = parts  # for the comparison with the scalar variant below
            bound = (dx / 2) @ w.abs().T * (1 + 1e-5) + 1e-6 * magnitude  # |x − q·d| ≤ d / 2 per element
            assert ((y.double() - ref).abs() <= bound).all(), where
        if isa != "scalar":  # every variant against the readable one
            assert relative(y, scalar.matmul(blocks, name, x, mode=mode), magnitude) < 1e-6, where


@pytest.mark.parametrize("name", TYPES)
def test_dequantize_is_the_reference_bit_for_bit(nk, name):
    """Every variant's decoder (a prefill's dense path) gives gguf's own fp32 weights, on odd shapes and with out."""
    qk = SUPPORTED[name][0]
    for n, k in ((1, qk), (7, 7 * qk if qk == 32 else 3 * qk), (130, qk)):
        blocks = make_blocks(name, n, k, seed=n)
        reference = dequantize_blocks(blocks, name).float()
        for kernels in variants(nk):
            assert torch.equal(kernels.dequantize(blocks, name, k), reference), (kernels.isa, n, k)
            out = torch.full((n, k), float("nan"))
            assert kernels.dequantize(blocks, name, k, out=out, threads=2) is out and torch.equal(out, reference)
    assert nk.dequantize(torch.empty((0, SUPPORTED[name][1]), dtype=torch.uint8), name, qk).shape == (0, qk)


@pytest.mark.parametrize("isa", VARIANTS)
def test_quantize_bit_for_bit(nk, isa):
    if isa not in nk.isas:
        pytest.skip(f"this CPU does not run {isa}")
    x = activations(5, 512, seed=3)
    x[1, 64:96] = 1e-31  # under the floor: an all-zero block
    x[2, 100] = 0.5 * 127 / 3  # near a rounding tie
    x[3, 300], x[4, 7] = float("inf"), float("nan")  # blocks of zero codes and d = NaN
    for qx in (32, 256):
        q, d, bs = nk.with_isa(isa).quantize(x, qx)
        q_ref, d_ref, bs_ref = q8_reference(x, qx)
        assert torch.equal(q, q_ref) and torch.equal(bs, bs_ref), (isa, qx)
        assert torch.equal(d.view(torch.int32), d_ref.view(torch.int32)), (isa, qx)  # NaN's bits too
    q, d, xs = nk.with_isa(isa).quantize16(x)
    q_ref, d_ref, xs_ref = q16_reference(x)
    assert torch.equal(q, q_ref) and torch.equal(d.view(torch.int32), d_ref.view(torch.int32)), isa
    fine = xs_ref.isfinite()  # x's own sums, in fp32 in the variant's order
    assert torch.allclose(xs.double()[fine], xs_ref[fine], rtol=1e-6, atol=1e-5) and not xs[~fine].isfinite().any()


@pytest.mark.parametrize("mode", ["exact", "int16", "int8"])
def test_non_finite_x_gives_nan_rows(nk, mode):
    """inf or NaN in a row of x: that row of y is NaN (int8: its block's scale is NaN); the other rows are not."""
    blocks, x = make_blocks("Q4_K", 8, 512, 0), activations(3, 512, 0)
    x[1, 5] = float("nan")
    for kern in variants(nk):
        y = kern.matmul(blocks, "Q4_K", x, mode=mode)
        assert y[1].isnan().all() and y[[0, 2]].isfinite().all(), kern.isa


def test_threads_and_tiles_agree(nk):
    """Each output is computed whole by one thread, so any thread count gives the same bits; an M-tile row gives
    what the same row alone gives (to fp32 order noise: tiles and single rows keep different accumulators)."""
    blocks, x = make_blocks("Q4_K", 64, 512, 0), activations(6, 512, 0)
    magnitude = x.abs().double() @ dequantize_blocks(blocks, "Q4_K").abs().double().T
    for mode in ("exact", "int16", "int8"):
        one = nk.matmul(blocks, "Q4_K", x, mode=mode, threads=1)
        for threads in (2, 3, 8):
            assert torch.equal(nk.matmul(blocks, "Q4_K", x, mode=mode, threads=threads), one)
        alone = torch.cat([nk.matmul(blocks, "Q4_K", x[i : i + 1], mode=mode) for i in range(6)])
        assert relative(alone, one.double(), magnitude) < 1e-6


def test_out_and_empty_shapes(nk):
    blocks, x = make_blocks("Q8_0", 16, 64, 0), activations(2, 64, 0)
    out = torch.full((2, 16), float("nan"))
    assert nk.matmul(blocks, "Q8_0", x, out=out) is out and not out.isnan().any()
    assert nk.matmul(blocks, "Q8_0", x[:0]).shape == (0, 16)
    assert nk.matmul(blocks[:0], "Q8_0", x).shape == (2, 0)
    assert torch.equal(nk.matmul(blocks, "Q8_0", x.T.contiguous().T), out)  # a non-contiguous x is copied


def test_concurrent_callers(nk):
    """Two Python threads at once: the library serialises them, each gets its own right answer."""
    blocks = make_blocks("Q6_K", 256, 512, 0)
    xs = [activations(3, 512, seed) for seed in range(2)]
    expected = [nk.matmul(blocks, "Q6_K", x, mode="int8") for x in xs]
    errors = []

    def call(i):
        for _ in range(20):
            if not torch.equal(nk.matmul(blocks, "Q6_K", xs[i], mode="int8"), expected[i]):
                errors.append(i)

    workers = [threading.Thread(target=call, args=(i,)) for i in range(2)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    assert not errors


def test_a_bound_matmul_gives_matmuls_bits_and_checks_its_weight_once(nk):
    """The packed Linear's per-call product: the blocks, type and mode checked when it is made; each call writes
    what matmul returns into the caller's output, whatever its rows' shape."""
    blocks, x = make_blocks("Q5_K", 24, 512, 0), activations(3, 512, 0)
    product = nk.bound_matmul(blocks, "Q5_K", 512, "int16")
    out = torch.full((1, 3, 24), float("nan"))
    product(x.view(1, 3, 512), 3, out, 2)
    assert torch.equal(out.view(3, 24), nk.matmul(blocks, "Q5_K", x, mode="int16"))
    for bad, message in (
        (lambda: nk.bound_matmul(blocks, "Q5_K", 256, "int16"), "do not hold K = 256"),
        (lambda: nk.bound_matmul(blocks, "Q5_K", 512, "fp8"), "mode"),
        (lambda: nk.bound_matmul(blocks.view(torch.int8), "Q5_K", 512), "uint8"),
    ):
        with pytest.raises(ValueError, match=message):
            bad()


def test_supported_and_layouts(nk):
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    for name, type_id in GGML_IDS.items():
        assert (
            GGMLQuantizationType[name].value == type_id
            and GGML_QUANT_SIZES[GGMLQuantizationType[name]] == SUPPORTED[name]
        )
        assert nk.supported(name) and nk.supported(GGMLQuantizationType[name])
    assert not nk.supported("IQ2_XXS") and not nk.supported("F16") and not nk.supported("nonsense")


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda nk, b, x: nk.matmul(b.view(torch.int8), "Q4_0", x), "uint8"),
        (lambda nk, b, x: nk.matmul(b, "Q4_0", x.double()), "float32"),
        (lambda nk, b, x: nk.matmul(b, "Q4_0", x[0]), "2-D"),
        (lambda nk, b, x: nk.matmul(b, "Q4_0", x[:, :48]), "multiple of 32"),
        (lambda nk, b, x: nk.matmul(b, "Q4_0", x[:, :32]), "do not hold K = 32"),
        (lambda nk, b, x: nk.matmul(b, "Q8_0", x), "do not hold"),
        (lambda nk, b, x: nk.matmul(b, "IQ2_XXS", x), "no native kernel"),
        (lambda nk, b, x: nk.matmul(b, "Q4_0", x, mode="fp8"), "mode"),
        (lambda nk, b, x: nk.matmul(b, "Q4_0", x, out=torch.empty(2, 3)), "out must be"),
        (lambda nk, b, x: nk.matmul(b, "Q4_0", x, out=torch.empty(16, 2).T), "out must be"),
        (lambda nk, b, x: nk.matmul(b.T.contiguous().T, "Q4_0", x), "contiguous"),
        (lambda nk, b, x: nk.dequantize(b, "Q4_0", 48), "multiple of 32"),
        (lambda nk, b, x: nk.dequantize(b, "Q8_0", 64), "do not hold"),
        (lambda nk, b, x: nk.dequantize(b, "IQ2_XXS", 64), "no native kernel"),
        (lambda nk, b, x: nk.dequantize(b, "Q4_0", 64, out=torch.empty(64, 16)), "out must be"),
    ],
)
def test_bad_inputs_raise_one_line(nk, call, message):
    blocks, x = make_blocks("Q4_0", 16, 64, 0), activations(2, 64, 0)
    with pytest.raises(ValueError, match=message) as err:
        call(nk, blocks, x)
    assert "\n" not in str(err.value)


def test_a_build_compiles_the_best_variant_this_cpu_runs_and_the_capped_one(monkeypatch):
    monkeypatch.delenv(build.VARIANTS_ENV, raising=False)
    monkeypatch.delenv(native.ISA_ENV, raising=False)
    avx512 = {"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni"}
    assert build.wanted_variants(avx512) == ("avx512",)
    assert build.wanted_variants(avx512 - {"avx512_vnni"}) == ("avx2",)  # what the library's cpuid check asks
    assert build.wanted_variants({"sse4_2"}) == build.wanted_variants(set()) == ("scalar",)  # old x86, or not x86
    monkeypatch.setenv(native.ISA_ENV, "scalar")
    assert build.wanted_variants(avx512) == ("scalar", "avx512")  # the cap runs too
    monkeypatch.setenv(build.VARIANTS_ENV, "all")
    assert build.wanted_variants(avx512) == build.ISAS
    monkeypatch.setenv(build.VARIANTS_ENV, "avx2, scalar")
    assert build.wanted_variants(avx512) == ("scalar", "avx2")


def test_a_library_of_one_variant_runs_that_one_alone(nk, monkeypatch, tmp_path):
    monkeypatch.setenv("ROCKETLLM_CACHE", str(tmp_path))
    monkeypatch.setenv(build.VARIANTS_ENV, "scalar")
    path, reason = build.library()
    assert path is not None, reason
    alone, reason = NativeKernels.load(path)
    assert alone is not None and alone.isas == ("scalar",), reason
    blocks, x = make_blocks("Q4_K", 8, 256, 0), activations(1, 256, 0)
    assert torch.equal(alone.matmul(blocks, "Q4_K", x), nk.with_isa("scalar").matmul(blocks, "Q4_K", x))
    with pytest.raises(ValueError, match="ROCKETLLM_NATIVE_VARIANTS=all"):
        alone.with_isa("avx2")
    if nk.isas[0] != "scalar":  # a library of the best variant alone, asked for less
        monkeypatch.setenv(build.VARIANTS_ENV, nk.isas[0])
        path, _ = build.library()
        none, reason = NativeKernels.load(path, isa="scalar")
        assert none is None and reason.startswith(NO_VARIANT), reason


def test_a_build_whose_variant_does_not_run_is_made_again_with_every_variant(nk, monkeypatch):
    asked, real_load = [], NativeKernels.load
    monkeypatch.delenv(native.ISA_ENV, raising=False)  # the library as loaded, not a capped view of it
    monkeypatch.setattr(native, "_loaded", None)
    monkeypatch.setattr(build, "library", lambda every=False: asked.append(every) or (Path("lib.so"), ""))
    loads = iter([(None, f"{NO_VARIANT} at or below avx512 in lib.so (it runs: none)"), (nk, "")])
    monkeypatch.setattr(NativeKernels, "load", staticmethod(lambda path, isa=None: next(loads)))
    assert native.kernels() is nk and asked == [False, True]
    monkeypatch.setattr(NativeKernels, "load", real_load)


def test_isa_cap(nk, monkeypatch):
    monkeypatch.setenv(native.ISA_ENV, "scalar")
    assert native.kernels().isa == "scalar"
    monkeypatch.setenv(native.ISA_ENV, "avx2")
    assert native.kernels().isa == ("avx2" if "avx2" in nk.isas else "scalar")
    monkeypatch.setenv(native.ISA_ENV, "sse9")
    assert native.kernels() is None and "sse9" in native.why_not()
    monkeypatch.delenv(native.ISA_ENV)
    assert native.kernels().isa == nk.isas[0] and native.why_not() == ""
    with pytest.raises(ValueError, match="does not run here"):
        nk.with_isa("itanium")


def test_no_compiler_gives_none_and_a_reason(monkeypatch, tmp_path):
    monkeypatch.setattr(build, "PREBUILT_DIR", tmp_path)  # no install build either
    monkeypatch.setattr(build.shutil, "which", lambda name: None)
    path, reason = build.library()
    assert path is None and "g++" in reason and "\n" not in reason


def test_no_compiler_in_a_fresh_process(tmp_path):
    """PATH without g++, an empty cache and no install build: kernels() is None, why_not() names the compiler,
    nothing raises."""
    env = {**os.environ, "PATH": str(tmp_path), "ROCKETLLM_CACHE": str(tmp_path / "cache")}
    code = (
        "from pathlib import Path; from rocketllm_cli.native import build, kernels, why_not; "
        f"build.PREBUILT_DIR = Path({str(tmp_path)!r}); print(kernels() is None); print(why_not())"
    )
    run = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).resolve().parent.parent,
    )
    assert run.returncode == 0, run.stderr
    is_none, reason = run.stdout.splitlines()
    assert is_none == "True" and "g++ is not on PATH" in reason


def test_an_install_build_runs_without_a_compiler_and_only_for_its_own_sources(nk, monkeypatch, tmp_path):
    """What setup.py does at install: every variant into the package under a name keyed by the sources and flags.
    library() then takes it with no g++ on PATH and no cache; an edit to the sources, or a subset of variants asked
    for, builds in the cache instead."""
    if build.shutil.which(build.COMPILER) is None:
        pytest.skip("no g++")
    target = tmp_path / "package" / build.prebuilt_name()
    assert build.install(target) == "" and target.is_file()
    assert not [p for p in target.parent.iterdir() if p != target]  # the scratch folder is gone
    monkeypatch.setattr(build, "PREBUILT_DIR", target.parent)
    monkeypatch.setenv("ROCKETLLM_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv(build.VARIANTS_ENV, raising=False)
    monkeypatch.setattr(build.shutil, "which", lambda name: None)  # no compiler from here on
    path, reason = build.library()
    assert path == target, reason
    installed, reason = NativeKernels.load(path)
    assert installed is not None and set(installed.isas) == set(nk.isas), reason
    assert installed.build == "install-" + target.stem.rpartition("-")[2]
    blocks, x = make_blocks("Q6_K", 9, 256, 1), activations(3, 256, 1)
    for isa in installed.isas:
        assert torch.equal(
            installed.with_isa(isa).matmul(blocks, "Q6_K", x), nk.with_isa(isa).matmul(blocks, "Q6_K", x)
        )
    assert not (tmp_path / "cache").exists()  # nothing compiled, nothing cached
    monkeypatch.setenv(build.VARIANTS_ENV, "scalar")  # a build of one variant asked for: not the install's
    assert build.library()[0] is None
    monkeypatch.delenv(build.VARIANTS_ENV)
    sources = tmp_path / "src"
    sources.mkdir()
    for source in build.SOURCE_DIR.iterdir():
        (sources / source.name).write_bytes(source.read_bytes() + (b"// edited\n" if source.name == "api.cpp" else b""))
    monkeypatch.setattr(build, "SOURCE_DIR", sources)  # an edited checkout: the install's build is stale
    assert build.prebuilt() is None and build.library()[0] is None


def test_build_failure_gives_the_first_error(tmp_path, monkeypatch):
    if build.shutil.which(build.COMPILER) is None:
        pytest.skip("no g++")
    (tmp_path / "broken.cpp").write_text("int f() { return undeclared_name; }\n")
    monkeypatch.setattr(build, "SOURCE_DIR", tmp_path)
    monkeypatch.setenv("ROCKETLLM_CACHE", str(tmp_path / "cache"))
    path, reason = build.library()
    assert path is None and reason.startswith("native kernel build failed") and "undeclared_name" in reason
    assert "\n" not in reason


def test_scalar_only_build(tmp_path):
    """What a non-x86 machine builds: the x86 files compile to nothing and the scalar variant runs alone."""
    cxx = build.shutil.which(build.COMPILER)
    if cxx is None:
        pytest.skip("no g++")
    sources = [str(p) for p in sorted(build.SOURCE_DIR.glob("*.cpp"))]
    lib = tmp_path / "scalar_only.so"
    subprocess.run(
        [cxx, *build.FLAGS, "-O1", "-DRL_SCALAR_ONLY", "-shared", *sources, "-o", str(lib)], check=True, timeout=300
    )
    kernels, reason = NativeKernels.load(lib)
    assert reason == "" and kernels.isas == ("scalar",) and kernels.isa == "scalar"
    blocks, x = make_blocks("Q5_K", 3, 256, 0), activations(2, 256, 0)
    w = dequantize_blocks(blocks, "Q5_K").double()
    assert relative(kernels.matmul(blocks, "Q5_K", x), x.double() @ w.T, x.abs().double() @ w.abs().T) < 1e-6
    ctypes.CDLL(str(lib))  # loads twice without trouble


def test_a_machine_without_a_compiler_runs_gguf_blocks_and_says_why_it_is_slow(smollm2_gguf, tmp_path):
    """PATH without g++: the model still answers (the torch decoder computes on the blocks), and the load says in
    one line why it is slow and what to install."""
    import os
    import subprocess
    import sys

    env = {
        **os.environ,
        "PATH": os.path.dirname(sys.executable),
        "ROCKETLLM_CACHE": str(tmp_path / "cache"),
        "ROCKETLLM_KEEP_ALIVE": "0",
    }
    # the command as `rocketllm` runs it, in a process that sees no install build either
    code = (
        "import sys; from pathlib import Path; from rocketllm_cli.native import build; "
        f"build.PREBUILT_DIR = Path({str(tmp_path)!r}); from rocketllm_cli.app import main; "
        "sys.argv = ['rocketllm', *sys.argv[1:]]; main()"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, "generate", str(smollm2_gguf), "The capital of France is", "--raw", "-n", "3"],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr
    assert " Paris" in done.stdout
    notes = [line for line in done.stderr.splitlines() if "native kernels" in line]
    assert len(notes) == 1 and "g++" in notes[0], done.stderr


def test_a_build_begun_in_the_background_is_the_one_kernels_returns(monkeypatch):
    """A first run starts the build beside its sharding (auto.py); kernels() then waits for it, not a second."""
    first = native.kernels()
    monkeypatch.setattr(native, "_loaded", None)
    monkeypatch.setattr(native, "_background", None)
    native.build_in_background()
    thread = native._background
    assert thread is not None and thread.name == "rocketllm-native-build"
    thread.join(timeout=300)
    assert native._loaded is not None and (native.kernels() is None) == (first is None)
    native.build_in_background()  # loaded already: no second thread
    assert native._background is thread


def test_bench_kernels_times_each_type_in_both_modes_and_measures_their_error(nk):
    """`bench --kernels`: per type, each mode's speed and error against the fp64 product of gguf's own weights:
    exact to fp32 rounding, int16 to its 16-bit activations (about 2e-5), int8 to its 8-bit ones (about 5e-3 on
    these weights), and the torch decoder."""
    from rocketllm_cli.bench.kernels import render_kernels, run_kernels

    doc = run_kernels(types=("Q8_0", "Q4_K"))
    assert [r["type"] for r in doc["rows"]] == ["Q8_0", "Q4_K"] and doc["isa"] == nk.isa
    for row in doc["rows"]:
        assert row["exact_gb_per_s"] > 0 and row["int16_gb_per_s"] > 0 and row["int8_gb_per_s"] > 0
        assert row["torch_decoder_gb_per_s"] > 0
        assert row["exact_rel_error"] < 1e-6 < row["int16_rel_error"] < 1e-4 < row["int8_rel_error"] < 5e-2, row
    text = render_kernels(doc)
    assert "| Q4_K | 4.5 |" in text and "int16 speed-up" in text and "int8 speed-up" in text


def test_bench_kernels_takes_no_model():
    from typer.testing import CliRunner

    from rocketllm_cli.app import app

    done = CliRunner().invoke(app, ["bench", "--kernels", "some.gguf"])
    assert done.exit_code != 0 and "--kernels measures the kernels alone" in done.stderr


def test_loaded_never_builds_or_waits(monkeypatch):
    """loaded(): the kernels this process has already, else None without a build (a lookup's fallback is exact)."""
    monkeypatch.setattr(native, "_loaded", None)
    monkeypatch.setattr(build, "library", lambda *a, **k: pytest.fail("loaded() started a build"))
    assert native.loaded() is None
    monkeypatch.undo()
    found = native.kernels()
    assert (native.loaded() is None) == (found is None) and (found is None or native.loaded().isa == found.isa)
