"""Just enough of a GGUF header to size a model: metadata values, tensor byte extents, and what shards will hold.

Parsed by hand (no gguf import: its reader decodes the whole vocabulary, seconds on a small model).
"""

from __future__ import annotations

import mmap
import os
import struct
from pathlib import Path

from ..errors import ModelError
from ..sizes import format_bytes, round_up

# value type id -> struct format of a scalar; 8 = string, 9 = array
_LENGTH = struct.Struct("<Q")
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
FILE_TYPES = {
    0: "F32",
    1: "F16",
    2: "Q4_0",
    3: "Q4_1",
    7: "Q8_0",
    8: "Q5_0",
    9: "Q5_1",
    10: "Q2_K",
    11: "Q3_K_S",
    12: "Q3_K_M",
    13: "Q3_K_L",
    14: "Q4_K_S",
    15: "Q4_K_M",
    16: "Q5_K_S",
    17: "Q5_K_M",
    18: "Q6_K",
    32: "BF16",
}


# ggml tensor type id -> (elements per block, bytes per block), for the types whose size we can check exactly
_BLOCKS = {
    0: (1, 4),
    1: (1, 2),
    2: (32, 18),
    3: (32, 20),
    6: (32, 22),
    7: (32, 24),
    8: (32, 34),
    9: (32, 36),
    10: (256, 84),
    11: (256, 110),
    12: (256, 144),
    13: (256, 176),
    14: (256, 210),
    15: (256, 292),
    16: (256, 66),
    17: (256, 74),
    18: (256, 98),
    19: (256, 50),
    20: (32, 18),
    21: (256, 110),
    22: (256, 82),
    23: (256, 136),
    24: (1, 1),
    25: (1, 2),
    26: (1, 4),
    27: (1, 8),
    28: (1, 8),
    29: (256, 56),
    30: (1, 2),
    34: (256, 54),
    35: (256, 66),
    39: (32, 17),
    40: (64, 36),
}


# ggml tensor type id -> name (gguf's GGMLQuantizationType names), for the types _BLOCKS sizes
GGML_NAMES = {
    0: "F32",
    1: "F16",
    2: "Q4_0",
    3: "Q4_1",
    6: "Q5_0",
    7: "Q5_1",
    8: "Q8_0",
    9: "Q8_1",
    10: "Q2_K",
    11: "Q3_K",
    12: "Q4_K",
    13: "Q5_K",
    14: "Q6_K",
    15: "Q8_K",
    16: "IQ2_XXS",
    17: "IQ2_XS",
    18: "IQ3_XXS",
    19: "IQ1_S",
    20: "IQ4_NL",
    21: "IQ3_S",
    22: "IQ2_S",
    23: "IQ4_XS",
    24: "I8",
    25: "I16",
    26: "I32",
    27: "I64",
    28: "F64",
    29: "IQ1_M",
    30: "BF16",
    34: "TQ1_0",
    35: "TQ2_0",
    39: "MXFP4",
    40: "NVFP4",
}


# ggml type ids `shard --quantize auto` keeps as their own blocks (shard/packing.py KEPT), sized by _BLOCKS
# not Q8_1, Q8_K
_KEPT_IDS = frozenset(type_id for type_id, (elems, _) in _BLOCKS.items() if elems > 1 and type_id not in (9, 15))


def read_gguf(path: Path) -> tuple[dict[str, object], dict[str, int]]:
    """(metadata without arrays of strings, tensor name -> bytes as stored). ModelError on a foreign or truncated
    file."""
    meta, sizes, _ = read_gguf_tensors(path)
    return meta, sizes


class Truncated(ValueError):
    """The file ends before its header says it does: `expected` bytes (a lower bound when `in_header`)."""

    def __init__(self, expected: int, actual: int, in_header: bool) -> None:
        super().__init__(f"truncated: {expected} > {actual}")
        self.expected, self.actual, self.in_header = expected, actual, in_header

    def message(self, name: str) -> str:
        if self.actual == 0:
            what = "the file is empty"
        elif self.in_header:
            what = f"it ends inside its header, at {self.actual:,} bytes ({format_bytes(self.actual)})"
        else:
            what = (
                f"its header describes {self.expected:,} bytes ({format_bytes(self.expected)}), the file has "
                f"{self.actual:,} ({format_bytes(self.actual)})"
            )
        return (
            f"{name} is truncated: {what}; download it again (an interrupted download or a full disk cuts a file short)"
        )


_PARSED: dict[tuple, tuple] = {}  # (path, device, inode, size, mtime) -> what read_gguf_tensors returned


