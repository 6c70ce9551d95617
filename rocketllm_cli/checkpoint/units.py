"""A model's weights in bytes, grouped as streaming reads them (each decoder layer's dense part, its routed experts,
everything else), from its tensor names or a shard set's units; and the tables a token only looks rows up in.

ModelFacts (modelfacts.py) is built from these.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from ..errors import ModelError

# a repeated stack: "<prefix>.<index>.<rest>", e.g. model.layers.3.mlp..., transformer.h.3..., blk.3...
_STACK = re.compile(r"^(?P<prefix>(?:.*\.)?(?:layers|h|blocks|block|blk))\.(?P<index>\d+)\.")


@dataclass
class Units:
    """A model's weights in bytes, grouped as streaming reads them."""

    layers: dict[int, int] = field(default_factory=dict)  # decoder layer index -> its dense part
    # layer index -> (its routed experts' bytes, how many)
    experts: dict[int, tuple[int, int]] = field(default_factory=dict)
    others: list[int] = field(default_factory=list)  # embed, norm, lm_head, extras, another stack's layers


def tensor_units(name: str, sizes: dict[str, int], experts_per_layer: int | None) -> Units:
    """Tensors by name into units: each index of the largest repeated stack is a layer (its `.experts.` tensors
    apart when the config gives their count); every other stack's layer and every other module is a unit."""
    stacks: dict[str, dict[int, int]] = {}
    routed: dict[int, int] = {}  # decoder layer index -> its experts' bytes
    others: dict[str, int] = {}
    for tensor, nbytes in sizes.items():
        m = _STACK.match(tensor)
        if m:
            stack = stacks.setdefault(m["prefix"], {})
            stack[int(m["index"])] = stack.get(int(m["index"]), 0) + nbytes
        else:
            module = tensor.rsplit(".", 1)[0]
            others[module] = others.get(module, 0) + nbytes
    if not stacks:
        raise ModelError(f"{name}: no repeated layer stack found in the tensor names")
    decoder = max(stacks, key=lambda p: sum(stacks[p].values()))  # a vision tower is a smaller stack
    if experts_per_layer:
        for tensor, nbytes in sizes.items():
            m = _STACK.match(tensor)
            if m and m["prefix"] == decoder and ".experts." in tensor:
                routed[int(m["index"])] = routed.get(int(m["index"]), 0) + nbytes
    units = Units(others=list(others.values()))
    for prefix, layers in stacks.items():
        if prefix != decoder:
            units.others.extend(layers.values())
    for index in sorted(stacks[decoder]):
        units.layers[index] = stacks[decoder][index] - routed.get(index, 0)
        if routed.get(index):
            units.experts[index] = (routed[index], experts_per_layer)
    return units


def manifest_units(rows) -> Units:
    """(kind, bytes) per unit in manifest order: an expert belongs to the layer before it."""
    units = Units()
    for kind, nbytes in rows:
        if kind == "layer":
            units.layers[len(units.layers)] = nbytes
        elif kind == "expert":
            layer = len(units.layers) - 1
            total, count = units.experts.get(layer, (0, 0))
            units.experts[layer] = (total + nbytes, count + 1)
        else:
            units.others.append(nbytes)
    return units


def is_lookup_table(kind: str, names, aliases: dict[str, str]) -> bool:
    """Whether a manifest's unit of KIND holding tensors NAMES is only ever looked rows up in: an input embedding
    table no output head is tied to (ALIASES: the manifest's, tied tensor -> the one holding the data)."""
    return kind == "embed" and not set(aliases.values()) & set(names)


def lookup_tables(units, aliases: dict[str, str]) -> set[str]:
    """The tensors of UNITS ((kind, [tensor names]) per unit, a manifest's) that a token only looks rows up in
    (is_lookup_table; stream/residency.py row_tables serves them by rows). A projection's products leave them out: a
    token reads one row of each, not the table (a 2.5 B model's 252 MB bf16 table was 11 ms of a 77 ms token that it
    never spends)."""
    return {name for kind, names in units if is_lookup_table(kind, names, aliases) for name in names}


# a checkpoint's own input embedding and output head, by the names transformers' models give them
EMBEDDING_NAMES = ("embed_tokens", "wte", "word_embeddings", "embed_in", "tok_embeddings")
HEAD_NAMES = ("lm_head", "embed_out")


def named_lookup_tables(names) -> set[str]:
    """lookup_tables from tensor names alone (a checkpoint before it is sharded, which has no module tree yet): its
    input embedding tables, where it stores an output head of its own (a tied head is not stored apart)."""
    parts = [name.split(".") for name in names]
    if not any(p[-2:-1] and p[-2] in HEAD_NAMES and p[-1] == "weight" for p in parts):
        return set()
    return {".".join(p) for p in parts if p[-2:-1] and p[-2] in EMBEDDING_NAMES and p[-1] == "weight"}
