"""Split a checkpoint into one safetensors file per unit (embed, layer.NNN, norm, lm_head, extras).

Streams: one unit's tensors in memory at a time. Writes into a hidden partial
directory with a journal of finished units, and renames it into place only
after every tensor is accounted for, so an interrupted run never leaves a set
that loads, and a rerun resumes from the journal. A damaged set of the same
source is written again and swapped in; a full disk stops with one line.

The steps live beside it: names.py (which source tensor fills each parameter), journal.py (resume),
target.py (where the set goes, the lock, reuse or replace, the swap), checks.py (disk space, --verify).
"""

from __future__ import annotations

import hashlib
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ..cachehome import unwritable
from ..checkpoint import stfile
from ..checkpoint.manifest import FORMAT_VERSION, FUSED_VERSION, PACKED_VERSION, Manifest
from ..checkpoint.unitrecords import TensorRecord, UnitRecord
from ..dtypes import NAMES as DTYPES
from ..dtypes import short_name, torch_dtype
from ..errors import Interrupted, ParameterError, ShardError
from ..output import BLINK_S, no_progress
from ..sizes import format_bytes
from . import journal
from .checks import DISK_FULL, check_space, free_bytes
from .discover import Layout, build_meta_model, discover
from .fusion import FusionPlan, plan_fusion
from .identity import hashing
from .completion import finish, manifest_of, summarize, write_indexed
from .indexing import index
from .names import SourceMap, map_names, split_experts
from .packing import (
    PackPlan,
    check_packing,
    packed_nbytes,
    plan_packing,
    predicted_key,
    predicted_mode,
    read_packed,
)
from .source import Source, locate, open_source
from .target import default_out, exclusive, find_existing, partial_of, reusable

# Ctrl-C before any unit reached the disk (reading, planning, or the first unit): the same words wherever it lands.
NOTHING_KEPT = "interrupted before the first unit was written: nothing to resume"


def shard(
    model: str | os.PathLike,
    out: Path | None = None,
    dtype: str = "auto",
    progress=None,
    log=print,
    rebuild: bool = False,
    packing: str = "auto",
    fuse: bool = True,
    copy: bool = False,
) -> tuple[Manifest, Path, dict]:
    """Shard MODEL (or reuse a complete shard set). Returns (manifest, directory, summary).

    rebuild: write the set again even if one of this source exists (after `--verify` found changed bytes).
    packing: auto (keep a GGUF's low-bit blocks where a kernel computes on them), none, int4 or int8 (packing.py).
    fuse: store packed Linears of a layer that read the same input (q/k/v, gate/up) as one weight (fusion.py).
    copy: write the set's own files even where it could index a GGUF in place (indexing.py).
    """
    check_packing(packing)
    started = time.perf_counter()
    phase = progress or no_progress
    with phase(f"fetching {model}", after=BLINK_S):  # slow only for a hub id, whose download it is
        located = locate(model)
    source = None
    if out is None and not rebuild:
        if located.kind == "gguf" and hashing(located.path):
            # A first contact with this file: its content hash (what finds an existing set) runs on its thread while
            # its header is read here; a set found after all makes this reading wasted, not wrong.
            source = _open(located, phase)
        try:
            found = find_existing(located, dtype, packing, log)
        except BaseException:
            if source is not None:
                source.close()
            raise
        if found is not None and not (copy and found[0].indexed):  # --copy over an indexed set: _shard rewrites it
            if source is not None:
                source.close()
            return found[0], found[1], {"reused": True, **summarize(found[0], 0.0)}
    if source is None:
        source = _open(located, phase)
    try:
        return _shard(source, out, dtype, progress, log, started, rebuild, packing, fuse, copy)
    except Interrupted:  # the writing said what it kept
        raise
    except KeyboardInterrupt:  # while planning, before a unit is written
        raise Interrupted(NOTHING_KEPT) from None
    finally:
        source.close()


