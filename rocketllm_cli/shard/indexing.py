"""A GGUF set that indexes the file in place: each unit a window of the GGUF, each tensor a piece of it.

A GGUF's quantized tensors are kept as their own blocks (shard/packing.py, mode "blocks"), so most of a set is the
file's bytes as they are. Copying them costs the disk space of a second model and the time to read and write it.
Instead the manifest records, per unit, the window of the file its tensors lie in, and per tensor where in the window
its bytes are:

- as they are (one piece): the blocks of a weight, a norm stored in the set's dtype and left alone by transformers;
- pieces in another order or side by side: Llama's Q/K rows, which transformers reorders (a row order taken once
  per read), and the members of a fused weight (shard/fusion.py), which need not be neighbours in the file;
- the side file (`side.safetensors`, read once at load): a small tensor transformers changes on its way in (Gemma's
  norms less one) or one stored in another float dtype than the set's.

A set is indexed only where that costs no more than a copy would: every weight maps to one tensor of the file, no
routed experts, the embedding as it is stored (it is read by rows), each window no more than 2% larger than its
tensors, the side file small. Anything else is copied (sharder.py), as is every set `shard --copy` asks for.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..checkpoint import stfile
from ..checkpoint.manifest import SIDE_FILE, fused_name
from ..checkpoint.unitrecords import TensorRecord, UnitRecord
from ..sizes import ALIGN
from .fusion import fused_format

WINDOW_SLACK = 0.02  # a window may hold this share of bytes beyond its tensors' (and an aligned page at each end)
SIDE_LIMIT = 16 << 20  # side file bytes an indexed set may carry (Gemma 3 270M's norms: 236 KB)


@dataclass
class Indexed:
    """What indexing decided: the units, the row orders their pieces use, the side tensors, or why not."""

    units: list[UnitRecord] = field(default_factory=list)
    row_orders: dict[str, list[int]] = field(default_factory=dict)
    side: dict[str, torch.Tensor] = field(default_factory=dict)
    why_not: str = ""


def index(job, fingerprint: str, expected: dict[str, torch.dtype]) -> Indexed:
    """The units of JOB's set as windows of its GGUF, or an Indexed whose `why_not` says why it is copied instead."""
    lazy = getattr(job.source, "_lazy", None)
    if job.source.kind != "gguf" or lazy is None or not hasattr(lazy, "place"):
        return Indexed(why_not="not a GGUF")
    if job.packs.mode != "blocks":
        return Indexed(why_not=f"its weights are stored as {job.packs.mode or 'floats'}, not as the file's blocks")
    if any(u.kind == "expert" for u in job.layout.units):
        return Indexed(why_not="its routed experts are cut out of fused tensors")
    out = Indexed()
    for plan in job.layout.units:
        unit = _index_unit(job, lazy, plan, fingerprint, expected, out)
        if isinstance(unit, str):
            return Indexed(why_not=unit)
        out.units.append(unit)
    side = sum(t.numel() * t.element_size() for t in out.side.values())
    if side > SIDE_LIMIT:
        return Indexed(why_not=f"{side} bytes of its tensors are changed on their way in")
    return out


