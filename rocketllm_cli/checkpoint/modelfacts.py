"""ModelFacts: what the knob formulas and the cost model need to know about a model, built in one place.

Whatever form the model comes in (a Hugging Face directory: safetensors headers + config.json; a .gguf
file; a shard set: its manifest), its weights are grouped into units (each decoder layer's dense part, its
routed experts, everything else) and go with its config into one builder (`build_facts`).
Reading a path touches only headers and configs, never torch or transformers, so `doctor --model` is fast.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from ..dtypes import ITEMSIZE, short_name
from ..errors import ModelError, ShardError
from ..redact import redact
from .configfiles import config_dtype, read_config
from .configreads import DEFAULT_POSITIONS, POSITION_KEYS, architecture_of, config_int, expert_count, top_k
from .ggufheader import (
    FILE_TYPES,
    GGML_NAMES,
    kept_as_blocks,
    read_gguf_tensors,
    shard_sizes,
)
from .stfile import read_header
from .units import Units, lookup_tables, manifest_units, named_lookup_tables, tensor_units


@dataclass(frozen=True)
class ModelFacts:
    """Sizes of a model as stored in its shards (or as described by --model-size/--weight-bits)."""

    name: str
    total_bytes: int  # all weights, as stored
    num_layers: int  # decoder layers in the repeated stack
    layer_bytes: int  # the largest decoder layer, its dense part and all of its experts
    largest_unit_bytes: int  # the largest unit of any kind (a layer's dense part, one expert, embed, lm_head ...)
    non_layer_bytes: int  # embed, norm, lm_head and extras together
    kv_bytes_per_token: int  # K and V for every layer, per token, in the compute dtype (the stored one when not given)
    max_positions: int  # the context the config allows
    dtype: str = "bf16"
    gguf_blocks: bool = False  # low-bit weights kept as a GGUF's blocks: a CPU computes them in fp32 (derivation.py)
    architecture: str = ""  # the decoder's model type ("llama", "gemma3"), where the config or header names it
    # {GGML type name: {"NxK": bytes}}: the set's tensors kept as that type's blocks, by product shape (a weight of N
    # rows of K elements), summed over the tensors of that shape (a GGUF set); None: no blocks
    block_bytes: dict | None = None
    # mixture-of-experts: what one decode token reads (dense part + routed experts); None = every weight
    active_bytes: int | None = None
    # What really grows with the context (max_context divides by it): K and V values per token of the layers whose
    # cache keeps every token (full attention), how many such layers, and what sliding-window layers hold at most.
    # Linear-attention, convolution and Mamba layers keep a fixed state, counted in neither. 0 = not known.
    kv_values_per_token: int = 0
    kv_growing_layers: int = 0
    kv_window_values: int = 0
    kv_head_dim: int = 0
    # The widths a layer's and a token's own work grow with, where the config gives them (the layer-cost probe's)
    layer_shape: dict | None = None
    # Bytes of the tables a token only looks rows up in (an untied input embedding, units.py): no product
    lookup_bytes: int = 0
    # How this machine reads the set's own units cold (profiles/probe/unitreads.py, UnitReads.to_dict()), where the
    # model streams from storage and it was measured; None: the storage probe's 16 MiB figures stand.
    unit_reads: dict | None = None
    # What a decode token of the set costs to compute here, as bench measured it resident
    # (profiles/probe/decodecompute.py); None: the cost model's matvec floor stands.
    decode_compute: dict | None = None
    # What the native kernels read per second here for block_bytes' types (profiles/probe/kernelrates.py rates());
    # None: not measured (the matvec floor stands for the blocks too).
    kernel_rates: dict | None = None
    # What a decoder layer costs here beside its products, from the sets bench measured on this machine
    # (profiles/probe/decodecompute.py layer_overhead); None: left out of the projection.
    layer_overhead: dict | None = None

    @property
    def bytes_per_token(self) -> int:
        return self.active_bytes if self.active_bytes is not None else self.total_bytes

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_size(cls, params: float, weight_bits: float, name: str | None = None) -> "ModelFacts":
        """Rough facts for a dense decoder of `params` parameters (doctor --model-size 70B --weight-bits 4).

        Shape rules of thumb from Llama-family models: layers = 20 * (params/1e9) ** 0.28 rounded,
        embed + head ~ 2 * vocab (128k) * hidden, KV per token with grouped-query attention (8 KV heads, head 128).
        """
        total = int(params * weight_bits / 8)
        num_layers = max(1, round(20 * (params / 1e9) ** 0.28))
        hidden = max(256, int((params / (12 * num_layers)) ** 0.5) // 128 * 128)
        non_layer = int(2 * 128_256 * hidden * weight_bits / 8)
        layer = max(1, (total - non_layer) // num_layers)
        kv = num_layers * 2 * 8 * 128 * 2
        return cls(
            name=name or f"{params / 1e9:g}B@{weight_bits:g}bit",
            total_bytes=total,
            num_layers=num_layers,
            layer_bytes=layer,
            largest_unit_bytes=max(layer, non_layer // 2),
            non_layer_bytes=non_layer,
            kv_bytes_per_token=kv,
            max_positions=131_072,
            dtype=f"{weight_bits:g}bit",
        )


# -- the one builder ---------------------------------------------------------------------------


def build_facts(
    name: str,
    units: Units,
    config,
    dtype: str,
    compute_dtype: str | None = None,
    gguf_blocks: bool = False,
    block_bytes: dict | None = None,
    lookup_bytes: int = 0,
) -> ModelFacts:
    """`config`: a mapping or a transformers config object, read only through config_int."""
    if not units.layers:
        raise ModelError(f"{name}: no decoder layers found")
    routed = sum(nbytes for nbytes, _ in units.experts.values())
    total = sum(units.layers.values()) + routed + sum(units.others)
    # what streaming a layer whole reads
    stored = [dense + units.experts.get(i, (0, 0))[0] for i, dense in units.layers.items()]
    one_expert = [-(-nbytes // count) for nbytes, count in units.experts.values()]
    # A decode token reads every dense weight and top-k of each layer's experts. Top-k unknown: every weight
    # (None), so the cost model never promises a speed the model cannot reach.
    k, active = top_k(config), None
    if units.experts and k:
        active = total - routed + sum(nbytes * min(k, count) // count for nbytes, count in units.experts.values())
    heads = config_int(config, ("num_attention_heads", "n_head")) or 0
    kv_heads = config_int(config, ("num_key_value_heads",)) or heads
    hidden = config_int(config, ("hidden_size", "n_embd")) or 0
    head_dim = config_int(config, ("head_dim",)) or (hidden // heads if heads else 0)
    # layers that keep a KV cache: the config's count (the weights may hold more, e.g. a multi-token-prediction layer)
    kv_layers = config_int(config, ("num_hidden_layers", "n_layer")) or len(units.layers)
    # K and V in the compute dtype when the caller knows it, else in the stored one (facts are built before the
    # knobs that pick the compute dtype); 16-bit for quantized weights, which compute in a 16-bit float
    itemsize = ITEMSIZE.get(compute_dtype or dtype, 2)
    growing, windowed, window = _kv_layer_kinds(config, kv_layers)
    per_layer = 2 * kv_heads * head_dim  # K and V values of one layer for one token
    shape = dict(hidden_size=hidden, num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim)
    shape["vocab_size"] = config_int(config, ("vocab_size",)) or 0
    return ModelFacts(
        name=name,
        total_bytes=total,
        num_layers=len(units.layers),
        layer_bytes=max(stored),
        largest_unit_bytes=max([*units.layers.values(), *one_expert, *units.others]),
        non_layer_bytes=total - sum(stored),
        kv_bytes_per_token=kv_layers * 2 * kv_heads * head_dim * itemsize,
        max_positions=config_int(config, POSITION_KEYS) or DEFAULT_POSITIONS,
        dtype=dtype or "unknown",
        gguf_blocks=gguf_blocks,
        architecture=architecture_of(config),
        block_bytes=block_bytes or None,
        active_bytes=active,
        kv_values_per_token=growing * per_layer,
        kv_growing_layers=growing,
        kv_window_values=windowed * window * per_layer,
        kv_head_dim=head_dim,
        layer_shape={k: v for k, v in shape.items() if v} or None,
        lookup_bytes=lookup_bytes,
    )


def _kv_layer_kinds(config, kv_layers: int) -> tuple[int, int, int]:
    """(layers keeping every token, sliding-window layers, their window) from the config's `layer_types`.

    Without layer types every layer counts as keeping every token: a window the cache may not apply is not
    a saving to promise."""
    text = (
        config.get("text_config") or config
        if isinstance(config, Mapping)
        else (config.get_text_config() if hasattr(config, "get_text_config") else config)
    )
    read = text.get if isinstance(text, Mapping) else (lambda key: getattr(text, key, None))
    types = read("layer_types")
    if not isinstance(types, (list, tuple)) or not types:
        return kv_layers, 0, 0
    window = config_int(config, ("sliding_window", "attention_chunk_size")) or 0
    windowed = sum(1 for t in types if window and isinstance(t, str) and ("sliding" in t or "chunked" in t))
    growing = sum(
        1
        for t in types
        if isinstance(t, str)
        and t in ("full_attention", "attention", "global_attention")
        or (not window and isinstance(t, str) and ("sliding" in t or "chunked" in t))
    )
    return growing, windowed, window


# -- the forms a model comes in ----------------------------------------------------------------


def facts_from_manifest(manifest, config, compute_dtype: str | None = None) -> ModelFacts:
    """ModelFacts of a loaded shard set (a Manifest); `config` is its config.json as a mapping, or the
    transformers config object (AutoConfig.from_pretrained(directory))."""
    units = manifest_units((u.kind, u.tensor_bytes) for u in manifest.units)
    tensors = [t for u in manifest.units for t in u.tensors]
    looked = lookup_tables(((u.kind, [t.name for t in u.tensors]) for u in manifest.units), manifest.aliases)
    blocks = _block_bytes((t.packed, t.nbytes) for t in tensors if t.name not in looked)
    return build_facts(
        manifest.source.get("name") or "model",
        units,
        config,
        manifest.dtype,
        compute_dtype,
        manifest.packing == "blocks",
        blocks,
        sum(t.nbytes for t in tensors if t.name in looked),
    )


def _block_bytes(rows) -> dict[str, dict[str, int]]:
    """{GGML type: {"NxK": bytes}} of the (packed record, bytes) ROWS kept as a GGUF type's blocks."""
    out: dict[str, dict[str, int]] = {}
    for packed, nbytes in rows:
        kind = packed.get("gguf_type") if isinstance(packed, dict) and packed.get("kind") == "gguf" else None
        shape = packed.get("shape") if kind else None
        if isinstance(shape, (list, tuple)) and len(shape) == 2:
            n, k = shape
            shapes = out.setdefault(kind, {})
            shapes[f"{n}x{k}"] = shapes.get(f"{n}x{k}", 0) + int(nbytes)
    return out


