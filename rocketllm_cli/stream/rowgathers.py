"""Embedding lookups on a streamed table: only the rows a batch of token ids names are read and converted.

A tied or untied embedding table is the largest unit of a small model; streaming it whole once per token would
move it twice per token when it is also the head. These methods of WeightStore serve just the looked-up rows:
the host tier through the persistent mapping, the storage tier with one pread per row into a sparse anonymous
mapping (pages never touched take no memory), packed int8 tables by reading each row's codes and scale.
"""

from __future__ import annotations

import mmap
import os
import time

import torch

from .. import dtypes
from ..checkpoint.manifest import RESHARD
from ..checkpoint.stfile import DTYPES
from ..checkpoint.unitrecords import UnitRecord
from ..errors import ShardError
from ..profiles.probe.storage import evict_range


FEW_ROWS = 16  # looked-up rows at most that a resident GGUF table dequantizes one native call a row


class RowGathers:
    """The row-gathering half of WeightStore (which supplies units, plan, ledger, dtype, directory, cuda and the
    host mappings)."""

    def can_gather_rows(self, name: str) -> bool:
        """Rows of a streamed unit can be served alone on a CPU, where the lookup reads them in place."""
        unit = self.units[name]
        return (
            not self.cuda
            and self.plan.tier[name] != "device"
            and len(unit.tensors) == 1
            and len(unit.tensors[0].shape) == 2
        )

    def gather_rows(self, name: str, key: str, ids: torch.Tensor) -> torch.Tensor:
        """A full-shaped table in which the rows `ids` name hold their values: the lookup reads nothing else.

        Host tier: the persistent mapping itself. Storage tier: the rows are read one by one into a sparse
        anonymous mapping (pages never touched take no memory), with readahead off so nothing else is read.
        """
        unit = self.units[name]
        record = unit.tensors[0]
        rows = _unique_rows(ids)
        row_bytes = record.nbytes // record.shape[0]
        self.ledger.serve(self.plan.tier[name], len(rows) * row_bytes)
        stored = DTYPES[record.dtype]
        if stored != self.dtype and stored.is_floating_point:
            # Convert only the rows asked for, into a sparse table of the compute dtype: converting the whole
            # table would touch every page of it, and a tied head would then move the table twice per token.
            source = self._host_raw[name][key] if self.plan.tier[name] == "host" else self._read_rows(name, rows)
            started = time.perf_counter()
            table = self._sparse_table(f"{name}:{self.dtype}", record.nbytes // stored.itemsize * self.dtype.itemsize)
            table = table.view(self.dtype).view(record.shape)
            index = torch.tensor(rows, dtype=torch.long)
            table.index_copy_(0, index, source.index_select(0, index).to(self.dtype))
            self.ledger.add_time("convert", time.perf_counter() - started)
            return table
        if self.plan.tier[name] == "host":
            return self._host_views[name][key]
        return self._read_rows(name, rows)

    def gather_packed_rows(self, name: str, key: str, fmt, ids: torch.Tensor) -> torch.Tensor:
        """gather_rows for a table stored packed (int8 with one scale per row, or a GGUF type's own blocks): only the
        rows looked up are read and dequantized, into a sparse full-shaped table of the compute dtype."""
        from ..checkpoint.packedformat import PackedTensor

        rows = _unique_rows(ids)
        n, k = fmt.shape
        if rows and not (0 <= rows[0] and rows[-1] < n):
            raise IndexError(
                f"token id {rows[-1] if rows[-1] >= n else rows[0]} outside the embedding table of {n} rows"
            )
        tier = self.plan.tier[name]
        if tier == "device" and len(rows) <= FEW_ROWS and fmt.kind == "gguf" and self.dtype == torch.float32:
            table = self._native_rows(name, key, fmt, rows)
            if table is not None:
                return table
        unit = self.units[name]
        record = next(t for t in unit.tensors if t.name == key)
        offsets, _ = fmt.offsets()
        # bytes of one row in each part: int8 codes and their scale, or one row of blocks
        widths = (
            {"blocks": fmt.groups * fmt.block_bytes}
            if fmt.kind == "gguf"
            else {"codes": k, "scale": fmt.parts()["scale"][0][1] * dtypes.ITEMSIZE[fmt.scale_dtype]}
        )
        if tier != "device":  # a resident unit is counted once per pass already
            self.ledger.serve(tier, len(rows) * sum(widths.values()))
        index = where = torch.tensor(rows, dtype=torch.long)  # WHERE: the rows' places in the table
        if tier == "device":
            parts = self._resident_parts(name, key, fmt)
        elif tier == "host" and not self.cuda:
            parts = PackedTensor.from_bytes(fmt, self._host_raw[name][key]).parts
        else:
            parts = self._read_packed_rows(unit, record, fmt, rows, offsets, widths)
            index = torch.arange(len(rows))
        started = time.perf_counter()
        picked = {part: parts[part].index_select(0, index.to(parts[part].device)) for part in widths}
        if fmt.kind == "gguf":
            values = _gguf_rows(picked["blocks"], fmt).to(self.dtype)
        else:
            values = (picked["codes"].float() * picked["scale"].float()).to(self.dtype)
        table = self._rows_table(name, key, n, k)
        if table.device != values.device:
            values = values.to(table.device)
        table.index_copy_(0, where, values)
        self.ledger.add_time("convert", time.perf_counter() - started)
        return table.to(self.device) if self.cuda else table

    def _native_rows(self, name: str, key: str, fmt, rows: list[int]) -> torch.Tensor | None:
        """A resident GGUF table's few looked-up ROWS dequantized by the native kernels straight into its sparse fp32
        table, a call a row (a decode step's lookup: no index tensors, no copies); None where this process has no
        kernels loaded for the type (a lookup never waits on their build)."""
        if self.cuda:
            return None
        from ..native import loaded

        nk = loaded()
        if nk is None or not nk.supported(fmt.gguf_type):
            return None
        started = time.perf_counter()
        blocks = self._resident_parts(name, key, fmt)["blocks"]
        n, k = fmt.shape
        table = self._rows_table(name, key, n, k)
        for row in rows:
            nk.dequantize(blocks[row : row + 1], fmt.gguf_type, k, out=table[row : row + 1], threads=1)
        self.ledger.add_time("convert", time.perf_counter() - started)
        return table

    def _resident_parts(self, name: str, key: str, fmt) -> dict[str, torch.Tensor]:
        """The parts of a resident packed table, parsed once per load of its bytes (a decode looks a row up a
        token)."""
        from ..checkpoint.packedformat import PackedTensor

        raw = self._resident[name][key]
        held = self._parts_of_resident.get((name, key))
        if held is None or held[0] is not raw:
            held = self._parts_of_resident[(name, key)] = (raw, PackedTensor.from_bytes(fmt, raw).parts)
        return held[1]

    def _read_packed_rows(self, unit: UnitRecord, record, fmt, rows: list[int], offsets: dict, widths: dict) -> dict:
        """{part: [len(rows), its row bytes] in the part's dtype} read with one pread per row and part."""
        out = {part: torch.empty((len(rows), width), dtype=torch.uint8) for part, width in widths.items()}
        started = time.perf_counter()
        fd = os.open(self.directory / unit.file, os.O_RDONLY)
        base = max(unit.start, 0) + record.offset  # an indexed unit is a window of its file
        try:
            os.posix_fadvise(fd, base, record.nbytes, os.POSIX_FADV_RANDOM)
            for i, row in enumerate(rows):
                for part, width in widths.items():
                    if (
                        pread(fd, memoryview(out[part][i].numpy()), base + offsets[part] + row * width, unit.file)
                        != width
                    ):
                        raise ShardError(f"shard file {unit.file} ended early (truncated); {RESHARD}")
            evict_range(fd, base if unit.indexed else 0, record.nbytes if unit.indexed else 0)
        finally:
            os.close(fd)
        self.ledger.add_time("read", time.perf_counter() - started)
        if fmt.kind == "gguf":
            return out
        return {"codes": out["codes"].view(torch.int8), "scale": out["scale"].view(dtypes.torch_dtype(fmt.scale_dtype))}

    def _read_rows(self, name: str, rows: list[int]) -> torch.Tensor:
        """The table of a storage-tier unit with only `rows` read, one pread each, into a sparse anonymous mapping."""
        unit = self.units[name]
        record = unit.tensors[0]
        row_bytes = record.nbytes // record.shape[0]
        started = time.perf_counter()
        table = self._sparse_table(name, record.nbytes)
        view = memoryview(table.numpy())
        fd = os.open(self.directory / unit.file, os.O_RDONLY)
        base = max(unit.start, 0) + record.offset  # an indexed unit is a window of its file
        try:
            os.posix_fadvise(fd, base, record.nbytes, os.POSIX_FADV_RANDOM)
            for row in rows:
                if not 0 <= row < record.shape[0]:
                    raise IndexError(f"token id {row} outside the embedding table of {record.shape[0]} rows")
                start = row * row_bytes
                if pread(fd, view[start : start + row_bytes], base + start, unit.file) != row_bytes:
                    raise ShardError(f"shard file {unit.file} ended early (truncated); {RESHARD}")
            evict_range(fd, base if unit.indexed else 0, record.nbytes if unit.indexed else 0)
        finally:
            os.close(fd)
        self.ledger.add_time("read", time.perf_counter() - started)
        return table.view(DTYPES[record.dtype]).view(record.shape)

    def _rows_table(self, name: str, key: str, n: int, k: int) -> torch.Tensor:
        """The sparse [N, K] table of the compute dtype that a packed table's looked-up rows are written into, viewed
        once (a decode step looks a row up a token)."""
        view = f"{name}:{key}:{self.dtype} rows"
        table = self._tables.get(view)
        if table is None:
            raw = self._sparse_table(f"{name}:{key}:{self.dtype}", n * k * self.dtype.itemsize)
            table = self._tables[view] = raw.view(self.dtype).view(n, k)
        return table

    def _sparse_table(self, name: str, nbytes: int) -> torch.Tensor:
        table = self._tables.get(name)
        if table is None:
            table = self._tables[name] = torch.frombuffer(mmap.mmap(-1, nbytes), dtype=torch.uint8)
        return table


def pread(fd: int, view: memoryview, offset: int, file: str) -> int:
    """os.preadv into one buffer; a failing read (EIO from a dying disk, a file gone under a network mount) is a
    ShardError naming the file."""
    try:
        return os.preadv(fd, [view], offset)
    except OSError as exc:
        raise ShardError(f"cannot read shard file {file} ({exc.strerror or exc}); {RESHARD}") from None


def _unique_rows(ids: torch.Tensor) -> list[int]:
    """The sorted distinct ids: a decode step's few in Python (torch.unique is several ops), a prompt's in torch."""
    if ids.numel() <= 64:
        return sorted(set(ids.reshape(-1).tolist()))
    return torch.unique(ids.reshape(-1)).tolist()


def _gguf_rows(blocks: torch.Tensor, fmt) -> torch.Tensor:
    """Rows of a GGUF type's blocks as fp32: one call to the native kernels' dequantize where they cover the type
    (bit for bit the torch decoder's, tested per type and variant), else the torch decoder. SmolLM2's tied Q8_0 table
    took 98 us a looked-up token through the decoder's ~15 ops, ~320 inside a decode, where caches are cold."""
    if blocks.is_cpu:
        from ..native import loaded

        nk = loaded()  # a model whose products run on them has them; a lookup never waits on their build
        if nk is not None and nk.supported(fmt.gguf_type):
            return nk.dequantize(blocks.contiguous(), fmt.gguf_type, fmt.shape[1], threads=1)
    from ..checkpoint.ggmlblocks import dequantize_blocks

    return dequantize_blocks(blocks, fmt.gguf_type)
