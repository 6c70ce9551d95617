"""GGUF block bytes -> the portable packed layout, exactly: dequantizing the result in fp32 gives gguf's own
`dequantize` bit for bit (tests/test_packed.py checks it on real and synthetic blocks).

    Q4_0  d fp16, 32 codes        w = (q − 8)·d     -> int4 group 32, scale d, min −8·d (fp16; fp32 if −8·d overflows)
    Q4_1  d, m fp16, 32 codes     w = q·d + m       -> int4 group 32, scale d, min m (fp16)
    Q4_K  256 = 8 sub-blocks of 32; d, dmin fp16, 6-bit sc, mn per sub-block: w = q·(d·sc) − dmin·mn
          -> int4 group 32, scale d·sc, min −dmin·mn (fp32: both are exact products, not fp16 values)
    Q8_0  d fp16, 32 int8 codes   w = q·d           -> int8 group 32, scale d (fp16)
    any other quantized type      -> kind gguf: the raw blocks, dequantized by the gguf package when used

Everything is vectorised over all blocks of the tensor at once (numpy on the mapped bytes).
"""

from __future__ import annotations

import numpy as np
import torch

from ..checkpoint.packedformat import PackedFormat, PackedTensor
from . import nibbles

SUB_BLOCK = 32  # Q4_K: each 256-element super-block is 8 int4 groups of this many


def from_gguf(blocks: np.ndarray, ggml_type, raw: bool = False, copy: bool = True) -> PackedTensor:
    """A GGUF tensor's blocks (`GGUFReader(path).tensors[i].data`: uint8 [rows, bytes_per_row], rows = N)
    in the portable layout, or as the raw blocks themselves (kind gguf) where `raw` or no unpacker applies.
    `ggml_type` is a `gguf.GGMLQuantizationType` or its name. copy=False: raw blocks the caller read into an array of
    their own and hands over are kept as they are, not copied."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    qtype = ggml_type if isinstance(ggml_type, GGMLQuantizationType) else GGMLQuantizationType[str(ggml_type)]
    block, block_bytes = GGML_QUANT_SIZES[qtype]
    if block == 1:
        raise ValueError(f"{qtype.name} is not a quantized type: nothing to pack")
    blocks = np.asarray(blocks)
    if blocks.dtype != np.uint8 or blocks.ndim != 2 or blocks.shape[1] % block_bytes:
        raise ValueError(
            f"{qtype.name} blocks must be uint8 [rows, k·{block_bytes}], got {blocks.dtype} {blocks.shape}"
        )
    n, per_row = blocks.shape[0], blocks.shape[1] // block_bytes
    shape = (n, per_row * block)
    split = blocks.reshape(n, per_row, block_bytes)
    unpacker = None if raw else _UNPACKERS.get(qtype.name)
    if unpacker is None:
        fmt = PackedFormat("gguf", shape, block, gguf_type=qtype.name, block_bytes=block_bytes)
        kept = not copy and blocks.flags.writeable and blocks.flags.c_contiguous
        # off the mapping
        return PackedTensor(fmt, {"blocks": torch.from_numpy(blocks if kept else np.array(blocks, copy=True))})
    return unpacker(split, shape)


def _f16(field: np.ndarray) -> np.ndarray:
    """[n, blocks, 2] bytes -> [n, blocks] float16."""
    return np.ascontiguousarray(field).view(np.float16)[..., 0]


def _low_high(qs: np.ndarray) -> np.ndarray:
    """GGUF's 4-bit order, per run of 2m bytes-worth: byte i's low nibble is element i, its high nibble element i+m."""
    return np.concatenate((qs & 0x0F, qs >> 4), axis=-1)


def _int4(shape, group: int, codes: np.ndarray, scale: np.ndarray, minimum: np.ndarray) -> PackedTensor:
    n = shape[0]
    scale_dtype = "fp16" if scale.dtype == np.float16 else "fp32"
    fmt = PackedFormat("int4", shape, group, scale_dtype=scale_dtype)
    parts = {
        "codes": nibbles.pack(torch.from_numpy(np.ascontiguousarray(codes.reshape(n, -1)))),
        "scale": torch.from_numpy(np.ascontiguousarray(scale.reshape(n, -1))),
        "min": torch.from_numpy(np.ascontiguousarray(minimum.reshape(n, -1))),
    }
    return PackedTensor(fmt, parts)


def _q4_0(split: np.ndarray, shape) -> PackedTensor:
    d = _f16(split[..., 0:2])
    with np.errstate(over="ignore"):
        minimum = d * np.float16(-8)  # exact: a power-of-two multiple, unless it overflows fp16
    if not np.isfinite(minimum[np.isfinite(d)]).all():
        d, minimum = d.astype(np.float32), d.astype(np.float32) * np.float32(-8)
    return _int4(shape, 32, _low_high(split[..., 2:]), d, minimum)


def _q4_1(split: np.ndarray, shape) -> PackedTensor:
    return _int4(shape, 32, _low_high(split[..., 4:]), _f16(split[..., 0:2]), _f16(split[..., 2:4]))


def _q4_k(split: np.ndarray, shape) -> PackedTensor:
    n, per_row = split.shape[:2]
    d = _f16(split[..., 0:2]).astype(np.float32)[..., None]
    dmin = _f16(split[..., 2:4]).astype(np.float32)[..., None]
    sc, mn = _q4_k_scale_min(split[..., 4:16])
    # qs: 4 runs of 32 bytes, run r holding sub-block 2r in its low nibbles and 2r+1 in its high ones
    qs = split[..., 16:].reshape(n, per_row, 4, 32)
    codes = np.stack((qs & 0x0F, qs >> 4), axis=3).reshape(n, per_row, 8, SUB_BLOCK)
    return _int4(shape, SUB_BLOCK, codes, d * sc.astype(np.float32), -(dmin * mn.astype(np.float32)))


def _q4_k_scale_min(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """12 bytes -> 8 six-bit scales and 8 six-bit mins. Bytes 0-3: scale 0-3 (low 6 bits) and the top 2 bits of
    scale 4-7; bytes 4-7: the same for the mins; bytes 8-11: low 4 bits of scale 4-7 | low 4 bits of min 4-7 << 4."""
    s, m, low = scales[..., 0:4], scales[..., 4:8], scales[..., 8:12]
    sc = np.concatenate((s & 0x3F, (low & 0x0F) | ((s >> 2) & 0x30)), axis=-1)
    mn = np.concatenate((m & 0x3F, (low >> 4) | ((m >> 2) & 0x30)), axis=-1)
    return sc, mn


def _q8_0(split: np.ndarray, shape) -> PackedTensor:
    n = shape[0]
    fmt = PackedFormat("int8", shape, 32, scale_dtype="fp16")
    codes = np.ascontiguousarray(split[..., 2:]).view(np.int8).reshape(n, -1)
    scale = np.ascontiguousarray(_f16(split[..., 0:2]))
    return PackedTensor(fmt, {"codes": torch.from_numpy(codes), "scale": torch.from_numpy(scale)})


_UNPACKERS = {"Q4_0": _q4_0, "Q4_1": _q4_1, "Q4_K": _q4_k, "Q8_0": _q8_0}
