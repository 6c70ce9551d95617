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

from .ggmlbits import QK_K, bits_of, f16_at, gather_into, lookup_table, nibble_pairs, u16_at, unpack_bits, view_as
from .ggmliq import iq1_m, iq1_s, iq2_s, iq2_xs, iq2_xxs, iq3_s, iq3_xxs

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


# ---- the decoders: uint8 x [n, block_bytes] -> dst, fp32 [n, block_elems] (contiguous), filled in place ----


def _f32(x, dst):
    dst.copy_(view_as(x, torch.float32))


def _f16_plain(x, dst):
    dst.copy_(view_as(x, torch.float16))


def _bf16(x, dst):
    dst.copy_(view_as(x, torch.bfloat16))  # the bits << 16, as gguf's BF16 does


def _q4_0(x, dst):
    q = nibble_pairs(x[:, 2:], 16).sub_(8).view(torch.int8)  # q − 8 (wraps in uint8; read back as int8)
    dst.copy_(q).mul_(f16_at(x, 0))


def _q4_1(x, dst):
    dst.copy_(nibble_pairs(x[:, 4:], 16)).mul_(f16_at(x, 0)).add_(
        f16_at(x, 2)
    )  # (d·q) + m: exact product, one rounding


def _q5(x, at):
    """Q5_0 / Q5_1 5-bit codes [n, 32] uint8: a nibble from byte `at` on, bit 4 from the uint32 at at − 4."""
    return nibble_pairs(x[:, at:], 16).bitwise_or_(bits_of(x[:, at - 4 : at]).bitwise_left_shift_(4))


def _q5_0(x, dst):
    dst.copy_(_q5(x, 6).sub_(16).view(torch.int8)).mul_(f16_at(x, 0))


def _q5_1(x, dst):
    dst.copy_(_q5(x, 8)).mul_(f16_at(x, 0)).add_(f16_at(x, 2))


def _q8_0(x, dst):
    dst.copy_(x[:, 2:].view(torch.int8)).mul_(f16_at(x, 0))


def _q2_k(x, dst):
    n = x.shape[0]
    scales = x[:, :16]
    dl = (f16_at(x, 80) * (scales & 0xF).float()).unsqueeze(-1)  # [n, 16, 1]: d·sc and dmin·m are exact
    ml = (f16_at(x, 82) * (scales >> 4).float()).unsqueeze(-1)
    q = unpack_bits(x[:, 16:80].reshape(n, 2, 32), "0,2,4,6", 2, 3)  # [n, 2, 4, 32] = 16 groups of 16
    dst.view(n, 16, 16).copy_(q.view(n, 16, 16)).mul_(dl).sub_(ml)  # the one rounding: the subtraction


def _q3_k(x, dst):
    n = x.shape[0]
    sc = x[:, 96:108]
    low = unpack_bits(sc[:, :8], "0,4", 1, 0x0F).view(n, 16)
    high = unpack_bits(sc[:, 8:], "0,2,4,6", 1, 3).view(n, 16)
    dl = (f16_at(x, 108) * (low.bitwise_or_(high.bitwise_left_shift_(4)).view(torch.int8) - 32).float()).unsqueeze(-1)
    q = unpack_bits(x[:, 32:96].reshape(n, 2, 32), "0,2,4,6", 2, 3).view(n, 16, 16)
    minus = unpack_bits(x[:, :32], "0,1,2,3,4,5,6,7", 1, 1).view(n, 16, 16).bitwise_xor_(1).bitwise_left_shift_(2)
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
    return (f16_at(x, 0) * sc.float()).unsqueeze(-1), (f16_at(x, 2) * mn.float()).unsqueeze(-1)


def _q4_k(x, dst):
    n = x.shape[0]
    d, dm = _k4_scales(x)
    dst.view(n, 8, 32).copy_(nibble_pairs(x[:, 16:], 32).view(n, 8, 32)).mul_(d).sub_(dm)


