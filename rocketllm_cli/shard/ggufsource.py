"""A GGUF checkpoint read one tensor at a time, through transformers' own GGUF name mapping and tensor processors.

The `gguf` package maps the file lazily; each tensor is dequantized only when the sharder asks for it, so
sharding a GGUF holds about one unit in memory, like a safetensors checkpoint, instead of the whole
dequantized model. Names and per-architecture fixes (Llama's Q/K permutation, Gemma's norm offset ...)
come from transformers (`get_gguf_hf_weights_map`, `TENSOR_PROCESSORS`), so no architecture is named here.
A processor that rewrites the tensor set itself (it stores into `parsed_parameters`: fused MoE experts,
GPT-2's output head) cannot be read one tensor at a time; such a file is dequantized whole, as before.
"""

from __future__ import annotations

import inspect
from pathlib import Path

import torch

from ..errors import ModelError

CHUNK_BYTES = 64 << 20  # fp32 bytes dequantized at once when a large tensor is read block by block


class LazyGGUF:
    """{transformers parameter name: GGUF tensor}; read(name) dequantizes that one tensor."""

    def __init__(self, reader, processor, mapping: dict[str, str], shapes: dict) -> None:
        self.reader, self.processor = reader, processor
        self.mapping = mapping  # HF name -> GGUF tensor name
        self.shapes = shapes  # HF name -> (shape, dtype as stored: quantized tensors count as bf16)
        self._tensors = {t.name: t for t in reader.tensors}

    def read(self, name: str) -> torch.Tensor:
        """One tensor as transformers would load it; a large one the processor leaves alone is dequantized a
        block of rows at a time straight into its stored dtype, never whole in fp32 (a 70B embedding is 4 GiB)."""
        import numpy as np
        from gguf import dequantize

        tensor = self._tensors[self.mapping[name]]
        shape, dtype = self.shapes[name]
        rows = tensor.data.shape[0] if tensor.data.ndim > 1 else 0
        if rows > 1 and 4 * int(tensor.n_elements) > CHUNK_BYTES and self._leaves_alone(tensor, rows):
            out = torch.empty((rows, int(tensor.n_elements) // rows), dtype=dtype)
            step = max(1, rows * CHUNK_BYTES // (4 * int(tensor.n_elements)))
            for start in range(0, rows, step):
                block = dequantize(tensor.data[start : start + step], tensor.tensor_type)
                out[start : start + step] = torch.from_numpy(np.ascontiguousarray(block)).reshape(-1, out.shape[1])
            return out.reshape(shape)
        weights = dequantize(tensor.data, tensor.tensor_type)
        result = self.processor.process(weights=weights, name=tensor.name, tensor_key_mapping={}, parsed_parameters={"tensors": {}})
        out = torch.from_numpy(np.ascontiguousarray(result.weights))
        return out.reshape(shape) if tuple(out.shape) != tuple(shape) else out

    def _leaves_alone(self, tensor, rows: int) -> bool:
        """Whether the processor returns this tensor unchanged: asked with a read-only stand-in that costs no memory."""
        import numpy as np

        probe = np.broadcast_to(np.zeros((), dtype=np.float32), (rows, int(tensor.n_elements) // rows))
        try:
            result = self.processor.process(weights=probe, name=tensor.name, tensor_key_mapping={}, parsed_parameters={"tensors": {}})
        except Exception:  # noqa: BLE001 - it wanted to change the tensor: take the whole-tensor path
            return False
        return result.weights is probe and result.name == tensor.name


def open_lazy(path: Path, config, meta_model) -> LazyGGUF | None:
    """A per-tensor reader of the GGUF at `path`, or None when its processor must see the whole file."""
    try:
        from gguf import GGMLQuantizationType, GGUFReader
        from transformers.modeling_gguf_pytorch_utils import (
            TENSOR_PROCESSORS,
            TensorProcessor,
            get_gguf_hf_weights_map,
        )
    except ImportError:  # transformers without the per-tensor helpers: the whole-model path
        return None
    try:
        reader = GGUFReader(path)
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
        gguf_to_hf = get_gguf_hf_weights_map(meta_model, processor) if takes_processor else get_gguf_hf_weights_map(meta_model)
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
