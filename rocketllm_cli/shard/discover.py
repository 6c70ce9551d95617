"""Find the layer structure of any causal LM from its module tree: no class per architecture.

The repeated decoder stack is the ModuleList of blocks nearest the input embeddings (the largest
among equals); the input and output embeddings come from transformers' own accessors;
every other parameter belongs to the outermost module that contains none of those. In a model whose config has a
vision config, those outside the decoder (the module holding the stack: a vision tower, its projector) are `vision`
units, run once per request and kept resident.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from ..errors import ModelError


@dataclass
class UnitPlan:
    name: str
    kind: str
    module: str  # hook point ("" = root model)
    params: list[str] = field(default_factory=list)  # canonical parameter/buffer names
    index: int = -1


@dataclass
class Layout:
    stack: str
    units: list[UnitPlan]
    aliases: dict[str, str]  # tied param -> canonical param that holds the data

    def owner_of(self) -> dict[str, str]:
        return {p: u.name for u in self.units for p in u.params}


def build_meta_model(config, dtype: torch.dtype | None = None) -> nn.Module:
    """The model skeleton: parameters on the meta device, buffers (rotary inv_freq ...) real."""
    import transformers
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    from ..compat import dtype_kwargs

    try:
        with init_empty_weights(include_buffers=False), _MetaWritesSkipped():
            try:
                model = AutoModelForCausalLM.from_config(config, **dtype_kwargs(dtype))
            except ValueError:
                named = _causal_lm_named_by(config)  # a text config of a composite model (Emu3, Mllama) names its class
                if named is not None:
                    model = named._from_config(config, **dtype_kwargs(dtype))
                else:  # an image-text-to-text model (LLaVA, Qwen2.5-VL ...) has no causal-LM class: its own auto class
                    model = _image_text_to_text(config, dtype)
    except ValueError as exc:
        if "Unrecognized configuration class" in str(exc) or "does not recognize this architecture" in str(exc):
            raise ModelError(
                f"unsupported architecture {getattr(config, 'model_type', '?')!r}: transformers "
                f"{transformers.__version__} "
                "has no causal-LM class for it; upgrade transformers or use a supported model"
            ) from None
        raise
    model.eval()
    model.requires_grad_(False)
    return model


class _MetaWritesSkipped(TorchDispatchMode):
    """In-place writes into meta tensors are skipped: a parameter on the meta device holds no values, so an
    initialiser's fill of it (nn.Linear's kaiming_uniform_, transformers' normal_ and zero_) is nothing but time; torch
    runs uniform_ and normal_ on meta through Python decompositions, 0.05 s of a 30-layer Llama's 0.085 s build, and a
    first run builds the skeleton three or four times. Every other op, those on the real buffers included, runs as
    it would: the skeleton is the same."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        schema = func._schema
        if (
            schema.is_mutable
            and args
            and isinstance(args[0], torch.Tensor)
            and args[0].is_meta
            and schema.arguments[0].alias_info is not None
            and schema.arguments[0].alias_info.is_write
        ):
            return args[0]
        return func(*args, **(kwargs or {}))


def _image_text_to_text(config, dtype):
    """The model AutoModelForImageTextToText builds for CONFIG; ValueError (as the causal-LM class gave) if none takes
    it."""
    try:
        from transformers import AutoModelForImageTextToText
    except ImportError:  # transformers before 4.50 has no such class
        raise ValueError("Unrecognized configuration class") from None

    from ..compat import dtype_kwargs

    return AutoModelForImageTextToText.from_config(config, **dtype_kwargs(dtype))


def has_vision(config) -> bool:
    """Does CONFIG describe a model that takes pictures (a vision config beside the text one)?"""
    return getattr(config, "vision_config", None) is not None


