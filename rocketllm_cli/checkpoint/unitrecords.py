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


@dataclass
class UnitRecord:
    name: str  # embed, layer.000 ..., layer.000.expert.000 ..., norm, lm_head, extra.<module path>
    kind: str  # embed | layer | expert | norm | lm_head | extra | root | vision
    # module path the unit's forward hook sits on ("" = the whole model); for an expert, its tensors' common prefix
    module: str
    file: str
    bytes: int  # file size
    sha256: str
    tensors: list[TensorRecord]
    index: int = -1  # layer index within the decoder stack (a layer's, or the layer an expert belongs to)

    @property
    def tensor_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)
