"""Mixture-of-experts: one expert of one layer is a unit of its own, stored once, bound in either layout.

Checkpoints keep experts one module each (`...experts.3.w1.weight`) or fused into 3D tensors
(`...experts.gate_up_proj` [E, 2I, H]); transformers 4.x runs one module per expert, 5.x one
batched module whose parameters are the fused tensors. The sharder writes every expert as its own
unit whose tensors ("pieces") are named after the checkpoint (per-expert names) or, for a fused
source, after the fused parameter with the expert index inserted (`...experts.3.gate_up_proj`).
At load, each piece is resolved against the running module tree: a parameter of a per-expert
module (4.x), or part of one expert's slice of a fused parameter (5.x), found through
transformers' own conversion mapping. Nothing here names an architecture.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from torch import nn

from ..checkpoint.configreads import expert_count, top_k
from ..errors import ModelError

UNIT_NAME = re.compile(r"^layer\.(\d{3,})\.expert\.(\d{3,})$")


def unit_name(layer: int, expert: int) -> str:
    return f"layer.{layer:03d}.expert.{expert:03d}"


@dataclass
class Container:
    """One layer's experts: a batched module of fused [E, ...] parameters, or a list of per-expert modules."""

    path: str
    layout: str  # "fused" | "list"
    layer: int
    num_experts: int


def find_containers(model: nn.Module, stack: str) -> list[Container]:
    """Expert containers in the decoder stack, recognised by shape: E = the config's expert count."""
    count = expert_count(model.config)
    if count is None:
        return []
    found = []
    for i, layer in enumerate(model.get_submodule(stack)):
        for name, module in layer.named_modules():
            path = f"{stack}.{i}.{name}" if name else f"{stack}.{i}"
            if (
                isinstance(module, nn.ModuleList)
                and len(module) == count
                and len({type(m) for m in module}) == 1
                and any(True for _ in module.parameters())
            ):
                found.append(Container(path, "list", i, count))
                continue
            own = list(module.named_parameters(recurse=False))
            if own and all(p.dim() >= 3 and p.shape[0] == count for _, p in own):
                found.append(Container(path, "fused", i, count))
    return found


# -- sharding: which source tensors make one expert -------------------------------------------


@dataclass
class Piece:
    name: str  # name recorded in the manifest
    source: str  # source checkpoint tensor
    expert: int
    sliced: bool = False  # the source is fused [E, ...]: take [expert]
    made: str = ""  # the fused parameter a conversion of the source makes (Inkling's interleaved w13), sliced [expert]


@dataclass
class ExpertShardPlan:
    units: dict[tuple[int, int], list[Piece]] = field(default_factory=dict)  # (layer, expert) -> pieces
    claimed: set[str] = field(default_factory=set)  # module-tree parameters the pieces replace


def conversion_rules(model) -> tuple[list, list]:
    """transformers' own (renamings, converters) for this model; empty on 4.x."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming
    except ImportError:
        return [], []
    try:
        rules = list(get_model_conversion_mapping(model))
    except Exception:  # noqa: BLE001 - no mapping for this model
        return [], []
    renamings = [r for r in rules if isinstance(r, WeightRenaming) and not isinstance(r, WeightConverter)]
    converters = [r for r in rules if isinstance(r, WeightConverter)]
    return renamings, converters


@dataclass
class FusedSlot:
    """Where a piece lands in the fused parameter: its expert's slice, concatenated at `offset` along `dim`."""

    target: str
    expert: int
    part: int
    parts: int
    dim: int  # within one expert's slice


def converter_slot(name: str, renamings: list, converters: list) -> FusedSlot | None:
    """The fused target of a per-expert source tensor, by transformers' conversion mapping (5.x), or None."""
    if not converters:
        return None
    from transformers.core_model_loading import rename_source_key

    try:
        renamed, _ = rename_source_key(name, renamings, [], None, None)
        target, pattern = rename_source_key(name, renamings, converters, None, None)
    except Exception:  # noqa: BLE001 - an API change: treat as no conversion
        return None
    if pattern is None:
        return None
    conv = next((c for c in converters if pattern in c.source_patterns), None)
    if conv is None or "*" not in pattern:  # sources not indexed by expert: a conversion of other weights (names.py)
        return None
    ops = [type(op).__name__ for op in conv.operations]
    if (
        ops not in (["MergeModulelist"], ["MergeModulelist", "Concatenate"])
        or getattr(conv.operations[0], "dim", 0) != 0
    ):
        raise ModelError(
            f"{name}: transformers fuses these experts with {', '.join(ops)}, which expert streaming does "
            f"not "
            "reassemble yet; use a per-expert checkpoint with a transformers 4.x install, or a dense model"
        )
    # transformers' patterns are regular expressions in which `*` stands for the expert index (`\.experts.*.w1.weight`)
    regex = pattern.lstrip("^").rstrip("$").replace("*.", r"(\d+)\.").replace("*", r"(\d+)")
    match = re.search(regex, renamed)
    if match is None or not match.groups():
        return None
    dim = conv.operations[1].dim - 1 if len(ops) == 2 else 0
    return FusedSlot(target, int(match.group(1)), conv.source_patterns.index(pattern), len(conv.source_patterns), dim)


_INDEXED = re.compile(r"^(.*)\.(\d+)\.([^.]+)$")


