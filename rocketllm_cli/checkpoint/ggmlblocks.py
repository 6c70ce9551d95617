"""GGUF (GGML) quantized blocks -> fp32, exactly: one torch decoder per block type, vectorised over all blocks.

    y = dequantize_blocks(blocks, "Q4_K")                # uint8 [rows, k·144] -> fp32 [rows, k·256]
    dequantize_blocks(blocks, "Q6_K", out=bf16_weight)   # fp32 per chunk, rounded once into `out`

The result equals `gguf.quants.dequantize(bytes, GGMLQuantizationType[name])` bit for bit (tests/test_ggml_blocks.py
checks every type, on random, raw and real blocks). This is the reference faster kernels are tested against and the
fallback for any type a kernel does not cover. It runs on the input's device (CPU or CUDA): only torch ops, small
lookup tables cached per device, and no Python loop over blocks.

Why it is exact: every product gguf forms is exact in fp32 (an fp16 scale has 11 significant bits, the integer
factors at most 13 between them, and nothing over- or underflows but MXFP4's own 2^127 scale, identically), so
any grouping of the multiplications gives the same bits, signed zeros, inf and NaN included. The one rounding is
the addition of a min (Q4_1, Q5_1, Q2_K, Q4_K, Q5_K), done as gguf does it: (d·q) then a separate + m or − dmin·m,
with d·sc and dmin·m formed first as fp32 products. NaN payloads are not promised (a NaN matches a NaN).

What is mirrored from gguf's numpy code rather than ggml's C: scales are fp16 -> fp32 before any product;
IQ2_XXS / IQ2_XS / IQ2_S scale by d·(0.5 + s)·0.25, IQ3_XXS by d·(0.5 + s)·0.5, IQ3_S by d·(1 + 2s); IQ1_S /
IQ1_M by d·(2s + 1)·(grid ± 0.125); MXFP4 halves its e8m0 scale (ggml_e8m0_to_fp32_half) and doubles the
e2m1 values; NVFP4's ue4m3 scale ignores bit 7 and reads 0x7F as 0; the IQ sign bytes are gguf's ksigns table
(7 bits + even parity) and the grids are decoded by gguf itself from the tables it ships.

Large tensors are done a tile of about CHUNK_ELEMS outputs at a time (whole rows where they fit, else part of
one row), so the temporaries stay a few MB whatever the tensor's size.
"""

from __future__ import annotations

import torch

QK_K = 256  # elements in a K-quant / IQ super-block
CHUNK_ELEMS = 1 << 20  # outputs per tile on a CPU (4 MiB of fp32): fewer ops cost more in per-op overhead than
CUDA_CHUNKS = 16  # ... the cache saves; on CUDA a tile is 16 times that (launch-bound otherwise)

# name -> (elements per block, bytes per block), as gguf's GGML_QUANT_SIZES has them
SUPPORTED: dict[str, tuple[int, int]] = {
    "F32": (1, 4),
    "F16": (1, 2),
    "BF16": (1, 2),
    "Q4_0": (32, 18),
    "Q4_1": (32, 20),
    "Q5_0": (32, 22),
    "Q5_1": (32, 24),
    "Q8_0": (32, 34),
    "Q2_K": (256, 84),
    "Q3_K": (256, 110),
    "Q4_K": (256, 144),
    "Q5_K": (256, 176),
    "Q6_K": (256, 210),
    "IQ4_NL": (32, 18),
    "IQ4_XS": (256, 136),
    "IQ2_XXS": (256, 66),
    "IQ2_XS": (256, 74),
    "IQ2_S": (256, 82),
    "IQ3_XXS": (256, 98),
    "IQ3_S": (256, 110),
    "IQ1_S": (256, 50),
    "IQ1_M": (256, 56),
    "TQ1_0": (256, 54),
    "TQ2_0": (256, 66),
    "MXFP4": (32, 17),
    "NVFP4": (64, 36),
}

# GGML types gguf knows that are not decoded here, and why (gguf's dequantize has none of them either)
_NOT_DECODED = {
    "Q8_1": "an activation-only type that gguf cannot dequantize (no reference to match)",
    "Q8_K": "an activation-only type that gguf cannot dequantize (no reference to match)",
    "Q1_0": "gguf has no dequantization for it (no reference to match)",
    **{name: "an integer tensor, not a quantized weight" for name in ("I8", "I16", "I32", "I64")},
    "F64": "fp64 tensors are not decoded here (gguf's dequantize has no F64 either)",
}