def model_facts_from_path(path: Path) -> ModelFacts:
    """Sizes of the model at `path`: a shard directory (manifest.json), a HF directory (config.json +
    *.safetensors), or a .gguf file. Raises ModelError with one line when it is none of these."""
    try:
        return _facts_of(Path(path).expanduser())
    except ModelError as exc:
        raise ModelError(redact(str(exc))) from None  # messages name paths; keep user and home out of them


def _facts_of(path: Path) -> ModelFacts:
    if not path.exists():
        raise ModelError(f"model path not found: {path}")
    if path.is_file() and path.suffix == ".gguf":
        return _from_gguf(path)
    if not path.is_dir():
        raise ModelError(f"{path.name}: expected a model directory or a .gguf file")
    if (path / "manifest.json").is_file():
        return _from_shard_dir(path)
    files = sorted(path.glob("*.safetensors"))
    if files and (path / "config.json").is_file():
        return _from_hf_dir(path, files)
    ggufs = sorted(path.glob("*.gguf"))
    if len(ggufs) == 1:
        return _from_gguf(ggufs[0])
    raise ModelError(f"{path.name}: no manifest.json, no config.json with *.safetensors, and no single .gguf file")


def _from_shard_dir(path: Path) -> ModelFacts:
    # manifest.json as JSON, not Manifest.load: that checks every unit file's header, which a size estimate does not
    # need
    try:
        doc = json.loads((path / "manifest.json").read_text(encoding="utf-8"))
        units = manifest_units((u["kind"], sum(t["nbytes"] for t in u["tensors"])) for u in doc["units"])
        tensors = [t for u in doc["units"] for t in u["tensors"]]
        looked = lookup_tables(
            ((u["kind"], [t["name"] for t in u["tensors"]]) for u in doc["units"]), doc.get("aliases") or {}
        )
        blocks = _block_bytes((t.get("packed"), t["nbytes"]) for t in tensors if t["name"] not in looked)
        looked_bytes = sum(t["nbytes"] for t in tensors if t["name"] in looked)
        dtype = short_name(doc.get("dtype", "")) or str(doc.get("dtype", ""))
        name = (doc.get("source") or {}).get("name") or path.name
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        raise ModelError(f"{path.name}/manifest.json is unreadable; re-run `rocketllm shard`") from None
    if not units.layers:
        raise ModelError(f"{path.name}/manifest.json lists no decoder layers")
    config = read_config(path / "config.json") if (path / "config.json").is_file() else {}
    packing = doc.get("packing") == "blocks"
    return build_facts(name, units, config, dtype, gguf_blocks=packing, block_bytes=blocks, lookup_bytes=looked_bytes)


