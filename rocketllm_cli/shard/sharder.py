"""Split a checkpoint into one safetensors file per unit (embed, layer.NNN, norm, lm_head, extras).

Streams: one unit's tensors in memory at a time. Writes into a hidden partial
directory with a journal of finished units, and renames it into place only
after every tensor is accounted for, so an interrupted run never leaves a set
that loads, and a rerun resumes from the journal. A damaged set of the same
source is written again and swapped in; a full disk stops with one line.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import re
import shutil
import time
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path

import torch

from ..dtypes import NAMES as DTYPES
from ..dtypes import short_name, torch_dtype
from ..errors import ParameterError, ShardError
from ..sizes import format_bytes
from . import stfile
from .discover import Layout, build_meta_model, discover
from .manifest import MANIFEST, UNIT_FILE, Manifest, TensorRecord, UnitRecord
from .names import SourceMap, map_names, split_experts
from .source import (
    TOKENIZER_FILES,
    Located,
    Source,
    locate,
    open_source,
    save_tokenizer,
)

JOURNAL = "journal.jsonl"
HEADROOM = 64 << 20  # free space left over after sharding, for everything else on the disk
DISK_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


def default_out(located: Located, dtype: str) -> Path:
    """Beside the model cache, keyed by the source's fingerprint, so generate finds and reuses it."""
    from ..profiles import cache_dir

    safe = re.sub(r"[^A-Za-z0-9._-]+", "-", located.name)[:64] or "model"
    return cache_dir() / "shards" / f"{safe}-{located.fingerprint()}-{dtype}"


def find_existing(located: Located, dtype: str) -> tuple[Manifest, Path] | None:
    """A complete shard set of this source in the default place (any dtype for 'auto'), without reading weights."""
    dtypes = list(DTYPES) if dtype == "auto" else [dtype]
    for dt in dtypes:
        final = default_out(located, dt)
        if (final / MANIFEST).is_file():
            try:
                manifest = Manifest.load(final)
            except ShardError:
                continue  # damaged: shard() says so and writes it again
            if manifest.source.get("fingerprint") == located.fingerprint():
                _drop_replaced(final)
                return manifest, final
    return None


def resolve_dtype(source: Source, dtype: str) -> str:
    if dtype != "auto":
        if dtype not in DTYPES:
            raise ParameterError(f"bad {{dtype}} {dtype!r}: expected auto, {', '.join(DTYPES)}", "dtype")
        return dtype
    counts: dict[torch.dtype, int] = {}
    for shape, dt in source.shapes.values():
        if dt.is_floating_point:
            n = 1
            for d in shape:
                n *= d
            counts[dt] = counts.get(dt, 0) + n
    stored = max(counts, key=counts.get) if counts else torch.float32
    return short_name(stored) or "bf16"


def shard(model: str | os.PathLike, out: Path | None = None, dtype: str = "auto", progress=None, log=print,
          rebuild: bool = False) -> tuple[Manifest, Path, dict]:
    """Shard MODEL (or reuse a complete shard set). Returns (manifest, directory, summary).

    rebuild: write the set again even if one of this source exists (after `--verify` found changed bytes).
    """
    started = time.perf_counter()
    located = locate(model)
    if out is None and not rebuild:
        found = find_existing(located, dtype)
        if found is not None:
            return found[0], found[1], {"reused": True, **summarize(found[0], 0.0)}
    source = open_source(located)
    try:
        return _shard(source, out, dtype, progress, log, started, rebuild)
    finally:
        source.close()


