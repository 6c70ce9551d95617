"""What a packed weight is: its kind, logical shape, group and the shape and dtype of each stored part.

A packed weight stands for a float matrix W [N out, K in] (the layout of `nn.Linear.weight`). Every part is
row-major over the N output rows, so rows can be sliced or permuted part by part. Kinds, in the portable
layout a shard stores (the kernels' own layouts are made from it at bind time, see kernels.py):

    int4  codes uint8 [N, K/2]: byte j holds column 2j in its low nibble, 2j+1 in its high nibble (q in 0..15);
          scale, min [N, K/group]:  w = q·scale + min   (GGUF Q4_1/Q4_K's own form; Q4_0 has min = −8·scale)
    int8  codes int8 [N, K]; scale [N, K/group]:  w = q·scale   (group == K: one scale per output channel)
    gguf  blocks uint8 [N, K/block·block_bytes]: a GGUF type's raw blocks, dequantized by the gguf package

The descriptor is a plain dict in the manifest (`to_dict`/`from_dict`); no torch is needed to read it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .. import dtypes

KINDS = ("int4", "int8", "gguf")
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
        parts = {"codes": (codes, CODE_DTYPES[self.kind]), "scale": ((n, self.groups), self.scale_dtype)}
        if self.kind == "int4":
            parts["min"] = ((n, self.groups), self.scale_dtype)
        return parts

    @property
    def nbytes(self) -> int:
        """Stored bytes of all parts."""
        sizes = {"uint8": 1, "int8": 1, **dtypes.ITEMSIZE}
        return sum(shape[0] * shape[1] * sizes[dtype] for shape, dtype in self.parts().values())

    def to_dict(self) -> dict:
        """The manifest form: the fields plus every part's shape and dtype (checked again on reading)."""
        out: dict = {"kind": self.kind, "shape": list(self.shape), "group": self.group}
        if self.kind == "gguf":
            out.update(gguf_type=self.gguf_type, block_bytes=self.block_bytes)
        else:
            out["scale_dtype"] = self.scale_dtype
        out["parts"] = {name: {"shape": list(shape), "dtype": dtype} for name, (shape, dtype) in self.parts().items()}
        return out

    @classmethod
    def from_dict(cls, data: dict) -> PackedFormat:
        """The inverse of to_dict; ValueError for a malformed or inconsistent descriptor."""
        if not isinstance(data, dict):
            raise ValueError(f"packed format must be a mapping, got {type(data).__name__}")
        try:
            fmt = cls(
                kind=data["kind"], shape=tuple(data["shape"]), group=int(data["group"]),
                scale_dtype=data.get("scale_dtype", ""), gguf_type=data.get("gguf_type", ""),
                block_bytes=int(data.get("block_bytes", 0)),
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
                raise ValueError(f"packed part {name} is {tuple(tensor.shape)} {tensor.dtype}, expected {shape} {dtype}")

    def to(self, device) -> PackedTensor:
        """The same parts on another device (a part already there is not copied)."""
        return PackedTensor(self.format, {name: t.to(device) for name, t in self.parts.items()})


def _dtype_name(dtype) -> str:
    text = str(dtype).removeprefix("torch.")
    return text if text in ("uint8", "int8") else (dtypes.short_name(text) or text)
