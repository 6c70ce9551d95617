"""A shard set's records as its manifest lists them: each unit (its file, kind, module and digest) and each
tensor in it (its name in the module tree and in the source, dtype, shape and place in the file)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class TensorRecord:
    name: str  # the parameter or buffer name in the transformers module tree
    source: str  # its name in the source checkpoint
    dtype: str
    shape: list[int]
    offset: int  # absolute offset in the unit file
    nbytes: int
    packed: dict | None = None  # a packed weight (dtype U8, shape [nbytes]): its PackedFormat.to_dict()
    # Several Linears' packed weights stored as one (shard/fusion.py): [[member weight name, its rows], ...] in row
    # order; the record's name is `<parent>.<a>+<b>.weight`, its source the members' sources joined by " + "
    fused: list | None = None
    # A set that indexes a GGUF in place (its manifest's `indexes`): the tensor's bytes made from pieces of its unit's
    # window, [[offset in the window, bytes, row order or None], ...] (a row order: the key of the manifest's
    # `row_orders` list its rows are taken in); None where they are one piece at `offset` as they are
    pieces: list | None = None
    # True: the tensor's bytes are in the set's own side file at `offset` (a small tensor the source stores otherwise,
    # such as a norm transformers reads with an offset added), not in the unit's window
    side: bool | None = None


@dataclass
class UnitRecord:
    name: str  # embed, layer.000 ..., layer.000.expert.000 ..., norm, lm_head, extra.<module path>
    kind: str  # embed | layer | expert | norm | lm_head | extra | root | vision
    # module path the unit's forward hook sits on ("" = the whole model); for an expert, its tensors' common prefix
    module: str
    file: str
    bytes: int  # file size (an indexed unit: its window's)
    sha256: str
    tensors: list[TensorRecord]
    index: int = -1  # layer index within the decoder stack (a layer's, or the layer an expert belongs to)
    # -1: the unit is its own file in the set. Otherwise the unit is the window [start, start + bytes) of the file it
    # indexes in place (`file`, the manifest's `indexes` path): no weight byte was copied
    start: int = -1

    @property
    def indexed(self) -> bool:
        return self.start >= 0

    @property
    def tensor_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)
