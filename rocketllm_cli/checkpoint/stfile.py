"""Safetensors files, read and written by hand.

Reading parses the header defensively (bounded length, offsets inside the file,
no overlaps, shape x itemsize == byte length) so a hostile file yields one
ShardError line and never a large allocation or a read past its end.
Writing pads the header so tensor data starts on a 4096-byte boundary: a unit
can then be read with O_DIRECT in one sequential request.
"""

from __future__ import annotations

import functools
import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import ShardError
from ..sizes import round_up

if TYPE_CHECKING:
    import torch

MAX_HEADER_BYTES = 100 * 1024 * 1024  # the safetensors reference limit

# safetensors dtype -> (torch dtype attribute, bytes per element). The torch dtypes are looked up on first
# use, so parsing a header (doctor --model sizes a model from its headers) does not import torch.
_KINDS = {
    "F64": ("float64", 8),
    "F32": ("float32", 4),
    "F16": ("float16", 2),
    "BF16": ("bfloat16", 2),
    "I64": ("int64", 8),
    "I32": ("int32", 4),
    "I16": ("int16", 2),
    "I8": ("int8", 1),
    "U8": ("uint8", 1),
    "BOOL": ("bool", 1),
    "F8_E4M3": ("float8_e4m3fn", 1),
    "F8_E5M2": ("float8_e5m2", 1),
    "U16": ("uint16", 2),
    "U32": ("uint32", 4),
    "U64": ("uint64", 8),
}


@functools.cache
def _torch_tables() -> tuple[dict, dict]:
    import torch

    dtypes = {name: getattr(torch, attr) for name, (attr, _) in _KINDS.items()}
    return dtypes, {v: k for k, v in dtypes.items()}


def __getattr__(name: str):
    """DTYPES (safetensors name -> torch dtype) and NAMES (torch dtype -> safetensors name), built on first use."""
    if name in ("DTYPES", "NAMES"):
        dtypes, names = _torch_tables()
        return dtypes if name == "DTYPES" else names
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@dataclass(frozen=True)
class TensorEntry:
    name: str
    stored: str  # the safetensors dtype name, e.g. BF16
    shape: tuple[int, ...]
    start: int  # absolute offset in the file
    nbytes: int

    @property
    def dtype(self) -> torch.dtype:
        return _torch_tables()[0][self.stored]


@dataclass(frozen=True)
class Header:
    path: Path
    data_offset: int
    entries: dict[str, TensorEntry]
    metadata: dict[str, str]


def read_header(path: Path) -> Header:
    """Parse and validate a safetensors header without touching tensor data."""
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            prefix = f.read(8)
            if len(prefix) < 8:
                raise ShardError(f"{path.name}: not a safetensors file (shorter than 8 bytes)")
            (length,) = struct.unpack("<Q", prefix)
            if length > MAX_HEADER_BYTES or length > size - 8:
                raise ShardError(
                    f"{path.name}: corrupt safetensors header (length {length} exceeds the file or the 100 MB limit)"
                )
            raw = f.read(length)
    except OSError as exc:
        raise ShardError(f"{path.name}: cannot read ({exc.strerror or exc})") from None
    try:
        doc = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise ShardError(f"{path.name}: corrupt safetensors header (not UTF-8 JSON)") from None
    except RecursionError:
        raise ShardError(f"{path.name}: corrupt safetensors header (JSON nested too deeply)") from None
    except ValueError:  # an integer longer than Python converts (sys.get_int_max_str_digits)
        raise ShardError(f"{path.name}: corrupt safetensors header (a number too long to parse)") from None
    if not isinstance(doc, dict):
        raise ShardError(f"{path.name}: corrupt safetensors header (not a JSON object)")
    data_offset = 8 + length
    metadata = doc.pop("__metadata__", None) or {}
    # As in the reference implementation: a flat map of strings (a nested value could not even be printed safely).
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise ShardError(f"{path.name}: corrupt safetensors header (__metadata__ is not a map of strings)")
    entries = {name: _entry(path, name, spec, data_offset, size) for name, spec in doc.items()}
    spans = sorted((e.start, e.start + e.nbytes, e.name) for e in entries.values() if e.nbytes)
    for (_, end, a), (start, _, b) in zip(spans, spans[1:]):
        if start < end:
            raise ShardError(f"{path.name}: corrupt safetensors header (tensors {a} and {b} overlap)")
    return Header(path, data_offset, entries, dict(metadata))


