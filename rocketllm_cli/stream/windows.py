"""A unit's bytes as the store reads them: its own file in the set, or its window of the file an indexed set indexes
in place (shard/indexing.py); an indexed tensor made from pieces of its window; the side file's few tensors."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from ..checkpoint.manifest import RESHARD, SIDE_FILE, Manifest
from ..checkpoint.stfile import DTYPES
from ..checkpoint.unitrecords import UnitRecord
from ..errors import ShardError
from ..profiles.probe.storage import evict_range, window_advice
from ..sizes import ALIGN, round_up
from .rowgathers import pread


def read_unit(directory: Path, unit: UnitRecord, into: torch.Tensor, evict: bool, direct_io: bool) -> None:
    """UNIT's bytes into INTO: with O_DIRECT where asked and the buffer allows, else buffered and then dropped from the
    page cache where EVICT (only the unit's window: the rest of an indexed file may be other units' host tier)."""
    if unit.indexed and not unit.bytes:
        return  # every tensor of it is in the side file: a window of nothing (and a length 0 would mean the file)
    path = directory / unit.file
    direct = direct_io and into.data_ptr() % ALIGN == 0 and into.numel() >= round_up(unit.bytes)
    try:
        fd = os.open(path, os.O_RDONLY | (os.O_DIRECT if direct else 0))
    except OSError as exc:
        raise ShardError(f"cannot open shard file {unit.file} ({exc.strerror}); {RESHARD}") from None
    base = max(unit.start, 0)  # an indexed unit is a window of its file, starting at an aligned offset
    try:
        if unit.indexed and not direct:
            window_advice(fd, base, unit.bytes)
        view = memoryview(into.numpy())
        want = round_up(unit.bytes) if direct else unit.bytes
        done = 0
        while done < unit.bytes:
            n = pread(fd, view[done:want], base + done, unit.file)
            if n <= 0:
                raise ShardError(f"shard file {unit.file} ended early (truncated); {RESHARD}")
            done += n
        if evict and not direct:
            evict_range(fd, base, unit.bytes if unit.indexed else 0)
    finally:
        os.close(fd)


def assemble(record, buf: torch.Tensor, row_orders: dict[str, torch.Tensor]) -> torch.Tensor:
    """An indexed tensor's bytes made from its pieces of the window BUF: each piece's rows, in its row order where it
    has one (Llama's Q/K rows as transformers orders them; ROW_ORDERS on BUF's device), one after another (the members
    of a fused weight)."""
    parts = []
    for offset, nbytes, order in record.pieces:
        piece = buf[offset : offset + nbytes]
        if order is not None:
            rows = row_orders[order]
            piece = piece.view(len(rows), -1).index_select(0, rows).view(-1)
        parts.append(piece)
    return parts[0].clone() if len(parts) == 1 and record.pieces[0][2] is None else torch.cat(parts)


def own_copies(unit: UnitRecord, views: dict[str, torch.Tensor], buf: torch.Tensor) -> dict[str, torch.Tensor]:
    """A resident unit's tensors, kept for good: where its window holds bytes no tensor keeps as they are (pieces
    assembled into copies, a neighbour's bytes), the rest are copied too, so the window's buffer BUF goes."""
    if not unit.indexed or not (any(t.pieces for t in unit.tensors) or unit.bytes > unit.tensor_bytes + 2 * ALIGN):
        return views
    base = buf.untyped_storage().data_ptr()
    return {n: t.clone() if t.untyped_storage().data_ptr() == base else t for n, t in views.items()}


def load_side(directory: Path, manifest: Manifest, dtype: torch.dtype, device: torch.device) -> dict[str, torch.Tensor]:
    """An indexed set's side tensors (a few small ones its source stores otherwise), read once, in DTYPE on DEVICE."""
    records = [t for u in manifest.units for t in u.tensors if t.side]
    if not records:
        return {}
    end = max(t.offset + t.nbytes for t in records)
    buf = torch.empty(end, dtype=torch.uint8)
    fd = os.open(directory / SIDE_FILE, os.O_RDONLY)
    try:
        view, done = memoryview(buf.numpy()), 0
        while done < end:
            n = pread(fd, view[done:end], done, SIDE_FILE)
            if n <= 0:
                raise ShardError(f"{SIDE_FILE} ended early (truncated); {RESHARD}")
            done += n
    finally:
        os.close(fd)
    out = {}
    for t in records:
        view = buf[t.offset : t.offset + t.nbytes].view(DTYPES[t.dtype]).view(t.shape).clone()
        if view.is_floating_point() and view.dtype != dtype:
            view = view.to(dtype)
        out[t.name] = view.to(device)
    return out
