"""A shard set's last steps, whether its weights were copied into unit files (sharder.py) or indexed in place
(indexing.py): the manifest, the config and tokenizer beside it, and the swap into place."""

from __future__ import annotations

import time
from pathlib import Path

from ..checkpoint.manifest import INDEXED_VERSION, Manifest
from ..checkpoint.unitrecords import UnitRecord
from ..errors import ShardError
from ..output import BLINK_S, no_progress
from ..sizes import format_bytes
from .indexing import indexes, write_side
from .journal import JOURNAL
from .target import partial_of, swap_in
from .tokenizers import save_tokenizer


def write_indexed(job, indexed) -> tuple[Manifest, Path, dict]:
    """A set that indexes the GGUF in place: its manifest, side file, config and tokenizer; no weight is copied."""
    fingerprint = job.source.fingerprint()
    partial = partial_of(job.final)
    partial.mkdir(parents=True, exist_ok=True)
    for stale in partial.iterdir():  # a copy interrupted here before: its unit files are not this set's
        if stale.is_file():
            stale.unlink()
    write_side(partial, indexed)
    written = sum(len(t.fused) if t.fused else 1 for u in indexed.units for t in u.tensors)
    if written != len(job.mapping):
        raise ShardError(f"shard set incomplete: indexed {written} tensors, source has {len(job.mapping)}")
    manifest = manifest_of(job, indexed.units, fingerprint, INDEXED_VERSION)
    manifest.indexes, manifest.row_orders = indexes(job), indexed.row_orders
    return finish(job, partial, manifest, "indexed")


def manifest_of(job, units: list[UnitRecord], fingerprint: str, version: int) -> Manifest:
    return Manifest(
        source={"kind": job.source.kind, "name": job.source.name, "fingerprint": fingerprint},
        model_type=job.source.config.model_type,
        architecture=type(job.model).__name__,
        dtype=job.dtype,
        stack=job.layout.stack,
        units=units,
        aliases=job.layout.aliases,
        seconds=round(time.perf_counter() - job.started, 3),
        packing=job.packs.mode,
        int4_layout=job.packs.int4_layout,
        format_version=version,
        fusion=job.fusion.describe(units) if job.packs.params else "",  # a float set's manifest stays as before
    )


def finish(job, partial: Path, manifest: Manifest, verb: str) -> tuple[Manifest, Path, dict]:
    """The config and tokenizer beside the units, the manifest, and the set swapped into place."""
    with (job.progress or no_progress)(f"saving the config and tokenizer of {job.source.name}", after=BLINK_S):
        job.source.config.save_pretrained(partial)
        save_tokenizer(job.source, partial)
    manifest.seconds = round(time.perf_counter() - job.started, 3)
    manifest.save(partial)  # before the journal goes, so a run killed in between still resumes every unit
    (partial / JOURNAL).unlink(missing_ok=True)
    swap_in(partial, job.final)
    for note in getattr(job.source._lazy, "written_notes", list)():
        job.log(note)
    size = format_bytes(manifest.total_bytes)
    where = f" of {Path(manifest.indexes['path']).name} in place" if manifest.indexed else ""
    job.log(
        f"{verb} {job.source.name}: {len(manifest.units)} units, {size}{where} in {manifest.seconds:.1f} s -> "
        f"{job.final}"
    )
    return manifest, job.final, {"reused": False, **summarize(manifest, manifest.seconds)}


def summarize(manifest: Manifest, seconds: float) -> dict:
    total = manifest.total_bytes
    return {
        "units": len(manifest.units),
        "layers": len(manifest.layers),
        "experts": len(manifest.experts),
        "bytes": total,
        "seconds": round(seconds, 3),
        "mb_per_s": round(total / seconds / 1e6, 1) if seconds > 0 else None,
        "dtype": manifest.dtype,
        "packing": manifest.packing,
        "packed_tensors": sum(
            len(t.fused or ()) or 1 for u in manifest.units for t in u.tensors if t.packed is not None
        ),
        "fused_tensors": sum(1 for u in manifest.units for t in u.tensors if t.fused),
        "fusion": manifest.fusion,
    }
