"""What a packed weight is: its kind, logical shape, group and the shape and dtype of each stored part.

A packed weight stands for a float matrix W [N out, K in] (the layout of `nn.Linear.weight`). Every part is
row-major over the N output rows, so rows can be sliced or permuted part by part. Kinds, in the portable
layout a shard stores (the kernels' own layouts are made from it at bind time, see kernels.py):

    int4  codes uint8 [N, K/2]: byte j holds column 2j in its low nibble, 2j+1 in its high nibble (q in 0..15);
          scale, min [N, K/group]:  w = q·scale + min   (GGUF Q4_1/Q4_K's own form; Q4_0 has min = −8·scale)
          `layout` says how the codes are ordered: "rows" as above, or the CPU kernel's own shuffle (cpulayout.py);
          in a kernel layout the scales are stored as the kernel takes them, in scale_dtype (the set's dtype):
          sz [K/group, 2·N] = per group and row (scale, zero), w = (q − 8)·scale + zero, zero = min + 8·scale
    int8  codes int8 [N, K]; scale [N, K/group]:  w = q·scale   (group == K: one scale per output channel)
    gguf  blocks uint8 [N, K/block·block_bytes]: a GGUF type's raw blocks, decoded exactly by ggmlblocks.py

The descriptor is a plain dict in the manifest (`to_dict`/`from_dict`); no torch is needed to read it. In a
shard, a packed weight is one byte tensor, its parts one after another at PART_ALIGN boundaries (`offsets`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .. import dtypes
from ..sizes import round_up

KINDS = ("int4", "int8", "gguf")
CODE_LAYOUTS = ("rows", "pairs", "lanes32", "lanes64")  # int4 codes: portable, or a CPU kernel's (cpulayout.py)
PART_ALIGN = 64  # bytes: each part of a stored weight starts at a multiple of this
CODE_DTYPES = {"int4": "uint8", "int8": "int8", "gguf": "uint8"}  # the dtype of each kind's codes/blocks part
SCALE_DTYPES = dtypes.NAMES  # scales and mins are stored as one of the floating dtypes


@dataclass(frozen=True)
class PackedFormat:
    """The descriptor of one packed weight; parts() derives every stored tensor's shape and dtype from it."""

    kind: str
    shape: tuple[int, int]  # (N, K) of the float weight it stands for
    group: int  # columns sharing one scale (int4/int8), or the elements of one GGUF block
    scale_dtype: str = ""  # int4/int8: the short dtype name of scale (and min)
    gguf_type: str = ""  # gguf: the GGML type name of the blocks ("Q6_K")
    block_bytes: int = 0  # gguf: bytes of one block
    layout: str = "rows"  # int4: the order of the codes (CODE_LAYOUTS)

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))
        _check(self)

    @property
    def groups(self) -> int:
        """Groups (or blocks) per row."""
        return self.shape[1] // self.group

    def parts(self) -> dict[str, tuple[tuple[int, int], str]]:
        """{part name: (shape, dtype name)} of what is stored."""
        n, k = self.shape
        if self.kind == "gguf":
            return {"blocks": ((n, self.groups * self.block_bytes), "uint8")}
        codes = (n, k // 2) if self.kind == "int4" else (n, k)
        if self.kind == "int4" and self.layout != "rows":
            return {"codes": (codes, "uint8"), "sz": ((self.groups, 2 * n), self.scale_dtype)}
        parts = {"codes": (codes, CODE_DTYPES[self.kind]), "scale": ((n, self.groups), self.scale_dtype)}
        if self.kind == "int4":
            parts["min"] = ((n, self.groups), self.scale_dtype)
        return parts

    @property
    def nbytes(self) -> int:
        """Stored bytes of all parts."""
        return sum(_part_bytes(shape, dtype) for shape, dtype in self.parts().values())

    def offsets(self) -> tuple[dict[str, int], int]:
        """({part: byte offset} in the stored byte tensor, its total length): parts in parts() order, aligned."""
        out, at = {}, 0
        for name, (shape, dtype) in self.parts().items():
            at = round_up(at, PART_ALIGN)
            out[name] = at
            at += _part_bytes(shape, dtype)
        return out, at

    def with_layout(self, layout: str, scale_dtype: str | None = None) -> PackedFormat:
        """The same weight with its codes in another order (and its scales in another dtype)."""
        return PackedFormat(
            self.kind, self.shape, self.group, scale_dtype or self.scale_dtype, self.gguf_type, self.block_bytes, layout
        )

    def to_dict(self) -> dict:
        """The manifest form: the fields plus every part's shape and dtype (checked again on reading)."""
        out: dict = {"kind": self.kind, "shape": list(self.shape), "group": self.group}
        if self.kind == "gguf":
            out.update(gguf_type=self.gguf_type, block_bytes=self.block_bytes)
        else:
            out["scale_dtype"] = self.scale_dtype
        if self.kind == "int4":
            out["layout"] = self.layout
        out["parts"] = {name: {"shape": list(shape), "dtype": dtype} for name, (shape, dtype) in self.parts().items()}
        return out

    @classmethod
    def from_dict(cls, data: dict) -> PackedFormat:
        """The inverse of to_dict; ValueError for a malformed or inconsistent descriptor."""
        if not isinstance(data, dict):
            raise ValueError(f"packed format must be a mapping, got {type(data).__name__}")
        try:
            fmt = cls(
                kind=data["kind"],
                shape=tuple(data["shape"]),
                group=int(data["group"]),
                scale_dtype=data.get("scale_dtype", ""),
                gguf_type=data.get("gguf_type", ""),
                block_bytes=int(data.get("block_bytes", 0)),
                layout=data.get("layout", "rows"),
            )
        except (KeyError, TypeError) as exc:
            raise ValueError(f"packed format is missing or mistypes a field ({exc})") from None
        stated = {name: (tuple(p["shape"]), p["dtype"]) for name, p in dict(data.get("parts", {})).items()}
        if stated and stated != fmt.parts():
            raise ValueError(f"packed format parts {stated} do not match its fields ({fmt.parts()})")
        return fmt


def _check(fmt: PackedFormat) -> None:
    if fmt.kind not in KINDS:
        raise ValueError(f"packed kind must be one of {', '.join(KINDS)}, got {fmt.kind!r}")
    if len(fmt.shape) != 2 or min(fmt.shape) < 1:
        raise ValueError(f"packed shape must be two positive sizes (N, K), got {fmt.shape}")
    if fmt.group < 1 or fmt.shape[1] % fmt.group:
        raise ValueError(f"packed group {fmt.group} must divide K = {fmt.shape[1]}")
    if fmt.kind == "gguf":
        if not fmt.gguf_type or fmt.block_bytes < 1:
            raise ValueError("a gguf packed format needs gguf_type and block_bytes")
    elif fmt.scale_dtype not in SCALE_DTYPES:
        raise ValueError(f"packed scale_dtype must be one of {', '.join(SCALE_DTYPES)}, got {fmt.scale_dtype!r}")
    if fmt.layout not in CODE_LAYOUTS or (fmt.layout != "rows" and fmt.kind != "int4"):
        raise ValueError(
            f"packed layout must be one of {', '.join(CODE_LAYOUTS)} (not rows only for int4), got {fmt.layout!r}"
        )
    if fmt.kind == "int4" and fmt.group % 2:
        raise ValueError(f"int4 groups pack two codes a byte: group must be even, got {fmt.group}")


@dataclass
class PackedTensor:
    """A format and its parts as tensors ({name: tensor}, on any device), in the portable layout."""

    format: PackedFormat
    parts: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        want = self.format.parts()
        if set(self.parts) != set(want):
            raise ValueError(f"packed parts {sorted(self.parts)} != {sorted(want)} for kind {self.format.kind}")
        for name, (shape, dtype) in want.items():
            tensor = self.parts[name]
            if tuple(tensor.shape) != shape or _dtype_name(tensor.dtype) != dtype:
                raise ValueError(
                    f"packed part {name} is {tuple(tensor.shape)} {tensor.dtype}, expected {shape} {dtype}"
                )

    def to_bytes(self):
        """The parts as one uint8 tensor, laid out as format.offsets() says (padding zeroed): what a shard stores."""
        import torch

        offsets, total = self.format.offsets()
        if len(offsets) == 1:  # one part that fills the layout (a GGUF tensor's blocks): itself, no copy
            ((name, at),) = offsets.items()
            raw = self.parts[name].detach().contiguous().cpu().reshape(-1).view(torch.uint8)
            if at == 0 and raw.numel() == total:
                return raw
        out = torch.zeros(total, dtype=torch.uint8)
        for name, at in offsets.items():
            raw = self.parts[name].detach().contiguous().cpu().reshape(-1).view(torch.uint8)
            out[at : at + raw.numel()] = raw
        return out

    @classmethod
    def from_bytes(cls, fmt: PackedFormat, data) -> PackedTensor:
        """Views of a stored byte tensor (on any device) as the parts of `fmt`; no copy."""
        import torch

        offsets, total = fmt.offsets()
        if data.dtype != torch.uint8 or data.numel() != total:
            raise ValueError(
                f"packed bytes are {data.numel()} {data.dtype}, {fmt.kind} {fmt.shape} needs {total} uint8"
            )
        parts = {}
        for name, (shape, dtype) in fmt.parts().items():
            at, size = offsets[name], _part_bytes(shape, dtype)
            parts[name] = data[at : at + size].view(_torch_dtype(dtype)).view(shape)
        return cls(fmt, parts)

    def to(self, device) -> PackedTensor:
        """The same parts on another device (a part already there is not copied)."""
        return PackedTensor(self.format, {name: t.to(device) for name, t in self.parts.items()})


def _dtype_name(dtype) -> str:
    text = str(dtype).removeprefix("torch.")
    return text if text in ("uint8", "int8") else (dtypes.short_name(text) or text)


def _part_bytes(shape, dtype: str) -> int:
    return shape[0] * shape[1] * ({"uint8": 1, "int8": 1, **dtypes.ITEMSIZE}[dtype])


def _torch_dtype(name: str):
    import torch

    return {"uint8": torch.uint8, "int8": torch.int8}.get(name) or dtypes.torch_dtype(name)
