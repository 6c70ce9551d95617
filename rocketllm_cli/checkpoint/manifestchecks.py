"""A manifest document's types and cross-field consistency, checked before any field is trusted (manifest.py loads
it): a manifest that passes describes units whose names, files, modules, tensors and places agree with one another."""

from __future__ import annotations

import os
import re
from dataclasses import fields

from ..dtypes import SAFETENSORS as SHARD_DTYPES  # manifest dtype -> stored name of its floating tensors
from ..sizes import ALIGN
from . import stfile
from .unitrecords import TensorRecord, UnitRecord

FORMAT_VERSION = 2  # 2: mixture-of-experts models have one unit per expert (kind "expert")
PACKED_VERSION = 3  # 3: some tensors are packed low-bit weights (a `packed` format on their record)
FUSED_VERSION = 4  # 4: some packed tensors are several Linears' weights stored as one (a `fused` list on their record)
INDEXED_VERSION = 5  # 5: the units are windows of the source file, indexed in place (`indexes`, a unit's `start`)
READABLE_VERSIONS = (1, 2, 3, 4, 5)  # a dense float set is the same in 1 and 2; only a set with packed weights is 3
FIXED_UNIT_NAMES = {"embed": "embed", "norm": "norm", "lm_head": "lm_head", "root": "root"}
PREFIXED_KINDS = ("extra", "vision")  # named `<kind>.<module>`; vision: a vision tower or projector, resident

OPTIONAL = {"packed", "packing", "int4_layout", "fused", "fusion", "indexes", "row_orders", "pieces", "side"}
UNIT_OPTIONAL = {"start"}  # a unit field only an indexed set's manifest has
PACKINGS = ("", "packed", "blocks", "int4", "int8")
INT4_LAYOUTS = ("rows", "pairs", "lanes32", "lanes64")  # packed/cpulayout.py LAYOUTS, named here without torch


def fused_name(members: list[str]) -> str:
    """The stored name of MEMBERS' fused weight (shard/fusion.py): `<parent>.<a>+<b>+<c>.weight`."""
    parent = members[0].rsplit(".", 2)[0]
    return f"{parent}.{'+'.join(m.rsplit('.', 2)[1] for m in members)}.weight"


class Corrupt(Exception):
    """What is wrong with a parsed manifest, for the one-line message."""


def _require(ok: bool, what: str) -> None:
    if not ok:
        raise Corrupt(what)


def _count(value) -> bool:
    return type(value) is int and 0 <= value < 2**63  # bool is not a count; the bound keeps products cheap


def _show(value) -> str:
    """A short, safe rendering of a value from an untrusted document (never the repr of a deep structure)."""
    if isinstance(value, str):
        return repr(value[:40])
    return repr(value)[:40] if value is None or type(value) in (bool, int, float) else f"a {type(value).__name__}"


def _fields(cls) -> set[str]:
    return {f.name for f in fields(cls)}