def _q5_k(x, dst):
    n = x.shape[0]
    d, dm = _k4_scales(x)
    q = nibble_pairs(x[:, 48:], 32).view(n, 8, 32)
    q.bitwise_or_(unpack_bits(x[:, 16:48], "0,1,2,3,4,5,6,7", 1, 1).bitwise_left_shift_(4))  # group j's bit 4: bit j
    dst.view(n, 8, 32).copy_(q).mul_(d).sub_(dm)


def _q6_k(x, dst):
    n = x.shape[0]
    d = (f16_at(x, 208) * x[:, 192:208].view(torch.int8).float()).unsqueeze(-1)  # [n, 16, 1]
    q = unpack_bits(x[:, :128].reshape(n, 2, 64), "0,4", 2, 0x0F).view(n, 8, 32)
    q.bitwise_or_(unpack_bits(x[:, 128:192].reshape(n, 2, 32), "0,2,4,6", 2, 3).view(n, 8, 32).bitwise_left_shift_(4))
    dst.view(n, 16, 16).copy_(q.sub_(32).view(torch.int8).view(n, 16, 16)).mul_(d)


def _iq4_nl(x, dst):
    gather_into(dst, lookup_table("iq4", x.device), nibble_pairs(x[:, 2:], 16)).mul_(f16_at(x, 0))


def _iq4_xs(x, dst):
    n = x.shape[0]
    low = unpack_bits(x[:, 4:8], "0,4", 2, 0x0F).view(n, 8).int()
    high = unpack_bits(u16_at(x, 2, 1)[:, 0], "0,2,4,6,8,10,12,14", 1, 3)  # [n, 8]
    dl = (f16_at(x, 0) * ((low | (high << 4)) - 32).float()).unsqueeze(-1)  # [n, 8, 1]
    gather_into(dst, lookup_table("iq4", x.device), nibble_pairs(x[:, 8:], 16))
    dst.view(n, 8, 32).mul_(dl)


def _tq1_0(x, dst):
    n = x.shape[0]
    powers = lookup_table("pow3", x.device)  # base-3 digits: multiply (mod 256), then take the top bits
    q0 = (x[:, :32].unsqueeze(1) * powers.view(1, 5, 1)).view(n, 160)
    q1 = (x[:, 32:48].unsqueeze(1) * powers.view(1, 5, 1)).view(n, 80)
    qh = (x[:, 48:52].unsqueeze(1) * powers[:4].view(1, 4, 1)).view(n, 16)
    q = ((torch.cat((q0, q1, qh), dim=1).int() * 3) >> 8) - 1
    dst.copy_(q).mul_(f16_at(x, 52))


def _tq2_0(x, dst):
    n = x.shape[0]
    q = unpack_bits(x[:, :64].reshape(n, 2, 32), "0,2,4,6", 2, 3).view(n, QK_K).sub_(1).view(torch.int8)
    dst.copy_(q).mul_(f16_at(x, 64))


def _mxfp4(x, dst):
    d = lookup_table("e8m0_half", x.device)[x[:, :1].to(torch.int64)]  # [n, 1]
    gather_into(dst, lookup_table("mxfp4", x.device), nibble_pairs(x[:, 1:], 16)).mul_(d)


def _nvfp4(x, dst):
    n = x.shape[0]
    d = lookup_table("ue4m3_half", x.device)[x[:, :4].to(torch.int64)].unsqueeze(-1)  # [n, 4, 1]: one scale per 16
    gather_into(dst, lookup_table("mxfp4", x.device), nibble_pairs(x[:, 4:], 8))
    dst.view(n, 4, 16).mul_(d)


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
    "IQ2_XXS": iq2_xxs,
    "IQ2_XS": iq2_xs,
    "IQ2_S": iq2_s,
    "IQ3_XXS": iq3_xxs,
    "IQ3_S": iq3_s,
    "IQ1_S": iq1_s,
    "IQ1_M": iq1_m,
    "TQ1_0": _tq1_0,
    "TQ2_0": _tq2_0,
    "MXFP4": _mxfp4,
    "NVFP4": _nvfp4,
}
