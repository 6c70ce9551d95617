"""Which weights a shard set stores packed (low-bit), and their packed form.

A packed weight is stored as one byte tensor holding its parts (checkpoint/packedformat.py), with the format in the
manifest.
Only weights a low-bit kernel can compute on are packed: the weight of an `nn.Linear` (or an embedding table tied
to one, the output head), [N out, K in] as the module holds it, and a GGUF's embedding table of its own (untied), kept
as its blocks: a lookup dequantizes the rows it names (stream/rowgathers.py). Everything else stays in the set's float
dtype. (A K-quant table expanded to bf16 is 3.6x its blocks: 252 MB for a 2.5 B model's 71 MB, a billion bytes for
Llama 3 8B's.)

    auto  keep the source's own low-bit encoding where it maps onto a kernel's format (GGUF Q4_0, Q4_1, Q5_0, Q5_1,
          Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL and IQ4_XS as their own blocks, byte for byte, which the native
          kernels compute on; a compressed-tensors, GPTQ or
          AWQ checkpoint's int4 exactly at its group, its per-channel int8 exactly, bitsandbytes LLM.int8 as int8
          per row and nf4/fp4 re-quantized to int4 group 32 (lossy, said), shard/quantsource.py); a float source
          is not packed
    none  dequantize everything (the float set of earlier versions)
    int4  round-to-nearest int4, group 32, of every Linear weight of a float source (lossy; said so)
    int8  round-to-nearest int8, one scale per row (lossy)

A GGUF type kept as its blocks computes on the native kernels (rocketllm_cli/native: fp32 activations, or 8-bit ones
with `--kernel int8`) and, where they are not built, through the exact torch decoder (checkpoint/ggmlblocks.py); Q8_0
was once re-scaled per row for torch's int8 kernel (1.2% relative RMS error on SmolLM2's embedding). The grid types
(IQ2/IQ3/IQ1, TQ, MXFP4, NVFP4) are kept as blocks too and decoded by the torch decoder when used (no native kernel
yet); a type nothing here decodes (Q8_1, Q8_K, Q1_0) is refused in one line. Llama's Q/K row permutation
(transformers' GGUF processor) is applied to every part of a packed weight: rows are independent.
int4 codes are written in the order this machine's CPU kernel reads (packed/cpulayout.py) with their scales and
zeros in the set's dtype as the kernel takes them, so binding them is a view; a CPU whose kernel reads another
order converts them when bound.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from ..checkpoint.ggmlblocks import SUPPORTED
from ..checkpoint.manifest import set_key
from ..errors import ParameterError

PACKINGS = ("auto", "none", "int4", "int8")
INT4_MODES = ("packed", "int4")  # PackPlan modes that may write int4 (and so record its code order)
# GGUF types kept as their own blocks, byte for byte (mode "blocks"): the native kernels compute on them
# (rocketllm_cli/native), the exact torch decoder (checkpoint/ggmlblocks.py) where those are not built. Q4_0, Q4_1 and
# Q4_K were once converted to torch's int4 layout, whose kernel runs fp32 activations ~10x slower than bf16 ones.
# The grid types (IQ2/IQ3/IQ1, TQ, MXFP4, NVFP4) have no native kernel yet: they stay blocks too, decoded when used.
KEPT = tuple(name for name, (elems, _) in SUPPORTED.items() if elems > 1)
NATIVE_KEPT = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS")
RTN_GROUP = 32  # int4 group of --quantize int4: GGUF's own block size
INT4_ROWS = 16  # the int4 kernels want N a multiple of this; other weights stay float
REQUANT_ROWS = 4096  # rows dequantized at once when Q8_0 is re-scaled per row


@dataclass
class PackPlan:
    """mode: "" (a float set), "packed" (the source's encoding kept), "int4" or "int8"; params: {shard name: how}."""

    mode: str = ""
    params: dict[str, str] = field(default_factory=dict)  # name -> "source" (the source's own encoding) | "rtn"
    layout: str = "rows"  # the order int4 codes are written in
    scale_dtype: str = "fp32"  # int4 in a kernel order: the dtype of its scales and zeros (the set's dtype)
    notes: list[str] = field(default_factory=list)  # what the shard output says about weights kept otherwise

    def key(self, dtype: str) -> str:
        """What names this set beside its dtype: the cache directory, the journal, reuse."""
        return set_key(dtype, self.mode, self.int4_layout)

    @property
    def int4_layout(self) -> str:
        """The int4 order the manifest records: where the packing writes int4 (not an int8-only set)."""
        return self.layout if self.mode in INT4_MODES else ""


def predicted_key(source, packing: str, dtype: str) -> str:
    """The set's key, known before the model is built (plan_packing's PackPlan.key gives the same)."""
    return key_here(dtype, predicted_mode(source, packing))


def key_here(dtype: str, mode: str) -> str:
    """The key of a set of this dtype and PackPlan mode written on this machine (int4 in this CPU's order)."""
    return set_key(dtype, mode, layout_here() if mode in INT4_MODES else "")


def layout_here() -> str:
    """The int4 order this machine's CPU kernel reads ("rows" where it has none)."""
    from ..packed.cpulayout import cpu_layout

    return cpu_layout() or "rows"


def predicted_mode(source, packing: str) -> str:
    """The PackPlan mode `packing` gives for this source, known without the model: what names its set."""
    check_packing(packing)
    if packing == "none":
        return ""
    if packing == "auto":
        lazy = getattr(source, "_lazy", None)
        if lazy is not None and lazy.holds_kept_types():
            return "blocks" if getattr(lazy, "kind", "") == "gguf" else "packed"
        return ""
    return packing


def check_packing(packing: str) -> str:
    if packing not in PACKINGS:
        raise ParameterError(f"bad {{quantize}} {packing!r}: expected {', '.join(PACKINGS)}", "quantize")
    return packing


def plan_packing(
    source, model: nn.Module, mapping, aliases: dict[str, str], packing: str = "auto", dtype: str = "fp32"
) -> PackPlan:
    """The weights to store packed, decided from the module each belongs to and what the source holds."""
    mode = predicted_mode(source, packing)
    if not mode:
        return PackPlan()
    linear = _linear_weights(model, aliases)
    if mode == "blocks":  # a GGUF's own embedding table too, where its type is kept: only its rows are ever read
        linear.update({k: v for k, v in _linear_weights(model, aliases, nn.Embedding).items() if k not in linear})
    params: dict[str, str] = {}
    lazy = getattr(source, "_lazy", None)
    noted: dict[str, int] = {}
    for name, shape in linear.items():
        if name not in mapping or name in mapping.sliced or name in mapping.converted:
            continue
        if mode in ("packed", "blocks"):
            if lazy is not None and lazy.packable(mapping[name], shape, INT4_ROWS):
                params[name] = "source"
            note = getattr(lazy, "pack_note", None)
            note = note(mapping[name], shape, INT4_ROWS) if note is not None else None
            if note:
                noted[note] = noted.get(note, 0) + 1
        elif (
            shape[1] % RTN_GROUP == 0
            and (packing == "int8" or shape[0] % INT4_ROWS == 0)
            and not _tied_table(name, aliases)
        ):
            params[name] = "rtn"
    notes = [f"{count} quantized weight{'s' if count > 1 else ''}: {note}" for note, count in noted.items()]
    return PackPlan(mode, params, layout_here(), dtype, notes)


def read_packed(source, mapping, name: str, plan: PackPlan):
    """The PackedTensor stored for `name` (a PackPlan.params entry)."""
    from ..packed import quantize_rtn

    if plan.params[name] == "source":
        packed = source._lazy.read_packed(mapping[name])
        if packed.format.kind == "int8" and packed.format.group != packed.format.shape[1]:
            packed = _per_row_int8(packed)
    else:
        weight = mapping.read(source, name)
        bits = 4 if plan.mode == "int4" else 8
        packed = quantize_rtn(
            weight, bits=bits, group=RTN_GROUP if bits == 4 else None, scale_dtype=_scale_dtype(weight)
        )
    if packed.format.kind == "int4" and plan.layout != packed.format.layout:
        from ..packed.kernelform import to_kernel_form

        packed = to_kernel_form(packed, plan.layout, plan.scale_dtype)
    return packed


def packed_nbytes(source, mapping, name: str, plan: PackPlan, shape: tuple[int, int]) -> int:
    """Bytes the packed weight will take, known before it is read (the disk-space check; a scale that needs fp32
    where fp16 was expected can make the real size a little larger)."""
    from ..checkpoint.packedformat import PackedFormat

    if plan.params[name] == "source":
        fmt = source._lazy.packed_format(mapping[name])
    elif plan.mode == "int4":
        fmt = PackedFormat("int4", shape, RTN_GROUP, scale_dtype="fp16")
    else:
        fmt = PackedFormat("int8", shape, shape[1], scale_dtype="fp16")
    if fmt.kind == "int4" and plan.layout != "rows":
        fmt = fmt.with_layout(plan.layout, plan.scale_dtype)
    return fmt.offsets()[1]


def _linear_weights(
    model: nn.Module, aliases: dict[str, str], kind: type[nn.Module] = nn.Linear
) -> dict[str, tuple[int, int]]:
    """{parameter: (N, K)} of every KIND module's 2-D weight (an nn.Linear's, and each table tied to one; or an
    nn.Embedding's table, rows by width), by the name holding the data."""
    out: dict[str, tuple[int, int]] = {}
    for path, module in model.named_modules():
        if isinstance(module, kind) and module.weight is not None and module.weight.dim() == 2:
            name = f"{path}.weight" if path else "weight"
            out[aliases.get(name, name)] = tuple(module.weight.shape)
    return out


def _tied_table(name: str, aliases: dict[str, str]) -> bool:
    return name in aliases.values()


def _scale_dtype(weight: torch.Tensor) -> str:
    return "fp16" if float(weight.detach().abs().max()) < 6e4 else "fp32"


def _per_row_int8(packed):
    """Q8_0 (a scale per 32 values) -> int8 with one fp32 scale per row, a block of rows at a time."""
    from ..checkpoint.packedformat import PackedFormat, PackedTensor
    from ..packed import dequantize, quantize_rtn

    n, k = packed.format.shape
    codes, scales = [], []
    for start in range(0, n, REQUANT_ROWS):
        block = PackedTensor(
            PackedFormat(
                "int8", (min(REQUANT_ROWS, n - start), k), packed.format.group, scale_dtype=packed.format.scale_dtype
            ),
            {name: part[start : start + REQUANT_ROWS] for name, part in packed.parts.items()},
        )
        again = quantize_rtn(dequantize(block), bits=8, group=None, scale_dtype="fp32")
        codes.append(again.parts["codes"])
        scales.append(again.parts["scale"])
    return PackedTensor(
        PackedFormat("int8", (n, k), k, scale_dtype="fp32"), {"codes": torch.cat(codes), "scale": torch.cat(scales)}
    )
