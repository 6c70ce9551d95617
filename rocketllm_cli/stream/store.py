"""Where weights live between uses, and how a streamed unit's bytes reach the compute device.

device  - read once into memory owned by the compute device; bound for good.
host    - CPU: a persistent zero-copy mmap of the unit file, served from the page cache;
          GPU: a pinned RAM copy, copied to a device buffer on each use.
storage - read on each use into one of a few reusable buffers, then dropped from the
          page cache (POSIX_FADV_DONTNEED) so streaming never evicts the resident set.

IO workers read the next units of the learned schedule while the current one computes.
"""

from __future__ import annotations

import mmap
import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from contextvars import ContextVar
from pathlib import Path

import torch

from ..checkpoint.manifest import Manifest
from ..checkpoint.stfile import DTYPES
from ..checkpoint.unitrecords import UnitRecord
from ..output import BLINK_S, no_progress
from ..sizes import round_up
from .buffers import Slot, aligned_buffer
from .ledger import Ledger
from .residency import ResidencyPlan
from .rowgathers import RowGathers
from .windows import assemble, load_side, own_copies, read_unit

# Where AutoModel puts its progress for the resident load: StreamingModel builds the store without carrying it.
LOAD_PROGRESS: ContextVar = ContextVar("rocketllm_load_progress", default=None)


