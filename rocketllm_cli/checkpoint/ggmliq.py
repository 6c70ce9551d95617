"""The IQ block types' decoders (IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S, IQ1_M): codebook grids gguf ships,
indexed per group and signed by gguf's ksigns table; exact in fp32 as the other types' (ggmlblocks.py)."""

from __future__ import annotations

import torch

from .ggmlbits import bits_of, f16_at, gather_into, i32_at, lookup_table, u16_at, unpack_bits


def iq_signs(bits: torch.Tensor) -> torch.Tensor:
    """uint8 sign bytes [n, m] -> ±1.0 [n, m, 8] (a set bit i makes element i negative)."""
    return 1.0 - 2.0 * unpack_bits(bits, "0,1,2,3,4,5,6,7", 2, 1).float()


def ksign_bytes(index: torch.Tensor) -> torch.Tensor:
    """7-bit sign indices (int32) -> the 8 sign bits of gguf's ksigns table, uint8."""
    return lookup_table("ksigns", index.device)[index.to(torch.int64)].to(torch.uint8)


def iq_db(x, at: int, count: int) -> torch.Tensor:
    """IQ2_XS / IQ2_S: d·(0.5 + s)·0.25 for the 4-bit scales in `count` bytes from `at`, fp32 [n, 2·count]."""
    s = unpack_bits(x[:, at : at + count], "0,4", 2, 0x0F).view(x.shape[0], -1)
    return f16_at(x, 0) * (0.5 + s.float()) * 0.25


def iq_grid_fill(x, dst, name: str, index: torch.Tensor, db: torch.Tensor, signs: torch.Tensor, shape) -> None:
    """dst <- (db · grid[index]) · signs, all viewed as `shape` (every product exact)."""
    gather_into(dst, lookup_table("grid:" + name, x.device), index)
    dst.view(shape).mul_(db).mul_(signs.view(shape))


def iq2_xxs(x, dst):
    n = x.shape[0]
    aux = i32_at(x, 2, 16).view(n, 8, 2)[..., 1]  # per 32 elements: 4 grid bytes, then 4×7 sign bits + a 4-bit scale
    db = (f16_at(x, 0) * (0.5 + ((aux >> 28) & 0xF).float()) * 0.25).view(n, 8, 1, 1)
    signs = iq_signs(ksign_bytes(unpack_bits(aux, "0,7,14,21", 2, 0x7F)).view(n, 32))
    index = x[:, 2:66].reshape(n, 8, 8)[:, :, :4]  # the low word's 4 bytes
    iq_grid_fill(x, dst, "IQ2_XXS", index, db, signs, (n, 8, 4, 8))


def iq2_xs(x, dst):
    n = x.shape[0]
    qs = u16_at(x, 2, 32)  # 9-bit grid index + 7-bit sign index per 8 elements
    db = iq_db(x, 66, 8).view(n, 16, 1, 1)
    iq_grid_fill(x, dst, "IQ2_XS", qs & 511, db, iq_signs(ksign_bytes(qs >> 9)), (n, 16, 2, 8))


def iq2_s(x, dst):
    n = x.shape[0]
    db = iq_db(x, 74, 8).view(n, 16, 1, 1)
    high = unpack_bits(x[:, 66:74], "0,2,4,6", 2, 3).view(n, 32)
    index = x[:, 2:34].int() | (high.int() << 8)
    iq_grid_fill(x, dst, "IQ2_S", index, db, iq_signs(x[:, 34:66]), (n, 16, 2, 8))


def iq3_xxs(x, dst):
    n = x.shape[0]
    aux = i32_at(x, 66, 8)  # [n, 8]: 4×7 sign bits + a 4-bit scale per 32 elements
    db = (f16_at(x, 0) * (0.5 + ((aux >> 28) & 0xF).float()) * 0.5).view(n, 8, 1, 1)
    signs = iq_signs(ksign_bytes(unpack_bits(aux, "0,7,14,21", 2, 0x7F)).view(n, 32))
    iq_grid_fill(x, dst, "IQ3_XXS", x[:, 2:66], db, signs, (n, 8, 4, 8))


def iq3_s(x, dst):
    n = x.shape[0]
    s = unpack_bits(x[:, 106:110], "0,4", 2, 0x0F).view(n, 8)
    db = (f16_at(x, 0) * (1 + 2 * s.int()).float()).view(n, 8, 1, 1)
    index = x[:, 2:66].int() | (bits_of(x[:, 66:74]).int() << 8)
    iq_grid_fill(x, dst, "IQ3_S", index, db, iq_signs(x[:, 74:106]), (n, 8, 4, 8))


def iq1_s(x, dst):
    n = x.shape[0]
    qh = u16_at(x, 34, 8)  # [n, 8]: 4×3 grid-index high bits, a 3-bit scale, the delta's sign
    dl = (f16_at(x, 0) * (2 * ((qh >> 12) & 7) + 1).float()).view(n, 8, 1, 1)
    delta = torch.where((qh & 0x8000) == 0, 0.125, -0.125).float().view(n, 8, 1, 1)
    index = x[:, 2:34].int() | (unpack_bits(qh, "0,3,6,9", 2, 7) << 8).view(n, 32)
    gather_into(dst, lookup_table("grid:IQ1_S", x.device), index)
    dst.view(n, 8, 32).add_(delta.view(n, 8, 1)).mul_(dl.view(n, 8, 1))  # dl·(grid + delta): all exact


def iq1_m(x, dst):
    n = x.shape[0]
    sc = u16_at(x, 48, 4)  # [n, 4]: 4×3-bit scales each, and the fp16 d spread over their top nibbles
    bits = (sc[:, 0] >> 12) | ((sc[:, 1] >> 8) & 0xF0) | ((sc[:, 2] >> 4) & 0xF00) | (sc[:, 3] & 0xF000)
    d = ((bits ^ 0x8000) - 0x8000).to(torch.int16).view(torch.float16).float().view(n, 1)  # uint16 -> int16 bits
    dl = (d * (2 * unpack_bits(sc, "0,3,6,9", 2, 7).view(n, 16) + 1).float()).view(n, 16, 1)  # per 16 elements
    qh = unpack_bits(x[:, 32:48], "0,4", 2, 0x0F).view(n, 32)  # per 8 elements: 3 grid-index bits, the delta's sign
    index = x[:, :32].int() | ((qh & 7).int() << 8)
    delta = torch.where((qh & 8) == 0, 0.125, -0.125).float().view(n, 32, 1)
    gather_into(dst, lookup_table("grid:IQ1_M", x.device), index)
    dst.view(n, 32, 8).add_(delta)
    dst.view(n, 16, 16).mul_(dl)
