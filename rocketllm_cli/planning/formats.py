"""The weight formats a model can run in, each as the ModelFacts its shard set would have: from headers, never weights.

A model comes as a GGUF file (its header), a checkpoint directory (safetensors headers and config.json), a shard set
(its manifest) or a config.json by itself (tensor shapes predicted from the config). Its formats:

    as stored  what `rocketllm shard MODEL` writes by default (a GGUF's blocks, a pre-quantized checkpoint's codes, a
               float checkpoint's floats): the facts `doctor --model` reads, unchanged
    int4/int8  `shard MODEL --quantize int4|int8`: round-to-nearest of every Linear weight (lossy), offered where the
               model allows it (not a pre-quantized checkpoint, not a shard set) and where it stores fewer bytes

Torch-free: a 70B GGUF header is read in milliseconds. Sizes of a requantised set are predicted from tensor names and
shapes (2-D `.weight` tensors that are not embeddings or norms), as `packed_nbytes` sizes them before sharding.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from pathlib import Path

from ..checkpoint.configfiles import read_json_object
from ..checkpoint.configreads import config_int, expert_count
from ..checkpoint.ggufheader import FILE_TYPES, read_gguf_tensors
from ..checkpoint.modelfacts import ModelFacts, build_facts, model_facts_from_path
from ..checkpoint.units import tensor_units
from ..checkpoint.packedformat import PackedFormat
from ..checkpoint.stfile import read_header
from ..dtypes import ITEMSIZE, short_name
from ..errors import ModelError

RTN_GROUP, INT4_ROWS = 32, 16  # shard/packing.py: int4 group 32, N a multiple of 16 for the int4 kernels
FLOAT_GGUF = ("F32", "F16", "BF16")
_NOT_LINEAR = ("embed", "wte", "wpe", "word_embeddings", "norm", "ln_", "token_embd")
SIZE_FIELDS = ("total_bytes", "num_layers", "layer_bytes", "largest_unit_bytes", "non_layer_bytes", "active_bytes")


@dataclass(frozen=True)
class WeightFormat:
    """One way to store the weights: the shard set `shard --quantize QUANTIZE` writes, and what it weighs."""

    name: str  # "as stored", "int4", "int8"
    quantize: str  # shard --quantize: auto (as stored), int4, int8
    label: str  # what the set holds, in words (gguf-Q4_1 blocks, bf16, int4 RTN ...)
    facts: ModelFacts
    kl: float | None  # KL divergence per token against the unquantised weights, where known (0: they are those weights)
    kl_note: str = ""
    # compute dtype (exact kernels) or "<dtype>-<kernel>" -> this set's resident decode as bench measured it here
    decode: dict = field(default_factory=dict)
    # speculation mode -> this set's tokens per pass as bench measured it here
    speculation: dict = field(default_factory=dict)

    @property
    def stored(self) -> bool:
        return self.quantize == "auto"


@dataclass
class ModelSource:
    """A model as its headers describe it; `formats()` lists the sets it can be sharded into."""

    path: Path
    kind: str  # gguf | checkpoint | shards | config
    name: str
    facts: ModelFacts  # the stored format, as doctor reads it
    hidden_size: int = 0
    tensors: dict[str, tuple[tuple[int, ...], bool]] = field(default_factory=dict)  # name -> (rows, cols...), float?
    float_itemsize: int = 2  # bytes of one float in the default set
    quantized: str = ""  # what quantized the stored weights ("gguf-Q4_1", "gptq" ...); "" for floats
    experts: int | None = None
    config: dict = field(default_factory=dict)
    # a shard set: compute dtype (or "<dtype>-<kernel>", kernel not exact) -> its resident decode measured by bench here
    decode: dict = field(default_factory=dict)
    # a shard set: speculation mode -> its tokens per pass measured by bench here
    speculation: dict = field(default_factory=dict)

    @property
    def run_path(self) -> Path:
        """What `generate`/`bench` take: a config.json alone stands for the checkpoint directory beside it."""
        return self.path.parent if self.kind == "config" and self.path.is_file() else self.path

    def formats(self) -> list[WeightFormat]:
        if self.quantized:
            kl, note = (
                None,
                (
                    f"the weights are stored quantized ({self.quantized}); the unquantised weights are not "
                    f"here to "
                    "measure against (rocketllm bench SET --perplexity FILE --reference UNQUANTISED measures "
                    "it)"
                ),
            )
        else:
            kl, note = 0.0, "the stored floats themselves"
        if self.kind == "shards":
            kl, note = None, "a shard set: what it was written from is not known here"
        out = [WeightFormat("as stored", "auto", self.facts.dtype, self.facts, kl, note, self.decode, self.speculation)]
        if self.kind in ("shards",) or (self.quantized and self.kind != "gguf") or not self.tensors:
            return out
        for bits in (4, 8):
            sizes = {
                name: self._requantised(name, shape, is_float, bits) for name, (shape, is_float) in self.tensors.items()
            }
            if sum(sizes.values()) >= self.facts.total_bytes:
                continue  # bigger than the set as stored (a 4-bit GGUF in int8): never a better row
            facts = self._facts_of(sizes, f"int{bits}")
            out.append(
                WeightFormat(
                    f"int{bits}",
                    f"int{bits}",
                    f"int{bits} RTN",
                    facts,
                    None,
                    f"round-to-nearest int{bits} of every Linear weight: lossy, not measured against "
                    f"the "
                    "unquantised weights (rocketllm bench SET --perplexity FILE --reference MODEL "
                    "measures it)",
                )
            )
        return out

    def _requantised(self, name: str, shape: tuple[int, ...], is_float: bool, bits: int) -> int:
        numel = 1
        for d in shape:
            numel *= d
        linear = len(shape) == 2 and name.endswith(".weight") and not any(word in name for word in _NOT_LINEAR)
        if linear and shape[1] % RTN_GROUP == 0 and (bits == 8 or shape[0] % INT4_ROWS == 0):
            fmt = (
                PackedFormat("int4", shape, RTN_GROUP, scale_dtype="fp16")
                if bits == 4
                else PackedFormat("int8", shape, shape[1], scale_dtype="fp16")
            )
            return fmt.offsets()[1]
        return numel * self.float_itemsize if is_float else numel

    def _facts_of(self, sizes: dict[str, int], dtype: str) -> ModelFacts:
        """The facts of the stored format with the sizes of another: KV, context and positions are the model's own."""
        sized = build_facts(self.name, tensor_units(self.name, sizes, self.experts), self.config, dtype)
        known = {f.name for f in fields(ModelFacts)}
        extra = {"gguf_blocks": False} if "gguf_blocks" in known else {}  # a requantised set keeps no GGUF blocks
        return replace(self.facts, dtype=dtype, **{k: getattr(sized, k) for k in SIZE_FIELDS}, **extra)


