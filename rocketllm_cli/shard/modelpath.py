"""model_facts_from_path: ModelFacts for a shard directory, a Hugging Face directory, or a .gguf file.

Only headers and configs are read (no torch, no transformers), so `doctor --model` stays fast.
"""

from __future__ import annotations

import json
import re
import struct
from collections import defaultdict
from pathlib import Path

from ..dtypes import ITEMSIZE, short_name
from ..errors import ModelError
from ..profiles.report.redact import redact
from .ggufheader import FILE_TYPES, read_gguf
from .modelfacts import ModelFacts

# a repeated stack: "<prefix>.<index>.<rest>", e.g. model.layers.3.mlp..., transformer.h.3..., blk.3...
_STACK = re.compile(r"^(?P<prefix>(?:.*\.)?(?:layers|h|blocks|block|blk))\.(?P<index>\d+)\.")


def model_facts_from_path(path: Path) -> ModelFacts:
    """Sizes of the model at `path`: a shard directory (manifest.json), a HF directory (config.json +
    *.safetensors), or a .gguf file. Raises ModelError with one line when it is none of these."""
    try:
        return _facts_from_path(Path(path).expanduser())
    except ModelError as exc:
        raise ModelError(redact(str(exc))) from None  # messages name paths; keep user and home out of them


def _facts_from_path(path: Path) -> ModelFacts:
    if not path.exists():
        raise ModelError(f"model path not found: {path}")
    if path.is_file() and path.suffix == ".gguf":
        return _from_gguf(path)
    if not path.is_dir():
        raise ModelError(f"{path.name}: expected a model directory or a .gguf file")
    if (path / "manifest.json").is_file():
        return _from_manifest(path)
    files = sorted(path.glob("*.safetensors"))
    if files and (path / "config.json").is_file():
        sizes: dict[str, int] = {}
        for f in files:
            sizes.update(_safetensors_sizes(f))
        return _facts(path.name, sizes, _config(path / "config.json"))
    ggufs = sorted(path.glob("*.gguf"))
    if len(ggufs) == 1:
        return _from_gguf(ggufs[0])
    raise ModelError(f"{path.name}: no manifest.json, no config.json with *.safetensors, and no single .gguf file")


def _from_manifest(path: Path) -> ModelFacts:
    try:
        doc = json.loads((path / "manifest.json").read_text(encoding="utf-8"))
        units = [(u["kind"], u.get("index", -1), sum(t["nbytes"] for t in u["tensors"])) for u in doc["units"]]
    except (OSError, ValueError, KeyError, TypeError):
        raise ModelError(f"{path.name}/manifest.json is unreadable; re-run `rocketllm shard`") from None
    experts_of: dict = defaultdict(int)  # layer index -> its experts' bytes
    for kind, index, nbytes in units:
        if kind == "expert":
            experts_of[index] += nbytes
    # a layer as stored: its dense part and all of its experts (layers are in index order)
    layers = [nbytes + experts_of[i] for i, nbytes in enumerate(b for kind, _, b in units if kind == "layer")]
    if not layers:
        raise ModelError(f"{path.name}/manifest.json lists no decoder layers")
    config = _config(path / "config.json") if (path / "config.json").is_file() else doc.get("config", {})
    total = sum(b for _, _, b in units)
    name = (doc.get("source") or {}).get("name") or path.name
    experts = sum(b for kind, _, b in units if kind == "expert")
    return _build(name, total, layers, max(b for _, _, b in units), config, (short_name(doc.get("dtype", "")) or str(doc.get("dtype", ""))),
                  experts)