def _open(located, phase) -> Source:
    # Reading a GGUF's metadata can take seconds: off a terminal its line comes once it lasts ANNOUNCE_AFTER_S,
    # so a bad input refused at once stays one error line. transformers is imported first: its import (seconds on
    # a busy machine) is not the reading, and would announce a phase that a bad config then ends at once.
    import transformers.models.auto.configuration_auto  # noqa: F401

    with phase(f"reading {located.name}", after=BLINK_S):
        try:
            return open_source(located)
        except KeyboardInterrupt:
            raise Interrupted(NOTHING_KEPT) from None


def _shard(
    source: Source,
    out: Path | None,
    dtype: str,
    progress,
    log,
    started: float,
    rebuild: bool = False,
    packing: str = "auto",
    fuse: bool = True,
    copy: bool = False,
) -> tuple[Manifest, Path, dict]:
    dtype = resolve_dtype(source, dtype, predicted_mode(source, packing) == "blocks")
    lazy = getattr(source, "_lazy", None)
    if lazy is not None and hasattr(lazy, "float_dtype"):
        lazy.float_dtype = torch_dtype(dtype)  # a quantized tensor read as floats lands in the set's dtype, not bf16
    key = predicted_key(source, packing, dtype)  # names the set: its dtype, how it is packed, its int4 order
    final = Path(out) if out else default_out(source.located, key)
    fingerprint = source.fingerprint()
    existing = reusable(final, fingerprint, key, ours=out is None, log=log)
    if existing is not None and copy and existing.indexed and not rebuild:
        log(f"{final}: indexes the file in place; writing the set's own files (--copy)")
        rebuild = True
    if existing is not None and rebuild:
        log(f"{final}: writing every unit again")
        existing = None
    if existing is not None:
        return existing, final, {"reused": True, **summarize(existing, 0.0)}
    # Everything that can refuse the input does so before anything is written, the disk space check included.
    # built once (~0.7 s for Gemma 3)
    model = source._meta if source._meta is not None else build_meta_model(source.config)
    layout = discover(model)
    pieces, sliced, made = split_experts(source, model, layout)
    names, converted = map_names(source, model, layout)
    mapping = SourceMap(names, sliced, {**converted, **made})
    mapping.update(pieces)
    packs = plan_packing(source, model, mapping, layout.aliases, packing, dtype)
    for note in [*getattr(source._lazy, "notes", ()), *packs.notes]:
        log(note)
    fusion = plan_fusion(source.config, layout, packs, dtype) if fuse else FusionPlan(note="off (--no-fuse)")
    need = _bytes_needed(source, mapping, dtype, packs)
    partial = partial_of(final)
    why = unwritable(final.parent)
    if why is not None:
        raise ShardError(
            f"cannot write shards in {final.parent} ({why}): put them on a writable disk (`rocketllm "
            f"shard --out DIR`, "
            "or ROCKETLLM_CACHE=DIR for every command)"
        )
    check_space(final.parent, need - sum(r.tensor_bytes for r in journal.resumable(partial, fingerprint, key).values()))
    final.parent.mkdir(parents=True, exist_ok=True)
    with exclusive(final, log):
        # Another process may have finished it while we waited.
        existing = reusable(final, fingerprint, key, ours=out is None, log=lambda m: None)
        if existing is not None and not rebuild:
            return existing, final, {"reused": True, **summarize(existing, 0.0)}
        job = _Job(source, final, dtype, model, layout, mapping, progress, log, started, packs, fusion)
        if not copy:
            target = torch_dtype(dtype)
            expected = {n: _out_dtype(source.shapes[s][1], target) for n, s in mapping.items()}
            indexed = index(job, fingerprint, expected)
            if indexed.units:
                return write_indexed(job, indexed)
            if source.kind == "gguf":
                log(f"copying the weights of {source.name} into the set: {indexed.why_not}")
        return _write(job)