def _entry(path: Path, name: str, spec: object, data_offset: int, size: int) -> TensorEntry:
    bad = f"{path.name}: corrupt safetensors header at tensor {str(name)[:80]!r}"
    if not isinstance(spec, dict):
        raise ShardError(f"{bad} (entry is not an object)")
    name_of_dtype = spec.get("dtype")
    itemsize = _KINDS[name_of_dtype][1] if isinstance(name_of_dtype, str) and name_of_dtype in _KINDS else None
    shape, offsets = spec.get("shape"), spec.get("data_offsets")
    if itemsize is None:
        shown = (
            repr(name_of_dtype[:20]) if isinstance(name_of_dtype, str) else f"of type {type(name_of_dtype).__name__}"
        )
        raise ShardError(f"{bad} (unknown dtype {shown})")
    if not isinstance(shape, list) or not all(
        isinstance(d, int) and not isinstance(d, bool) and 0 <= d < 2**48 for d in shape
    ):
        raise ShardError(f"{bad} (shape is not a list of non-negative integers)")
    if not (
        isinstance(offsets, list)
        and len(offsets) == 2
        and all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
    ):
        raise ShardError(f"{bad} (data_offsets is not [start, end])")
    begin, end = offsets
    if not 0 <= begin <= end or data_offset + end > size:
        raise ShardError(f"{bad} (data_offsets {begin}..{end} fall outside the file)")
    numel = 1
    for d in shape:
        numel *= d
    if numel * itemsize != end - begin:
        raise ShardError(
            f"{bad} (shape {shape} x {name_of_dtype} needs {numel * itemsize} bytes, header says {end - begin})"
        )
    return TensorEntry(str(name), name_of_dtype, tuple(shape), data_offset + begin, end - begin)


def read_tensor(fd: int, entry: TensorEntry) -> torch.Tensor:
    """Read one tensor with a positional read into fresh memory (no mmap, so RSS stays honest)."""
    import torch

    buf = bytearray(entry.nbytes)
    view = memoryview(buf)
    done = 0
    while done < entry.nbytes:
        n = os.preadv(fd, [view[done:]], entry.start + done)
        if n <= 0:
            raise ShardError(f"tensor {entry.name}: file ended early (truncated?)")
        done += n
    if entry.nbytes == 0:
        return torch.empty(entry.shape, dtype=entry.dtype)
    return torch.frombuffer(buf, dtype=torch.uint8).view(entry.dtype).view(entry.shape)


def layout(
    tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None
) -> tuple[bytes, list[tuple[str, int, int]]]:
    """Header bytes (padded to ALIGN) and (name, offset-in-data, nbytes) in write order: largest first."""
    order = sorted(tensors, key=lambda n: (-tensors[n].numel() * tensors[n].element_size(), n))
    doc: dict[str, object] = {"__metadata__": dict(metadata or {})}
    spans, offset = [], 0
    for name in order:
        t = tensors[name]
        nbytes = t.numel() * t.element_size()
        doc[name] = {
            "dtype": _torch_tables()[1][t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + nbytes],
        }
        spans.append((name, offset, nbytes))
        offset += nbytes
    raw = json.dumps(doc, separators=(",", ":")).encode()
    total = round_up(8 + len(raw))
    raw += b" " * (total - 8 - len(raw))  # safetensors allows trailing spaces in the header
    return struct.pack("<Q", len(raw)) + raw, spans


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The raw bytes of a contiguous CPU tensor, without a copy."""
    import torch

    t = t.detach().contiguous().cpu()
    if t.numel() == 0:
        return memoryview(b"")
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())