def validate(doc, manifest_fields: set[str]) -> None:
    """Types and cross-field consistency, before any field is trusted: a manifest that passes describes
    units whose names, files, modules and tensors agree with one another."""
    _require(
        isinstance(doc, dict) and manifest_fields - OPTIONAL <= set(doc) <= manifest_fields,
        "fields missing or unknown",
    )
    _require(doc.get("packing", "") in PACKINGS, "bad packing")
    _require(doc.get("int4_layout", "") in ("", *INT4_LAYOUTS), "bad int4_layout")
    _require(type(doc["format_version"]) is int, "bad format_version")
    _require(isinstance(doc.get("fusion", ""), str), "bad fusion")
    indexes, orders = doc.get("indexes") or {}, doc.get("row_orders") or {}
    _require(
        not indexes
        or (
            doc["format_version"] >= INDEXED_VERSION
            and isinstance(indexes, dict)
            and set(indexes) == {"path", "size", "mtime_ns"}
            and isinstance(indexes["path"], str)
            and os.path.isabs(indexes["path"])
            and _count(indexes["size"])
            and type(indexes["mtime_ns"]) is int
        ),
        "bad indexes",
    )
    _require(
        isinstance(orders, dict)
        and all(
            isinstance(v, list) and all(_count(i) for i in v) and sorted(v) == list(range(len(v)))
            for v in orders.values()
        ),
        "bad row_orders",
    )
    source = doc["source"]
    _require(isinstance(source, dict) and isinstance(source.get("fingerprint"), str), "bad source")
    _require(
        all(isinstance(doc[k], str) for k in ("model_type", "architecture", "stack")),
        "bad model_type, architecture or stack",
    )
    _require(isinstance(doc["dtype"], str) and doc["dtype"] in SHARD_DTYPES, "bad dtype")
    _require(type(doc["seconds"]) in (int, float), "bad seconds")
    units = doc["units"]
    _require(isinstance(units, list) and len(units) > 0, "no units")
    tensors: set[str] = set()
    layers = 0
    for i, u in enumerate(units):
        _require(
            isinstance(u, dict) and _fields(UnitRecord) - UNIT_OPTIONAL <= set(u) <= _fields(UnitRecord),
            f"unit {i}: fields missing or unknown",
        )
        start = u.get("start", -1)
        _require(
            type(start) is int and (start == -1 if not indexes else _count(start) and start % ALIGN == 0),
            f"unit {i}: bad start",
        )  # a window starts on a page, as O_DIRECT reads it
        name, kind, module, index = u["name"], u["kind"], u["module"], u["index"]
        _require(isinstance(name, str) and isinstance(module, str), f"unit {i}: bad name or module")
        if kind == "layer":
            _require(
                type(index) is int and index == layers, f"unit {name[:40]!r}: layer index {_show(index)} out of order"
            )
            expected = (f"layer.{index:03d}", f"{doc['stack']}.{index}")
            layers += 1
        elif kind == "expert":
            m = re.fullmatch(r"layer\.(\d{3,})\.expert\.(\d{3,})", name) if isinstance(name, str) else None
            _require(
                doc["format_version"] >= 2
                and m is not None
                and type(index) is int
                and index == layers - 1 == int(m.group(1)),
                f"unit {i}: expert {_show(name)} is not after its layer",
            )
            expected = (name, module)
        else:
            _require(
                isinstance(kind, str) and (kind in FIXED_UNIT_NAMES or kind in PREFIXED_KINDS),
                f"unit {i}: unknown kind {_show(kind)}",
            )
            _require(type(index) is int and index == -1, f"unit {name[:40]!r}: bad index")
            expected = (
                (f"{kind}.{module}", module)
                if kind in PREFIXED_KINDS
                else (FIXED_UNIT_NAMES[kind], "" if kind == "root" else module)
            )
        _require(
            (name, module) == expected,
            f"unit {i}: name {name[:40]!r} or module {module[:40]!r} does not fit kind {kind}",
        )
        _require(
            u["file"] == (indexes["path"] if indexes else f"{i:04d}-{name}.safetensors")
            and "/" not in name
            and "\x00" not in name,
            f"unit {name[:40]!r}: bad file name",
        )
        _require(_count(u["bytes"]), f"unit {name[:40]!r}: bad bytes")
        _require(
            isinstance(u["sha256"], str) and re.fullmatch(r"[0-9a-f]{64}", u["sha256"]) is not None,
            f"unit {name[:40]!r}: bad sha256",
        )
        _require(isinstance(u["tensors"], list), f"unit {name[:40]!r}: bad tensors")
        for t in u["tensors"]:
            _require(
                isinstance(t, dict) and _fields(TensorRecord) - OPTIONAL <= set(t) <= _fields(TensorRecord),
                f"unit {name[:40]!r}: a tensor's fields missing or unknown",
            )
            _validate_tensor(t, module, doc["dtype"], tensors)
            _validate_place(t, u["bytes"], indexes, orders)
            _require(
                t.get("packed") is None or (doc["format_version"] >= PACKED_VERSION and bool(doc.get("packing"))),
                f"tensor {_show(t['name'])}: packed in a set that does not say so",
            )
            _require(
                t.get("fused") is None or doc["format_version"] >= FUSED_VERSION,
                f"tensor {_show(t['name'])}: fused in a set that does not say so",
            )
    _require(layers > 0, "no layer units")
    aliases = doc["aliases"]
    _require(
        isinstance(aliases, dict)
        and all(isinstance(v, str) and v in tensors and k not in tensors for k, v in aliases.items()),
        "bad aliases",
    )