def _causal_lm_named_by(config):
    """The class in config.architectures that transformers lists as a causal LM and that takes this config, or None."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    listed = set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())
    for name in getattr(config, "architectures", None) or []:
        cls = getattr(transformers, name, None) if name in listed else None
        if cls is not None and isinstance(config, cls.config_class):
            return cls
    return None


def tied_aliases(model: nn.Module) -> dict[str, str]:
    """Parameters that share storage with another: {alias: source}, chains collapsed to the source.

    transformers 5 lists its ties ({target: source}, `all_tied_weights_keys`; BERT's decoder bias, ProphetNet's
    decoder embeddings) and ties nothing it does not list (CPM-Ant's head is wider than its embeddings); 4.x ties by
    identity, on the meta model too, and the config's tie_word_embeddings says whether the head is the embeddings."""
    aliases: dict[str, str] = {}
    seen: dict[int, str] = {}
    params = dict(model.named_parameters(remove_duplicate=False))
    for name, p in params.items():
        if id(p) in seen:
            aliases[name] = seen[id(p)]
        else:
            seen[id(p)] = name
    listed = getattr(model, "all_tied_weights_keys", None)
    if listed is not None:
        aliases.update({t: s for t, s in listed.items() if t in params and s in params and t != s})
    else:
        aliases.update(
            {t: s for t, s in _tied_head(model).items() if t not in aliases and params[t].shape == params[s].shape}
        )
    for alias in aliases:
        while aliases[alias] in aliases:
            aliases[alias] = aliases[aliases[alias]]
    return aliases


def _tied_head(model: nn.Module) -> dict[str, str]:
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if not (getattr(text, "tie_word_embeddings", False) or getattr(config, "tie_word_embeddings", False)):
        return {}
    inp, out = model.get_input_embeddings(), model.get_output_embeddings()
    if inp is None or out is None or getattr(out, "weight", None) is None:
        return {}
    names = {id(m): n for n, m in model.named_modules()}
    if id(inp) not in names or id(out) not in names:
        return {}
    return {_join(names[id(out)], "weight"): _join(names[id(inp)], "weight")}


def discover(model: nn.Module) -> Layout:
    """Split MODEL (a meta-device skeleton is enough) into units: embed, each layer of the stack, norm, lm_head, root,
    extras
    and vision units.

    Found from the module tree alone, so any causal LM transformers builds works without a class for its architecture;
    every persistent tensor lands in exactly one unit, tied ones become aliases. ModelError if there is no decoder
    stack."""
    modules = dict(model.named_modules())
    names = {id(m): n for n, m in modules.items()}
    inp = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    stack = _find_stack(modules, names.get(id(inp)))
    aliases = tied_aliases(model)
    persistent = _persistent_tensors(model)

    claimed: set[str] = set()
    units: list[UnitPlan] = []

    def claim(unit: UnitPlan) -> None:
        prefix = unit.module + "." if unit.module else ""
        unit.params = [p for p in persistent if p.startswith(prefix) and p not in claimed and p not in aliases]
        claimed.update(unit.params)
        if unit.params:
            units.append(unit)

    out = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if inp is not None and id(inp) in names:
        claim(UnitPlan("embed", "embed", names[id(inp)]))
    for i, _ in enumerate(modules[stack]):
        claim(UnitPlan(f"layer.{i:03d}", "layer", f"{stack}.{i}", index=i))
    head = None
    if out is not None and id(out) in names:
        head = UnitPlan("lm_head", "lm_head", names[id(out)])

    # Everything else: the outermost module that contains neither the stack nor an embedding.
    reserved = [stack] + [u.module for u in units if u.kind == "embed"] + ([head.module] if head else [])
    groups: dict[str, list[str]] = {}
    for p in persistent:
        if p in claimed or p in aliases or (head and p.startswith(head.module + ".")):
            continue
        groups.setdefault(_outermost_free(p, reserved), []).append(p)
    for owner in groups:
        kind = "root" if owner == "" or any(r.startswith(owner + ".") for r in reserved) else "extra"
        name = "root" if kind == "root" else f"extra.{owner}"
        claim(UnitPlan(name, kind, owner if kind == "extra" else ""))
    extras = [u for u in units if u.kind == "extra"]
    if has_vision(getattr(model, "config", None)):
        # Outside the decoder (the stack's parent): the vision tower and its projector, run once per request.
        decoder = stack.rpartition(".")[0]
        for u in extras:
            if decoder and not (u.module == decoder or u.module.startswith(decoder + ".")):
                u.name, u.kind = f"vision.{u.module}", "vision"
        extras = [u for u in extras if u.kind == "extra"]
    norms = [u for u in extras if re.search(r"(norm|ln_f)$", u.module)]
    if len(norms) == 1:
        norms[0].name, norms[0].kind = "norm", "norm"
    if head is not None:
        claim(head)
    if not any(u.kind == "layer" for u in units):
        raise ModelError(
            "could not find a repeated decoder stack in this model's module tree; architecture not "
            "supported for streaming"
        )
    return Layout(stack, units, aliases)


def _find_stack(modules: dict[str, nn.Module], embeddings: str | None = None) -> str:
    """The decoder stack: of the ModuleLists of parameter-holding blocks, the one nearest the input embeddings in the
    module tree (a vision or audio tower's layers sit further away, however large), the largest among equals.

    Its blocks may be of several classes (attention and linear-attention layers in one list)."""
    best, best_key = None, None
    for name, m in modules.items():
        if not isinstance(m, nn.ModuleList) or len(m) == 0 or not all(any(True for _ in c.parameters()) for c in m):
            continue
        if name == embeddings:  # the embeddings themselves may be a list (MusicGen: one table per codebook)
            continue
        size = sum(p.numel() for p in m.parameters())
        key = (_tree_distance(name, embeddings) if embeddings is not None else 0, -size)
        if best_key is None or key < best_key:
            best, best_key = name, key
    if best is None:
        raise ModelError(
            "could not find a repeated decoder stack in this model's module tree; architecture not "
            "supported for streaming"
        )
    return best


def _tree_distance(a: str, b: str) -> int:
    pa, pb = a.split(".") if a else [], b.split(".") if b else []
    common = next((i for i, (x, y) in enumerate(zip(pa, pb)) if x != y), min(len(pa), len(pb)))
    return len(pa) + len(pb) - 2 * common


def _persistent_tensors(model: nn.Module) -> list[str]:
    """Parameters, then persistent buffers (the ones a checkpoint may carry), in module order."""
    names = [n for n, _ in model.named_parameters(remove_duplicate=False)]
    for mod_name, mod in model.named_modules():
        for b, _ in mod.named_buffers(recurse=False):
            if b not in mod._non_persistent_buffers_set:
                names.append(_join(mod_name, b))
    return names


def _outermost_free(param: str, reserved: list[str]) -> str:
    parts = param.split(".")[:-1]
    for i in range(1, len(parts) + 1):
        candidate = ".".join(parts[:i])
        if not any(r == candidate or r.startswith(candidate + ".") for r in reserved):
            return candidate
    return ".".join(parts)


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name
