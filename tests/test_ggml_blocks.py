"""rocketllm_cli.checkpoint.ggmlblocks against gguf's own dequantization, bit for bit, for every supported type.

Blocks come three ways: random bytes with sensible (finite, modest) fp16 scales, fully random bytes (scales may be
inf or NaN: NaN positions must match, every other value's bits too), and gguf's own quantizer where it has one.
The real SmolLM2 GGUF, when present beside the repository, is compared tensor by tensor. CUDA runs the same
comparisons where a GPU is present.
"""

from __future__ import annotations

import zlib
from pathlib import Path

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType  # noqa: E402
from gguf.quants import dequantize as gguf_dequantize  # noqa: E402
from gguf.quants import quantize as gguf_quantize  # noqa: E402

from rocketllm_cli.checkpoint import ggmlbits, ggmlblocks  # noqa: E402
from rocketllm_cli.checkpoint.ggmlblocks import (  # noqa: E402
    SUPPORTED,
    dequantize_blocks,
    unsupported,
)

REAL_GGUF = Path(__file__).resolve().parent.parent.parent / "shared" / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
TYPES = sorted(SUPPORTED)
SHAPES = [(1, 5), (7, 3), (33, 2)]  # (rows, blocks per row)
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])

# byte offsets of the fp16 scale fields in one block: filled with modest finite values for the "sensible" blocks
F16_FIELDS = {
    "Q4_0": (0,),
    "Q4_1": (0, 2),
    "Q5_0": (0,),
    "Q5_1": (0, 2),
    "Q8_0": (0,),
    "Q2_K": (80, 82),
    "Q3_K": (108,),
    "Q4_K": (0, 2),
    "Q5_K": (0, 2),
    "Q6_K": (208,),
    "IQ4_NL": (0,),
    "IQ4_XS": (0,),
    "IQ2_XXS": (0,),
    "IQ2_XS": (0,),
    "IQ2_S": (0,),
    "IQ3_XXS": (0,),
    "IQ3_S": (0,),
    "IQ1_S": (0,),
    "TQ1_0": (52,),
    "TQ2_0": (64,),
}


def _scales(rng, shape) -> np.ndarray:
    """Random fp16 values, either sign, magnitudes 1e-3 .. 2 (subnormal-free, and no overflow downstream)."""
    return (rng.uniform(1e-3, 2.0, shape) * rng.choice([-1.0, 1.0], shape)).astype(np.float16)


def sensible_blocks(name: str, rows: int, per_row: int, rng) -> np.ndarray:
    """uint8 [rows, per_row·block_bytes]: random codes, finite modest scales."""
    elems, nbytes = SUPPORTED[name]
    if name in ("F32", "F16", "BF16"):
        values = rng.standard_normal((rows, per_row)).astype(np.float32)
        if name == "F32":
            return values.view(np.uint8)
        if name == "F16":
            return values.astype(np.float16).view(np.uint8)
        return (values.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)  # bf16: the top half
    raw = rng.integers(0, 256, size=(rows, per_row, nbytes), dtype=np.uint8)
    for at in F16_FIELDS.get(name, ()):
        raw[..., at : at + 2] = _scales(rng, (rows, per_row)).view(np.uint8).reshape(rows, per_row, 2)
    if name == "IQ1_M":  # the fp16 d lives in the top nibbles of the four uint16 scale words at bytes 48..56
        d = _scales(rng, (rows, per_row)).view(np.uint16).astype(np.uint16)
        words = np.ascontiguousarray(raw[..., 48:56]).view(np.uint16)  # [rows, per_row, 4]
        for k in range(4):
            words[..., k] = (words[..., k] & 0x0FFF) | (((d >> (4 * k)) & 0xF) << 12)
        raw[..., 48:56] = words.view(np.uint8)
    if name == "MXFP4":  # e8m0 exponents near 2^0
        raw[..., 0] = rng.integers(110, 140, size=(rows, per_row), dtype=np.uint8)
    return raw.reshape(rows, per_row * nbytes)