def _shard(source: Source, out: Path | None, dtype: str, progress, log, started: float, rebuild: bool = False) -> tuple[Manifest, Path, dict]:
    dtype = resolve_dtype(source, dtype)
    final = Path(out) if out else default_out(source.located, dtype)
    fingerprint = source.fingerprint()
    existing = _reusable(final, fingerprint, dtype, ours=out is None, log=log)
    if existing is not None and rebuild:
        log(f"{final}: writing every unit again")
        existing = None
    if existing is not None:
        return existing, final, {"reused": True, **summarize(existing, 0.0)}
    # Everything that can refuse the input does so before anything is written, the disk space check included.
    model = build_meta_model(source.config)
    layout = discover(model)
    pieces, sliced = split_experts(source, model, layout)
    mapping = SourceMap(map_names(source, model, layout), sliced)
    mapping.update(pieces)
    need = _bytes_needed(source, mapping, dtype)
    partial = final.parent / f".{final.name}.partial"
    _check_space(final.parent, need - sum(r.tensor_bytes for r in _resumable(partial, fingerprint, dtype).values()))
    final.parent.mkdir(parents=True, exist_ok=True)
    with _exclusive(final.parent / f".{final.name}.lock", log):
        # Another process may have finished it while we waited.
        existing = _reusable(final, fingerprint, dtype, ours=out is None, log=lambda m: None)
        if existing is not None and not rebuild:
            return existing, final, {"reused": True, **summarize(existing, 0.0)}
        return _write(source, final, dtype, model, layout, mapping, progress, log, started)


