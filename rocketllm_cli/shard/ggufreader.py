"""gguf's GGUFReader, built in a fraction of the time: the same fields and tensors, for transformers and for us.

gguf's reader makes every metadata value its own numpy memmap slice, twice per string: a 262,144-token vocabulary
is ~800,000 of them and 10 s before the first tensor is known. `FastReader` scans the header with `struct` and
makes a value's parts only when they are asked for (a vocabulary's parts are read by the tokenizer conversion, not
by the config or the tensor map). Tensors are gguf's own `ReaderTensor`s over the same mapping, so every caller
(transformers' config and tokenizer, `gguf.dequantize`, ggufsource.py) sees what gguf's reader would give.

`config_fields()` is the metadata a config is made from: everything but the tokenizer's arrays (the vocabulary,
scores, token types and merges), which no config key reads; where the architecture declares no vocab_size of its own,
transformers counts the tokens: it gets the count as that field instead (or the vocabulary, where it would not read
that field for the architecture).
"""

from __future__ import annotations

import struct
from collections import OrderedDict
from collections.abc import Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np
from gguf import GGUFReader, GGUFValueType
from gguf.gguf_reader import ReaderField

_STRING, _ARRAY = int(GGUFValueType.STRING), int(GGUFValueType.ARRAY)


class _ArrayParts(Sequence):
    """The parts gguf's reader lists for an array value, made on access: [key length, key, value type, element type,
    count] then each element's parts (a string: its length and its bytes; a number: one element)."""

    def __init__(
        self, head: list, plain: np.ndarray, starts: np.ndarray | None, first: int, count: int, dtype: np.dtype | None
    ) -> None:
        self._head, self._plain, self._starts = head, plain, starts
        self._first, self._count, self._dtype = first, count, dtype
        self._per = 2 if starts is not None else 1

    def __len__(self) -> int:
        return len(self._head) + self._per * self._count

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        if index < 0:
            index += len(self)
        if index < len(self._head):
            return self._head[index]
        element, which = divmod(index - len(self._head), self._per)
        if not 0 <= element < self._count:
            raise IndexError(index)
        if self._starts is None:  # a number: one element of the array's type
            width = self._dtype.itemsize
            at = self._first + element * width
            return self._plain[at : at + width].view(self._dtype)
        at = int(self._starts[element])
        length = self._plain[at : at + 8].view(np.uint64)
        return length if which == 0 else self._plain[at + 8 : at + 8 + int(length[0])]