def _from_hf_dir(path: Path, files: list[Path]) -> ModelFacts:
    sizes: dict[str, int] = {}
    elements: dict[str, int] = {}  # safetensors dtype -> elements stored in it
    for f in files:
        try:
            entries = read_header(f).entries
        except ShardError as exc:
            raise ModelError(str(exc)) from None
        for name, entry in entries.items():
            sizes[name] = entry.nbytes
            numel = 1
            for d in entry.shape:
                numel *= d
            elements[entry.stored] = elements.get(entry.stored, 0) + numel
    config = read_config(path / "config.json")
    # the dtype most weights are stored in, as `shard --dtype auto` picks it; the config's for other dtypes (fp8 ...)
    floating = {k: n for k, n in elements.items() if k.startswith(("F", "BF"))}
    dtype = short_name(max(floating, key=floating.get)) if floating else None
    return build_facts(
        path.name,
        tensor_units(path.name, sizes, expert_count(config)),
        config,
        dtype or short_name(config_dtype(config)) or "bf16",
        lookup_bytes=sum(sizes[n] for n in named_lookup_tables(sizes)),
    )


def _from_gguf(path: Path) -> ModelFacts:
    meta, _, infos = read_gguf_tensors(path)
    sizes = shard_sizes(infos)  # what streams is the shard set `shard` writes, not the GGUF's own blocks
    arch = str(meta.get("general.architecture", ""))

    def get(key: str, default=None):
        value = meta.get(f"{arch}.{key}", default)
        return max(value) if isinstance(value, list) and value else value  # per-layer arrays: the largest

    heads = get("attention.head_count", 0) or 0
    config = {
        "model_type": arch,
        "num_hidden_layers": get("block_count"),
        "max_position_embeddings": get("context_length"),
        "num_attention_heads": heads,
        "num_key_value_heads": get("attention.head_count_kv", heads),
        "head_dim": get("attention.key_length") or (get("embedding_length", 0) // heads if heads else None),
        "hidden_size": get("embedding_length"),
        "vocab_size": get("vocab_size") or (infos["token_embd.weight"][1][-1] if "token_embd.weight" in infos else 0),
    }
    dtype = "gguf-" + FILE_TYPES.get(meta.get("general.file_type"), str(meta.get("general.file_type", "?")))
    # an untied token embedding is looked up by rows, not multiplied (units.py lookup_tables)
    looked = {"token_embd.weight"} & set(infos) if "output.weight" in infos else set()
    kept = kept_as_blocks(infos) - looked
    blocks = _block_bytes(
        (
            {
                "kind": "gguf",
                "gguf_type": GGML_NAMES.get(infos[n][0], str(infos[n][0])),
                "shape": [infos[n][1][1], infos[n][1][0]],
            },
            sizes[n],
        )
        for n in kept
    )
    units = tensor_units(path.stem, sizes, None)
    lookup = sum(sizes[n] for n in looked)
    facts = build_facts(path.stem, units, config, dtype, gguf_blocks=True, block_bytes=blocks, lookup_bytes=lookup)
    window = get("attention.sliding_window")
    if isinstance(window, int) and window > 0 and not facts.kv_window_values:
        # The header declares sliding-window layers but not which (transformers derives them per architecture): every
        # layer still counts as keeping every token (the KV never undercounted), and one window's worth marks the
        # model as not all full attention, which an int4 KV cache needs (stream/kvcache.py).
        facts = replace(
            facts, kv_window_values=window * 2 * (config["num_key_value_heads"] or 0) * (config["head_dim"] or 0)
        )
    return facts
