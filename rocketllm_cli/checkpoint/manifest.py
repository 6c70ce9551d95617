"""manifest.json: what a shard directory holds, checked before anything loads.

Every load validates the manifest's types and internal consistency, then checks each unit file
against it: size, and the file's own safetensors header (a few KB per unit) against the recorded
tensors. Contents are hashed only by `shard --verify`.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from ..dtypes import (
    SAFETENSORS as SHARD_DTYPES,  # manifest dtype -> stored name of its floating tensors
)
from ..errors import ShardError
from . import stfile
from .unitrecords import TensorRecord, UnitRecord

FORMAT_VERSION = 2  # 2: mixture-of-experts models have one unit per expert (kind "expert")
PACKED_VERSION = 3  # 3: some tensors are packed low-bit weights (a `packed` format on their record)
FUSED_VERSION = 4  # 4: some packed tensors are several Linears' weights stored as one (a `fused` list on their record)
INDEXED_VERSION = 5  # 5: the units are windows of the source file, indexed in place (`indexes`, a unit's `start`)
READABLE_VERSIONS = (1, 2, 3, 4, 5)  # a dense float set is the same in 1 and 2; only a set with packed weights is 3
MANIFEST = "manifest.json"
RESHARD = "re-run `rocketllm shard` on the source model"
UNIT_FILE = re.compile(r"^\d{4}-.+\.safetensors$")
SIDE_FILE = "side.safetensors"  # an indexed set's few tensors the source stores otherwise (TensorRecord.side)
FIXED_UNIT_NAMES = {"embed": "embed", "norm": "norm", "lm_head": "lm_head", "root": "root"}
PREFIXED_KINDS = ("extra", "vision")  # named `<kind>.<module>`; vision: a vision tower or projector, resident


@dataclass
class Manifest:
    """What a shard directory holds: the model's identity and dtype, and every unit with its file and tensors.

    The one description the streaming side trusts, so load() checks it and every unit file before returning it."""

    source: dict  # kind, name, fingerprint
    model_type: str
    architecture: str
    dtype: str
    stack: str  # module path of the repeated decoder stack
    units: list[UnitRecord]
    aliases: dict[str, str] = field(default_factory=dict)  # tied parameter -> the parameter it shares storage with
    format_version: int = FORMAT_VERSION
    seconds: float = 0.0
    packing: str = ""  # "" (all float), "packed" (a source's low-bit encoding kept), "blocks" (a GGUF's block types
    # kept as they are stored), "int4" or "int8" (quantized)
    int4_layout: str = ""  # the order int4 codes are written in (packed/cpulayout.py), where the packing writes int4
    fusion: str = ""  # which packed Linears are stored fused, in words (shard/fusion.py); "" in sets from before fusion
    # A set indexing its source in place: {"path": the file, "size": its bytes, "mtime_ns": its modification time}, as
    # they were when it was indexed (checked on every load); {} for a set of its own files
    indexes: dict = field(default_factory=dict)
    row_orders: dict = field(default_factory=dict)  # key -> the rows, in order, an indexed tensor piece is taken in

    @property
    def total_bytes(self) -> int:
        """Bytes of every unit's tensors: the model's weights, as the budgets count them."""
        return sum(u.tensor_bytes for u in self.units)

    @property
    def layers(self) -> list[UnitRecord]:
        """The decoder stack's units, in layer order (their experts not included)."""
        return [u for u in self.units if u.kind == "layer"]

    @property
    def experts(self) -> list[UnitRecord]:
        """A mixture-of-experts model's routed experts, one unit each, after their layer; empty for a dense model."""
        return [u for u in self.units if u.kind == "expert"]

    @property
    def vision(self) -> list[UnitRecord]:
        """A vision-language model's vision tower and projector units (resident, run once per request); empty
        otherwise."""
        return [u for u in self.units if u.kind == "vision"]

    def unit(self, name: str) -> UnitRecord:
        """The unit called NAME; KeyError if there is none."""
        for u in self.units:
            if u.name == name:
                return u
        raise KeyError(name)

    @property
    def key(self) -> str:
        """The set's dtype and packing, as its default directory and journal name them ("bf16",
        "bf16-packed-lanes64")."""
        return set_key(self.dtype, self.packing, self.int4_layout)

    def to_dict(self) -> dict:
        """The manifest as the JSON document save() writes (a float set's has no packing fields)."""
        doc = asdict(self)
        if not doc["packing"]:
            del doc["packing"]
        if not doc["int4_layout"]:
            del doc["int4_layout"]
        for name in ("fusion", "indexes", "row_orders"):
            if not doc[name]:
                del doc[name]
        for unit in doc["units"]:
            if unit["start"] < 0:
                del unit["start"]
            for t in unit["tensors"]:
                for name in ("packed", "fused", "pieces", "side"):
                    if t[name] is None:
                        del t[name]
        return doc

    @property
    def indexed(self) -> bool:
        """The set's units are windows of its source file (`indexes`), not files of their own."""
        return bool(self.indexes)

    def save(self, directory: Path) -> None:
        """Write manifest.json into DIRECTORY atomically (temporary file, fsync, rename): a reader sees all of it or
        none."""
        tmp = directory / (MANIFEST + ".tmp")
        with open(tmp, "w") as f:
            json.dump(self.to_dict(), f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, directory / MANIFEST)

    @classmethod
    def load(cls, directory: Path) -> "Manifest":
        """The manifest of the shard set in DIRECTORY, validated and checked against its unit files (check_files).

        Anything missing, corrupt, of another format or not matching is one ShardError that says to re-run `rocketllm
        shard`."""
        path = Path(directory) / MANIFEST
        if not path.is_file():
            raise ShardError(f"{directory}: no {MANIFEST} (not a complete shard directory); {RESHARD}")
        if path.stat().st_size > 256 * 1024 * 1024:
            raise ShardError(f"{path}: manifest is implausibly large; {RESHARD}")
        try:
            doc = json.loads(path.read_text(encoding="utf-8"))
        except (ValueError, RecursionError):  # not UTF-8, not JSON, nested too deeply, a number too long
            raise ShardError(f"{path}: manifest is corrupt (not readable JSON); {RESHARD}") from None
        if (
            isinstance(doc, dict)
            and doc.get("format_version") not in READABLE_VERSIONS
            and isinstance(doc.get("format_version"), int)
        ):
            raise ShardError(
                f"{path}: manifest format {doc.get('format_version')!r}, this rocketllm reads "
                f"{' and '.join(map(str, READABLE_VERSIONS))}; {RESHARD}"
            )
        try:
            _validate(doc)
        except _Corrupt as exc:
            raise ShardError(f"{path}: manifest is corrupt ({exc}); {RESHARD}") from None
        units = [UnitRecord(**{**u, "tensors": [TensorRecord(**t) for t in u["tensors"]]}) for u in doc.pop("units")]
        manifest = cls(**doc, units=units)
        manifest.check_files(Path(directory))
        return manifest

    def check_files(self, directory: Path) -> None:
        """Cheap checks on load: every unit file present with its recorded size and a header that agrees with
        the manifest (names, dtypes, shapes, offsets), and no unit file the manifest does not list."""
        listed = {u.file for u in self.units}
        if self.indexed:
            self._check_indexed(directory)
        for u in self.units:
            if u.indexed:
                continue
            path = directory / u.file
            try:
                size = path.stat().st_size
            except OSError:
                raise ShardError(f"shard file {u.file} is missing; {RESHARD}") from None
            if size != u.bytes:
                raise ShardError(
                    f"shard file {u.file} is {size} bytes, manifest says {u.bytes} (truncated or changed); {RESHARD}"
                )
            try:
                header = stfile.read_header(path)
            except ShardError as exc:
                raise ShardError(f"shard file {exc}; {RESHARD}") from None
            stored = {n: (stfile.NAMES[e.dtype], list(e.shape), e.start, e.nbytes) for n, e in header.entries.items()}
            recorded = {t.name: (t.dtype, list(t.shape), t.offset, t.nbytes) for t in u.tensors}
            if stored != recorded or header.metadata.get("unit", u.name) != u.name:
                differs = next(
                    (n for n in sorted(set(stored) | set(recorded)) if stored.get(n) != recorded.get(n)), None
                )
                what = f"tensor {differs}" if differs else f"it holds unit {header.metadata.get('unit')!r}"
                raise ShardError(f"shard file {u.file} does not match the manifest ({what[:120]}); {RESHARD}")
        try:
            extra = sorted(p.name for p in directory.iterdir() if UNIT_FILE.match(p.name) and p.name not in listed)
        except OSError:
            extra = []
        if extra:
            raise ShardError(f"shard file {extra[0]} is not in the manifest (a unit removed from it?); {RESHARD}")

    def _check_indexed(self, directory: Path) -> None:
        """The file an indexed set reads is there as it was indexed (its size and modification time), every window
        lies inside it, and the side file holds what the records say."""
        path = Path(self.indexes["path"])
        try:
            st = path.stat()
        except OSError:
            raise ShardError(f"the set indexes {path.name} in place, and {path} is gone; {RESHARD}") from None
        if st.st_size != self.indexes["size"] or st.st_mtime_ns != self.indexes["mtime_ns"]:
            raise ShardError(f"the set indexes {path} in place, and it has changed since; {RESHARD}")
        for u in self.units:
            if u.indexed and u.start + u.bytes > st.st_size:
                raise ShardError(f"unit {u.name} lies past the end of {path.name}; {RESHARD}")
        side = {t.name: (t.dtype, list(t.shape), t.offset, t.nbytes) for u in self.units for t in u.tensors if t.side}
        if not side:
            return
        try:
            header = stfile.read_header(directory / SIDE_FILE)
        except (OSError, ShardError) as exc:
            raise ShardError(f"{SIDE_FILE}: {str(exc)[:200]}; {RESHARD}") from None
        stored = {n: (stfile.NAMES[e.dtype], list(e.shape), e.start, e.nbytes) for n, e in header.entries.items()}
        if stored != side:
            raise ShardError(f"{SIDE_FILE} does not match the manifest; {RESHARD}")