def with_measured_decode(source: ModelSource, profile) -> ModelSource:
    """A shard set's resident decode per compute dtype, where `rocketllm bench` measured it on this machine
    (probe/decodecompute.py): its rows project from it rather than from the matvec floor, as `doctor --model SET` does;
    and its tokens per speculative pass per mode (probe/acceptance.py), which its speculating rows project at.
    A GGUF file: the same for the default set sharded from it, where one is in the cache (sets_of_gguf)."""
    directories = (
        [source.path] if source.kind == "shards" else sets_of_gguf(source.path) if source.kind == "gguf" else []
    )
    if not directories:
        return source
    from ..checkpoint.manifest import Manifest
    from ..dtypes import NAMES
    from ..profiles.knobs.table import SPECULATION_MODES
    from ..profiles.probe import acceptance
    from ..profiles.probe.decodecompute import lookup

    from ..profiles.probe.machine import is_this_machine
    from ..profiles.probe.unitreads import load_or_measure

    directory = directories[0]
    try:
        manifest = Manifest.load(directory)
        # keyed as the planner reads them: the compute dtype for the exact kernels, "<dtype>-<kernel>" for the others
        found = {
            dtype if kernel == "exact" else f"{dtype}-{kernel}": lookup(profile, directory, manifest, dtype, kernel)
            for dtype in NAMES
            for kernel in ("exact", "int16", "int8")
        }
        speculation = acceptance.lookup(directory, manifest, SPECULATION_MODES)
        # the set's own units read cold (measured once per machine, as a streaming load measures them): its rows
        # stream at that rate and their read knobs derive from it, as they will when it runs
        reads = load_or_measure(profile, directory, manifest) if is_this_machine(profile) else None
    except Exception:  # noqa: BLE001 - an unreadable record or set: the floor stands
        return source
    facts = replace(source.facts, unit_reads=reads.to_dict()) if reads is not None else source.facts
    return replace(
        source,
        facts=facts,
        decode={dtype: record for dtype, record in found.items() if record},
        speculation=speculation,
    )


