"""bitsandbytes weights (LLM.int8 and 4-bit nf4/fp4, as transformers saves them) -> their exact dequantization
and the portable packed layout.

    LLM.int8  `<m>.weight` int8 [N, K] q, `<m>.SCB` fp32 [N] each row's absmax, `<m>.weight_format` (0: rows):
              w = q·SCB·(1/127) in fp32, as bitsandbytes' int8_vectorwise_dequant computes it (two roundings).
              Portable: int8 per row with q and scale = SCB·(1/127) in fp32 (one rounding: q·scale differs from
              bitsandbytes' (q·SCB)·(1/127) by at most one fp32 rounding, measured in the tests).
    4-bit     `<m>.weight` [⌈N·K/2⌉, 1] bytes (any storage dtype, viewed as bytes): the weight flattened row after row,
              value 2j in the high nibble of byte j, 2j+1 in the low one; `<m>.weight.absmax` [⌈N·K/blocksize⌉]
              one scale a block of `blocksize` consecutive values; `<m>.weight.quant_map` fp32 [16] the codebook
              (nf4: normal quantiles, fp4: a 4-bit float), `<m>.weight.quant_state.bitsandbytes__<type>` the
              JSON of the rest (shape, dtype, blocksize; with double quantization nested_blocksize and
              nested_offset). Double quantization stores absmax as uint8 codes of `nested_quant_map` [256] with
              one `nested_absmax` a block of nested_blocksize: absmax = map[a]·nested_absmax + offset (fp32).
              w = quant_map[code]·absmax, one fp32 product: bitsandbytes' own dequantize_4bit bit for bit (its
              reference code; its CPU kernel agrees where K is a multiple of blocksize, and misplaces blocks
              that cross rows otherwise, so the reference is what is matched).

A 16-value codebook is not an affine grid, so no int4 format holds nf4 or fp4 exactly: `Bnb4bit.to_packed` re-
quantizes the exact dequantization round-to-nearest into int4 (lossy; the shard output says by how much), while a
float set (`--quantize none`) holds the exact dequantization.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .fromint import IntWeight
from .rtn import quantize_rtn

INT8_RECIPROCAL = 7.874015718698502e-3  # what bitsandbytes multiplies by to divide by 127 (rounded to fp32 in use)
QUANT_TYPES = ("nf4", "fp4")
REPACK_GROUP = 32  # int4 group nf4/fp4 is re-quantized at: rms 7.8e-2 vs the nf4 weights (9.2e-2 at 64), see the docs
DEQUANT_VALUES = 1 << 22  # values dequantized at once


# -- LLM.int8 ----------------------------------------------------------------------------
def int8_dequantize(weight: torch.Tensor, scb: torch.Tensor) -> torch.Tensor:
    """bitsandbytes' own dequantization, fp32 [N, K]: (q·SCB)·(1/127), as int8_vectorwise_dequant computes it."""
    _check_int8(weight, scb)
    return weight.float().mul(scb.float().view(-1, 1)).mul_(INT8_RECIPROCAL)


def from_int8(weight: torch.Tensor, scb: torch.Tensor) -> IntWeight:
    """q int8 [N, K] and SCB [N] as an IntWeight: u = q + 128, uz = 128, s = SCB·(1/127) in fp32, one group a row."""
    _check_int8(weight, scb)
    n, k = weight.shape
    codes = (weight.to(torch.int16) + 128).to(torch.uint8)
    scale = scb.float().view(n, 1).mul(INT8_RECIPROCAL)
    return IntWeight(8, codes, torch.full((n, 1), 128, dtype=torch.int16), scale, k)


def _check_int8(weight: torch.Tensor, scb: torch.Tensor) -> None:
    if weight.dtype != torch.int8 or weight.dim() != 2 or scb.numel() != weight.shape[0]:
        raise ValueError(f"SCB of {scb.numel()} values does not fit an int8 weight {list(weight.shape)} {weight.dtype}")