OPTIONAL = {"packed", "packing", "int4_layout", "fused", "fusion", "indexes", "row_orders", "pieces", "side"}
UNIT_OPTIONAL = {"start"}  # a unit field only an indexed set's manifest has
PACKINGS = ("", "packed", "blocks", "int4", "int8")
INT4_LAYOUTS = ("rows", "pairs", "lanes32", "lanes64")  # packed/cpulayout.py LAYOUTS, named here without torch


def set_key(dtype: str, packing: str = "", int4_layout: str = "") -> str:
    """What names a set beside its source: its dtype, its packing, and the order its int4 codes are in, since a CPU
    whose kernel reads another order reorders them on every streamed use ("bf16", "bf16-int8",
    "bf16-packed-lanes64")."""
    key = f"{dtype}-{packing}" if packing else dtype
    return f"{key}-{int4_layout}" if packing and int4_layout and int4_layout != "rows" else key


def fused_name(members: list[str]) -> str:
    """The stored name of MEMBERS' fused weight (shard/fusion.py): `<parent>.<a>+<b>+<c>.weight`."""
    parent = members[0].rsplit(".", 2)[0]
    return f"{parent}.{'+'.join(m.rsplit('.', 2)[1] for m in members)}.weight"


class _Corrupt(Exception):
    """What is wrong with a parsed manifest, for the one-line message."""


def _require(ok: bool, what: str) -> None:
    if not ok:
        raise _Corrupt(what)


def _count(value) -> bool:
    return type(value) is int and 0 <= value < 2**63  # bool is not a count; the bound keeps products cheap


def _show(value) -> str:
    """A short, safe rendering of a value from an untrusted document (never the repr of a deep structure)."""
    if isinstance(value, str):
        return repr(value[:40])
    return repr(value)[:40] if value is None or type(value) in (bool, int, float) else f"a {type(value).__name__}"


def _fields(cls) -> set[str]:
    return {f.name for f in fields(cls)}


def _validate(doc) -> None:
    """Types and cross-field consistency, before any field is trusted: a manifest that passes describes
    units whose names, files, modules and tensors agree with one another."""
    _require(
        isinstance(doc, dict) and _fields(Manifest) - OPTIONAL <= set(doc) <= _fields(Manifest),
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
        _require(type(start) is int and (start == -1 if not indexes else _count(start)), f"unit {i}: bad start")
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
            raise _Corrupt(f"tensor {name[:60]!r}: bad packed format ({str(exc)[:120]})") from None
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
