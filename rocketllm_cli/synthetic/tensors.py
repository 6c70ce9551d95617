"""Which tensors a checkpoint holds, read from the model itself, and their synthetic values.

Names and shapes come from a meta-device model passed through the same two steps
`save_pretrained` applies: drop tied aliases (only the kept name of each tied group
is written) and revert transformers' load-time weight conversions (transformers 5
fuses MoE experts into 3D tensors when loading and splits them back when saving).
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Iterator

import torch

CHUNK_ELEMENTS = 1 << 22  # values are made and written 4M elements at a time


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    layer: int | None  # index in the repeated decoder stack; None for embeddings, final norm, head
    kind: str  # "embedding" (input), "matrix", "norm" (other 1-D weights) or "bias": decides the values

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def meta_model(config):
    """The causal-LM module tree for `config`, with every parameter on the meta device."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def saved_tensors(config) -> list[TensorSpec]:
    """What `model.save_pretrained` writes for `config`, ordered: embeddings, layer 0..N-1, the rest."""
    model = meta_model(config)
    state = model.state_dict()
    module_order = {name: i for i, name in enumerate(state)}
    saved = _revert_conversions(model, _drop_tied(state, model))
    stack = _stack_prefix(model, config)
    embedding = next(n for n, p in model.named_parameters() if p is model.get_input_embeddings().weight)
    first_layer = min((module_order[n] for n in state if n.startswith(stack)), default=0)

    placed = []
    for index, (name, tensor) in enumerate(saved.items()):
        layer = int(name[len(stack) :].split(".", 1)[0]) if name.startswith(stack) else None
        # Non-layer tensors keep their side of the stack; renamed ones (none so far) go after it.
        group = 1 if layer is not None else 0 if module_order.get(name, first_layer + 1) < first_layer else 2
        kind = "embedding" if name == embedding else "matrix" if tensor.dim() > 1 else "norm"
        kind = "bias" if kind == "norm" and name.endswith("bias") else kind
        spec = TensorSpec(name, tuple(tensor.shape), layer, kind)
        placed.append(((group, -1 if layer is None else layer, index), spec))
    return [spec for _, spec in sorted(placed, key=lambda item: item[0])]


def _stack_prefix(model, config) -> str:
    # The repeated decoder stack is the ModuleList with one entry per hidden layer: "model.layers.", "transformer.h."
    # ...
    num_layers = getattr(config, "num_hidden_layers", None)
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) == num_layers and name:
            return name + "."
    raise ValueError(f"cannot find the decoder stack of {type(model).__name__}")


def _drop_tied(state: dict, model) -> dict:
    try:
        from transformers.modeling_utils import remove_tied_weights_from_state_dict
    except ImportError:  # transformers 4.x: keep the first name of each group of shared parameters
        params = dict(model.named_parameters(remove_duplicate=False))
        seen: set[int] = set()
        kept = {}
        for name, tensor in state.items():
            ident = id(params.get(name, tensor))
            if ident not in seen:
                seen.add(ident)
                kept[name] = tensor
        return kept
    return remove_tied_weights_from_state_dict(state, model)


def _revert_conversions(model, state: dict) -> dict:
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:  # transformers 4.x has no load-time conversions
        return state
    return revert_weight_conversion(model, state)


def tensor_seed(seed: int, name: str, chunk: int = 0) -> int:
    """Values depend only on (seed, tensor name, chunk), so every layout of one seed holds the same weights."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{name}:{chunk}".encode()).digest()[:8], "little") & (2**63 - 1)


def chunk_count(spec: TensorSpec) -> int:
    return max(1, math.ceil(spec.numel / CHUNK_ELEMENTS))


def make_chunk(
    spec: TensorSpec,
    index: int,
    *,
    dtype: torch.dtype,
    seed: int,
    std: float,
    norm_value: float,
    embedding_std: float | None = None,
) -> torch.Tensor:
    """Chunk `index` of the flattened tensor: at most CHUNK_ELEMENTS values, each chunk seeded on its own
    so chunks can be made in parallel and a 30 GB model needs a few chunks of memory.

    Matrices ~ N(0, std), the input embedding ~ N(0, embedding_std or std); biases 0; norms `norm_value`.
    """
    size = min(CHUNK_ELEMENTS, spec.numel - index * CHUNK_ELEMENTS)
    if spec.kind in ("norm", "bias"):
        return torch.full((size,), norm_value if spec.kind == "norm" else 0.0, dtype=dtype)
    scale = embedding_std if spec.kind == "embedding" and embedding_std is not None else std
    generator = torch.Generator().manual_seed(tensor_seed(seed, spec.name, index))
    return torch.empty(size, dtype=dtype).normal_(0.0, scale, generator=generator)


def tensor_chunks(spec: TensorSpec, **values) -> Iterator[torch.Tensor]:
    """The tensor's values as flat chunks, in order; `values` as for make_chunk."""
    for index in range(chunk_count(spec)):
        yield make_chunk(spec, index, **values)


def tensor_values(spec: TensorSpec, **kwargs) -> torch.Tensor:
    """The whole tensor (tiny models and tests only); the same values the writers store."""
    return torch.cat(list(tensor_chunks(spec, **kwargs))).reshape(spec.shape)
