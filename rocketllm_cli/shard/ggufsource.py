"""A GGUF checkpoint read one tensor at a time, through transformers' own GGUF name mapping and tensor processors.

The `gguf` package maps the file lazily; each tensor is dequantized only when the sharder asks for it, so
sharding a GGUF holds about one unit in memory, like a safetensors checkpoint, instead of the whole
dequantized model. Names and per-architecture fixes (Llama's Q/K permutation, Gemma's norm offset ...)
come from transformers (`get_gguf_hf_weights_map`, `TENSOR_PROCESSORS`), so no architecture is named here.
A processor that rewrites the tensor set itself (it stores into `parsed_parameters`: fused MoE experts,
GPT-2's output head) cannot be read one tensor at a time; such a file is dequantized whole, as before.
"""

from __future__ import annotations

import functools
import inspect
import os
from contextlib import contextmanager
from pathlib import Path

import torch

from ..errors import ModelError

CHUNK_BYTES = 64 << 20  # fp32 bytes dequantized at once when a large tensor is read block by block


class LazyGGUF:
    """{transformers parameter name: GGUF tensor}; read(name) dequantizes that one tensor."""

    kind = "gguf"  # what shard/packing.py keeps: a GGUF's block types as they are stored (mode "blocks")

    def __init__(self, reader, processor, mapping: dict[str, str], shapes: dict) -> None:
        self.reader, self.processor = reader, processor
        self.mapping = mapping  # HF name -> GGUF tensor name
        self.shapes = shapes  # HF name -> (shape, dtype as stored: quantized tensors count as bf16)
        self._tensors = {t.name: t for t in reader.tensors}
        # what a quantized tensor read as floats is decoded into (the sharder sets the set's dtype): an fp32 set gets
        # gguf's exact values, not values rounded to bf16 on the way
        self.float_dtype: torch.dtype | None = None

    def read(self, name: str) -> torch.Tensor:
        """One tensor as transformers would load it; a large one the processor leaves alone is dequantized a
        block of rows at a time straight into its stored dtype, never whole in fp32 (a 70B embedding is 4 GiB)."""
        import numpy as np
        from gguf import dequantize

        tensor = self._tensors[self.mapping[name]]
        shape, dtype = self.shapes[name]
        if self.float_dtype is not None and tensor.tensor_type.name not in ("F32", "F16", "BF16", "F64"):
            dtype = self.float_dtype
        rows = tensor.data.shape[0] if tensor.data.ndim > 1 else 0
        if rows > 1 and 4 * int(tensor.n_elements) > CHUNK_BYTES and self._leaves_alone(tensor, rows):
            out = torch.empty((rows, int(tensor.n_elements) // rows), dtype=dtype)
            step = max(1, rows * CHUNK_BYTES // (4 * int(tensor.n_elements)))
            for start in range(0, rows, step):
                block = dequantize(tensor.data[start : start + step], tensor.tensor_type)
                out[start : start + step] = torch.from_numpy(np.ascontiguousarray(block)).reshape(-1, out.shape[1])
            self._release(tensor)
            return out.reshape(shape)
        weights = dequantize(tensor.data, tensor.tensor_type)
        result = self.processor.process(
            weights=weights, name=tensor.name, tensor_key_mapping={}, parsed_parameters={"tensors": {}}
        )
        out = torch.from_numpy(np.array(result.weights))  # a copy: a float tensor may be a view of the mapping
        self._release(tensor)
        return out.reshape(shape) if tuple(out.shape) != tuple(shape) else out

    # -- packed: the blocks kept as they are -------------------------------------------
    def holds_kept_types(self) -> bool:
        """Whether any tensor is of a type kept packed."""
        from ..shard.packing import KEPT

        return any(t.tensor_type.name in KEPT for t in self._tensors.values())

    def auto_dtype(self) -> str:
        """The float dtype of a set keeping this file's blocks, as `shard --dtype auto` picks it (from the header's
        types: checkpoint/ggufheader.py blocks_set_dtype, which `doctor` sizes the set with too)."""
        from ..checkpoint.ggufheader import blocks_set_dtype

        return blocks_set_dtype(
            {t.name: (int(t.tensor_type), tuple(int(d) for d in t.shape)) for t in self._tensors.values()}
        )

    def packable(self, name: str, shape: tuple[int, int], int4_rows: int) -> bool:
        """Whether `name` can be stored packed: a kept type, rows = N of `shape`, only rows reordered by the
        processor."""
        from ..shard.packing import KEPT

        tensor = self._tensors[self.mapping[name]]
        if tensor.tensor_type.name not in KEPT or tensor.data.ndim != 2 or int(tensor.data.shape[0]) != shape[0]:
            return False
        if int(tensor.n_elements) != shape[0] * shape[1]:
            return False
        return self._row_order(tensor) is not False

    def packed_format(self, name: str):
        """The PackedFormat read_packed will give: the tensor's own blocks."""
        from gguf import GGML_QUANT_SIZES

        from ..checkpoint.packedformat import PackedFormat

        tensor = self._tensors[self.mapping[name]]
        block, block_bytes = GGML_QUANT_SIZES[tensor.tensor_type]
        return PackedFormat(
            "gguf", self.shapes[name][0], block, gguf_type=tensor.tensor_type.name, block_bytes=block_bytes
        )

    def read_packed(self, name: str):
        """The tensor's blocks in the portable packed layout (exact), rows in transformers' order."""
        from ..checkpoint.packedformat import PackedTensor
        from ..packed import from_gguf

        tensor = self._tensors[self.mapping[name]]
        packed = from_gguf(self._owned_bytes(tensor), tensor.tensor_type, raw=True, copy=False)
        order = self._row_order(tensor)
        if order is not None:
            index = torch.from_numpy(order)
            packed = PackedTensor(packed.format, {part: t.index_select(0, index) for part, t in packed.parts.items()})
        self._release(tensor)  # the parts are copies: dropping the mapped pages loses nothing
        return packed

    # -- in place: where a tensor's bytes are in the file (shard/indexing.py) ----------------
    def place(self, name: str):
        """(absolute offset, bytes, row order) of a kept tensor's blocks in the file; the order is None where
        transformers takes the rows as they are, an index array where it only reorders them, False otherwise."""
        tensor = self._tensors[self.mapping[name]]
        return int(tensor.data_offset), int(tensor.n_bytes), self._row_order(tensor)

    def place_float(self, name: str, dtype: torch.dtype) -> tuple[int, int] | None:
        """(absolute offset, bytes) of a float tensor stored in DTYPE that transformers takes as it is; None where
        it is stored in another type or changed on its way in."""
        from ..dtypes import torch_dtype

        tensor = self._tensors[self.mapping[name]]
        stored = {"F32": "fp32", "F16": "fp16", "BF16": "bf16"}.get(tensor.tensor_type.name)
        if stored is None or torch_dtype(stored) != dtype:
            return None
        rows = int(tensor.data.shape[0]) if tensor.data.ndim > 1 else int(tensor.n_elements)
        if not self._leaves_alone(tensor, rows):
            return None
        return int(tensor.data_offset), int(tensor.n_bytes)

    def _owned_bytes(self, tensor):
        """The tensor's bytes as an array of its own, read from the file in one call: copying them off the mapping
        faults it in a page at a time (200 MB/s here, against several GB/s for a read of the cached file)."""
        import numpy as np

        view = tensor.data
        filename = getattr(self.reader.data, "filename", None)
        if view.dtype != np.uint8 or filename is None:
            return np.array(view, copy=True)
        out = np.empty(view.shape, dtype=np.uint8)
        buffer, done = memoryview(out).cast("B"), 0
        with open(filename, "rb", buffering=0) as f:
            while done < len(buffer):
                got = os.preadv(f.fileno(), [buffer[done:]], int(tensor.data_offset) + done)
                if got <= 0:
                    raise ModelError(f"{Path(filename).name}: tensor {tensor.name} ends past the end of the file")
                done += got
        return out

    def _release(self, tensor) -> None:
        """Drop the file's pages this tensor was read from out of the process: the mapping would otherwise keep
        every tensor read so far resident (its RSS growing to the whole file). The page cache keeps them."""
        import mmap

        mm = getattr(self.reader.data, "_mmap", None)
        if mm is None or not hasattr(mm, "madvise"):
            return
        page = mmap.PAGESIZE
        start = int(tensor.data_offset) // page * page
        end = int(tensor.data_offset) + int(tensor.n_bytes)
        try:
            mm.madvise(mmap.MADV_DONTNEED, start, end - start)
        except (OSError, ValueError):
            pass

    def _row_order(self, tensor):
        """None: the processor leaves the rows alone; an index array: it only reorders them; False: it does more."""
        import numpy as np

        rows = int(tensor.data.shape[0])
        probe = np.arange(rows, dtype=np.float32).reshape(rows, 1)
        try:
            result = self.processor.process(
                weights=probe.copy(), name=tensor.name, tensor_key_mapping={}, parsed_parameters={"tensors": {}}
            )
        except Exception:  # noqa: BLE001 - it needs the real tensor: not a pure reordering
            return False
        got = np.asarray(result.weights)
        if result.name != tensor.name or got.shape != probe.shape:
            return False
        order = got.reshape(-1)
        if np.array_equal(order, probe.reshape(-1)):
            return None
        if not np.array_equal(np.sort(order), probe.reshape(-1)):
            return False
        return order.astype(np.int64)

    def _leaves_alone(self, tensor, rows: int) -> bool:
        """Whether the processor returns this tensor unchanged: asked with a read-only stand-in that costs no memory."""
        import numpy as np

        probe = np.broadcast_to(np.zeros((), dtype=np.float32), (rows, int(tensor.n_elements) // rows))
        try:
            result = self.processor.process(
                weights=probe, name=tensor.name, tensor_key_mapping={}, parsed_parameters={"tensors": {}}
            )
        except Exception:  # noqa: BLE001 - it wanted to change the tensor: take the whole-tensor path
            return False
        return result.weights is probe and result.name == tensor.name


@contextmanager
def _one_name_map():
    """transformers' name mapping walks every submodule and builds gguf's whole TensorNameMap at each (hundreds of
    times, ~10 s for a 30-layer model); the map depends only on (architecture, layers), so build it once."""
    import gguf

    original = gguf.get_tensor_name_map
    gguf.get_tensor_name_map = functools.lru_cache(maxsize=None)(original)
    try:
        yield
    finally:
        gguf.get_tensor_name_map = original


@contextmanager
def shared_reader(path: Path):
    """Within the block, every `gguf.GGUFReader(path)` (transformers' config, tokenizer and weight loading, and
    open_lazy) is one reader, ggufreader.FastReader: the header parsed once, in milliseconds. Yields a function that
    gives that reader."""
    import gguf

    from .ggufreader import FastReader

    original = gguf.GGUFReader
    target = os.path.realpath(path)
    made: list = []

    def reader(file=path, mode="r"):
        if mode == "r" and os.path.realpath(os.fspath(file)) == target:
            if not made:
                made.append(FastReader(file, mode))
            return made[0]
        return original(file, mode)

    gguf.GGUFReader = reader
    try:
        yield reader
    finally:
        gguf.GGUFReader = original


def open_lazy(path: Path, config, meta_model) -> LazyGGUF | None:
    """A per-tensor reader of the GGUF at `path`, or None when its processor must see the whole file."""
    try:
        import gguf
        from gguf import GGMLQuantizationType
        from transformers.modeling_gguf_pytorch_utils import (
            TENSOR_PROCESSORS,
            TensorProcessor,
            get_gguf_hf_weights_map,
        )
    except ImportError:  # transformers without the per-tensor helpers: the whole-model path
        return None
    try:
        reader = gguf.GGUFReader(path)  # shared_reader's, where it is in effect
    except Exception as exc:  # noqa: BLE001 - a truncated or foreign file
        raise ModelError(f"{path.name}: not a readable GGUF model ({' '.join(str(exc).split())[:160]})") from None
    field = reader.fields.get("general.architecture")
    architecture = bytes(field.parts[field.data[0]]).decode("utf-8", "replace") if field is not None else ""
    processor_class = TENSOR_PROCESSORS.get(architecture, TensorProcessor)
    if _rewrites_tensor_set(processor_class):
        return None
    processor = processor_class(config=config.to_dict())
    # transformers 5 takes the processor; 4.x derives the names from the model type alone
    takes_processor = "processor" in inspect.signature(get_gguf_hf_weights_map).parameters
    try:
        with _one_name_map():
            gguf_to_hf = (
                get_gguf_hf_weights_map(meta_model, processor)
                if takes_processor
                else get_gguf_hf_weights_map(meta_model)
            )
    except (NotImplementedError, ValueError, KeyError):
        return None
    params = dict(meta_model.named_parameters(remove_duplicate=False))
    mapping: dict[str, str] = {}
    shapes: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    floats = {GGMLQuantizationType.F32: torch.float32, GGMLQuantizationType.F16: torch.float16}
    bf16 = getattr(GGMLQuantizationType, "BF16", None)
    if bf16 is not None:
        floats[bf16] = torch.bfloat16
    for tensor in reader.tensors:
        hf = gguf_to_hf.get(tensor.name)
        if hf is None:
            continue
        stored = tuple(int(d) for d in reversed(tensor.shape))  # GGUF lists dimensions innermost first
        want = tuple(params[hf].shape) if hf in params else stored
        numel = 1
        for d in stored:
            numel *= d
        want_numel = 1
        for d in want:
            want_numel *= d
        mapping[hf] = tensor.name
        # quantized tensors are dequantized to a float type; as stored, they count as 16-bit
        shapes[hf] = (want if numel == want_numel else stored, floats.get(tensor.tensor_type, torch.bfloat16))
    reader.fields.clear()  # the vocabulary alone is ~10^5 small arrays; only the tensors are needed from here on
    return LazyGGUF(reader, processor, mapping, shapes)


def _rewrites_tensor_set(processor_class) -> bool:
    """Whether transformers' processor for this architecture merges, splits or renames tensors on its own."""
    try:
        source = inspect.getsource(processor_class.process)
    except (OSError, TypeError):
        return True  # cannot tell: take the path that is right for every processor
    overridden = "perform_fallback_tensor_mapping" in processor_class.__dict__
    return "parsed_parameters" in source or overridden