def _validate_place(t: dict, window: int, indexes: dict, orders: dict) -> None:
    """Where an indexed set's tensor is: one piece of its unit's window, pieces of it (each inside the window, rows
    taken in a known order), or the side file."""
    name, pieces, side = t["name"], t.get("pieces"), t.get("side")
    _require(not (pieces or side) or bool(indexes), f"tensor {_show(name)}: placed in a set that indexes nothing")
    _require(side is None or (type(side) is bool and pieces is None), f"tensor {_show(name)}: bad side")
    if side:
        return
    if pieces is None:
        _require(not indexes or t["offset"] + t["nbytes"] <= window, f"tensor {_show(name)}: outside its window")
        return
    _require(
        isinstance(pieces, list)
        and len(pieces) > 0
        and all(
            isinstance(p, list)
            and len(p) == 3
            and _count(p[0])
            and _count(p[1])
            and p[0] + p[1] <= window
            and (p[2] is None or (isinstance(p[2], str) and p[2] in orders and p[1] % len(orders[p[2]]) == 0))
            for p in pieces
        )
        and sum(p[1] for p in pieces) == t["nbytes"],
        f"tensor {_show(name)}: bad pieces",
    )


def _validate_tensor(t: dict, module: str, dtype: str, seen: set[str]) -> None:
    name = t["name"]
    _require(
        isinstance(name, str) and name not in seen and name.startswith(module + "." if module else ""),
        f"tensor {_show(name)}: duplicate or outside its unit's module",
    )
    seen.add(name)
    _require(isinstance(t["source"], str), f"tensor {name[:60]!r}: bad source name")
    stored = stfile.DTYPES.get(t["dtype"]) if isinstance(t["dtype"], str) else None
    _require(
        stored is not None and (not stored.is_floating_point or t["dtype"] == SHARD_DTYPES[dtype]),
        f"tensor {name[:60]!r}: bad dtype",
    )
    shape = t["shape"]
    _require(isinstance(shape, list) and all(_count(d) for d in shape), f"tensor {name[:60]!r}: bad shape")
    numel = 1
    for d in shape:
        numel *= d
    _require(
        _count(t["offset"]) and _count(t["nbytes"]) and t["nbytes"] == numel * stored.itemsize,
        f"tensor {name[:60]!r}: bad offset or size",
    )
    if t.get("packed") is not None:
        from .packedformat import PackedFormat

        try:
            fmt = PackedFormat.from_dict(t["packed"])
        except (ValueError, TypeError) as exc:
            raise Corrupt(f"tensor {name[:60]!r}: bad packed format ({str(exc)[:120]})") from None
        _require(
            t["dtype"] == "U8" and shape == [fmt.offsets()[1]],
            f"tensor {name[:60]!r}: packed bytes do not match its format",
        )
    if t.get("fused") is not None:
        _validate_fused(t, seen)


def _validate_fused(t: dict, seen: set[str]) -> None:
    """A fused record names its members (each a weight beside the others, in no other record) and their rows, which add
    up to its packed weight's."""
    name, fused = t["name"], t["fused"]
    _require(
        t.get("packed") is not None
        and isinstance(fused, list)
        and len(fused) > 1
        and all(
            isinstance(m, list) and len(m) == 2 and isinstance(m[0], str) and _count(m[1]) and m[1] > 0 for m in fused
        ),
        f"tensor {name[:60]!r}: bad fused members",
    )
    members = [m[0] for m in fused]
    _require(
        fused_name(members) == name
        and len({m.rsplit(".", 2)[0] for m in members}) == 1
        and all(m.endswith(".weight") for m in members),
        f"tensor {name[:60]!r}: fused members do not match its name",
    )
    _require(
        sum(m[1] for m in fused) == t["packed"]["shape"][0],
        f"tensor {name[:60]!r}: fused rows do not add up to its weight's",
    )
    _require(not any(m in seen for m in members), f"tensor {name[:60]!r}: a fused member is stored twice")
    seen.update(members)
