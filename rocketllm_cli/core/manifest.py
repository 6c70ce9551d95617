"""manifest.json: what a shard directory holds, checked before anything loads."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..errors import ShardError

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
RESHARD = "re-run `rocketllm shard` on the source model"


@dataclass
class TensorRecord:
    name: str  # the parameter or buffer name in the transformers module tree
    source: str  # its name in the source checkpoint
    dtype: str
    shape: list[int]
    offset: int  # absolute offset in the unit file
    nbytes: int


@dataclass
class UnitRecord:
    name: str  # embed, layer.000 ..., norm, lm_head, extra.<module path>
    kind: str  # embed | layer | norm | lm_head | extra | root
    module: str  # module path the unit's forward hook sits on ("" = the whole model)
    file: str
    bytes: int  # file size
    sha256: str
    tensors: list[TensorRecord]
    index: int = -1  # layer index within the decoder stack

    @property
    def tensor_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)


@dataclass
class Manifest:
    source: dict  # kind, name, fingerprint
    model_type: str
    architecture: str
    dtype: str
    stack: str  # module path of the repeated decoder stack
    units: list[UnitRecord]
    aliases: dict[str, str] = field(default_factory=dict)  # tied parameter -> the parameter it shares storage with
    format_version: int = FORMAT_VERSION
    seconds: float = 0.0

    @property
    def total_bytes(self) -> int:
        return sum(u.tensor_bytes for u in self.units)

    @property
    def layers(self) -> list[UnitRecord]:
        return [u for u in self.units if u.kind == "layer"]

    def unit(self, name: str) -> UnitRecord:
        for u in self.units:
            if u.name == name:
                return u
        raise KeyError(name)

    def to_dict(self) -> dict:
        return asdict(self)

    def save(self, directory: Path) -> None:
        tmp = directory / (MANIFEST + ".tmp")
        with open(tmp, "w") as f:
            json.dump(self.to_dict(), f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, directory / MANIFEST)

    @classmethod
    def load(cls, directory: Path) -> "Manifest":
        path = Path(directory) / MANIFEST
        if not path.is_file():
            raise ShardError(f"{directory}: no {MANIFEST} (not a complete shard directory); {RESHARD}")
        if path.stat().st_size > 256 * 1024 * 1024:
            raise ShardError(f"{path}: manifest is implausibly large; {RESHARD}")
        try:
            doc = json.loads(path.read_text(encoding="utf-8"))
            if doc.get("format_version") != FORMAT_VERSION:
                raise ShardError(f"{path}: manifest format {doc.get('format_version')!r}, this rocketllm reads {FORMAT_VERSION}; {RESHARD}")
            units = [UnitRecord(**{**u, "tensors": [TensorRecord(**t) for t in u["tensors"]]}) for u in doc.pop("units")]
            manifest = cls(**doc, units=units)
        except ShardError:
            raise
        except (ValueError, TypeError, KeyError, AttributeError, RecursionError):
            raise ShardError(f"{path}: manifest is corrupt; {RESHARD}") from None
        manifest.check_files(Path(directory))
        return manifest

    def check_files(self, directory: Path) -> None:
        """Cheap checks on load: every unit file present with its recorded size, tensors inside it."""
        for u in self.units:
            if "/" in u.file or u.file.startswith("."):
                raise ShardError(f"manifest names an invalid unit file {u.file!r}; {RESHARD}")
            path = directory / u.file
            try:
                size = path.stat().st_size
            except OSError:
                raise ShardError(f"shard file {u.file} is missing; {RESHARD}") from None
            if size != u.bytes:
                raise ShardError(f"shard file {u.file} is {size} bytes, manifest says {u.bytes} (truncated or changed); {RESHARD}")
            for t in u.tensors:
                if t.offset < 0 or t.nbytes < 0 or t.offset + t.nbytes > size:
                    raise ShardError(f"manifest places tensor {t.name} outside {u.file}; {RESHARD}")