class FastReader(GGUFReader):
    """gguf.GGUFReader with the metadata scanned by struct and array values' parts made on access."""

    def __init__(self, path, mode: str = "r") -> None:
        self._plain: np.ndarray | None = None
        super().__init__(path, mode)

    def _get(self, offset: int, dtype, count: int = 1, override_order=None) -> np.ndarray:
        if self.byte_order != "I" or override_order not in (None, "<"):  # a file of the other byte order: gguf's way
            return super()._get(offset, dtype, count, override_order)
        if self._plain is None:
            self._plain = self.data.view(np.ndarray)  # slices of a plain view cost a tenth of the memmap's
        dtype = np.dtype(dtype)
        count = int(count)
        return self._plain[offset : offset + dtype.itemsize * count].view(dtype)[:count]

    def _build_fields(self, offs: int, count: int) -> int:
        if self.byte_order != "I":
            return super()._build_fields(offs, count)
        self._get(0, np.uint8)  # makes the plain view
        plain = self._plain
        buffer = memoryview(plain)
        for _ in range(int(count)):
            start = offs
            key_length = self._get(offs, np.uint64)
            key = bytes(buffer[offs + 8 : offs + 8 + int(key_length[0])])
            offs += 8 + int(key_length[0])
            head = [key_length, self._get(start + 8, np.uint8, int(key_length[0])), self._get(offs, np.uint32)]
            (value_type,) = struct.unpack_from("<I", buffer, offs)
            offs += 4
            if value_type != _ARRAY:
                size, parts, data, types = self._get_field_parts(offs, value_type)
                field = ReaderField(start, key.decode("utf-8"), head + parts, [i + len(head) for i in data], types)
                offs += size
            else:
                field, offs = self._array_field(start, key.decode("utf-8"), head, offs, buffer)
            self._push_field(field, skip_sum=True)
        return offs

    def _array_field(self, start: int, name: str, head: list, offs: int, buffer) -> tuple[ReaderField, int]:
        element_type, count = struct.unpack_from("<IQ", buffer, offs)
        head = head + [self._get(offs, np.uint32), self._get(offs + 4, np.uint64)]
        first = offs + 12
        types = [GGUFValueType.ARRAY]
        if element_type == _STRING:
            starts = np.empty(count, dtype=np.int64)
            pos = first
            unpack = struct.Struct("<Q").unpack_from
            for i in range(count):
                starts[i] = pos
                pos += 8 + unpack(buffer, pos)[0]
            parts = _ArrayParts(head, self._plain, starts, first, count, None)
            data = range(len(head) + 1, len(head) + 2 * count, 2)
        else:
            dtype = np.dtype(self.gguf_scalar_to_np.get(GGUFValueType(element_type)) or np.void)
            if dtype == np.void:  # nested arrays: gguf's own walk
                size, parts, data, sub_types = self._get_field_parts(offs, _ARRAY)
                return ReaderField(start, name, head[:3] + parts, [i + 3 for i in data], sub_types), offs + size
            pos = first + dtype.itemsize * count
            parts = _ArrayParts(head, self._plain, None, first, count, dtype)
            data = range(len(head), len(head) + count)
        if count:
            types.append(GGUFValueType(element_type))
        return ReaderField(start, name, parts, data, types), pos

    # -- what a config is made from ----------------------------------------------------------------------------
    def config_fields(self) -> OrderedDict[str, ReaderField]:
        """The fields without the tokenizer's arrays (kept: the vocabulary, where no `{arch}.vocab_size` is given)."""
        arch_field = self.fields.get("general.architecture")
        arch = bytes(arch_field.parts[arch_field.data[0]]).decode("utf-8") if arch_field is not None else ""
        keep_vocabulary = f"{arch}.vocab_size" not in self.fields
        tokens = self.fields.get("tokenizer.ggml.tokens")
        counted = None
        if keep_vocabulary and tokens is not None and _maps_vocab_size(arch):
            # what transformers would count from the vocabulary (262,144 strings parsed one by one: 1.5 s for Gemma 3),
            # given as the field it reads first
            counted = ReaderField(
                tokens.offset,
                f"{arch}.vocab_size",
                [np.array([len(tokens.data)], dtype=np.uint32)],
                [0],
                [GGUFValueType.UINT32],
            )
            keep_vocabulary = False
        out: OrderedDict[str, ReaderField] = OrderedDict()
        for key, field in self.fields.items():
            array = bool(field.types) and field.types[0] == GGUFValueType.ARRAY
            if array and key.startswith("tokenizer.") and not (keep_vocabulary and key == "tokenizer.ggml.tokens"):
                continue
            out[key] = field
        if counted is not None:
            out[counted.name] = counted
        return out

    @contextmanager
    def for_config(self):
        """Within the block, `fields` is config_fields(): what transformers' config reads, parsed in milliseconds."""
        full = self.fields
        self.fields = self.config_fields()
        try:
            yield self
        finally:
            self.fields = full


def _maps_vocab_size(arch: str) -> bool:
    """Whether transformers makes the config's vocab_size from `{arch}.vocab_size` for this architecture."""
    try:
        from transformers.integrations.ggml import GGUF_CONFIG_MAPPING
    except ImportError:
        return False
    return (GGUF_CONFIG_MAPPING.get(arch) or {}).get("vocab_size") == "vocab_size"


def field_value(field: ReaderField) -> Any:
    """A scalar or string field's value (None for an array)."""
    if not field.types or field.types[0] == GGUFValueType.ARRAY:
        return None
    part = field.parts[field.data[0]]
    return bytes(part).decode("utf-8") if field.types[0] == GGUFValueType.STRING else part.tolist()[0]