def _from_gguf(path: Path) -> ModelFacts:
    meta, sizes = read_gguf(path)
    arch = str(meta.get("general.architecture", ""))

    def get(key: str, default=None):
        value = meta.get(f"{arch}.{key}", default)
        return max(value) if isinstance(value, list) and value else value  # per-layer arrays: the largest

    heads = get("attention.head_count", 0) or 0
    config = {
        "num_hidden_layers": get("block_count"),
        "max_position_embeddings": get("context_length"),
        "num_attention_heads": heads,
        "num_key_value_heads": get("attention.head_count_kv", heads),
        "head_dim": get("attention.key_length") or (get("embedding_length", 0) // heads if heads else None),
    }
    dtype = "gguf-" + FILE_TYPES.get(meta.get("general.file_type"), str(meta.get("general.file_type", "?")))
    return _facts(path.stem, sizes, config, dtype)


def _facts(name: str, sizes: dict[str, int], config: dict, dtype: str | None = None) -> ModelFacts:
    """Group tensors into units: each index of the largest repeated stack is a layer; the rest by module."""
    stacks: dict[str, dict[int, int]] = defaultdict(lambda: defaultdict(int))
    others: dict[str, int] = defaultdict(int)
    for tensor, nbytes in sizes.items():
        m = _STACK.match(tensor)
        if m:
            stacks[m["prefix"]][int(m["index"])] += nbytes
        else:
            others[tensor.rsplit(".", 1)[0]] += nbytes
    if not stacks:
        raise ModelError(f"{name}: no repeated layer stack found in the tensor names")
    decoder = max(stacks, key=lambda p: sum(stacks[p].values()))  # a vision tower is a smaller stack
    for prefix, layers in stacks.items():
        if prefix != decoder:
            others.update({f"{prefix}.{i}": b for i, b in layers.items()})
    layers = list(stacks[decoder].values())
    largest = max([*layers, *others.values()])
    experts = sum(b for tensor, b in sizes.items() if ".experts." in tensor)
    return _build(name, sum(sizes.values()), layers, largest, config, dtype or short_name(_dtype_of(config)) or "bf16", experts)


def _build(name: str, total: int, layers: list[int], largest: int, config: dict, dtype: str, expert_bytes: int = 0) -> ModelFacts:
    text = config.get("text_config") or config  # multimodal configs nest the decoder's
    count = next((text[k] for k in ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts") if text.get(k)), None)
    top_k = next((text[k] for k in ("num_experts_per_tok", "moe_top_k") if text.get(k)), None)
    active = None
    if expert_bytes and isinstance(count, int) and isinstance(top_k, int) and 0 < top_k < count:
        active = int(total - expert_bytes * (1 - top_k / count))  # a decode token reads top_k of count experts per layer
    heads = text.get("num_attention_heads") or text.get("n_head") or 0
    kv_heads = text.get("num_key_value_heads") or heads
    head_dim = text.get("head_dim") or ((text.get("hidden_size") or text.get("n_embd") or 0) // heads if heads else 0)
    num_layers = text.get("num_hidden_layers") or text.get("n_layer") or len(layers)
    positions = text.get("max_position_embeddings") or text.get("n_positions") or text.get("max_seq_len") or 0
    return ModelFacts(
        name=name,
        total_bytes=int(total),
        num_layers=len(layers),
        layer_bytes=max(layers),
        largest_unit_bytes=int(largest),
        non_layer_bytes=int(total - sum(layers)),
        kv_bytes_per_token=int(num_layers * 2 * kv_heads * head_dim * ITEMSIZE.get(dtype, 2)),  # K and V in the stored dtype (16-bit for quantized weights)
        max_positions=int(positions),
        dtype=dtype or "unknown",
        active_bytes=active,
    )


def _safetensors_sizes(path: Path) -> dict[str, int]:
    try:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > 100 * 1024**2:
                raise ValueError("header too large")
            header = json.loads(f.read(n))
        return {k: v["data_offsets"][1] - v["data_offsets"][0] for k, v in header.items() if k != "__metadata__"}
    except (OSError, ValueError, KeyError, TypeError, IndexError, struct.error):
        raise ModelError(f"{path.name}: not a readable safetensors file") from None


def _config(path: Path) -> dict:
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        raise ModelError(f"{path.parent.name}/config.json is unreadable") from None
    if not isinstance(config, dict):
        raise ModelError(f"{path.parent.name}/config.json is not a JSON object")
    return config


def _dtype_of(config: dict) -> str:
    text = config.get("text_config") or config
    return str(text.get("torch_dtype") or text.get("dtype") or config.get("torch_dtype") or config.get("dtype") or "")