def read_gguf_tensors(path: Path) -> tuple[dict[str, object], dict[str, int], dict[str, tuple[int, tuple[int, ...]]]]:
    """read_gguf plus each tensor's (ggml type id, dims as GGUF lists them, innermost first). Parsed once per file
    version in a process (the sharder, the facts and the tokenizer flags all ask); callers must not change it."""
    try:
        with open(path, "rb") as f:
            st = os.fstat(f.fileno())
            key = (os.fspath(path), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
            if key in _PARSED:
                return _PARSED[key]
            if st.st_size == 0:
                raise Truncated(4, 0, True)
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
                parsed = _parse(mm, len(mm))
        if len(_PARSED) > 16:
            _PARSED.clear()
        _PARSED[key] = parsed
        return parsed
    except Truncated as exc:
        raise ModelError(exc.message(path.name)) from None
    except (struct.error, IndexError, UnicodeDecodeError, ValueError, OverflowError) as exc:
        raise ModelError(f"{path.name}: not a readable GGUF file ({type(exc).__name__})") from None


def truncation(path: Path) -> str | None:
    """The one-line problem when the GGUF at `path` is shorter than its own header says, else None (whole, or
    unreadable for another reason: the reader that follows says what)."""
    try:
        read_gguf_tensors(path)
    except ModelError as exc:
        return str(exc) if " is truncated: " in str(exc) else None
    except OSError:
        return None
    return None


def header_problem(path: Path) -> str | None:
    """The one-line problem with the GGUF at `path` that its header alone shows (cut short; a tensor of a type nothing
    here decodes), else None (whole, or unreadable for another reason: the reader that follows says what)."""
    problem = truncation(path)
    if problem is not None:
        return problem
    try:
        _, _, infos = read_gguf_tensors(path)
    except (ModelError, OSError):
        return None
    for name, (type_id, _) in infos.items():
        if type_id in _KEPT_IDS or (type_id in _BLOCKS and _BLOCKS[type_id][0] == 1):
            continue
        from .ggmlblocks import unsupported  # imports torch: only for such a file

        try:
            from gguf import GGMLQuantizationType

            type_name = GGMLQuantizationType(type_id).name
        except (ImportError, ValueError):
            type_name = f"ggml type {type_id}"
        why = unsupported(type_name).split(" is not supported: ", 1)[-1]
        return (
            f"{path.name}: tensor {name} is {type_name}, which cannot be read here ({why}); use a file quantized "
            "to another type (Q4_K_M, Q5_K_M, Q6_K, Q8_0 ...)"
        )
    return None


def shard_sizes(infos: dict[str, tuple[int, tuple[int, ...]]], itemsize: int | None = None) -> dict[str, int]:
    """Bytes each tensor will take in a `shard --quantize auto` set of `itemsize`-byte floats (None: the set's own
    dtype, blocks_set_dtype), from the header alone.

    A matrix stays packed when its type is kept: its own blocks (Q4_0, Q5_0, Q8_0, Q4_K, Q6_K, IQ4_XS ...), an untied
    token embedding too (its lookups dequantize the rows they read). Everything else is dequantized to the set's
    dtype."""
    if itemsize is None:
        itemsize = _FLOAT_ITEMSIZE[blocks_set_dtype(infos)]
    kept = kept_as_blocks(infos)
    out = {}
    for name, (ggml_type, dims) in infos.items():
        numel = _numel(dims)
        out[name] = numel // _BLOCKS[ggml_type][0] * _BLOCKS[ggml_type][1] if name in kept else numel * itemsize
    return out


def kept_as_blocks(infos: dict[str, tuple[int, tuple[int, ...]]]) -> set[str]:
    """The tensors a `shard --quantize auto` set keeps as their blocks: every matrix of a kept type (the products'
    weights, and a token embedding, tied to the head or looked up by rows alone)."""
    return {
        name
        for name, (ggml_type, dims) in infos.items()
        if len(dims) == 2 and ggml_type in _KEPT_IDS and dims[0] % _BLOCKS[ggml_type][0] == 0
    }


_FLOAT_IDS = {0: "fp32", 1: "fp16", 30: "bf16"}  # ggml type ids F32, F16, BF16
_FLOAT_ITEMSIZE = {"fp32": 4, "fp16": 2, "bf16": 2}


def blocks_set_dtype(infos: dict[str, tuple[int, tuple[int, ...]]]) -> str:
    """The float dtype `shard --dtype auto` gives a set that keeps the file's blocks: the one most of the set's float
    values are stored in. The blocks are no float tensor of the set; the file's own float tensors count as stored (the
    F32 norms stay F32, as llama.cpp and transformers read them), a quantized tensor decoded into the set (a type not
    kept) as bf16, half an fp32 decode's bytes; fp32, what a block decodes to, where nothing counts."""
    kept = kept_as_blocks(infos)
    counts: dict[str, int] = {}
    for name, (ggml_type, dims) in infos.items():
        if name not in kept:
            dtype = _FLOAT_IDS.get(ggml_type, "bf16")
            counts[dtype] = counts.get(dtype, 0) + _numel(dims)
    return max(counts, key=counts.get) if counts else "fp32"


def _numel(dims) -> int:
    numel = 1
    for d in dims:
        numel *= d
    return numel


def _parse(mm, size: int) -> tuple[dict[str, object], dict[str, int], dict[str, tuple[int, tuple[int, ...]]]]:
    if size < 4:
        if bytes(mm[:size]) == b"GGUF"[:size]:
            raise Truncated(4, size, True)
        raise ValueError("bad magic")
    if mm[:4] != b"GGUF":
        raise ValueError("bad magic")
    try:
        return _parse_header(mm, size)
    except (struct.error, IndexError) as exc:  # a read past the end of the file: cut inside the header
        raise Truncated(size + 1, size, True) from exc


def _parse_header(mm, size: int) -> tuple[dict[str, object], dict[str, int], dict[str, tuple[int, tuple[int, ...]]]]:
    version, n_tensors, n_kv = struct.unpack_from("<IQQ", mm, 4)
    if version < 2 or n_tensors > 10**6 or n_kv > 10**6:
        raise ValueError("unsupported header")
    pos = 24
    meta: dict[str, object] = {}
    for key, value, _, pos in _entries(mm, n_kv):
        meta[key] = value
    offsets: list[tuple[int, str]] = []
    infos: dict[str, tuple[int, tuple[int, ...]]] = {}
    exact: dict[str, int] = {}  # stored bytes, where the type's block size is known
    for _ in range(n_tensors):
        name, pos = _string(mm, pos)
        (n_dims,) = struct.unpack_from("<I", mm, pos)
        if n_dims > 8:
            raise ValueError("too many dimensions")
        dims = struct.unpack_from(f"<{n_dims}Q", mm, pos + 4)
        (ggml_type,) = struct.unpack_from("<I", mm, pos + 4 + 8 * n_dims)
        pos += 4 + 8 * n_dims + 4
        (offset,) = struct.unpack_from("<Q", mm, pos)
        pos += 8
        offsets.append((offset, name))
        infos[name] = (ggml_type, tuple(dims))
        if ggml_type in _BLOCKS:
            per, nbytes = _BLOCKS[ggml_type]
            numel = 1
            for d in dims:
                numel *= d
            exact[name] = -(-numel // per) * nbytes
    align = int(meta.get("general.alignment", 32) or 32)
    data_start = round_up(pos, align)
    end = max((data_start + offset + exact.get(name, 0) for offset, name in offsets), default=data_start)
    if end > size:
        raise Truncated(end, size, False)
    offsets.sort()
    ends = [o for o, _ in offsets[1:]] + [size - data_start]
    # Each tensor runs to the next one's start (alignment padding of < 32 bytes included).
    return meta, {name: end - start for (start, name), end in zip(offsets, ends)}, infos


def tokenizer_digest(path: Path, salt: str = "") -> str | None:
    """A hash of the `tokenizer.*` entries of the GGUF at `path`, as stored (the vocabulary, scores, merges, special
    ids and flags, chat template), its `general.architecture` (transformers picks the tokenizer's class by it), and
    SALT; None where the header cannot be read. Two files of one model in other quantizations give the same digest:
    a tokenizer converted from one serves the other."""
    import hashlib

    digest = hashlib.sha256(salt.encode() + b"\0")
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            if mm[:4] != b"GGUF":
                return None
            _, _, n_kv = struct.unpack_from("<IQQ", mm, 4)
            if n_kv > 10**6:
                return None
            found = False
            for key, _, start, end in _entries(mm, n_kv):
                if key.startswith("tokenizer.") or key == "general.architecture":
                    digest.update(mm[start:end])
                    found = found or key.startswith("tokenizer.")
    except (OSError, ValueError, IndexError, struct.error):
        return None
    return digest.hexdigest()[:24] if found else None


def _entries(mm, n_kv: int):
    """The header's N_KV key-value entries, from byte 24: (key, value, start, end), [start, end) the entry's bytes."""
    pos = 24
    for _ in range(n_kv):
        start = pos
        key, pos = _string(mm, pos)
        (vtype,) = struct.unpack_from("<I", mm, pos)
        value, pos = _value(mm, pos + 4, vtype)
        yield key, value, start, pos


def _string(mm, pos: int) -> tuple[str, int]:
    (n,) = struct.unpack_from("<Q", mm, pos)
    if n > 1 << 24:
        raise ValueError("string too long")
    if pos + 8 + n > len(mm):
        raise IndexError("string runs past the end of the file")
    return bytes(mm[pos + 8 : pos + 8 + n]).decode("utf-8"), pos + 8 + n


def _value(mm, pos: int, vtype: int) -> tuple[object, int]:
    if vtype in _SCALARS:
        fmt = _SCALARS[vtype]
        return struct.unpack_from(fmt, mm, pos)[0], pos + struct.calcsize(fmt)
    if vtype == 8:
        return _string(mm, pos)
    if vtype == 9:
        (etype, count) = struct.unpack_from("<IQ", mm, pos)
        pos += 12
        if etype in _SCALARS:
            width = struct.calcsize(_SCALARS[etype])
            values = list(struct.unpack_from(f"<{count}{_SCALARS[etype][1]}", mm, pos)) if count <= 4096 else None
            return values, pos + width * count
        if etype == 8:  # arrays of strings (the vocabulary) are skipped, not kept
            unpack = _LENGTH.unpack_from
            for _ in range(count):
                pos += 8 + unpack(mm, pos)[0]
            if pos > len(mm):
                raise IndexError("an array runs past the end of the file")
            return None, pos
        for _ in range(count):  # arrays of arrays
            _, pos = _value(mm, pos, etype)
        return None, pos
    raise ValueError(f"unknown GGUF value type {vtype}")