class WeightStore(RowGathers):
    """Every unit's bytes in its tier: device units loaded once, host units kept in RAM (mapped page cache on a CPU),
    storage units read on each use.

    The streaming model asks for a unit's tensors just before its module runs (acquire) and gives them back after
    (release);
    meanwhile IO workers read the next units of the schedule learned from the last pass, `prefetch_depth` ahead."""

    def __init__(
        self,
        directory: Path,
        manifest: Manifest,
        plan: ResidencyPlan,
        ledger: Ledger,
        *,
        device: torch.device,
        compute_dtype: torch.dtype,
        prefetch_depth: int,
        io_workers: int,
        direct_io: bool,
        pin_memory: bool,
    ) -> None:
        self.directory = directory
        self.units = {u.name: u for u in manifest.units}
        self.sizes = {u.name: u.tensor_bytes for u in manifest.units}
        self.plan = plan
        self.ledger = ledger
        self.device = device
        self.dtype = compute_dtype
        self.depth = prefetch_depth
        self.direct_io = direct_io and hasattr(os, "O_DIRECT")
        self.cuda = device.type == "cuda"
        self.pin = pin_memory and self.cuda
        self._resident: dict[str, dict[str, torch.Tensor]] = {}
        self._parts_of_resident: dict = {}  # (unit, key) -> (its resident bytes, their packed parts): rowgathers
        self._host: dict[str, torch.Tensor] = {}  # unit -> its file bytes (mmap on CPU, pinned on CUDA)
        self._host_views: dict[str, dict[str, torch.Tensor]] = {}
        self._host_raw: dict[str, dict[str, torch.Tensor]] = {}  # the same tensors as stored, never converted
        self._maps: list[mmap.mmap] = []
        self._tables: dict[str, torch.Tensor] = {}  # sparse embedding tables for row gathers
        streamed = [u for u in manifest.units if plan.tier[u.name] != "device"]
        # Buffers fit their units (experts stage in their own, expertstream.py): prefetch_depth + 1 for the largest
        # streamed layer, one more for larger units (SmolLM2's 27 MiB tied table): a layer's depth costs layers' bytes.
        # a CPU maps its host tier
        self._per_use = [u for u in streamed if u.kind != "expert" and (plan.tier[u.name] == "storage" or self.cuda)]
        self.slot_bytes = self.large_bytes = 0
        self._size_buffers()
        self._slots: list[Slot] = []
        self._free: list[Slot] = []
        self._free_large: list[Slot] = []
        self._max_slots = max(1, prefetch_depth) + 1
        self._max_large = 1
        self._pending: dict[str, Future] = {}
        # Units with a float tensor stored in another dtype than the compute dtype (converted copies on each read), or
        # with a tensor made from pieces of an indexed window (assembled on each read): no views kept for the next read.
        self._converted = {
            u.name
            for u in manifest.units
            if any(
                t.pieces or (DTYPES[t.dtype].is_floating_point and DTYPES[t.dtype] != compute_dtype) for t in u.tensors
            )
        }
        orders = {k: torch.tensor(v, dtype=torch.long) for k, v in manifest.row_orders.items()}
        self.row_orders = {"cpu": orders, self.device.type: {k: v.to(self.device) for k, v in orders.items()}}
        self._side = load_side(self.directory, manifest, self.dtype, self.device)
        self._held: dict[str, tuple[Slot | None, int, dict[str, torch.Tensor]]] = {}
        # Host-tier units on a CPU are served through their mapping: only units read per use need IO threads.
        reads = [u for u in streamed if plan.tier[u.name] == "storage" or self.cuda]
        self._pool = (
            ThreadPoolExecutor(max(1, io_workers), thread_name_prefix="rocketllm-io")
            if prefetch_depth > 0 and reads
            else None
        )
        self._copy_stream = torch.cuda.Stream(device) if self.cuda else None
        self.schedule: list[str] = [u.name for u in streamed if u.kind != "expert"]  # experts go by routing, not order
        self._order: list[str] = []
        self._pos = -1
        # Read now: the device tier, and the host tier on CUDA (a CPU maps its host tier: nothing to read).
        loads = {
            u.name: u.bytes
            for u in manifest.units
            if plan.tier[u.name] == "device" or (plan.tier[u.name] == "host" and self.cuda)
        }
        with (LOAD_PROGRESS.get() or no_progress)(
            f"loading {manifest.source.get('name') or directory.name}",
            sum(loads.values()),
            units=len(loads),
            after=BLINK_S,
        ) as bar:
            for u in manifest.units:
                if plan.tier[u.name] == "device":
                    self._resident[u.name] = self._load_resident(u)
                elif plan.tier[u.name] == "host":
                    self._host[u.name] = self._load_host(u)
                if u.name in loads:
                    bar.advance(u.bytes, units=1)

    def _size_buffers(self) -> None:
        sizes = [u.bytes for u in self._per_use]
        layers = [u.bytes for u in self._per_use if u.kind == "layer"]
        self.slot_bytes = round_up(max(layers) if layers else max(sizes, default=0))
        self.large_bytes = round_up(max(sizes)) if sizes and round_up(max(sizes)) > self.slot_bytes else 0

    def read_whole_only(self, names: set[str]) -> None:
        """Only units NAMES are ever acquired whole (the others are looked up by rows): the schedule reads ahead only
        those, and the buffers are sized for them. Before the first pass (no buffer made yet)."""
        if self._slots:
            return
        self.schedule = [n for n in self.schedule if n in names]
        self._per_use = [u for u in self._per_use if u.name in names]
        self._size_buffers()

    # -- loading the resident tiers -------------------------------------------------
    def _load_resident(self, unit: UnitRecord) -> dict[str, torch.Tensor]:
        buf = torch.empty(unit.bytes, dtype=torch.uint8)
        self._read(unit, buf, evict=True)
        views = self._views(unit, buf)
        if self.device.type == "cpu":
            views = own_copies(unit, views, buf)
        return {name: t.to(self.device) for name, t in views.items()}

    def _load_host(self, unit: UnitRecord) -> torch.Tensor:
        if unit.indexed and not unit.bytes:  # all in the side file: nothing to map (length 0 maps the whole file)
            buf = torch.empty(0, dtype=torch.uint8)
            self._host_views[unit.name] = self._host_raw[unit.name] = self._views(unit, buf)
            return buf
        if self.cuda:
            buf = torch.empty(unit.bytes, dtype=torch.uint8, pin_memory=self.pin)
            self._read(unit, buf, evict=True)
            return buf
        with open(self.directory / unit.file, "rb") as f:
            # private, never written: zero-copy page cache (an indexed unit: its window of the file)
            mm = mmap.mmap(
                f.fileno(), unit.bytes if unit.indexed else 0, access=mmap.ACCESS_COPY, offset=max(unit.start, 0)
            )
        self._maps.append(mm)
        buf = torch.frombuffer(mm, dtype=torch.uint8)
        self._host_views[unit.name] = self._views(unit, buf)
        pieced = any(t.pieces for t in unit.tensors)  # never a table read by rows: no raw views to keep beside
        # row gathers convert only the rows they need
        self._host_raw[unit.name] = self._host_views[unit.name] if pieced else self._views(unit, buf, convert=False)
        return buf

    def resident(self, name: str) -> dict[str, torch.Tensor]:
        """A device-tier unit's tensors (tensor name -> tensor), loaded once at start and bound for good."""
        return self._resident[name]

    # -- streaming ------------------------------------------------------------------
    def begin_pass(self) -> None:
        """A forward pass starts: record the order units are asked for. Units still held are left from a pass that
        failed (a read error, an exception in a module): their buffers are free again."""
        self._order = []
        for slot, _, _ in self._held.values():
            if slot is not None:
                if self.cuda:
                    slot.free_after = torch.cuda.current_stream(self.device).record_event()
                self._give_back(slot)
        self._held.clear()

    def end_pass(self) -> None:
        """A forward pass ended: the order it asked for units is the schedule the next pass prefetches by."""
        if self._order:
            self.schedule = self._order

    def acquire(self, name: str) -> dict[str, torch.Tensor]:
        """The unit's tensors on the compute device, until release(name)."""
        held = self._held.get(name)
        if held is not None:
            self._held[name] = (held[0], held[1] + 1, held[2])
            return held[2]
        unit = self.units[name]
        tier = self.plan.tier[name]
        self._order.append(name)
        self._pos = self._locate(name)
        self.ledger.serve(tier, self.sizes[name])
        if tier == "host" and not self.cuda:
            slot, views = None, self._host_views[name]
        else:
            waited = time.perf_counter()
            future = self._pending.pop(name, None)
            slot = None
            if future is not None:
                try:
                    slot = future.result()
                except Exception:  # noqa: BLE001 - the read ahead failed (and gave its buffer back): read again now, and let that read's error stand
                    slot = None
            if slot is None:
                slot = self._fill(self._take_slot(name), name)
            self.ledger.add_time("wait", time.perf_counter() - waited)
            if slot.ready is not None:
                torch.cuda.current_stream(self.device).wait_event(slot.ready)
            views = slot.views.get(name)
            if views is None:
                views = self._views(unit, slot.device if self.cuda else slot.host)
                if name not in self._converted:  # the same views of the same buffer serve the unit's next read into it
                    slot.views[name] = views
        self._held[name] = (slot, 1, views)
        self._prefetch_after(name)
        return views

    def release(self, name: str) -> None:
        """The unit's module is done with it: its buffer is free for the next read once the last holder releases it."""
        slot, count, views = self._held[name]
        if count > 1:
            self._held[name] = (slot, count - 1, views)
            return
        del self._held[name]
        if slot is not None:
            if self.cuda:
                slot.free_after = torch.cuda.current_stream(self.device).record_event()
            self._give_back(slot)
        self._prefetch_after(name)

    def _prefetch_after(self, name: str) -> None:
        """Start reads for the next `depth` streamed units of the schedule that are not on their way yet."""
        if self._pool is None or not self.schedule:
            return
        n = len(self.schedule)
        for step in range(1, min(self.depth, n) + 1):
            nxt = self.schedule[(self._pos + step) % n]
            if nxt in self._pending or nxt in self._held or self.plan.tier[nxt] == "device":
                continue
            if self.plan.tier[nxt] == "host" and not self.cuda:
                continue  # served from the page cache through the mapping: nothing to read ahead
            slot = self._take_slot(nxt, block=False)
            if slot is None:
                if self._large(nxt):
                    continue  # the large buffer is busy: the layers after it still read ahead
                return
            self._pending[nxt] = self._pool.submit(self._fill, slot, nxt)

    def _locate(self, name: str) -> int:
        """Position of `name` in the schedule, searching forward from the last unit acquired."""
        n = len(self.schedule)
        for k in range(n):
            i = (self._pos + 1 + k) % n
            if self.schedule[i] == name:
                return i
        return self._pos

    def _large(self, name: str) -> bool:
        """Unit NAME goes in the large buffer (it does not fit a layer's)."""
        return bool(self.large_bytes) and self.units[name].bytes > self.slot_bytes

    def _give_back(self, slot: Slot) -> None:
        (self._free_large if self.large_bytes and slot.host.numel() == self.large_bytes else self._free).append(slot)

    def buffers(self) -> list[tuple[int, int]]:
        """[(bytes, count)] of the streaming buffers this store uses at most: the layers' pool, then the large one."""
        if not self.slot_bytes:
            return []
        out = [(self.slot_bytes, self._max_slots)] if self.slot_bytes else []
        return out + ([(self.large_bytes, self._max_large)] if self.large_bytes else [])

    def describe_buffers(self) -> str:
        """The streaming buffers and read-ahead in words, for --stats and bench."""
        from ..sizes import format_bytes

        sizes = self.buffers()
        if not sizes:
            return "streaming buffers: none (nothing is read per use)"
        pools = [
            f"{count} x {format_bytes(size)}"
            + (" (layers)" if i == 0 and len(sizes) > 1 else " (larger units)" if i else "")
            for i, (size, count) in enumerate(sizes)
        ]
        workers = self._pool._max_workers if self._pool is not None else 0
        return (
            f"streaming buffers: {' + '.join(pools)}; read-ahead {self.depth} units, {workers} IO "
            f"worker{'s' if workers != 1 else ''}"
        )

    def _take_slot(self, name: str, block: bool = True) -> Slot | None:
        large = self._large(name)
        free = self._free_large if large else self._free
        if free:
            return free.pop()
        count = sum(1 for s in self._slots if (s.host.numel() == self.large_bytes) == large)
        if count < (self._max_large if large else self._max_slots):
            size = self.large_bytes if large else self.slot_bytes
            slot = Slot(aligned_buffer(size, self.pin))
            if self.cuda:
                slot.device = torch.empty(size, dtype=torch.uint8, device=self.device)
            self._slots.append(slot)
            return slot
        waiting = [n for n in self._pending if self._large(n) == large]
        if not block or not waiting:
            if block:
                raise RuntimeError("no free streaming buffer (more units held at once than buffers)")
            return None
        # Every buffer of this size is waiting for a prefetched unit nobody asked for yet: take back the furthest one.
        victim = waiting[-1]
        try:
            return self._pending.pop(victim).result()
        except Exception:  # noqa: BLE001 - its read failed and gave the buffer back
            return free.pop()

    def _fill(self, slot: Slot, name: str) -> Slot:
        """Read unit `name` into `slot`; a read that fails gives the slot back before it raises."""
        try:
            return self._fill_slot(slot, name)
        except BaseException:
            self._give_back(slot)
            raise

    def _fill_slot(self, slot: Slot, name: str) -> Slot:
        unit = self.units[name]
        if self.cuda and slot.free_after is not None:
            # The GPU may still be running the last unit from this slot (and its copy from slot.host):
            # the CPU must not overwrite either buffer before that work is done.
            slot.free_after.synchronize()
        if self.plan.tier[name] == "host":  # CUDA: pinned copy already in RAM
            source = self._host[name]
        else:
            self._read(unit, slot.host, evict=True)
            source = slot.host
        if self.cuda:
            with torch.cuda.device(self.device), torch.cuda.stream(self._copy_stream):
                slot.device[: unit.bytes].copy_(source[: unit.bytes], non_blocking=True)
                slot.ready = self._copy_stream.record_event()
        return slot

    def _read(self, unit: UnitRecord, into: torch.Tensor, evict: bool) -> None:
        started = time.perf_counter()
        read_unit(self.directory, unit, into, evict, self.direct_io)
        self.ledger.add_time("read", time.perf_counter() - started)
        self.ledger.count_read(unit.name)

    def _views(self, unit: UnitRecord, buf: torch.Tensor, convert: bool = True) -> dict[str, torch.Tensor]:
        out = {}
        converting = 0.0
        for t in unit.tensors:
            if t.side:
                out[t.name] = self._side[t.name]
                continue
            view = (
                assemble(t, buf, self.row_orders[buf.device.type]) if t.pieces else buf[t.offset : t.offset + t.nbytes]
            )
            view = view.view(DTYPES[t.dtype]).view(t.shape)
            if convert and view.is_floating_point() and view.dtype != self.dtype:
                started = time.perf_counter()
                view = view.to(self.dtype)
                converting += time.perf_counter() - started
            out[t.name] = view
        if converting:
            self.ledger.add_time("convert", converting)  # a cost of computing in another dtype than the shards hold
        return out

    def close(self) -> None:
        """Stop the IO workers (reads in flight are finished or cancelled) and unmap the host tier's files."""
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
        self._pending.clear()
        self._host_views.clear()
        self._host_raw.clear()
        self._host.clear()
        for mm in self._maps:
            try:
                mm.close()
            except BufferError:
                pass  # a tensor still views it; the mapping goes when that tensor does
        self._maps.clear()