# -- 4-bit ---------------------------------------------------------------------------------
@dataclass
class Bnb4bit:
    """A 4-bit weight of `shape` [N, K]: its bytes, per-block absmax (or its nested codes) and the codebook."""

    packed: torch.Tensor  # uint8 [⌈N·K/2⌉]
    absmax: torch.Tensor  # fp32 [blocks], or uint8 codes of nested_map
    quant_map: torch.Tensor  # fp32 [16]
    blocksize: int
    shape: tuple[int, int]
    nested_absmax: torch.Tensor | None = None  # fp32 [⌈blocks/nested_blocksize⌉]
    nested_map: torch.Tensor | None = None  # fp32 [256]
    nested_blocksize: int = 256
    offset: float = 0.0

    def absmax_fp32(self) -> torch.Tensor:
        """Each block's absmax in fp32; double quantization undone as bitsandbytes does: map[a]·nested + offset."""
        if self.nested_absmax is None:
            return self.absmax.float()
        values = self.nested_map.float()[self.absmax.reshape(-1).long()]
        nested = self.nested_absmax.float().repeat_interleave(self.nested_blocksize)[: values.numel()]
        return values.mul_(nested).add_(torch.tensor(self.offset, dtype=torch.float32))

    def dequantize(self) -> torch.Tensor:
        """fp32 [N, K]: quant_map[code]·absmax, exactly bitsandbytes' own dequantize_4bit in fp32."""
        n, k = self.shape
        total = n * k
        absmax = self.absmax_fp32()
        table = self.quant_map.float().reshape(-1)
        out = torch.empty(total, dtype=torch.float32)
        step = max(1, DEQUANT_VALUES // (2 * self.blocksize)) * 2 * self.blocksize  # whole blocks, whole bytes
        for start in range(0, total, step):
            stop = min(total, start + step)
            raw = self.packed[start // 2 : (stop + 1) // 2]
            codes = torch.stack((raw >> 4, raw & 0xF), dim=1).reshape(-1)[: stop - start].long()
            scales = absmax[start // self.blocksize : math.ceil(stop / self.blocksize)].repeat_interleave(
                self.blocksize
            )
            out[start:stop] = table[codes].mul_(scales[: stop - start])
        return out.view(n, k)

    def to_packed(self, group: int, scale_dtype: str):
        """int4 round-to-nearest at `group` from the exact dequantization (lossy): (PackedTensor, exact fp32 weight)."""
        exact = self.dequantize()
        return quantize_rtn(exact, bits=4, group=group, scale_dtype=scale_dtype), exact


def from_4bit(
    packed: torch.Tensor,
    absmax: torch.Tensor,
    quant_map: torch.Tensor,
    state: dict,
    nested_absmax: torch.Tensor | None = None,
    nested_map: torch.Tensor | None = None,
) -> Bnb4bit:
    """The stored tensors of one 4-bit module and its parsed quant_state -> Bnb4bit; ValueError where they disagree."""
    shape = tuple(int(d) for d in state.get("shape") or ())
    blocksize = int(state.get("blocksize", 0))
    if len(shape) != 2 or blocksize < 1:
        raise ValueError(
            f"its quant_state gives shape {list(shape)} and blocksize {blocksize}: not a 2-D blocked weight"
        )
    n, k = shape
    raw = packed.contiguous().reshape(-1).view(torch.uint8)
    blocks = math.ceil(n * k / blocksize)
    if raw.numel() != math.ceil(n * k / 2) or absmax.numel() != blocks or quant_map.numel() != 16:
        raise ValueError(
            f"{raw.numel()} bytes, {absmax.numel()} absmax and a {quant_map.numel()}-value map do not hold a [{n}, "
            f"{k}] weight in blocks of {blocksize}"
        )
    nested = nested_absmax is not None
    if nested != ("nested_offset" in state) or (nested and (nested_map is None or nested_map.numel() != 256)):
        raise ValueError("its double quantization (nested absmax, map and offset) is incomplete")
    weight = Bnb4bit(raw, absmax.reshape(-1), quant_map, blocksize, (n, k))
    if nested:
        weight.nested_absmax, weight.nested_map = nested_absmax.reshape(-1), nested_map.reshape(-1)
        weight.nested_blocksize = int(state.get("nested_blocksize", 256))
        weight.offset = float(state["nested_offset"])
        if weight.nested_absmax.numel() != math.ceil(blocks / weight.nested_blocksize):
            raise ValueError(
                f"{weight.nested_absmax.numel()} nested absmax do not cover {blocks} blocks of "
                f"{weight.nested_blocksize}"
            )
    return weight
