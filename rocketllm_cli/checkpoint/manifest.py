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

from ..errors import ShardError
from . import stfile
from .manifestchecks import (  # noqa: F401 - the versions, names and kinds are the manifest's, declared with its checks
    FORMAT_VERSION,
    FUSED_VERSION,
    INDEXED_VERSION,
    INT4_LAYOUTS,
    PACKED_VERSION,
    READABLE_VERSIONS,
    Corrupt,
    fused_name,
    validate,
)
from .unitrecords import TensorRecord, UnitRecord

MANIFEST = "manifest.json"
RESHARD = "re-run `rocketllm shard` on the source model"
UNIT_FILE = re.compile(r"^\d{4}-.+\.safetensors$")
SIDE_FILE = "side.safetensors"  # an indexed set's few tensors the source stores otherwise (TensorRecord.side)


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
            validate(doc, {f.name for f in fields(cls)})
        except Corrupt as exc:
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
            stored, recorded = _as_stored(header), _as_recorded(u.tensors)
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
        side = _as_recorded(t for u in self.units for t in u.tensors if t.side)
        if not side:
            return
        try:
            header = stfile.read_header(directory / SIDE_FILE)
        except (OSError, ShardError) as exc:
            raise ShardError(f"{SIDE_FILE}: {str(exc)[:200]}; {RESHARD}") from None
        if _as_stored(header) != side:
            raise ShardError(f"{SIDE_FILE} does not match the manifest; {RESHARD}")


def _as_stored(header) -> dict:
    """A safetensors header's tensors as the manifest records them: name -> (dtype, shape, offset, bytes)."""
    return {n: (stfile.NAMES[e.dtype], list(e.shape), e.start, e.nbytes) for n, e in header.entries.items()}


def _as_recorded(tensors) -> dict:
    """TENSORS' records, for comparing with a header (_as_stored)."""
    return {t.name: (t.dtype, list(t.shape), t.offset, t.nbytes) for t in tensors}


def set_key(dtype: str, packing: str = "", int4_layout: str = "") -> str:
    """What names a set beside its source: its dtype, its packing, and the order its int4 codes are in, since a CPU
    whose kernel reads another order reorders them on every streamed use ("bf16", "bf16-int8",
    "bf16-packed-lanes64")."""
    key = f"{dtype}-{packing}" if packing else dtype
    return f"{key}-{int4_layout}" if packing and int4_layout and int4_layout != "rows" else key