_IQ4_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)  # IQ4_NL / IQ4_XS codebook
_MXFP4_VALUES = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)  # e2m1 doubled (the scale is halved)


def unsupported(gguf_type) -> str:
    """ "" if `gguf_type` (a name, or a gguf.GGMLQuantizationType) is decoded here, else a one-line reason."""
    name = _name(gguf_type)
    if name in SUPPORTED:
        return ""
    if name in _NOT_DECODED:
        return f"GGUF type {name} is not supported: {_NOT_DECODED[name]}"
    try:
        from gguf import GGMLQuantizationType

        GGMLQuantizationType[name]
    except (ImportError, KeyError):
        return f"{name!r} is not a GGUF (GGML) tensor type"
    return f"GGUF type {name} is not supported: no decoder for it here yet"


def dequantize_blocks(
    blocks: torch.Tensor, gguf_type, out: torch.Tensor | None = None, *, chunk_elems: int | None = None
) -> torch.Tensor:
    """uint8 `blocks` [rows, blocks_per_row·block_bytes] (one GGUF tensor's raw bytes, one row per weight row)
    -> fp32 [rows, blocks_per_row·block_elems], or written into `out` (that shape, any float dtype, on the same
    device; rounded once from fp32) and `out` returned. `chunk_elems` overrides the outputs decoded per tile."""
    name = _name(gguf_type)
    reason = unsupported(name)
    if reason:
        raise ValueError(reason)
    elems, nbytes = SUPPORTED[name]
    if not isinstance(blocks, torch.Tensor) or blocks.dtype != torch.uint8 or blocks.dim() != 2:
        what = (
            f"{blocks.dtype} tensor of shape {tuple(blocks.shape)}"
            if isinstance(blocks, torch.Tensor)
            else type(blocks).__name__
        )
        raise ValueError(f"{name} blocks must be a 2-D uint8 tensor [rows, bytes_per_row], got a {what}")
    rows, row_bytes = blocks.shape
    if row_bytes % nbytes:
        raise ValueError(f"{name} rows must be a whole number of {nbytes}-byte blocks, got {row_bytes} bytes per row")
    per_row = row_bytes // nbytes
    cols = per_row * elems
    if out is None:
        out = torch.empty(rows, cols, dtype=torch.float32, device=blocks.device)
    elif not (
        isinstance(out, torch.Tensor)
        and out.is_floating_point()
        and tuple(out.shape) == (rows, cols)
        and out.device == blocks.device
    ):
        what = (
            f"{out.dtype} {tuple(out.shape)} on {out.device}" if isinstance(out, torch.Tensor) else type(out).__name__
        )
        raise ValueError(f"{name} out must be a float tensor of shape {(rows, cols)} on {blocks.device}, got {what}")
    if chunk_elems is not None and chunk_elems < 1:
        raise ValueError(f"chunk_elems must be a positive number of outputs, got {chunk_elems}")
    if rows == 0 or cols == 0:
        return out
    decode = _DECODERS[name]
    chunk = chunk_elems or (CHUNK_ELEMS if blocks.device.type == "cpu" else CUDA_CHUNKS * CHUNK_ELEMS)
    if cols <= chunk:  # whole rows per tile
        row_step, block_step = max(1, chunk // cols), per_row
    else:  # a row is bigger than a tile: part of one row per tile
        row_step, block_step = 1, max(1, chunk // elems)
    direct = out.dtype == torch.float32 and out.is_contiguous()  # decode straight into out's rows
    work = None  # else an fp32 tile buffer, allocated once, then rounded into out
    for r0 in range(0, rows, row_step):
        r1 = min(rows, r0 + row_step)
        for b0 in range(0, per_row, block_step):
            b1 = min(per_row, b0 + block_step)
            tile = blocks[r0:r1, b0 * nbytes : b1 * nbytes].reshape(-1, nbytes)  # [tile blocks, block bytes]
            target = out[r0:r1, b0 * elems : b1 * elems]  # contiguous when out is: whole rows, or part of one
            if direct:
                decode(tile, target.view(-1, elems))
                continue
            if work is None:
                work = torch.empty(min(rows, row_step) * min(per_row, block_step) * elems, device=blocks.device)
            dst = work[: tile.shape[0] * elems].view(-1, elems)
            decode(tile, dst)
            target.copy_(dst.view(target.shape))  # the one rounding, when out is not fp32
    return out


def _name(gguf_type) -> str:
    return str(getattr(gguf_type, "name", gguf_type))


# ---- byte-field helpers: x is uint8 [n, block_bytes]; little-endian, as GGUF files and both devices are ----


def _as(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """uint8 x [n, m·size] read as `dtype` [n, m]: a view where x is contiguous and aligned, else a fresh copy
    (a field sliced out of the blocks, or a tile at an odd offset: CUDA cannot load misaligned words)."""
    size = torch.empty(0, dtype=dtype).element_size()
    if not x.is_contiguous() or x.stride(0) != x.shape[1] or x.data_ptr() % size:  # (one row keeps its stride)
        x = x.clone(memory_format=torch.contiguous_format)
    return x.view(dtype)


def _f16(x: torch.Tensor, at: int) -> torch.Tensor:
    """The fp16 field at byte `at` as fp32 [n, 1] (exact)."""
    return _as(x[:, at : at + 2], torch.float16).float()


def _u16(x: torch.Tensor, at: int, count: int) -> torch.Tensor:
    """`count` uint16 fields from byte `at` as int32 [n, count] (0..65535)."""
    return _as(x[:, at : at + 2 * count], torch.int16).int() & 0xFFFF


def _i32(x: torch.Tensor, at: int, count: int) -> torch.Tensor:
    """`count` uint32 fields from byte `at`, as int32 bit patterns [n, count] (mask after any right shift)."""
    return _as(x[:, at : at + 4 * count], torch.int32)


_TABLES: dict[tuple[str, torch.device], torch.Tensor] = {}


def _table(key: str, device: torch.device) -> torch.Tensor:
    """A small constant tensor (codebooks, grids, scale decodings), built once per device."""
    table = _TABLES.get((key, device))
    if table is None:
        table = _TABLES[(key, device)] = _build_table(key).to(device)
    return table


def _build_table(key: str) -> torch.Tensor:
    if key == "pow3":
        return torch.tensor([1, 3, 9, 27, 81], dtype=torch.uint8)
    if key == "iq4":
        return torch.tensor(_IQ4_VALUES, dtype=torch.float32)
    if key == "mxfp4":
        return torch.tensor(_MXFP4_VALUES, dtype=torch.float32)
    if key == "e8m0_half":  # ggml_e8m0_to_fp32_half: x < 2 -> the subnormal 0x00200000 << x, else (x - 1) << 23
        e = torch.arange(256, dtype=torch.int32)
        return torch.where(e < 2, 0x00200000 << e, (e - 1) << 23).view(torch.float32)
    if key == "ue4m3_half":
        return torch.tensor([_ue4m3_half(b) for b in range(256)], dtype=torch.float32)
    if key == "ksigns":  # 7 sign bits + an 8th making the count of set bits even (gguf's IQ2_XXS.ksigns)
        return torch.tensor([i | (bin(i).count("1") & 1) << 7 for i in range(128)], dtype=torch.int32)
    if key.startswith("grid:"):
        return _grid(key[5:])
    raise KeyError(key)


def _ue4m3_half(b: int) -> float:
    """gguf's NVFP4.ue4m3_to_fp32: unsigned e4m3 (bias 7, bit 7 ignored), halved; 0x00 and 0x7F are 0.
    Every value is a small dyadic number, so Python's doubles give gguf's fp32 values exactly."""
    if b in (0, 0x7F):
        return 0.0
    exp, man = (b >> 3) & 0xF, b & 7
    raw = man * 2.0**-9 if exp == 0 else (1 + man / 8) * 2.0 ** (exp - 7)
    return raw * 0.5


def _grid(name: str) -> torch.Tensor:
    """An IQ type's codebook [entries, 4 or 8] fp32, decoded by gguf itself from the table it ships."""
    import numpy as np
    from gguf import quants

    cls = getattr(quants, name)
    cls.init_grid()
    grid = np.ascontiguousarray(cls.grid, dtype=np.float32).reshape(cls.grid_shape)
    return torch.from_numpy(grid.copy())


def _unpack(x: torch.Tensor, amounts: str, dim: int, mask: int) -> torch.Tensor:
    """(x >> a) & mask for each a in `amounts`, stacked at `dim`: a new tensor, the one temporary most decoders
    need (the rest is done in place). One op per shift amount and a stack: a single broadcast shift by a tensor
    of amounts is several times slower on a CPU (no vectorised path for short rows)."""
    return torch.stack([(x >> int(a)) & mask if a != "0" else x & mask for a in amounts.split(",")], dim)


def _nibbles(qs: torch.Tensor, run: int) -> torch.Tensor:
    """uint8 [n, m] -> uint8 [n, 2m] codes: each run of `run` bytes gives `run` low nibbles, then `run` high ones."""
    n = qs.shape[0]
    return _unpack(qs.reshape(n, -1, run), "0,4", 2, 0x0F).view(n, -1)


def _bits(x: torch.Tensor) -> torch.Tensor:
    """uint8 [n, m] -> uint8 [n, 8m]: byte j's bit i is element 8j + i."""
    return _unpack(x, "0,1,2,3,4,5,6,7", 2, 1).view(x.shape[0], -1)


def _gather(dst: torch.Tensor, table: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """dst <- table[index], by rows of table (index any int dtype; dst holds numel(index) rows); returns dst."""
    index = index.reshape(-1)
    if index.dtype not in (torch.int32, torch.int64):
        index = index.int()  # a uint8 index would be read as a mask
    torch.index_select(table, 0, index, out=dst.view(index.numel(), *table.shape[1:]))
    return dst


# ---- the decoders: uint8 x [n, block_bytes] -> dst, fp32 [n, block_elems] (contiguous), filled in place ----


def _f32(x, dst):
    dst.copy_(_as(x, torch.float32))


def _f16_plain(x, dst):
    dst.copy_(_as(x, torch.float16))


def _bf16(x, dst):
    dst.copy_(_as(x, torch.bfloat16))  # the bits << 16, as gguf's BF16 does


def _q4_0(x, dst):
    q = _nibbles(x[:, 2:], 16).sub_(8).view(torch.int8)  # q − 8 (wraps in uint8; read back as int8)
    dst.copy_(q).mul_(_f16(x, 0))


def _q4_1(x, dst):
    dst.copy_(_nibbles(x[:, 4:], 16)).mul_(_f16(x, 0)).add_(_f16(x, 2))  # (d·q) + m: exact product, one rounding


def _q5(x, at):
    """Q5_0 / Q5_1 5-bit codes [n, 32] uint8: a nibble from byte `at` on, bit 4 from the uint32 at at − 4."""
    return _nibbles(x[:, at:], 16).bitwise_or_(_bits(x[:, at - 4 : at]).bitwise_left_shift_(4))


def _q5_0(x, dst):
    dst.copy_(_q5(x, 6).sub_(16).view(torch.int8)).mul_(_f16(x, 0))


def _q5_1(x, dst):
    dst.copy_(_q5(x, 8)).mul_(_f16(x, 0)).add_(_f16(x, 2))


def _q8_0(x, dst):
    dst.copy_(x[:, 2:].view(torch.int8)).mul_(_f16(x, 0))


def _q2_k(x, dst):
    n = x.shape[0]
    scales = x[:, :16]
    dl = (_f16(x, 80) * (scales & 0xF).float()).unsqueeze(-1)  # [n, 16, 1]: d·sc and dmin·m are exact
    ml = (_f16(x, 82) * (scales >> 4).float()).unsqueeze(-1)
    q = _unpack(x[:, 16:80].reshape(n, 2, 32), "0,2,4,6", 2, 3)  # [n, 2, 4, 32] = 16 groups of 16
    dst.view(n, 16, 16).copy_(q.view(n, 16, 16)).mul_(dl).sub_(ml)  # the one rounding: the subtraction


def _q3_k(x, dst):
    n = x.shape[0]
    sc = x[:, 96:108]
    low = _unpack(sc[:, :8], "0,4", 1, 0x0F).view(n, 16)
    high = _unpack(sc[:, 8:], "0,2,4,6", 1, 3).view(n, 16)
    dl = (_f16(x, 108) * (low.bitwise_or_(high.bitwise_left_shift_(4)).view(torch.int8) - 32).float()).unsqueeze(-1)
    q = _unpack(x[:, 32:96].reshape(n, 2, 32), "0,2,4,6", 2, 3).view(n, 16, 16)
    minus = _unpack(x[:, :32], "0,1,2,3,4,5,6,7", 1, 1).view(n, 16, 16).bitwise_xor_(1).bitwise_left_shift_(2)
    q = q.sub_(minus).view(torch.int8)  # ql − 4 where the hmask bit is clear (−4..3, through uint8)
    dst.view(n, 16, 16).copy_(q).mul_(dl)


def _scale_min_k4(x):
    """Q4_K / Q5_K: the 12 bytes at 4..16 -> 6-bit scales and mins, uint8 [n, 8] each."""
    s = x[:, 4:16].reshape(-1, 3, 4)
    d, m, md = s[:, 0], s[:, 1], s[:, 2]
    sc = torch.cat((d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)), dim=1)
    mn = torch.cat((m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)), dim=1)
    return sc, mn


def _k4_scales(x):
    """d·sc and dmin·m as fp32 [n, 8, 1] (both exact)."""
    sc, mn = _scale_min_k4(x)
    return (_f16(x, 0) * sc.float()).unsqueeze(-1), (_f16(x, 2) * mn.float()).unsqueeze(-1)


def _q4_k(x, dst):
    n = x.shape[0]
    d, dm = _k4_scales(x)
    dst.view(n, 8, 32).copy_(_nibbles(x[:, 16:], 32).view(n, 8, 32)).mul_(d).sub_(dm)


def _q5_k(x, dst):
    n = x.shape[0]
    d, dm = _k4_scales(x)
    q = _nibbles(x[:, 48:], 32).view(n, 8, 32)
    q.bitwise_or_(_unpack(x[:, 16:48], "0,1,2,3,4,5,6,7", 1, 1).bitwise_left_shift_(4))  # group j's bit 4: bit j
    dst.view(n, 8, 32).copy_(q).mul_(d).sub_(dm)


def _q6_k(x, dst):
    n = x.shape[0]
    d = (_f16(x, 208) * x[:, 192:208].view(torch.int8).float()).unsqueeze(-1)  # [n, 16, 1]
    q = _unpack(x[:, :128].reshape(n, 2, 64), "0,4", 2, 0x0F).view(n, 8, 32)
    q.bitwise_or_(_unpack(x[:, 128:192].reshape(n, 2, 32), "0,2,4,6", 2, 3).view(n, 8, 32).bitwise_left_shift_(4))
    dst.view(n, 16, 16).copy_(q.sub_(32).view(torch.int8).view(n, 16, 16)).mul_(d)


def _iq4_nl(x, dst):
    _gather(dst, _table("iq4", x.device), _nibbles(x[:, 2:], 16)).mul_(_f16(x, 0))


def _iq4_xs(x, dst):
    n = x.shape[0]
    low = _unpack(x[:, 4:8], "0,4", 2, 0x0F).view(n, 8).int()
    high = _unpack(_u16(x, 2, 1)[:, 0], "0,2,4,6,8,10,12,14", 1, 3)  # [n, 8]
    dl = (_f16(x, 0) * ((low | (high << 4)) - 32).float()).unsqueeze(-1)  # [n, 8, 1]
    _gather(dst, _table("iq4", x.device), _nibbles(x[:, 8:], 16))
    dst.view(n, 8, 32).mul_(dl)


def _tq1_0(x, dst):
    n = x.shape[0]
    powers = _table("pow3", x.device)  # base-3 digits: multiply (mod 256), then take the top bits
    q0 = (x[:, :32].unsqueeze(1) * powers.view(1, 5, 1)).view(n, 160)
    q1 = (x[:, 32:48].unsqueeze(1) * powers.view(1, 5, 1)).view(n, 80)
    qh = (x[:, 48:52].unsqueeze(1) * powers[:4].view(1, 4, 1)).view(n, 16)
    q = ((torch.cat((q0, q1, qh), dim=1).int() * 3) >> 8) - 1
    dst.copy_(q).mul_(_f16(x, 52))


def _tq2_0(x, dst):
    n = x.shape[0]
    q = _unpack(x[:, :64].reshape(n, 2, 32), "0,2,4,6", 2, 3).view(n, QK_K).sub_(1).view(torch.int8)
    dst.copy_(q).mul_(_f16(x, 64))


def _mxfp4(x, dst):
    d = _table("e8m0_half", x.device)[x[:, :1].to(torch.int64)]  # [n, 1]
    _gather(dst, _table("mxfp4", x.device), _nibbles(x[:, 1:], 16)).mul_(d)


def _nvfp4(x, dst):
    n = x.shape[0]
    d = _table("ue4m3_half", x.device)[x[:, :4].to(torch.int64)].unsqueeze(-1)  # [n, 4, 1]: one scale per 16
    _gather(dst, _table("mxfp4", x.device), _nibbles(x[:, 4:], 8))
    dst.view(n, 4, 16).mul_(d)


def _signs(bits: torch.Tensor) -> torch.Tensor:
    """uint8 sign bytes [n, m] -> ±1.0 [n, m, 8] (a set bit i makes element i negative)."""
    return 1.0 - 2.0 * _unpack(bits, "0,1,2,3,4,5,6,7", 2, 1).float()


def _ksign_bytes(index: torch.Tensor) -> torch.Tensor:
    """7-bit sign indices (int32) -> the 8 sign bits of gguf's ksigns table, uint8."""
    return _table("ksigns", index.device)[index.to(torch.int64)].to(torch.uint8)


def _iq_db(x, at: int, count: int) -> torch.Tensor:
    """IQ2_XS / IQ2_S: d·(0.5 + s)·0.25 for the 4-bit scales in `count` bytes from `at`, fp32 [n, 2·count]."""
    s = _unpack(x[:, at : at + count], "0,4", 2, 0x0F).view(x.shape[0], -1)
    return _f16(x, 0) * (0.5 + s.float()) * 0.25


def _iq_grid(x, dst, name: str, index: torch.Tensor, db: torch.Tensor, signs: torch.Tensor, shape) -> None:
    """dst <- (db · grid[index]) · signs, all viewed as `shape` (every product exact)."""
    _gather(dst, _table("grid:" + name, x.device), index)
    dst.view(shape).mul_(db).mul_(signs.view(shape))


def _iq2_xxs(x, dst):
    n = x.shape[0]
    aux = _i32(x, 2, 16).view(n, 8, 2)[..., 1]  # per 32 elements: 4 grid bytes, then 4×7 sign bits + a 4-bit scale
    db = (_f16(x, 0) * (0.5 + ((aux >> 28) & 0xF).float()) * 0.25).view(n, 8, 1, 1)
    signs = _signs(_ksign_bytes(_unpack(aux, "0,7,14,21", 2, 0x7F)).view(n, 32))
    index = x[:, 2:66].reshape(n, 8, 8)[:, :, :4]  # the low word's 4 bytes
    _iq_grid(x, dst, "IQ2_XXS", index, db, signs, (n, 8, 4, 8))


def _iq2_xs(x, dst):
    n = x.shape[0]
    qs = _u16(x, 2, 32)  # 9-bit grid index + 7-bit sign index per 8 elements
    db = _iq_db(x, 66, 8).view(n, 16, 1, 1)
    _iq_grid(x, dst, "IQ2_XS", qs & 511, db, _signs(_ksign_bytes(qs >> 9)), (n, 16, 2, 8))


def _iq2_s(x, dst):
    n = x.shape[0]
    db = _iq_db(x, 74, 8).view(n, 16, 1, 1)
    high = _unpack(x[:, 66:74], "0,2,4,6", 2, 3).view(n, 32)
    index = x[:, 2:34].int() | (high.int() << 8)
    _iq_grid(x, dst, "IQ2_S", index, db, _signs(x[:, 34:66]), (n, 16, 2, 8))


def _iq3_xxs(x, dst):
    n = x.shape[0]
    aux = _i32(x, 66, 8)  # [n, 8]: 4×7 sign bits + a 4-bit scale per 32 elements
    db = (_f16(x, 0) * (0.5 + ((aux >> 28) & 0xF).float()) * 0.5).view(n, 8, 1, 1)
    signs = _signs(_ksign_bytes(_unpack(aux, "0,7,14,21", 2, 0x7F)).view(n, 32))
    _iq_grid(x, dst, "IQ3_XXS", x[:, 2:66], db, signs, (n, 8, 4, 8))


def _iq3_s(x, dst):
    n = x.shape[0]
    s = _unpack(x[:, 106:110], "0,4", 2, 0x0F).view(n, 8)
    db = (_f16(x, 0) * (1 + 2 * s.int()).float()).view(n, 8, 1, 1)
    index = x[:, 2:66].int() | (_bits(x[:, 66:74]).int() << 8)
    _iq_grid(x, dst, "IQ3_S", index, db, _signs(x[:, 74:106]), (n, 8, 4, 8))


def _iq1_s(x, dst):
    n = x.shape[0]
    qh = _u16(x, 34, 8)  # [n, 8]: 4×3 grid-index high bits, a 3-bit scale, the delta's sign
    dl = (_f16(x, 0) * (2 * ((qh >> 12) & 7) + 1).float()).view(n, 8, 1, 1)
    delta = torch.where((qh & 0x8000) == 0, 0.125, -0.125).float().view(n, 8, 1, 1)
    index = x[:, 2:34].int() | (_unpack(qh, "0,3,6,9", 2, 7) << 8).view(n, 32)
    _gather(dst, _table("grid:IQ1_S", x.device), index)
    dst.view(n, 8, 32).add_(delta.view(n, 8, 1)).mul_(dl.view(n, 8, 1))  # dl·(grid + delta): all exact


def _iq1_m(x, dst):
    n = x.shape[0]
    sc = _u16(x, 48, 4)  # [n, 4]: 4×3-bit scales each, and the fp16 d spread over their top nibbles
    bits = (sc[:, 0] >> 12) | ((sc[:, 1] >> 8) & 0xF0) | ((sc[:, 2] >> 4) & 0xF00) | (sc[:, 3] & 0xF000)
    d = ((bits ^ 0x8000) - 0x8000).to(torch.int16).view(torch.float16).float().view(n, 1)  # uint16 -> int16 bits
    dl = (d * (2 * _unpack(sc, "0,3,6,9", 2, 7).view(n, 16) + 1).float()).view(n, 16, 1)  # per 16 elements
    qh = _unpack(x[:, 32:48], "0,4", 2, 0x0F).view(n, 32)  # per 8 elements: 3 grid-index bits, the delta's sign
    index = x[:, :32].int() | ((qh & 7).int() << 8)
    delta = torch.where((qh & 8) == 0, 0.125, -0.125).float().view(n, 32, 1)
    _gather(dst, _table("grid:IQ1_M", x.device), index)
    dst.view(n, 32, 8).add_(delta)
    dst.view(n, 16, 16).mul_(dl)


_DECODERS = {
    "F32": _f32,
    "F16": _f16_plain,
    "BF16": _bf16,
    "Q4_0": _q4_0,
    "Q4_1": _q4_1,
    "Q5_0": _q5_0,
    "Q5_1": _q5_1,
    "Q8_0": _q8_0,
    "Q2_K": _q2_k,
    "Q3_K": _q3_k,
    "Q4_K": _q4_k,
    "Q5_K": _q5_k,
    "Q6_K": _q6_k,
    "IQ4_NL": _iq4_nl,
    "IQ4_XS": _iq4_xs,
    "IQ2_XXS": _iq2_xxs,
    "IQ2_XS": _iq2_xs,
    "IQ2_S": _iq2_s,
    "IQ3_XXS": _iq3_xxs,
    "IQ3_S": _iq3_s,
    "IQ1_S": _iq1_s,
    "IQ1_M": _iq1_m,
    "TQ1_0": _tq1_0,
    "TQ2_0": _tq2_0,
    "MXFP4": _mxfp4,
    "NVFP4": _nvfp4,
}
