"""Packed low-bit weights: GGUF blocks convert exactly (dequantized in fp32 they are gguf's own values bit for bit,
real SmolLM2 Q4_1/Q8_0 and synthetic Q4_0/Q4_K), the kernels agree with F.linear on the dequantized weight (bit
for bit in fp32 for the int4 kernel's weights), the scratch fallback is F.linear on the dequantized weight
exactly and reuses one buffer, RTN stays within its stated bound, and the kernel probe runs once per device."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader
from gguf import dequantize as gguf_dequantize
from gguf import quantize as gguf_quantize

from rocketllm_cli.errors import ParameterError
from rocketllm_cli.packed import (
    PackedFormat,
    PackedTensor,
    Scratch,
    bind,
    capabilities,
    dequantize,
    from_gguf,
    kernel_path,
    linear,
    quantize_rtn,
)
from rocketllm_cli.packed import probe as probe_module

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# The kernels' output vs F.linear in fp32 on the same weight, as a fraction of the largest |y|. Measured on
# SmolLM2's layers: fp32 ~1e-6 (summation order), fp16 ~5e-4, bf16 ~5e-3 (bf16 scales and zeros round, ~2x a
# bf16 weight's own rounding).
KERNEL_TOLERANCE = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}


@pytest.fixture(scope="module")
def smol_tensors(smollm2_gguf):
    return {t.name: t for t in GGUFReader(smollm2_gguf).tensors}


def reference(blocks: np.ndarray, qtype) -> torch.Tensor:
    return torch.from_numpy(gguf_dequantize(blocks, qtype))


def q4_k_blocks(rows: int, super_blocks: int, seed: int = 0) -> np.ndarray:
    """Random Q4_K bytes (codes, 6-bit scales and mins all random) with finite, varied fp16 d and dmin."""
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (rows, super_blocks, 144), dtype=np.uint8)
    magnitude = 10.0 ** rng.uniform(-4, -1, (rows, super_blocks, 1))
    d_dmin = (rng.uniform(0.5, 2, (rows, super_blocks, 2)) * magnitude).astype(np.float16)
    raw[..., 0:4] = d_dmin.view(np.uint8).reshape(rows, super_blocks, 4)
    return raw.reshape(rows, -1)


def q6_k_blocks(rows: int, super_blocks: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (rows, super_blocks, 210), dtype=np.uint8)
    raw[..., 208:] = rng.uniform(1e-4, 1e-2, (rows, super_blocks, 1)).astype(np.float16).view(np.uint8)
    return raw.reshape(rows, -1)


def weight_seen_by_kernel(bound, k: int) -> torch.Tensor:
    """The [N, K] weight the kernel computes with: its output for the identity is Wᵀ (one product per entry)."""
    return linear(torch.eye(k, dtype=bound.dtype), bound).t()


# --- conversion: exact ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["blk.0.attn_q.weight", "blk.0.ffn_down.weight"])
def test_real_q4_1_blocks_convert_exactly(smol_tensors, name):
    tensor = smol_tensors[name]
    packed = from_gguf(tensor.data, tensor.tensor_type)
    want = reference(tensor.data, tensor.tensor_type)
    assert (packed.format.kind, packed.format.group, packed.format.scale_dtype) == ("int4", 32, "fp16")
    assert packed.format.shape == tuple(want.shape)
    assert packed.format.nbytes == tensor.data.nbytes  # the same 5 bits a weight as the file
    assert torch.equal(dequantize(packed), want)
    assert torch.equal(dequantize(packed, torch.bfloat16), want.to(torch.bfloat16))  # rounded once


def test_real_q8_0_embedding_converts_exactly(smol_tensors):
    tensor = smol_tensors["token_embd.weight"]
    blocks = np.asarray(tensor.data[:512])
    packed = from_gguf(blocks, tensor.tensor_type)
    assert (packed.format.kind, packed.format.group, packed.format.scale_dtype) == ("int8", 32, "fp16")
    assert torch.equal(dequantize(packed), reference(blocks, tensor.tensor_type))
    # RTN int8 with Q8_0's group gives back the file's own codes and scales
    again = quantize_rtn(dequantize(packed), bits=8, group=32)
    assert torch.equal(again.parts["codes"], packed.parts["codes"]) and torch.equal(
        again.parts["scale"], packed.parts["scale"]
    )


@pytest.mark.parametrize("magnitude, scale_dtype", [(1.0, "fp16"), (1e5, "fp32")])  # −8·d overflows fp16 at 1e5
def test_q4_0_blocks_convert_exactly(magnitude, scale_dtype):
    weight = (np.random.default_rng(1).standard_normal((32, 256)) * magnitude).astype(np.float32)
    blocks = gguf_quantize(weight, GGMLQuantizationType.Q4_0)
    packed = from_gguf(blocks, "Q4_0")
    assert (packed.format.kind, packed.format.scale_dtype) == ("int4", scale_dtype)
    assert torch.equal(dequantize(packed), reference(blocks, GGMLQuantizationType.Q4_0))


def test_q4_k_blocks_convert_exactly():
    blocks = q4_k_blocks(32, 2)
    packed = from_gguf(blocks, GGMLQuantizationType.Q4_K)
    fmt = packed.format
    assert (fmt.kind, fmt.shape, fmt.group, fmt.scale_dtype) == ("int4", (32, 512), 32, "fp32")
    assert torch.equal(dequantize(packed), reference(blocks, GGMLQuantizationType.Q4_K))


@pytest.mark.parametrize("qtype", ["Q6_K", "Q5_0"])
def test_other_types_stay_raw_blocks(qtype):
    gtype = GGMLQuantizationType[qtype]
    if qtype == "Q6_K":
        blocks = q6_k_blocks(16, 2)
    else:
        blocks = gguf_quantize(np.random.default_rng(2).standard_normal((16, 128)).astype(np.float32), gtype)
    packed = from_gguf(blocks, gtype)
    assert packed.format.kind == "gguf" and packed.format.gguf_type == qtype
    assert packed.format.block_bytes == GGML_QUANT_SIZES[gtype][1]
    assert torch.equal(dequantize(packed), reference(blocks, gtype))


def test_float_types_are_refused():
    with pytest.raises(ValueError, match="not a quantized type"):
        from_gguf(np.zeros((4, 16), dtype=np.uint8), "F32")


# --- format descriptors ------------------------------------------------------------------------------------


def test_formats_round_trip_through_json():
    formats = [
        from_gguf(q4_k_blocks(16, 1), "Q4_K").format,
        quantize_rtn(torch.randn(16, 64), bits=8, group=None, scale_dtype="bf16").format,
        from_gguf(q6_k_blocks(16, 1), "Q6_K").format,
    ]
    for fmt in formats:
        assert PackedFormat.from_dict(json.loads(json.dumps(fmt.to_dict()))) == fmt
    stated = formats[0].to_dict()
    assert stated["parts"] == {
        "codes": {"shape": [16, 128], "dtype": "uint8"},
        "scale": {"shape": [16, 8], "dtype": "fp32"},
        "min": {"shape": [16, 8], "dtype": "fp32"},
    }


@pytest.mark.parametrize(
    "change, message",
    [
        ({"kind": "int3"}, "kind must be one of"),
        ({"group": 48}, "must divide K"),
        ({"scale_dtype": "fp8"}, "scale_dtype must be one of"),
        ({"parts": {"codes": {"shape": [16, 256], "dtype": "uint8"}}}, "do not match"),
    ],
)
def test_malformed_formats_are_refused(change, message):
    data = {**quantize_rtn(torch.randn(16, 256), bits=4, group=32).format.to_dict(), **change}
    with pytest.raises(ValueError, match=message):
        PackedFormat.from_dict(data)


def test_parts_must_match_their_format():
    packed = quantize_rtn(torch.randn(16, 64), bits=4, group=32)
    with pytest.raises(ValueError, match="packed part scale"):
        PackedTensor(packed.format, {**packed.parts, "scale": packed.parts["scale"].float()})


# --- kernels -----------------------------------------------------------------------------------------------


def kernel_dtypes(kind: str):
    caps = capabilities("cpu")
    missing = [(d, not caps.supports(kind, d)) for d in DTYPES]
    return [pytest.param(d, marks=pytest.mark.skipif(skip, reason=f"no {kind} kernel for {d}")) for d, skip in missing]


@pytest.mark.parametrize("source", ["q4_1", "q4_k"])
def test_int4_kernel_weights_are_exact_in_fp32(smol_tensors, source):
    if not capabilities("cpu").supports("int4", torch.float32):
        pytest.skip("no fp32 int4 kernel on this CPU")
    if source == "q4_1":
        tensor = smol_tensors["blk.0.attn_q.weight"]
        blocks, qtype = tensor.data, tensor.tensor_type
    else:
        blocks, qtype = q4_k_blocks(32, 2, seed=3), GGMLQuantizationType.Q4_K
    packed = from_gguf(blocks, qtype)
    bound = bind(packed, "cpu", torch.float32)
    assert bound.path == "int4"
    assert torch.equal(weight_seen_by_kernel(bound, packed.format.shape[1]), reference(blocks, qtype))


@pytest.mark.parametrize("dtype", kernel_dtypes("int4"))
def test_int4_kernel_linear_matches_f_linear(smol_tensors, dtype):
    tensor = smol_tensors["blk.0.ffn_down.weight"]  # [576, 1536]
    packed = from_gguf(tensor.data, tensor.tensor_type)
    want_weight = reference(tensor.data, tensor.tensor_type)
    generator = torch.Generator().manual_seed(0)
    x, bias = torch.randn(2, 3, 1536, generator=generator), torch.randn(576, generator=generator)
    bound = bind(packed, "cpu", dtype)
    assert bound.path == "int4"
    got = linear(x.to(dtype), bound, bias.to(dtype))
    want = F.linear(x, want_weight, bias)
    assert got.shape == (2, 3, 576) and got.dtype == dtype
    assert (got.float() - want).abs().max() <= KERNEL_TOLERANCE[dtype] * want.abs().max()


@pytest.mark.parametrize("dtype", kernel_dtypes("int8"))
def test_int8_kernel_linear_matches_f_linear(dtype):
    generator = torch.Generator().manual_seed(1)
    packed = quantize_rtn(torch.randn(48, 96, generator=generator), bits=8, group=None)
    x = torch.randn(5, 96, generator=generator)
    bound = bind(packed, "cpu", dtype)
    assert bound.path == "int8"
    want = F.linear(x, dequantize(packed))
    got = linear(x.to(dtype), bound).float()
    assert (got - want).abs().max() <= KERNEL_TOLERANCE[dtype] * want.abs().max()


def test_formats_without_a_kernel_take_the_scratch_path(smol_tensors, monkeypatch):
    import rocketllm_cli.native as native

    q8_0 = from_gguf(np.asarray(smol_tensors["token_embd.weight"].data[:64]), "Q8_0")  # int8 group 32
    assert kernel_path(q8_0.format, torch.float32, "cpu") == "scratch"
    q6_k = from_gguf(q6_k_blocks(16, 1), "Q6_K").format  # raw blocks: the native kernels' where they are built
    assert kernel_path(q6_k, torch.float32, "cpu") == ("native" if native.kernels() is not None else "scratch")
    monkeypatch.setattr(native, "kernels", lambda isa=None: None)  # a machine without a compiler
    assert kernel_path(q6_k, torch.float32, "cpu") == "scratch"
    odd_rows = quantize_rtn(torch.randn(24, 64), bits=4, group=32)  # the int4 kernels want N % 16 == 0
    assert kernel_path(odd_rows.format, torch.float32, "cpu") == "scratch"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("source", ["q4_1", "q8_0", "q6_k"])
def test_scratch_fallback_is_f_linear_on_the_dequantized_weight(smol_tensors, source, dtype):
    if source == "q6_k":
        blocks, qtype = q6_k_blocks(32, 1), GGMLQuantizationType.Q6_K
    else:
        tensor = smol_tensors["blk.0.attn_k.weight" if source == "q4_1" else "token_embd.weight"]
        blocks, qtype = np.asarray(tensor.data[:192]), tensor.tensor_type
    packed = from_gguf(blocks, qtype)
    generator = torch.Generator().manual_seed(2)
    n, k = packed.format.shape
    x, bias = torch.randn(3, k, generator=generator).to(dtype), torch.randn(n, generator=generator).to(dtype)
    bound = bind(packed, "cpu", dtype, kernel=False)
    assert bound.path == "scratch"
    assert torch.equal(linear(x, bound, bias, Scratch()), F.linear(x, reference(blocks, qtype).to(dtype), bias))


def test_scratch_buffer_is_one_buffer_grown_only_when_needed():
    scratch = Scratch()
    small = bind(quantize_rtn(torch.randn(32, 64), bits=4, group=32), kernel=False)
    large = bind(quantize_rtn(torch.randn(64, 128), bits=8, group=32), kernel=False)
    x_small, x_large = torch.randn(2, 64, dtype=torch.bfloat16), torch.randn(2, 128, dtype=torch.bfloat16)
    first = linear(x_small, small, scratch=scratch)
    held = scratch.nbytes("cpu")
    assert torch.equal(linear(x_small, small, scratch=scratch), first) and (scratch.grown, scratch.nbytes("cpu")) == (
        1,
        held,
    )
    linear(x_large, large, scratch=scratch)
    assert scratch.grown == 2 and scratch.nbytes("cpu") > held
    assert torch.equal(linear(x_small, small, scratch=scratch), first) and scratch.grown == 2  # the larger one serves


def test_probe_runs_once_per_device_and_its_answer_is_stored(monkeypatch, tmp_path):
    calls = []
    real_probe = probe_module.probe
    monkeypatch.setattr(probe_module, "_CACHE", {})
    monkeypatch.setattr(probe_module, "stored_path", lambda: tmp_path / "kernels.json")
    monkeypatch.setattr(probe_module, "probe", lambda device: calls.append(device) or real_probe(device))
    packed = quantize_rtn(torch.randn(32, 64), bits=4, group=32)
    answers = {capabilities("cpu"), capabilities(torch.device("cpu"))}
    for dtype in DTYPES:
        bind(packed, "cpu", dtype)
    assert calls == ["cpu"] and len(answers) == 1
    monkeypatch.setattr(probe_module, "_CACHE", {})  # a later process: reads the stored answer, runs nothing
    answer = answers.pop()
    assert capabilities("cpu") == answer and calls == ["cpu"]
    assert {kind for kind, _, _ in answer.dense} <= {"int4", "int8"}
    assert all(
        rows in (0, *probe_module.DENSE_ROWS) and dtype in ("bf16", "fp16", "fp32") for _, rows, dtype in answer.dense
    )
    (tmp_path / "kernels.json").write_text("{not json")  # unreadable: probed again, never misread
    monkeypatch.setattr(probe_module, "_CACHE", {})
    capabilities("cpu")
    assert calls == ["cpu", "cpu"]


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, "bf16 kernel, fp32 multiply"])
def test_dense_multiply_is_the_kernels_weight_a_block_of_rows_at_a_time(bits, dtype, monkeypatch):
    """dense.py dequantizes the kernel's own form (the CPU int4 code order, its scales and zeros) a block of rows at
    a time: 208 rows in blocks of 64 (the last a partial block of the AVX-512 order) give F.linear on the weight."""
    from rocketllm_cli.packed import dense

    monkeypatch.setattr(dense, "CHUNK_VALUES", 64 * 128)  # 64 rows a block: four blocks, the last of 16 rows
    weight = torch.randn(208, 128, generator=torch.Generator().manual_seed(5))
    packed = quantize_rtn(weight, bits=bits, group=32 if bits == 4 else 128)
    wide = dtype == "bf16 kernel, fp32 multiply"  # where the probe found bf16 matmuls slow (no native bf16)
    dtype = torch.bfloat16 if wide else dtype
    bound = bind(packed, "cpu", dtype)
    if wide:
        import dataclasses

        bound = dataclasses.replace(bound, dense_dtype=torch.float32)
    if not dense.supported(bound.path, bound.device):
        pytest.skip(f"no {bound.path} kernel form dense.py can read on this CPU")
    x = torch.randn(40, 128, generator=torch.Generator().manual_seed(6)).to(dtype)
    got = dense.dense_linear(x, bound, Scratch())
    reference = F.linear(x.float(), dequantize(packed)).to(dtype)  # the weight as the shard holds it
    scale = reference.float().abs().max()
    assert got.shape == (40, 208) and got.dtype == dtype
    assert float((got.float() - reference.float()).abs().max() / scale) <= KERNEL_TOLERANCE[dtype]
    kernel = bound.fast(x)  # and the kernel on the same bound weight
    assert float((got.float() - kernel.float()).abs().max() / scale) <= KERNEL_TOLERANCE[dtype]


def test_linear_multiplies_densely_from_the_probes_row_count(monkeypatch):
    import dataclasses

    from rocketllm_cli.packed import compute, dense

    calls = []
    real = dense.dense_linear
    monkeypatch.setattr(
        dense, "dense_linear", lambda x, w, scratch=None: calls.append(x.shape[0]) or real(x, w, Scratch())
    )
    packed = quantize_rtn(torch.randn(64, 64, generator=torch.Generator().manual_seed(7)), bits=4, group=32)
    bound = bind(packed, "cpu", torch.bfloat16)
    if bound.path != "int4" or not dense.supported("int4", bound.device):
        pytest.skip("no int4 kernel form dense.py can read on this CPU")
    bound = dataclasses.replace(bound, dense_rows=4, fast=None, fast_numel=0)  # as bind makes it from a probe saying 4
    assert bound.fast_numel == 4 * 64
    module = torch.nn.Linear(64, 64, bias=False)
    from rocketllm_cli.stream.packedbind import make_packed

    make_packed(module, "w", "a test")
    module.packed_weight = bound
    small, large = torch.randn(1, 3, 64).bfloat16(), torch.randn(1, 4, 64).bfloat16()
    assert torch.equal(module(small), bound.fast(small)) and calls == []  # under 4 rows: the kernel
    assert torch.allclose(
        module(large).float(), bound.fast(large).float(), rtol=0, atol=2e-2 * float(bound.fast(large).abs().max())
    )
    assert calls == [4]
    compute.linear(large[0], bound, torch.zeros(64, dtype=torch.bfloat16))  # with a bias, through linear(): dense too
    assert calls == [4, 4]


def test_gguf_blocks_multiply_densely_as_exact_weights_from_the_measured_row_count(monkeypatch, tmp_path):
    """A native-kernel weight (GGUF blocks) bound before the crossover is known takes the kernel below the fewest rows
    the crossover can be, measuring nothing (a first run's short prompt); the first pass of as many measures it once.
    Fewer rows than the crossover take the kernel in its mode; as many or more, exact mode's fp32 weights times
    torch's fp32 GEMM, a block of rows at a time; inside kernel_passes() the kernel's mode again. Later binds, and a
    new process, read the answer back instead of measuring again."""
    import dataclasses

    import rocketllm_cli.native as native
    from rocketllm_cli.checkpoint.ggmlblocks import dequantize_blocks
    from rocketllm_cli.packed import compute, dense, nativeprobe
    from rocketllm_cli.packed.probe import DENSE_ROWS

    if native.kernels() is None:
        pytest.skip(f"no native kernels here: {native.why_not()}")
    fewest = min(DENSE_ROWS)
    measured, looked = [], []
    monkeypatch.setattr(nativeprobe, "_CACHE", {})
    monkeypatch.setattr(nativeprobe, "_UNSTORED", set())
    monkeypatch.setattr(nativeprobe, "stored_path", lambda: looked.append(1) or tmp_path / "kernels.json")
    monkeypatch.setattr(nativeprobe, "_measure", lambda: measured.append(1) or fewest)
    monkeypatch.setattr(dense, "CHUNK_VALUES", 64 * 96)  # 64 rows a block: two blocks, the last of 36 rows
    weights = (np.random.default_rng(3).standard_normal((100, 96)) * 0.05).astype(np.float32)
    blocks = gguf_quantize(weights, GGMLQuantizationType.Q4_1)
    packed = from_gguf(blocks, "Q4_1", raw=True)
    bound = bind(packed, "cpu", torch.float32, mode="int16")
    assert (bound.path, bound.dense_rows, bound.dense_dtype, measured) == ("native", fewest, torch.float32, [])
    for _ in range(5):  # a model's other weights: the stored file was looked for once (its path takes a fingerprint)
        bind(packed, "cpu", torch.float32, mode="int16")
    assert len(looked) == 1
    weights = dequantize_blocks(packed.parts["blocks"], "Q4_1").float()
    x = torch.randn(2, 50, 96, generator=torch.Generator().manual_seed(4))
    exact = (x.double() @ weights.double().T).float()
    module = torch.nn.Linear(96, 100, bias=False)
    from rocketllm_cli.stream.packedbind import make_packed

    make_packed(module, "w", "a test")
    module.packed_weight = bound
    assert torch.equal(module(x[:1, :4]), bound.fast(x[:1, :4])) and measured == []  # 4 rows: the int16 kernel
    dense_out = module(x.view(1, 100, 96)).view(2, 50, 100)  # 100 rows: measured now, then dense
    assert measured == [1] and bound.dense_rows == fewest and bound.dense_rows_later is None
    assert torch.allclose(dense_out, exact, rtol=0, atol=1e-5 * float(exact.abs().max()))
    assert not torch.equal(dense_out, bound.fast(x))  # the int16 kernel's answer differs: its x is rounded
    with dense.kernel_passes():
        assert torch.equal(compute.linear(x.view(100, 96), bound), bound.fast(x.view(100, 96)))
    assert bind(packed, "cpu", torch.float32, mode="int16").dense_rows_later is None and measured == [1]
    monkeypatch.setattr(nativeprobe, "_CACHE", {})  # a new process: the stored answer, not a second measurement
    monkeypatch.setattr(nativeprobe, "_UNSTORED", set())
    again = bind(packed, "cpu", torch.float32, mode="int16")
    assert (again.dense_rows, again.dense_rows_later, measured) == (fewest, None, [1])
    row = nativeprobe.stored_row("cpu")
    assert row["name"] == "packed_native_dense" and row["value"] == f"from {fewest} rows"
    assert dataclasses.replace(bound, dense_rows=0).dense_rows == 0


def test_a_crossover_measured_as_never_leaves_every_pass_on_the_kernel(monkeypatch, tmp_path):
    """The probe found dense multiplying never faster: the pass that measured it, and every later one, take the
    kernel, and nothing asks again."""
    import rocketllm_cli.native as native
    from rocketllm_cli.packed import nativeprobe
    from rocketllm_cli.packed.probe import DENSE_ROWS

    if native.kernels() is None:
        pytest.skip(f"no native kernels here: {native.why_not()}")
    measured = []
    monkeypatch.setattr(nativeprobe, "_CACHE", {})
    monkeypatch.setattr(nativeprobe, "_UNSTORED", set())
    monkeypatch.setattr(nativeprobe, "stored_path", lambda: tmp_path / "kernels.json")
    monkeypatch.setattr(nativeprobe, "_measure", lambda: measured.append(1) or 0)
    weights = (np.random.default_rng(5).standard_normal((40, 64)) * 0.05).astype(np.float32)
    packed = from_gguf(gguf_quantize(weights, GGMLQuantizationType.Q4_0), "Q4_0", raw=True)
    bound = bind(packed, "cpu", torch.float32, mode="int16")
    x = torch.randn(2 * min(DENSE_ROWS), 64, generator=torch.Generator().manual_seed(6))
    from rocketllm_cli.packed import compute

    for _ in range(2):
        assert torch.equal(compute.linear(x, bound), bound.fast(x))
    assert measured == [1] and bound.dense_rows == 0 and bound.serves_fast(x)


def test_a_burst_of_other_work_does_not_reverse_which_dtype_is_fastest(monkeypatch):
    """The bf16 kernel's first timed calls stall as if another process held the core for a scheduler slice each:
    the dtypes take turns, so bf16's later calls still rank it (one dtype's three calls in a row once stored fp16,
    ~50x slower, for every later process)."""
    import time

    real_mm, stalls = probe_module.layout.int4_mm, {"left": 4}  # the warm-up call and the first three turns

    def stalled(x, kernel, group):
        if x.dtype == torch.bfloat16 and x.shape == (1, probe_module.TIMING_SHAPE[1]) and stalls["left"]:
            stalls["left"] -= 1
            time.sleep(0.05)
        return real_mm(x, kernel, group)

    monkeypatch.setattr(probe_module.layout, "int4_mm", stalled)
    threads = torch.get_num_threads()
    caps = probe_module.probe("cpu")
    if "bf16" not in caps.int4:
        pytest.skip("this CPU's int4 kernel does not take bf16 activations")
    assert stalls["left"] == 0 and torch.get_num_threads() == threads  # stalled as planned; the thread count restored
    seconds = {d: t for k, d, t in caps.seconds if k == "int4"}
    assert seconds["bf16"] < 0.05 and set(seconds) == set(caps.int4)  # bf16's time is a call the stall did not hit
    assert caps.fastest("int4") == min(seconds, key=seconds.get)


def test_an_answer_timed_by_the_earlier_method_is_probed_again(monkeypatch, tmp_path):
    stored = tmp_path / "kernels.json"
    monkeypatch.setattr(probe_module, "_CACHE", {})
    monkeypatch.setattr(probe_module, "stored_path", lambda: stored)
    stored.write_text(
        json.dumps(
            {"cpu": {"int4": ["fp16"], "int8": ["fp32"], "seconds": [["int4", "fp16", 1e-3]]}, "cache_format": 1}
        )
    )
    caps = capabilities("cpu")
    assert caps.int4 != ("fp16",) and json.loads(stored.read_text())["cpu"]["probe_format"] == probe_module.PROBE_FORMAT


def test_linear_converts_another_activation_dtype_and_refuses_a_wrong_width():
    weight = torch.randn(32, 64)
    bound = bind(quantize_rtn(weight, bits=4, group=32), "cpu", torch.bfloat16)
    x = torch.randn(2, 64)
    got = linear(x, bound, torch.ones(32))  # fp32 x for a bf16 binding: the kernel's dtype in, fp32 back out
    assert got.dtype == torch.float32
    assert torch.allclose(got, linear(x.to(torch.bfloat16), bound, torch.ones(32, dtype=torch.bfloat16)).float())
    with pytest.raises(ValueError, match="got x"):
        linear(torch.randn(2, 32, dtype=torch.bfloat16), bound)


# --- RTN quantization --------------------------------------------------------------------------------------


def rtn_error_bound(packed: PackedTensor) -> torch.Tensor:
    """Per group: half a step (with the fp16 scale's rounding) plus the fp16 rounding of the min."""
    half_step = packed.parts["scale"].float().abs() / 2 * (1 + 2**-8)
    if packed.format.kind == "int4":
        half_step = half_step + packed.parts["min"].float().abs() * 2**-11
    return half_step


@pytest.mark.parametrize("bits, group", [(4, 32), (4, 64), (4, 128), (8, 32), (8, None)])
@pytest.mark.parametrize("source", ["random", "real"])
def test_rtn_error_stays_within_half_a_step(smol_tensors, source, bits, group):
    if source == "random":
        weight = torch.randn(64, 256, generator=torch.Generator().manual_seed(4)) * 0.02
    else:  # real weights: the embedding's first rows and 512 of its 576 columns, so groups of 128 fit
        weight = dequantize(from_gguf(np.asarray(smol_tensors["token_embd.weight"].data[:256]), "Q8_0"))[
            :, :512
        ].contiguous()
    packed = quantize_rtn(weight, bits=bits, group=group)
    n, k = weight.shape
    g = packed.format.group
    error = (dequantize(packed) - weight).abs().reshape(n, k // g, g).amax(dim=-1)
    assert bool((error <= rtn_error_bound(packed)).all())
    # measured: int4 ~0.08-0.11 and int8 ~0.005-0.012 of the weight's norm (0 for int8 group 32 of a Q8_0 weight)
    assert float((dequantize(packed) - weight).norm() / weight.norm()) < (0.15 if bits == 4 else 0.015)


def test_rtn_refuses_unusable_settings():
    with pytest.raises(ParameterError, match="bits must be one of 4, 8"):
        quantize_rtn(torch.randn(4, 64), bits=3)
    with pytest.raises(ParameterError, match="group must divide K = 64"):
        quantize_rtn(torch.randn(4, 64), bits=4, group=48)
    with pytest.raises(ParameterError, match="use fp32"):
        quantize_rtn(torch.full((4, 64), 1e9).tril(), bits=8, group=None, scale_dtype="fp16")


@pytest.mark.parametrize("bits", [4, 8])
def test_a_packed_linears_short_path_equals_linear_and_hooks_still_run(bits):
    """A packed Linear called with no hooks skips nn.Module's call machinery and linear()'s checks: the same output
    bit for bit; a hook, a bias or another width goes the long way (and a wrong width is still refused)."""
    from torch import nn

    from rocketllm_cli.stream.packedbind import make_packed

    generator = torch.Generator().manual_seed(5)
    packed = quantize_rtn(torch.randn(128, 64, generator=generator), bits=bits, group=32 if bits == 4 else None)
    dtype = torch.bfloat16
    bound = bind(packed, "cpu", dtype)
    if bound.path == "scratch":
        pytest.skip(f"no int{bits} kernel on this CPU")
    assert bound.fast is not None
    module = nn.Linear(64, 128, bias=False)
    make_packed(module, "w.weight", "w")
    module.__dict__["packed_weight"] = bound
    x = torch.randn(2, 3, 64, generator=generator).to(dtype)
    assert torch.equal(module(x), linear(x, bound))
    seen = []
    handle = module.register_forward_hook(lambda mod, args, out: seen.append(out.shape))
    assert torch.equal(module(x), linear(x, bound)) and seen == [torch.Size([2, 3, 128])]
    handle.remove()
    assert torch.equal(module(x.float()), linear(x.float(), bound))  # another dtype: converted in and out
    with pytest.raises(ValueError, match="got x"):
        module(torch.randn(2, 32, dtype=dtype))  # would view as [4, 64] in the kernel: refused instead
    biased = nn.Linear(64, 128)
    make_packed(biased, "b.weight", "b")
    biased.__dict__["packed_weight"] = bound
    biased._parameters["bias"] = nn.Parameter(torch.ones(128, dtype=dtype), requires_grad=False)
    assert torch.equal(biased(x), linear(x, bound, biased.bias))
