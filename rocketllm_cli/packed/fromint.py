"""Integer-quantized weights of safetensors checkpoints -> the portable packed layout, exactly.

compressed-tensors, GPTQ and AWQ all store, per output row n and group of `group` input columns, unsigned codes u,
an unsigned zero point uz and a scale s, with w = (u − uz)·s. Only how the codes are packed differs:

    compressed-tensors pack-quantized  weight_packed int32 [N, ⌈K·bits/32⌉]: column k at bit bits·(k mod 32/bits)
                       of word k·bits/32 (u = q + 2^(bits−1)); weight_zero_point (asymmetric) packed the same way
                       along N, [⌈N·bits/32⌉, G]; weight_scale [N, G]. Symmetric: uz = 2^(bits−1).
    compressed-tensors naive/int-quantized  weight int8 [N, K] holding q (u = q + 2^(bits−1)), zero point int8 [N, G]
    GPTQ   qweight int32 [K·bits/32, N] packed along K as above; qzeros int32 [G, N·bits/32] along N; scales [G, N];
           the original ("gptq", v1) format stores uz − 1, gptq_v2 stores uz; g_idx [K] names each column's group
    AWQ    (GEMM) qweight int32 [K, N/8] along N, nibble i of a word holding column ORDER[i] of its eight,
           ORDER = 0 2 4 6 1 3 5 7; qzeros [G, N/8] the same; scales [G, N]

`IntWeight` holds the unpacked codes [N, K]; `to_packed` gives int4 with scale = s and min = −uz·s (w = u·scale + min),
or int8 with q = u − 128 and scale = s (symmetric, one group per row: what the int8 kernel takes). With 16-bit
scales (what every format writes for an fp16 or bf16 model) u·s, uz·s and (u − uz)·s are exact in fp32, so the
packed weight dequantizes in fp32 bit for bit to the format's own (u − uz)·s; with fp32 scales, within one rounding.
A group the int4 kernel does not take but a multiple of one it does (per channel, 512 ...) is cut into that group
with its scale repeated, which changes no weight; any other group stays as it is (packed, dequantized per use).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import dtypes
from ..checkpoint.packedformat import PackedFormat, PackedTensor
from . import nibbles
from .layout import INT4_GROUPS

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AWQ GEMM: nibble i of a word holds column AWQ_ORDER[i] of its eight
AWQ_UNDO = tuple(AWQ_ORDER.index(c) for c in range(8))  # column c sits in nibble AWQ_UNDO[c]
DEQUANT_VALUES = 1 << 22  # weights dequantized at once: the temporaries of a block stay tens of MB


@dataclass
class IntWeight:
    """w [N, K] = (codes − zeros)·scale, per group of columns; g_idx: each column's group where it is not k // group."""

    bits: int  # 4 or 8
    codes: torch.Tensor  # uint8 [N, K]: u in 0 .. 2^bits − 1
    zeros: torch.Tensor  # int16 [N, G]: uz (GPTQ v1 may reach 2^bits)
    scale: torch.Tensor  # float [N, G], as stored
    group: int
    g_idx: torch.Tensor | None = None  # int64 [K]

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)

    @property
    def symmetric(self) -> bool:
        return bool((self.zeros == 1 << (self.bits - 1)).all())

    def groups_contiguous(self) -> bool:
        """Whether each group is a run of `group` columns (no act-order), the only grouping a packed format holds."""
        k = self.shape[1]
        return self.g_idx is None or torch.equal(self.g_idx, torch.arange(k) // self.group)

    def dequantize(self) -> torch.Tensor:
        """fp32 [N, K]: (u − uz)·s, the one rounding in fp32 (none for 16-bit scales); a block of rows at a time."""
        n, k = self.shape
        g_idx = torch.arange(k) // self.group if self.g_idx is None else self.g_idx
        out = torch.empty((n, k), dtype=torch.float32)
        step = max(1, DEQUANT_VALUES // k)
        for start in range(0, n, step):
            rows = slice(start, start + step)
            steps = self.codes[rows].to(torch.int16) - self.zeros[rows].index_select(1, g_idx)
            out[rows] = steps.float().mul_(self.scale[rows].float().index_select(1, g_idx))
        return out

    def to_packed(self) -> PackedTensor:
        """The portable int4 or int8 form (see the module docstring); ValueError where none holds it exactly."""
        n, k = self.shape
        if not self.groups_contiguous():
            raise ValueError("act-order groups (g_idx) are not runs of columns: no packed format holds them")
        if self.bits == 8:
            if not self.symmetric:
                raise ValueError("int8 with zero points has no packed form (w = q·scale)")
            codes = (self.codes.to(torch.int16) - 128).to(torch.int8)
            scale, name = _stored(self.scale)
            return PackedTensor(
                PackedFormat("int8", (n, k), self.group, scale_dtype=name), {"codes": codes, "scale": scale}
            )
        scale32 = self.scale.float()
        minimum = -(self.zeros.float() * scale32)
        name = dtypes.short_name(self.scale.dtype) or "fp32"
        as_stored = minimum.to(self.scale.dtype)
        if name == "fp32" or not (torch.isfinite(as_stored).all() and torch.equal(as_stored.float(), minimum)):
            name = "fp32"
        group, repeat = kernel_group(self.group, k)
        stored = dtypes.torch_dtype(name)
        scale = scale32.repeat_interleave(repeat, dim=1).to(stored)
        minimum = minimum.repeat_interleave(repeat, dim=1).to(stored)
        fmt = PackedFormat("int4", (n, k), group, scale_dtype=name)
        return PackedTensor(fmt, {"codes": nibbles.pack(self.codes), "scale": scale, "min": minimum})


def kernel_group(group: int, k: int) -> tuple[int, int]:
    """(the int4 group a weight of `group` is stored at, scales repeated per group): its own where the kernel takes
    it, the largest group the kernel takes that divides it, else its own (no kernel: dequantized per use)."""
    if group in INT4_GROUPS:
        return group, 1
    fits = [g for g in INT4_GROUPS if group % g == 0 and k % g == 0]
    return (max(fits), group // max(fits)) if fits else (group, 1)


def _stored(scale: torch.Tensor) -> tuple[torch.Tensor, str]:
    name = dtypes.short_name(scale.dtype)
    return (scale, name) if name else (scale.float(), "fp32")


# -- unpacking -------------------------------------------------------------------------
def lsb_first(words: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """int32 [R, W] holding `bits`-bit fields from the lowest bit up -> uint8 [R, count] (4 or 8 bits)."""
    raw = words.contiguous().view(torch.uint8)  # little-endian: a word's low byte first
    fields = nibbles.unpack(raw) if bits == 4 else raw
    return fields[:, :count]


def from_compressed(
    packed: torch.Tensor,
    scale: torch.Tensor,
    zero_point: torch.Tensor | None,
    shape: tuple[int, int],
    bits: int,
    g_idx: torch.Tensor | None = None,
) -> IntWeight:
    """compressed-tensors pack-quantized: weight_packed int32 [N, ⌈K·bits/32⌉], weight_scale [N, G] (or one value),
    weight_zero_point int32 [⌈N·bits/32⌉, G] or None (symmetric)."""
    n, k = shape
    codes = lsb_first(packed, bits, k)
    scale = _per_row(scale, n)
    if zero_point is None:
        zeros = torch.full(scale.shape, 1 << (bits - 1), dtype=torch.int16)
    else:
        zeros = lsb_first(zero_point.reshape(-1, scale.shape[1]).t(), bits, n).t().to(torch.int16)
    return _checked(bits, codes, zeros, scale, g_idx)


def from_naive(
    weight: torch.Tensor,
    scale: torch.Tensor,
    zero_point: torch.Tensor | None,
    bits: int,
    g_idx: torch.Tensor | None = None,
) -> IntWeight:
    """compressed-tensors naive-/int-quantized: weight int8 [N, K] holding q, zero point [N, G] holding z (or None)."""
    offset = 1 << (bits - 1)
    n = weight.shape[0]
    scale = _per_row(scale, n)
    codes = (weight.to(torch.int16) + offset).to(torch.uint8)
    zeros = (
        torch.zeros(scale.shape, dtype=torch.int16)
        if zero_point is None
        else _per_row(zero_point, n).round().to(torch.int16)
    ) + offset
    return _checked(bits, codes, zeros, scale, g_idx)


def from_gptq(
    qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor | None, bits: int, v1: bool
) -> IntWeight:
    """GPTQ: qweight int32 [K·bits/32, N], qzeros int32 [G, N·bits/32], scales [G, N]; v1 stores each zero minus one."""
    n = qweight.shape[1]
    k = qweight.shape[0] * 32 // bits
    codes = lsb_first(qweight.t(), bits, k)
    zeros = lsb_first(qzeros, bits, n).t().to(torch.int16) + (1 if v1 else 0)
    return _checked(bits, codes, zeros.contiguous(), scales.t().contiguous(), g_idx)


def from_awq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor) -> IntWeight:
    """AWQ GEMM: qweight int32 [K, N/8], qzeros int32 [G, N/8], scales [G, N], nibbles in AWQ_ORDER."""
    undo = torch.tensor(AWQ_UNDO)

    def columns(words: torch.Tensor) -> torch.Tensor:  # [R, W] -> uint8 [R, 8·W] in column order
        fields = lsb_first(words, 4, words.shape[1] * 8)
        return fields.view(words.shape[0], -1, 8).index_select(2, undo).reshape(words.shape[0], -1)

    codes = columns(qweight).t().contiguous()
    zeros = columns(qzeros).t().to(torch.int16).contiguous()
    return _checked(4, codes, zeros, scales.t().contiguous(), None)


def _per_row(values: torch.Tensor, n: int) -> torch.Tensor:
    """[N, G], [N] or a single value (a per-tensor scale) -> [N, G]."""
    if values.dim() == 2 and values.shape[0] == n:
        return values
    if values.numel() == n:
        return values.reshape(n, 1)
    return values.reshape(1, -1).expand(n, -1).contiguous()


def _checked(
    bits: int, codes: torch.Tensor, zeros: torch.Tensor, scale: torch.Tensor, g_idx: torch.Tensor | None
) -> IntWeight:
    n, k = codes.shape
    groups = scale.shape[1]
    if scale.shape[0] != n or zeros.shape != scale.shape or groups < 1 or k % groups:
        raise ValueError(f"scales {list(scale.shape)} and zeros {list(zeros.shape)} do not fit codes [{n}, {k}]")
    if g_idx is not None:
        g_idx = g_idx.to(torch.int64).reshape(-1)
        if g_idx.numel() != k or int(g_idx.min()) < 0 or int(g_idx.max()) >= groups:
            raise ValueError(f"g_idx of {g_idx.numel()} columns does not fit codes [{n}, {k}] in {groups} groups")
    return IntWeight(bits, codes.contiguous(), zeros, scale, k // groups, g_idx)