def sets_of_gguf(path: Path) -> list[Path]:
    """The default (blocks) sets in the cache sharded from the GGUF at PATH, found by its content fingerprint where an
    earlier run took it (shard/identity.py known_fingerprint: no hash here); [] otherwise."""
    import json

    from ..shard.identity import known_fingerprint
    from ..shard.target import shards_root

    fingerprint = known_fingerprint(path)
    if fingerprint is None:
        return []
    found = []
    for directory in sorted(shards_root().glob(f"*-{fingerprint}-*")):
        try:
            doc = json.loads((directory / "manifest.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if isinstance(doc, dict) and doc.get("packing") == "blocks":
            found.append(directory)
    return found


def read_source(path: Path) -> ModelSource:
    """The model at PATH as its headers describe it. ModelError in one line when it is not one."""
    path = Path(path).expanduser()
    if not path.exists():
        raise ModelError(f"model path not found: {path}")
    if path.is_file() and path.suffix == ".json":
        return _from_config(path)
    if path.is_file() and path.suffix == ".gguf":
        return _from_gguf(path)
    if (
        path.is_dir()
        and not (path / "manifest.json").is_file()
        and (path / "config.json").is_file()
        and not any(path.glob("*.safetensors"))
        and not any(path.glob("*.gguf"))
    ):
        return _from_config(path / "config.json")
    facts = model_facts_from_path(path)
    if path.is_dir() and (path / "manifest.json").is_file():
        config = read_json_object(path / "config.json") if (path / "config.json").is_file() else {}
        return ModelSource(path, "shards", facts.name, facts, _hidden(config), config=config)
    if path.is_dir() and (path / "config.json").is_file() and any(path.glob("*.safetensors")):
        return _from_checkpoint(path, facts)
    return _from_gguf(next(iter(sorted(path.glob("*.gguf")))))


def _from_gguf(path: Path) -> ModelSource:
    facts = model_facts_from_path(path)
    meta, _, infos = read_gguf_tensors(path)
    arch = str(meta.get("general.architecture", ""))
    file_type = FILE_TYPES.get(meta.get("general.file_type"), "")
    # GGUF lists dims innermost first: [K, N] is a weight of N rows of K
    tensors = {name: (tuple(reversed(dims)), True) for name, (_, dims) in infos.items()}
    hidden = meta.get(f"{arch}.embedding_length")
    return ModelSource(
        path,
        "gguf",
        facts.name,
        facts,
        int(hidden) if isinstance(hidden, int) else 0,
        tensors,
        quantized="" if file_type in FLOAT_GGUF else facts.dtype,
    )


def _from_checkpoint(path: Path, facts: ModelFacts) -> ModelSource:
    config = read_json_object(path / "config.json")
    tensors: dict[str, tuple[tuple[int, ...], bool]] = {}
    for f in sorted(path.glob("*.safetensors")):
        for name, entry in read_header(f).entries.items():
            tensors[name] = (tuple(entry.shape), entry.stored.startswith(("F", "BF")))
    quantization = config.get("quantization_config") or (config.get("text_config") or {}).get("quantization_config")
    quantized = str(quantization.get("quant_method") or "quantized") if isinstance(quantization, dict) else ""
    return ModelSource(
        path,
        "checkpoint",
        facts.name,
        facts,
        _hidden(config),
        tensors,
        ITEMSIZE.get(facts.dtype, 2),
        quantized,
        expert_count(config),
        config,
    )


def _from_config(path: Path) -> ModelSource:
    """A config.json alone: every tensor of a decoder of that shape (attention, MLP or routed experts, embeddings,
    norms), sized in the config's dtype."""
    config = read_json_object(path)
    text = config.get("text_config") or config
    hidden, layers = (
        config_int(config, ("hidden_size", "n_embd", "d_model")),
        config_int(config, ("num_hidden_layers", "n_layer")),
    )
    heads, vocab = config_int(config, ("num_attention_heads", "n_head")), config_int(config, ("vocab_size",))
    missing = [
        k
        for k, v in (
            ("hidden_size", hidden),
            ("num_hidden_layers", layers),
            ("num_attention_heads", heads),
            ("vocab_size", vocab),
        )
        if not v
    ]
    if missing:
        raise ModelError(f"{path.name} does not give {', '.join(missing)}: cannot size the model from its config")
    kv = config_int(config, ("num_key_value_heads",)) or heads
    head = config_int(config, ("head_dim",)) or hidden // heads
    inter = config_int(config, ("intermediate_size", "n_inner", "ffn_dim")) or 4 * hidden
    experts = expert_count(config)
    expert_inter = config_int(config, ("moe_intermediate_size",)) or inter
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,)}
    if not text.get("tie_word_embeddings", config.get("tie_word_embeddings", False)):
        shapes["lm_head.weight"] = (vocab, hidden)
    for i in range(layers):
        at = f"model.layers.{i}"
        shapes.update(
            {
                f"{at}.self_attn.q_proj.weight": (heads * head, hidden),
                f"{at}.self_attn.k_proj.weight": (kv * head, hidden),
                f"{at}.self_attn.v_proj.weight": (kv * head, hidden),
                f"{at}.self_attn.o_proj.weight": (hidden, heads * head),
                f"{at}.input_layernorm.weight": (hidden,),
                f"{at}.post_attention_layernorm.weight": (hidden,),
            }
        )
        mlps = [f"{at}.mlp.experts.{e}" for e in range(experts)] if experts else [f"{at}.mlp"]
        width = expert_inter if experts else inter
        for mlp in mlps:
            shapes.update(
                {
                    f"{mlp}.gate_proj.weight": (width, hidden),
                    f"{mlp}.up_proj.weight": (width, hidden),
                    f"{mlp}.down_proj.weight": (hidden, width),
                }
            )
        if experts:
            shapes[f"{at}.mlp.gate.weight"] = (experts, hidden)
    dtype = (
        short_name(
            text.get("torch_dtype") or text.get("dtype") or config.get("torch_dtype") or config.get("dtype") or ""
        )
        or "bf16"
    )
    itemsize = ITEMSIZE[dtype]
    sizes = {name: _numel(shape) * itemsize for name, shape in shapes.items()}
    name = path.parent.name if path.name == "config.json" else path.stem
    facts = build_facts(name, tensor_units(name, sizes, experts), config, dtype)
    tensors = {name: (shape, True) for name, shape in shapes.items()}
    return ModelSource(path, "config", name, facts, hidden, tensors, itemsize, "", experts, config)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _hidden(config: dict) -> int:
    return config_int(config, ("hidden_size", "n_embd", "d_model")) or 0 if config else 0
