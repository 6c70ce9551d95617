"""The CPU int4 kernel's weight layouts, made with tensor ops so shards can be written in the layout the kernel reads.

`_convert_weight_to_int4pack_for_cpu` takes int32 codes [N, K] and is slow (≈200 MB/s of output, 20× the matmul
it feeds), so converting at every bind would cost more than reading the weight. Its output is a fixed shuffle
of the codes, which depends on the vector width torch's CPU kernel was dispatched with; `cpu_layout()` finds which
shuffle this process's kernel uses by running the op once on labelled codes, and `to_layout`/`from_layout` make
or undo it at memory speed. A shard records the layout its codes are in; a bind on a CPU whose kernel reads
another converts (and says so once).

Layouts (N rows split into blocks of B; each block is stored k-major, B/2 bytes per column k):

    rows        the portable layout: [N, K/2], byte j of row n = column 2j (low nibble) | 2j+1 (high nibble)
    pairs       every block: byte (k, n/2) = row n (low) | row n+1 (high)            (B = 32, no vector unit)
    lanes32     full blocks of 32: byte (k, d) = row d (low) | row d+16 (high)       (AVX2)
    lanes64     full blocks of 64: byte (k, d) = row d | row d+32, byte (k, 16+d) = row d+16 | row d+48  (AVX512)

In lanes32 and lanes64 a last, partial block (N not a multiple of B) is stored as in pairs.
"""

from __future__ import annotations

import functools

import torch

from . import nibbles

LAYOUTS = ("rows", "pairs", "lanes32", "lanes64")
BLOCK = {"pairs": 32, "lanes32": 32, "lanes64": 64}
PROBE_SHAPE = (80, 64)  # one full block of 64 and a partial one, for every layout


def to_layout(rows: torch.Tensor, name: str) -> torch.Tensor:
    """Portable codes uint8 [N, K/2] -> the same codes in layout `name`, uint8 [N, K/2]."""
    if name == "rows":
        return rows
    codes = nibbles.unpack(rows)  # [N, K] in 0..15
    n, k = codes.shape
    block = BLOCK[name]
    full = n // block * block if name != "pairs" else 0
    pieces = []
    if full:
        lanes = codes[:full].reshape(full // block, block // 16, 16, k)
        if name == "lanes64":
            low, high = lanes[:, 0:2], lanes[:, 2:4]  # rows d, d+16 low; d+32, d+48 high
        else:
            low, high = lanes[:, 0:1], lanes[:, 1:2]  # rows d low; d+16 high
        packed = low | (high << 4)  # [blocks, lanes/2, 16, K]
        pieces.append(packed.permute(0, 3, 1, 2).reshape(-1))
    for start in range(full, n, block):  # pairs: every block, or the partial last one
        part = codes[start : start + block]
        pairs = part.reshape(-1, 2, k)
        pieces.append((pairs[:, 0] | (pairs[:, 1] << 4)).transpose(0, 1).reshape(-1))
    return torch.cat(pieces).reshape(n, k // 2) if len(pieces) > 1 else pieces[0].reshape(n, k // 2)


def from_layout(packed: torch.Tensor, name: str) -> torch.Tensor:
    """The inverse of to_layout: codes in layout `name` -> portable uint8 [N, K/2]."""
    return packed if name == "rows" else nibbles.pack(codes(packed, name))


def codes(packed: torch.Tensor, name: str) -> torch.Tensor:
    """Codes in layout `name` (uint8 [N, K/2]) -> one code a byte in row order, uint8 [N, K] in 0..15. A slice of
    whole blocks of rows (a multiple of BLOCK[name] rows from the start, the partial last block included) is a
    weight of its own in the same layout, so a weight can be unpacked a row block at a time."""
    if name == "rows":
        return nibbles.unpack(packed)
    n, k = packed.shape[0], packed.shape[1] * 2
    flat = packed.reshape(-1)
    block = BLOCK[name]
    full = n // block * block if name != "pairs" else 0
    out = torch.empty((n, k), dtype=torch.uint8, device=packed.device)
    if full:
        per = block // 16 // 2  # byte lanes per column: 2 for lanes64, 1 for lanes32
        grid = flat[: full * k // 2].reshape(full // block, k, per, 16).permute(0, 2, 3, 1)  # [blocks, per, 16, K]
        lanes = torch.cat((grid & 0x0F, grid >> 4), dim=1)  # [blocks, lanes, 16, K] in row order
        out[:full] = lanes.reshape(full, k)
    offset = full * k // 2
    for start in range(full, n, block):
        rows = min(block, n - start)
        part = flat[offset : offset + rows * k // 2].reshape(k, rows // 2).transpose(0, 1)  # [rows/2, K]
        out[start : start + rows] = torch.stack((part & 0x0F, part >> 4), dim=1).reshape(rows, k)
        offset += rows * k // 2
    return out


@functools.cache
def cpu_layout() -> str | None:
    """The layout this process's CPU int4 kernel reads, found by running its conversion op on labelled codes;
    None when the op is missing or matches none of LAYOUTS (the weight is then converted by the op at bind)."""
    n, k = PROBE_SHAPE
    codes = (
        torch.arange(n * k, dtype=torch.int32).reshape(n, k) * 7 + torch.arange(n, dtype=torch.int32)[:, None]
    ) % 16
    try:
        made = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 8)
    except (RuntimeError, AttributeError, NotImplementedError):
        return None
    rows = nibbles.pack(codes)
    for name in LAYOUTS[1:]:
        if made.shape == rows.shape and torch.equal(made, to_layout(rows, name)):
            return name
    return None
