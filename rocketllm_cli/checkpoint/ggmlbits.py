"""The byte fields of GGML blocks read as torch tensors (x is uint8 [n, block_bytes], little-endian, as GGUF
files and both devices are), the small lookup tables the decoders use, built once per device, and the unpacking of
packed codes: what ggmlblocks.py and ggmliq.py decode with."""

from __future__ import annotations

import torch

QK_K = 256  # elements in a K-quant / IQ super-block


_IQ4_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)  # IQ4_NL / IQ4_XS codebook


_MXFP4_VALUES = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)  # e2m1 doubled (the scale is halved)


def view_as(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """uint8 x [n, m·size] read as `dtype` [n, m]: a view where x is contiguous and aligned, else a fresh copy
    (a field sliced out of the blocks, or a tile at an odd offset: CUDA cannot load misaligned words)."""
    size = torch.empty(0, dtype=dtype).element_size()
    if not x.is_contiguous() or x.stride(0) != x.shape[1] or x.data_ptr() % size:  # (one row keeps its stride)
        x = x.clone(memory_format=torch.contiguous_format)
    return x.view(dtype)


def f16_at(x: torch.Tensor, at: int) -> torch.Tensor:
    """The fp16 field at byte `at` as fp32 [n, 1] (exact)."""
    return view_as(x[:, at : at + 2], torch.float16).float()


def u16_at(x: torch.Tensor, at: int, count: int) -> torch.Tensor:
    """`count` uint16 fields from byte `at` as int32 [n, count] (0..65535)."""
    return view_as(x[:, at : at + 2 * count], torch.int16).int() & 0xFFFF


def i32_at(x: torch.Tensor, at: int, count: int) -> torch.Tensor:
    """`count` uint32 fields from byte `at`, as int32 bit patterns [n, count] (mask after any right shift)."""
    return view_as(x[:, at : at + 4 * count], torch.int32)


_TABLES: dict[tuple[str, torch.device], torch.Tensor] = {}


def lookup_table(key: str, device: torch.device) -> torch.Tensor:
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
        return iq_grid_table(key[5:])
    raise KeyError(key)


def _ue4m3_half(b: int) -> float:
    """gguf's NVFP4.ue4m3_to_fp32: unsigned e4m3 (bias 7, bit 7 ignored), halved; 0x00 and 0x7F are 0.
    Every value is a small dyadic number, so Python's doubles give gguf's fp32 values exactly."""
    if b in (0, 0x7F):
        return 0.0
    exp, man = (b >> 3) & 0xF, b & 7
    raw = man * 2.0**-9 if exp == 0 else (1 + man / 8) * 2.0 ** (exp - 7)
    return raw * 0.5


def iq_grid_table(name: str) -> torch.Tensor:
    """An IQ type's codebook [entries, 4 or 8] fp32, decoded by gguf itself from the table it ships."""
    import numpy as np
    from gguf import quants

    cls = getattr(quants, name)
    cls.init_grid()
    grid = np.ascontiguousarray(cls.grid, dtype=np.float32).reshape(cls.grid_shape)
    return torch.from_numpy(grid.copy())


def unpack_bits(x: torch.Tensor, amounts: str, dim: int, mask: int) -> torch.Tensor:
    """(x >> a) & mask for each a in `amounts`, stacked at `dim`: a new tensor, the one temporary most decoders
    need (the rest is done in place). One op per shift amount and a stack: a single broadcast shift by a tensor
    of amounts is several times slower on a CPU (no vectorised path for short rows)."""
    return torch.stack([(x >> int(a)) & mask if a != "0" else x & mask for a in amounts.split(",")], dim)


def nibble_pairs(qs: torch.Tensor, run: int) -> torch.Tensor:
    """uint8 [n, m] -> uint8 [n, 2m] codes: each run of `run` bytes gives `run` low nibbles, then `run` high ones."""
    n = qs.shape[0]
    return unpack_bits(qs.reshape(n, -1, run), "0,4", 2, 0x0F).view(n, -1)


def bits_of(x: torch.Tensor) -> torch.Tensor:
    """uint8 [n, m] -> uint8 [n, 8m]: byte j's bit i is element 8j + i."""
    return unpack_bits(x, "0,1,2,3,4,5,6,7", 2, 1).view(x.shape[0], -1)


def gather_into(dst: torch.Tensor, table: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """dst <- table[index], by rows of table (index any int dtype; dst holds numel(index) rows); returns dst."""
    index = index.reshape(-1)
    if index.dtype not in (torch.int32, torch.int64):
        index = index.int()  # a uint8 index would be read as a mask
    torch.index_select(table, 0, index, out=dst.view(index.numel(), *table.shape[1:]))
    return dst