def reference(raw: np.ndarray, name: str) -> np.ndarray:
    elems, nbytes = SUPPORTED[name]
    with np.errstate(all="ignore"):
        ref = gguf_dequantize(raw, GGMLQuantizationType[name])
    return np.asarray(ref, dtype=np.float32).reshape(raw.shape[0], raw.shape[1] // nbytes * elems)


def assert_same_bits(ours: torch.Tensor, ref: np.ndarray, what: str = "") -> None:
    """Equal bit for bit (so −0 ≠ +0), except that any NaN matches any NaN."""
    got = ours.detach().cpu().numpy()
    assert got.dtype == np.float32 and got.shape == ref.shape, (what, got.dtype, got.shape, ref.shape)
    nan_got, nan_ref = np.isnan(got), np.isnan(ref)
    assert np.array_equal(nan_got, nan_ref), f"{what}: NaN at different places ({(nan_got != nan_ref).sum()})"
    diff = got.view(np.uint32) != ref.view(np.uint32)
    diff &= ~nan_ref
    if diff.any():
        i = tuple(int(j) for j in np.argwhere(diff)[0])
        pytest.fail(f"{what}: {int(diff.sum())} values differ, first at {i}: {got[i]!r} vs gguf {ref[i]!r}")


def run(raw: np.ndarray, name: str, device: str = "cpu", **kw) -> torch.Tensor:
    return dequantize_blocks(torch.tensor(raw, device=device), name, **kw)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("rows,per_row", SHAPES)
@pytest.mark.parametrize("name", TYPES)
def test_sensible_blocks_match_gguf(name, rows, per_row, device):
    rng = np.random.default_rng(zlib.crc32(f"{name} {rows}".encode()))
    raw = sensible_blocks(name, rows, per_row, rng)
    ref = reference(raw, name)
    assert np.isfinite(ref).all()
    assert_same_bits(run(raw, name, device), ref, name)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", TYPES)
def test_raw_bytes_match_gguf(name, device):
    """Any bytes at all: inf and NaN scales, subnormals, −0."""
    raw = np.random.default_rng(7).integers(0, 256, size=(33, 4 * SUPPORTED[name][1]), dtype=np.uint8)
    assert_same_bits(run(raw, name, device), reference(raw, name), name)


def _gguf_quantizes(name: str) -> bool:
    elems, _ = SUPPORTED[name]
    if elems == 1:
        return name == "BF16"  # F32 / F16 "quantize" to float arrays, not blocks
    try:
        gguf_quantize(np.zeros((1, elems), dtype=np.float32), GGMLQuantizationType[name])
    except NotImplementedError:
        return False
    return True


@pytest.mark.parametrize("name", [name for name in TYPES if _gguf_quantizes(name)])
def test_gguf_quantized_blocks_match(name):
    """Realistic blocks: gguf's own quantizer on weight-like data (rows of differing scale, a few zero blocks)."""
    elems, _ = SUPPORTED[name]
    rng = np.random.default_rng(3)
    weights = (rng.standard_normal((9, 6 * elems)) * rng.uniform(0.001, 3, (9, 1))).astype(np.float32)
    weights[2, :elems] = 0
    raw = np.asarray(gguf_quantize(weights, GGMLQuantizationType[name]))
    assert raw.dtype == np.uint8
    assert_same_bits(run(raw, name), reference(raw, name), name)


@pytest.mark.parametrize("name", ["MXFP4", "NVFP4"])
def test_every_scale_byte(name):
    """The 8-bit scale encodings, all 256 of them (decoded through tables here, arithmetic in gguf)."""
    rng = np.random.default_rng(5)
    elems, nbytes = SUPPORTED[name]
    raw = rng.integers(0, 256, size=(256, nbytes), dtype=np.uint8)
    if name == "MXFP4":
        raw[:, 0] = np.arange(256)
    else:
        raw[:, :4] = (np.arange(256)[:, None] + 64 * np.arange(4)) % 256  # each byte value, in each position
    assert_same_bits(run(raw, name), reference(raw, name), name)


def test_ksigns_table_is_ggufs():
    table = ggmlbits.lookup_table("ksigns", torch.device("cpu"))
    assert table.tolist() == list(gguf.quants.IQ2_XXS.ksigns)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", TYPES)
def test_out_rounds_fp32_once(name, dtype):
    raw = sensible_blocks(name, 7, 3, np.random.default_rng(11))
    expected = torch.from_numpy(reference(raw, name)).to(dtype)
    out = torch.full(expected.shape, float("nan"), dtype=dtype)
    assert run(raw, name, out=out, chunk_elems=SUPPORTED[name][0] * 2) is out
    assert torch.equal(out.view(torch.int16), expected.view(torch.int16))


@pytest.mark.parametrize("name", ["Q4_0", "Q5_1", "Q4_K", "Q6_K", "IQ2_XXS", "IQ4_XS", "F16"])
def test_tiles_strides_and_offsets(name):
    """Any tile size, a misaligned non-contiguous input, a non-contiguous output: the same bits."""
    elems, nbytes = SUPPORTED[name]
    rows, per_row = 5, 7
    raw = sensible_blocks(name, rows, per_row, np.random.default_rng(13))
    ref = reference(raw, name)
    wide = torch.zeros(rows, raw.shape[1] + 4, dtype=torch.uint8)
    wide[:, 1 : 1 + raw.shape[1]] = torch.from_numpy(raw)
    blocks = wide[:, 1 : 1 + raw.shape[1]]  # odd offset, row stride ≠ row length
    cols = per_row * elems
    for chunk in (1, elems, 3 * elems + 1, cols - 1, cols, 2 * cols + elems, None):
        assert_same_bits(dequantize_blocks(blocks, name, chunk_elems=chunk), ref, f"{name} chunk {chunk}")
        transposed = torch.empty(cols, rows).t()
        assert dequantize_blocks(blocks, name, out=transposed, chunk_elems=chunk) is transposed
        assert_same_bits(transposed.contiguous(), ref, f"{name} chunk {chunk}, transposed out")


def test_large_tensor_in_default_tiles():
    """More outputs than one default tile (whole-row tiles and a remainder), against gguf."""
    rows = ggmlblocks.CHUNK_ELEMS // 4096 + 3
    raw = sensible_blocks("Q4_K", rows, 16, np.random.default_rng(17))
    assert_same_bits(run(raw, "Q4_K"), reference(raw, "Q4_K"), "Q4_K large")


def test_supported_sizes_are_ggufs():
    for name, sizes in SUPPORTED.items():
        assert GGML_QUANT_SIZES[GGMLQuantizationType[name]] == sizes, name


def test_unsupported_reasons():
    for name in TYPES:
        assert unsupported(name) == ""
        assert unsupported(GGMLQuantizationType[name]) == ""
    for name in ("Q8_K", "Q8_1", "I32", "F64", "BOGUS"):
        reason = unsupported(name)
        assert reason and name in reason and "\n" not in reason
    # every GGML type is either decoded or has a reason
    assert all(unsupported(t) or t.name in SUPPORTED for t in GGMLQuantizationType)


def _raises(match: str, *args, **kw):
    with pytest.raises(ValueError, match=match) as info:
        dequantize_blocks(*args, **kw)
    assert "\n" not in str(info.value)


def test_bad_inputs_raise_one_line_value_errors():
    good = torch.zeros(3, 2 * 144, dtype=torch.uint8)
    _raises("uint8", good.to(torch.int8), "Q4_K")
    _raises("uint8", good.float(), "Q4_K")
    _raises("2-D", good.view(-1), "Q4_K")
    _raises("2-D", good.numpy(), "Q4_K")
    _raises("144-byte blocks", good[:, :200], "Q4_K")
    _raises("not a GGUF", good, "Q4_Z")
    _raises("Q8_K", torch.zeros(3, 292, dtype=torch.uint8), "Q8_K")
    _raises("out must be", good, "Q4_K", out=torch.empty(3, 256))
    _raises("out must be", good, "Q4_K", out=torch.empty(3, 512, dtype=torch.int32))
    _raises("chunk_elems", good, "Q4_K", chunk_elems=0)


def test_empty_tensor():
    assert dequantize_blocks(torch.zeros(0, 144, dtype=torch.uint8), "Q4_K").shape == (0, 256)
    assert dequantize_blocks(torch.zeros(4, 0, dtype=torch.uint8), "Q4_K").shape == (4, 0)


@pytest.mark.skipif(not REAL_GGUF.is_file(), reason=f"{REAL_GGUF.name} not found in ../shared/models/")
def test_real_gguf_tensors_match():
    reader = gguf.GGUFReader(str(REAL_GGUF))
    seen = 0
    for tensor in reader.tensors:
        name = tensor.tensor_type.name
        if SUPPORTED.get(name, (1, 0))[0] == 1:
            continue  # F32 / F16 / BF16: not quantized
        row_len = int(tensor.shape[0])  # GGUF shapes are reversed: shape[0] is the row length
        rows = int(np.prod(tensor.shape[1:]))
        raw = np.array(tensor.data).reshape(rows, -1)  # a writable copy of the mapped bytes
        assert raw.shape[1] == row_len // SUPPORTED[name][0] * SUPPORTED[name][1]
        with np.errstate(all="ignore"):
            ref = gguf_dequantize(raw, tensor.tensor_type).reshape(rows, row_len)
        assert_same_bits(dequantize_blocks(torch.from_numpy(raw), name), ref, tensor.name)
        seen += 1
    assert seen > 0