@dataclass
class _Job:
    """What writing a set needs, decided before the first byte is written."""

    source: Source
    final: Path
    dtype: str
    model: object  # the meta model
    layout: Layout
    mapping: SourceMap
    progress: object
    log: object
    started: float
    packs: PackPlan
    fusion: FusionPlan


def resolve_dtype(source: Source, dtype: str, blocks: bool = False) -> str:
    """The set's float dtype: DTYPE, or for "auto" the one most of the source's float values are stored in.

    BLOCKS: a GGUF whose quantized tensors stay its own blocks: they are no float tensor of the set, so its own float
    tensors decide (its F32 norms stay F32, as llama.cpp and transformers read them; checkpoint/ggufheader.py
    blocks_set_dtype)."""
    if dtype != "auto":
        if dtype not in DTYPES:
            raise ParameterError(f"bad {{dtype}} {dtype!r}: expected auto, {', '.join(DTYPES)}", "dtype")
        return dtype
    lazy = getattr(source, "_lazy", None) if blocks else None
    if lazy is not None and hasattr(lazy, "auto_dtype"):
        return lazy.auto_dtype()
    counts: dict[torch.dtype, int] = {}
    for shape, dt in source.shapes.values():
        if dt.is_floating_point:
            n = 1
            for d in shape:
                n *= d
            counts[dt] = counts.get(dt, 0) + n
    stored = max(counts, key=counts.get) if counts else torch.float32
    return short_name(stored) or "bf16"


def _write(job: _Job) -> tuple[Manifest, Path, dict]:
    need = _bytes_needed(job.source, job.mapping, job.dtype, job.packs)
    partial = partial_of(job.final)
    try:
        return _write_units(job, partial, need)
    except KeyboardInterrupt:
        kept = len(journal.resumable(partial, job.source.fingerprint(), job.packs.key(job.dtype)))
        if kept:
            raise Interrupted(
                f"interrupted: {kept} of {len(job.layout.units)} units are written and kept; run the same "
                f"command "
                "again to resume"
            ) from None
        raise Interrupted(NOTHING_KEPT) from None
    except OSError as exc:
        if exc.errno not in DISK_FULL:
            raise
        done = sum(
            r.tensor_bytes
            for r in journal.resumable(partial, job.source.fingerprint(), job.packs.key(job.dtype)).values()
        )
        raise ShardError(
            f"cannot write shards ({os.strerror(exc.errno)}): need {format_bytes(max(0, need - done))} more, "
            f"{format_bytes(free_bytes(job.final.parent))} free at {job.final.parent}; free space, or put the shards "
            f"on another disk (`rocketllm shard --out DIR`, or ROCKETLLM_CACHE=DIR for every command), "
            "then re-run `rocketllm shard` to resume (finished units are kept)"
        ) from None