def plan_expert_pieces(
    model: nn.Module,
    containers: list[Container],
    source_shapes: dict,
    resolve,
    candidates,
    renamings: list,
    converters: list,
    made: dict[str, str] | None = None,
) -> ExpertShardPlan:
    """Per (layer, expert): the source tensors that make it. `resolve(param)` -> the source name of a module-tree
    parameter (candidates and renamings applied) or None; `candidates(name)` -> the names it may carry in the tree;
    `made`: fused parameters a conversion of fused sources makes -> one of those sources."""
    made = made or {}
    plan = ExpertShardPlan()
    params = dict(model.named_parameters())
    by_target: dict[str, list[tuple[str, FusedSlot]]] = {}
    if any(c.layout == "fused" for c in containers):
        for src in source_shapes:
            slot = converter_slot(src, renamings, converters)
            if slot is not None:
                by_target.setdefault(_in_tree(slot.target, params, candidates), []).append((src, slot))
    for c in containers:
        prefix = c.path + "."
        owned = [p for p in params if p.startswith(prefix)]
        if c.layout == "list":
            for p in owned:
                expert = int(p[len(prefix) :].split(".", 1)[0])
                src = resolve(p)
                if src is None:
                    raise ModelError(f"checkpoint lacks expert tensor {p} (the config does not match the weights)")
                plan.units.setdefault((c.layer, expert), []).append(Piece(src, src, expert))
                plan.claimed.add(p)
            continue
        for p in owned:
            shape = tuple(params[p].shape)
            src = resolve(p)
            if (src is not None and tuple(source_shapes[src][0]) == shape) or p in made:  # stored fused: slice it
                leaf = p[len(prefix) :]
                for e in range(c.num_experts):
                    piece = Piece(f"{c.path}.{e}.{leaf}", src or made[p], e, sliced=True, made="" if src else p)
                    plan.units.setdefault((c.layer, e), []).append(piece)
                plan.claimed.add(p)
                continue
            parts = by_target.get(p, [])
            have = {(slot.expert, slot.part) for _, slot in parts}
            want = {(e, k) for e in range(c.num_experts) for k in range(parts[0][1].parts if parts else 1)}
            if have != want:
                e, k = min(want - have) if want - have else min(have - want)
                raise ModelError(
                    f"checkpoint lacks expert {e} of {p} (part {k + 1}; found {len(have)} of {len(want)} expert "
                    f"tensors); "
                    "the config does not match the weights, or this expert layout is not supported"
                )
            for src, slot in sorted(parts, key=lambda item: (item[1].expert, item[1].part)):
                plan.units.setdefault((c.layer, slot.expert), []).append(Piece(src, src, slot.expert))
            plan.claimed.add(p)
    return plan


def _in_tree(name: str, params: dict, candidates) -> str:
    """`name` as the module tree spells it (with or without the base-model prefix), or unchanged."""
    return next((c for c in candidates(name) if c in params), name)


# -- run time: resolving pieces against the running module tree --------------------------------


@dataclass
class Direct:
    module: nn.Module
    attr: str
    path: str  # the expert module's path


@dataclass
class Fused:
    module: nn.Module
    attr: str
    path: str  # the batched experts module's path
    expert: int
    dim: int
    offset: int = 0  # along dim, within the expert's slice
    size: int = 0


def resolve_pieces(model: nn.Module, pieces: dict[str, tuple[int, ...]], candidates) -> dict[str, Direct | Fused]:
    """piece name -> where it binds in this model; ModelError naming the first piece that fits nowhere."""
    params = dict(model.named_parameters())
    renamings, converters = conversion_rules(model)
    out: dict[str, Direct | Fused] = {}
    parts: dict[tuple[str, int], list[tuple[int, str, FusedSlot]]] = {}
    for name, shape in pieces.items():
        hit = _direct(name, shape, params, candidates, renamings)
        if hit is not None:
            path, _, attr = hit.rpartition(".")
            out[name] = Direct(model.get_submodule(path), attr, path)
            continue
        m = _INDEXED.match(name)
        if m:
            fused = next((c for c in candidates(f"{m.group(1)}.{m.group(3)}") if c in params), None)
            if (
                fused is not None
                and tuple(params[fused].shape[1:]) == tuple(shape)
                and int(m.group(2)) < params[fused].shape[0]
            ):
                path, _, attr = fused.rpartition(".")
                out[name] = Fused(
                    model.get_submodule(path), attr, path, int(m.group(2)), 0, 0, shape[0] if shape else 0
                )
                continue
        slot = converter_slot(name, renamings, converters)
        target = _in_tree(slot.target, params, candidates) if slot else None
        if slot is None or target not in params:
            raise ModelError(
                f"expert tensor {name} has no place in this transformers version's {type(model).__name__}; "
                "shard the source model again with this version into a new --out"
            )
        parts.setdefault((target, slot.expert), []).append((slot.part, name, slot))
    for (target, expert), group in parts.items():
        path, _, attr = target.rpartition(".")
        module = model.get_submodule(path)
        offset = 0
        for _, name, slot in sorted(group):
            size = pieces[name][slot.dim]
            out[name] = Fused(module, attr, path, expert, slot.dim, offset, size)
            offset += size
        want = params[target].shape[1 + group[0][2].dim]
        if offset != want:
            raise ModelError(
                f"experts of {target}: pieces add up to {offset} along dim {group[0][2].dim}, the model "
                f"has {want}; "
                "shard the source model again with this version into a new --out"
            )
    return out


def _direct(name: str, shape, params: dict, candidates, renamings) -> str | None:
    names = list(candidates(name))
    if renamings:
        from transformers.core_model_loading import rename_source_key

        try:
            renamed, _ = rename_source_key(name, renamings, [], None, None)
            names += list(candidates(renamed))
        except Exception:  # noqa: BLE001
            pass
    for n in names:
        if n in params and tuple(params[n].shape) == tuple(shape):
            return n
    return None