def _index_unit(job, lazy, plan, fingerprint: str, expected: dict, out: Indexed) -> UnitRecord | str:
    places: dict[str, list] = {}  # weight -> [[absolute offset, bytes, order key or None]]
    records: dict[str, dict] = {}  # weight -> its record's fields but offset and pieces
    for n in plan.params:
        if n in job.mapping.converted or n in job.mapping.sliced:
            return f"{n} is computed from several of the file's tensors"
        src = job.mapping[n]
        if n in job.packs.params:
            if job.packs.params[n] != "source":
                return f"{n} is requantized"
            offset, nbytes, order = lazy.place(src)
            if order is False or (order is not None and _looked_up_by_rows(job.model, n)):
                return f"{n} is changed on its way in"
            fmt = lazy.packed_format(src)
            places[n] = [[offset, nbytes, _order_key(order, out.row_orders)]]
            records[n] = dict(source=job.mapping.source_name(n), dtype="U8", packed=fmt, shape=[nbytes])
            continue
        placed = lazy.place_float(src, expected[n])
        shape = list(job.source.shapes[src][0])
        if placed is None:
            if plan.kind == "embed" or _looked_up_by_rows(job.model, n):  # read by rows from its place in the file
                return f"its embedding {n} is changed on its way in"
            out.side[n] = job.mapping.read(job.source, n).to(expected[n]).reshape(shape).contiguous()
            records[n] = dict(source=job.mapping.source_name(n), dtype=stfile.NAMES[expected[n]], shape=shape)
            continue
        offset, nbytes = placed
        places[n] = [[offset, nbytes, None]]
        records[n] = dict(source=job.mapping.source_name(n), dtype=stfile.NAMES[expected[n]], shape=shape)
    fused = {}
    for members in job.fusion.groups.get(plan.name, ()):
        if not all(m in places and records[m].get("packed") is not None for m in members):
            continue
        fmt = fused_format([records[m]["packed"] for m in members])
        if fmt is None:
            continue
        name = fused_name(members)
        fused[name] = [[m, records[m]["packed"].shape[0]] for m in members]
        places[name] = [p for m in members for p in places.pop(m)]
        nbytes = sum(p[1] for p in places[name])
        records[name] = dict(
            source=" + ".join(records[m]["source"] for m in members), dtype="U8", packed=fmt, shape=[nbytes]
        )
        for m in members:
            del records[m]
    spans = [p for pieces in places.values() for p in pieces]
    if spans:
        lo, hi = min(p[0] for p in spans), max(p[0] + p[1] for p in spans)
        start = lo // ALIGN * ALIGN
        if hi - start > sum(p[1] for p in spans) * (1 + WINDOW_SLACK) + 2 * ALIGN:
            return f"unit {plan.name}'s tensors are spread over {hi - start} bytes of the file"
    else:
        start, hi = 0, 0
    tensors = []
    for name, fields in records.items():
        pieces = places.get(name)
        packed = fields.pop("packed", None)
        if pieces is None:  # the side file: its offset is set once the file is laid out
            tensors.append(TensorRecord(name, offset=0, nbytes=_nbytes(out.side[name]), side=True, **fields))
            continue
        rel = [[p[0] - start, p[1], p[2]] for p in pieces]
        whole = len(rel) == 1 and rel[0][2] is None
        tensors.append(
            TensorRecord(
                name,
                offset=rel[0][0],
                nbytes=sum(p[1] for p in rel),
                packed=packed.to_dict() if packed is not None else None,
                fused=fused.get(name),
                pieces=None if whole else rel,
                **fields,
            )
        )
    digest = hashlib.sha256(f"{fingerprint}:{start}:{hi - start}".encode()).hexdigest()
    return UnitRecord(
        plan.name, plan.kind, plan.module, _path(job), hi - start, digest, tensors, plan.index, start=start
    )


def write_side(directory: Path, indexed: Indexed) -> None:
    """The side file, and each side tensor's offset in it on its record."""
    if not indexed.side:
        return
    header, spans = stfile.layout(indexed.side, {"format": "pt"})
    at = {name: len(header) + offset for name, offset, _ in spans}
    tmp = directory / (SIDE_FILE + ".tmp")
    with open(tmp, "wb") as f:
        f.write(header)
        for name, _, _ in spans:
            f.write(stfile.tensor_bytes(indexed.side[name]))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, directory / SIDE_FILE)
    for u in indexed.units:
        for t in u.tensors:
            if t.side:
                t.offset = at[t.name]


def indexes(job) -> dict:
    """The manifest's `indexes`: the file and what it was when indexed (a later change is found on load)."""
    path = _path(job)
    st = os.stat(path)
    return {"path": path, "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def _path(job) -> str:
    return str(Path(job.source.located.path).resolve())


def _order_key(order, orders: dict[str, list[int]]) -> str | None:
    if order is None:
        return None
    rows = [int(i) for i in order]
    key = hashlib.sha256(str(rows).encode()).hexdigest()[:12]
    orders.setdefault(key, rows)
    return key


def _looked_up_by_rows(model, name: str) -> bool:
    """Whether NAME is an embedding table, which the store reads by rows from its place in the file
    (stream/rowgathers.py): it must be there as it is, not in pieces or the side file."""
    owner = name.rpartition(".")[0]
    try:
        module = model.get_submodule(owner) if owner else model
    except AttributeError:
        return False
    return isinstance(module, torch.nn.Embedding)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()