def _write_units(job: _Job, partial: Path, need: int) -> tuple[Manifest, Path, dict]:
    fingerprint = job.source.fingerprint()
    key = job.packs.key(job.dtype)
    target = torch_dtype(job.dtype)
    expected = {n: _out_dtype(job.source.shapes[s][1], target) for n, s in job.mapping.items()}
    partial.mkdir(parents=True, exist_ok=True)

    done = journal.resumable(partial, fingerprint, key)
    files = [f"{index:04d}-{plan.name}.safetensors" for index, plan in enumerate(job.layout.units)]
    kept = sum(
        1 for plan, file in zip(job.layout.units, files) if (r := done.get(plan.name)) is not None and r.file == file
    )
    if kept:
        job.log(f"resuming: {kept} of {len(job.layout.units)} units already written (in {partial})")
    units: list[UnitRecord] = []
    with (job.progress or no_progress)(f"sharding {job.source.name}", need, units=len(job.layout.units)) as bar:
        for plan, file in zip(job.layout.units, files):
            record = done.get(plan.name)
            if record is None or record.file != file:
                tensors, formats, packed = {}, {}, {}
                for n in plan.params:
                    if n in job.packs.params:
                        packed[n] = read_packed(job.source, job.mapping, n, job.packs)
                    else:
                        tensors[n] = job.mapping.read(job.source, n).to(expected[n])
                fused = job.fusion.apply(plan.name, packed)  # members' weights become one, the rest stay as they are
                for n, p in packed.items():
                    tensors[n], formats[n] = p.to_bytes(), p.format.to_dict()
                del packed
                record = _write_unit(partial, file, plan, tensors, job.mapping, formats, fused)
                del tensors
                journal.append(partial, fingerprint, key, record)
            units.append(record)
            bar.advance(record.tensor_bytes, units=1)

    written = sum(len(t.fused) if t.fused else 1 for u in units for t in u.tensors)
    # packed sizes are known exactly only once written (a scale may need fp32): only float bytes must add up
    float_written = sum(t.nbytes for u in units for t in u.tensors if t.packed is None)
    float_need = _bytes_needed(job.source, job.mapping, job.dtype, job.packs, packed=False)
    if written != len(job.mapping) or float_written != float_need:
        raise ShardError(
            f"shard set incomplete: wrote {written} tensors / {float_written} bytes, source has "
            f"{len(job.mapping)} / {float_need}; not marked complete"
        )
    version = (
        FUSED_VERSION
        if any(t.fused for u in units for t in u.tensors)
        else PACKED_VERSION
        if job.packs.params
        else FORMAT_VERSION
    )
    return finish(job, partial, manifest_of(job, units, fingerprint, version), "sharded")


def _write_unit(
    directory: Path,
    file: str,
    plan,
    tensors: dict[str, torch.Tensor],
    mapping: SourceMap,
    formats: dict[str, dict] | None = None,
    fused: dict[str, list] | None = None,
) -> UnitRecord:
    header, spans = stfile.layout(tensors, {"format": "pt", "unit": plan.name})
    digest = hashlib.sha256(header)
    tmp = directory / (file + ".tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(header)
            for name, _, _ in spans:
                data = stfile.tensor_bytes(tensors[name])
                digest.update(data)
                f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        tmp.unlink(missing_ok=True)  # on a full disk, give the space back
        raise
    os.replace(tmp, directory / file)
    fused = fused or {}
    records = [
        TensorRecord(
            name,
            " + ".join(mapping.source_name(m) for m, _ in fused[name]) if name in fused else mapping.source_name(name),
            stfile.NAMES[tensors[name].dtype],
            list(tensors[name].shape),
            len(header) + offset,
            nbytes,
            (formats or {}).get(name),
            fused.get(name),
        )
        for name, offset, nbytes in spans
    ]
    size = len(header) + sum(n for _, _, n in spans)
    return UnitRecord(plan.name, plan.kind, plan.module, file, size, digest.hexdigest(), records, plan.index)


def _bytes_needed(
    source: Source, mapping: SourceMap, dtype: str, packs: PackPlan | None = None, packed: bool = True
) -> int:
    """Tensor bytes of the whole shard set (headers and the manifest are small next to them); packed=False: of its
    float tensors only."""
    target = torch_dtype(dtype)
    packs = packs or PackPlan()
    total = 0
    for n, s in mapping.items():
        if n in packs.params:
            total += packed_nbytes(source, mapping, n, packs, _shape2(mapping, source, n)) if packed else 0
        else:
            total += mapping.numel(source, n) * _out_dtype(source.shapes[s][1], target).itemsize
    return total


def _shape2(mapping: SourceMap, source: Source, name: str) -> tuple[int, int]:
    shape = source.shapes[mapping[name]][0]
    return int(shape[0]), int(mapping.numel(source, name) // shape[0])


def _out_dtype(stored: torch.dtype, target: torch.dtype) -> torch.dtype:
    return target if stored.is_floating_point else stored