@contextmanager
def _exclusive(lock_path: Path, log):
    """One sharder per target at a time: a second process waits, then finds the finished set and reuses it.

    The lock file is removed after a successful run only: a waiter still holding the old file then
    re-checks and finds the complete set; after a failure it stays, so no two writers ever meet.
    """
    with open(lock_path, "a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log(f"another rocketllm is sharding into {lock_path.parent}; waiting for it")
            fcntl.flock(lock, fcntl.LOCK_EX)
        yield
        lock_path.unlink(missing_ok=True)


def _write(source: Source, final: Path, dtype: str, model, layout: Layout, mapping: dict[str, str], progress, log,
           started: float) -> tuple[Manifest, Path, dict]:
    need = _bytes_needed(source, mapping, dtype)
    partial = final.parent / f".{final.name}.partial"
    try:
        return _write_units(source, final, partial, dtype, model, layout, mapping, need, progress, log, started)
    except OSError as exc:
        if exc.errno not in DISK_FULL:
            raise
        done = sum(r.tensor_bytes for r in _resumable(partial, source.fingerprint(), dtype).values())
        raise ShardError(
            f"cannot write shards ({os.strerror(exc.errno)}): need {format_bytes(max(0, need - done))} more, "
            f"{format_bytes(_free_bytes(final.parent))} free at {final.parent}; free space or pass --out on another disk, "
            "then re-run `rocketllm shard` to resume (finished units are kept)"
        ) from None


def _write_units(source: Source, final: Path, partial: Path, dtype: str, model, layout: Layout, mapping: dict[str, str], need: int,
                 progress, log, started: float) -> tuple[Manifest, Path, dict]:
    fingerprint = source.fingerprint()
    target = torch_dtype(dtype)
    expected = {n: _out_dtype(source.shapes[s][1], target) for n, s in mapping.items()}
    partial.mkdir(parents=True, exist_ok=True)

    done = _resumable(partial, fingerprint, dtype)
    units: list[UnitRecord] = []
    with (progress or _NoProgress)("sharding", len(layout.units)) as bar:
        for index, plan in enumerate(layout.units):
            file = f"{index:04d}-{plan.name}.safetensors"
            record = done.get(plan.name)
            if record is None or record.file != file:
                tensors = {n: mapping.read(source, n).to(expected[n]) for n in plan.params}
                record = _write_unit(partial, file, plan, tensors, mapping)
                del tensors
                _journal(partial, fingerprint, dtype, record)
            units.append(record)
            bar.advance(1)

    written = sum(len(u.tensors) for u in units)
    written_bytes = sum(u.tensor_bytes for u in units)
    if written != len(mapping) or written_bytes != need:
        raise ShardError(f"shard set incomplete: wrote {written} tensors / {written_bytes} bytes, source has {len(mapping)} / {need}; not marked complete")
    manifest = Manifest(
        source={"kind": source.kind, "name": source.name, "fingerprint": fingerprint},
        model_type=source.config.model_type,
        architecture=type(model).__name__,
        dtype=dtype,
        stack=layout.stack,
        units=units,
        aliases=layout.aliases,
        seconds=round(time.perf_counter() - started, 3),
    )
    source.config.save_pretrained(partial)
    save_tokenizer(source, partial)
    manifest.save(partial)  # before the journal goes, so a run killed in between still resumes every unit
    (partial / JOURNAL).unlink(missing_ok=True)
    _fsync_dir(partial)
    old = final.parent / f".{final.name}.old"
    if final.exists():  # a damaged set of this source, judged ours to replace by _reusable: swap, never delete first
        shutil.rmtree(old, ignore_errors=True)
        os.rename(final, old)
    os.rename(partial, final)
    _fsync_dir(final.parent)
    shutil.rmtree(old, ignore_errors=True)
    log(f"sharded {source.name}: {len(units)} units, {format_bytes(written_bytes)} in {manifest.seconds:.1f} s -> {final}")
    return manifest, final, {"reused": False, **summarize(manifest, manifest.seconds)}


def _write_unit(directory: Path, file: str, plan, tensors: dict[str, torch.Tensor], mapping: dict[str, str]) -> UnitRecord:
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
    records = [
        TensorRecord(name, _source_name(mapping, name), stfile.NAMES[tensors[name].dtype], list(tensors[name].shape), len(header) + offset, nbytes)
        for name, offset, nbytes in spans
    ]
    size = len(header) + sum(n for _, _, n in spans)
    return UnitRecord(plan.name, plan.kind, plan.module, file, size, digest.hexdigest(), records, plan.index)


def _source_name(mapping: dict[str, str], name: str) -> str:
    sliced = getattr(mapping, "sliced", {})
    return f"{mapping[name]}[{sliced[name]}]" if name in sliced else mapping[name]


def verify(directory: Path, log=print) -> list[str]:
    """Re-check every unit file against the manifest: sizes and sha256. Returns the problems found."""
    manifest = Manifest.load(directory)  # sizes and tensor bounds
    problems = []
    for u in manifest.units:
        digest = hashlib.sha256()
        with open(directory / u.file, "rb") as f:
            while chunk := f.read(16 << 20):
                digest.update(chunk)
        if digest.hexdigest() != u.sha256:
            problems.append(f"{u.file}: checksum mismatch (contents changed)")
    return problems


def _reusable(final: Path, fingerprint: str, dtype: str, ours: bool, log) -> Manifest | None:
    """The complete set at FINAL, or None when there is none or it is a damaged set of this source to write again.

    `ours`: FINAL is the default location, named after this source's fingerprint and dtype.
    """
    if not final.exists():
        return None
    if not (final / MANIFEST).is_file():
        if final.is_dir() and not any(final.iterdir()):
            final.rmdir()
            return None
        if final.is_dir() and (ours or _only_shard_files(final)):
            log(f"{final}: no {MANIFEST}; sharding it again")
            return None
        raise ShardError(f"{final} exists and is not a shard directory; choose another --out or remove it")
    try:
        manifest = Manifest.load(final)
    except ShardError as exc:
        recorded = _recorded_as(final, fingerprint, dtype)
        if not (ours or recorded or (recorded is None and _only_shard_files(final))):
            what = "that is not of this model and dtype" if recorded is False else "mixed with other files"
            raise ShardError(f"{final} holds a damaged shard set {what}; choose another --out or remove it") from None
        log(f"{final}: {str(exc).split('; re-run')[0]}; sharding it again")
        return None
    if manifest.source.get("fingerprint") != fingerprint or manifest.dtype != dtype:
        raise ShardError(f"{final} holds shards of another source or dtype; choose another --out or remove it")
    _drop_replaced(final)
    return manifest


def _drop_replaced(final: Path) -> None:
    """Remove what is left of a set this one replaced, when a run stopped before deleting it (it can be as big as the set)."""
    old = final.parent / f".{final.name}.old"
    if old.exists():
        shutil.rmtree(old, ignore_errors=True)


def _only_shard_files(directory: Path) -> bool:
    """A shard set that lost its manifest: unit files (by their own headers) and the files sharding copies, nothing else."""
    known = {"config.json", MANIFEST, MANIFEST + ".tmp", JOURNAL, *TOKENIZER_FILES}
    units = 0
    for f in directory.iterdir():
        if UNIT_FILE.match(f.name) and f.is_file():
            try:
                if "unit" not in stfile.read_header(f).metadata:
                    return False
            except ShardError:
                pass  # a damaged unit file is still one of ours by its name
            units += 1
        elif f.name not in known or not f.is_file():
            return False
    return units > 0


def _recorded_as(directory: Path, fingerprint: str, dtype: str) -> bool | None:
    """Whether a (possibly damaged) manifest still names this source and dtype; None when it cannot be read."""
    try:
        doc = json.loads((directory / MANIFEST).read_text(encoding="utf-8"))
        return doc["source"]["fingerprint"] == fingerprint and doc["dtype"] == dtype
    except Exception:  # noqa: BLE001 - unreadable in any way
        return None


def _resumable(partial: Path, fingerprint: str, dtype: str) -> dict[str, UnitRecord]:
    """Units an interrupted run finished, whose files are intact: from its journal, or from its manifest when it
    stopped between writing that and the rename."""
    if not partial.is_dir():
        return {}
    done = _read_journal(partial, fingerprint, dtype)
    if not done and (partial / MANIFEST).is_file():
        try:
            manifest = Manifest.load(partial)
        except ShardError:
            manifest = None
        if manifest is not None and manifest.source.get("fingerprint") == fingerprint and manifest.dtype == dtype:
            done = {u.name: u for u in manifest.units}
    return {name: r for name, r in done.items() if _file_ok(partial / r.file, r.bytes)}


def _read_journal(partial: Path, fingerprint: str, dtype: str) -> dict[str, UnitRecord]:
    done: dict[str, UnitRecord] = {}
    path = partial / JOURNAL
    if not path.is_file():
        return done
    for line in path.read_text().splitlines():
        try:
            doc = json.loads(line)
            if doc["fingerprint"] != fingerprint or doc["dtype"] != dtype:
                return {}
            u = doc["unit"]
            done[u["name"]] = UnitRecord(**{**u, "tensors": [TensorRecord(**t) for t in u["tensors"]]})
        except (ValueError, KeyError, TypeError):
            break  # a torn last line from an interrupted write: everything before it stands
    return done


def _journal(partial: Path, fingerprint: str, dtype: str, record: UnitRecord) -> None:
    with open(partial / JOURNAL, "a") as f:
        f.write(json.dumps({"fingerprint": fingerprint, "dtype": dtype, "unit": asdict(record)}) + "\n")
        f.flush()
        os.fsync(f.fileno())


def _file_ok(path: Path, size: int) -> bool:
    try:
        return path.stat().st_size == size
    except OSError:
        return False


def _bytes_needed(source: Source, mapping: SourceMap, dtype: str) -> int:
    """Tensor bytes of the whole shard set (headers and the manifest are small next to them)."""
    target = torch_dtype(dtype)
    return sum(mapping.numel(source, n) * _out_dtype(source.shapes[s][1], target).itemsize for n, s in mapping.items())


def _free_bytes(directory: Path) -> int:
    probe = directory
    while not probe.exists() and probe != probe.parent:  # the target may not exist yet
        probe = probe.parent
    return shutil.disk_usage(probe).free


def _check_space(directory: Path, need: int) -> None:
    free = _free_bytes(directory)
    if free < need + HEADROOM:
        raise ShardError(f"not enough disk space for shards: need {format_bytes(need)} plus {format_bytes(HEADROOM)} headroom, "
                         f"{format_bytes(free)} free at {directory}; free space or pass --out on another disk")


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _out_dtype(stored: torch.dtype, target: torch.dtype) -> torch.dtype:
    return target if stored.is_floating_point else stored


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
    }


class _NoProgress:
    def __init__(self, *_):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def advance(self, n):
        pass
