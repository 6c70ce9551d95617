"""Which source tensor fills each parameter of the model: checkpoint names against the module tree's names.

A tensor may carry the base-model prefix or not, legacy gamma/beta names, or a name transformers renames on
load; routed experts get one unit each, cut from fused source tensors where the checkpoint fuses them.
The runtime resolves stored expert pieces with candidate_names too, so it lives here and not in the writer.
"""

from __future__ import annotations

import re

import torch

from ..errors import ModelError
from .discover import Layout, UnitPlan
from .expertlayout import (
    conversion_rules,
    find_containers,
    plan_expert_pieces,
    unit_name,
)
from .source import Source


def candidate_names(name: str, prefix: str) -> list[str]:
    """The names a tensor may carry in a checkpoint or a module tree: with and without the base-model prefix, legacy gamma/beta."""
    out = [name]
    if prefix and name.startswith(prefix + "."):
        out.append(name[len(prefix) + 1 :])
    elif prefix:
        out.append(f"{prefix}.{name}")
    legacy = re.sub(r"\.weight$", ".gamma", name), re.sub(r"\.bias$", ".beta", name)
    return out + [c for c in legacy if c != name]


def map_names(source: Source, model: torch.nn.Module, layout: Layout) -> dict[str, str]:
    """canonical parameter name -> source tensor name; missing parameters are an error."""
    prefix = getattr(model, "base_model_prefix", "") or ""
    meta = dict(model.named_parameters(remove_duplicate=False))
    renamed = _renamed_by_transformers(model, list(source.shapes), meta)
    available = set(renamed)
    mapping: dict[str, str] = {}
    missing: list[str] = []
    for unit in layout.units:
        if unit.kind == "expert":
            continue  # mapped by split_experts
        for name in list(unit.params):
            found = next((c for c in candidate_names(name, prefix) if c in available), None)
            if found is None:
                if name in meta:
                    missing.append(name)
                else:
                    unit.params.remove(name)  # a persistent buffer the checkpoint omits keeps its initial value
                continue
            want = tuple(meta[name].shape) if name in meta else None
            found = renamed[found]
            got, stored = source.shapes[found]
            if want is not None and want != got:
                raise ModelError(f"tensor {found} has shape {list(got)} but the config expects {list(want)} (config and weights disagree)")
            if want is not None and meta[name].is_floating_point() and not stored.is_floating_point:
                # Converting integers to weights would shard "successfully" and generate garbage.
                raise ModelError(f"tensor {found} is stored as {str(stored).removeprefix('torch.')} but the model needs floating-point weights "
                                 "(a quantized or corrupt checkpoint; use an unquantized one)")
            mapping[name] = found
    if missing:
        raise ModelError(
            f"checkpoint lacks {len(missing)} tensors this {model.config.model_type} model needs (e.g. {missing[0]}); "
            "the config does not match the weights, or this checkpoint layout is not supported yet"
        )
    return mapping


def split_experts(source: Source, model, layout: Layout) -> tuple[dict[str, str], dict[str, int]]:
    """Give every expert of every layer a unit of its own, after its layer's unit (which keeps attention,
    norms, router and shared experts). Returns {piece: source tensor} and {piece: expert} for pieces sliced
    from a fused source tensor."""
    containers = find_containers(model, layout.stack)
    if not containers:
        return {}, {}
    prefix = getattr(model, "base_model_prefix", "") or ""
    meta = dict(model.named_parameters(remove_duplicate=False))
    renamed = _renamed_by_transformers(model, list(source.shapes), meta)

    def resolve(param: str) -> str | None:
        found = next((c for c in candidate_names(param, prefix) if c in renamed), None)
        return renamed[found] if found is not None else None

    renamings, converters = conversion_rules(model)
    plan = plan_expert_pieces(model, containers, source.shapes, resolve, lambda n: candidate_names(n, prefix), renamings, converters)
    units: list[UnitPlan] = []
    for unit in layout.units:
        unit.params = [p for p in unit.params if p not in plan.claimed]
        units.append(unit)
        if unit.kind != "layer":
            continue
        for (layer, expert), pieces in sorted(plan.units.items()):
            if layer == unit.index:
                names = [p.name for p in pieces]
                units.append(UnitPlan(unit_name(layer, expert), "expert", _common_module(names), names, index=layer))
    layout.units = units
    mapping = {p.name: p.source for pieces in plan.units.values() for p in pieces}
    for pieces in plan.units.values():
        for p in pieces:
            got = source.shapes[p.source]
            if not got[1].is_floating_point:
                raise ModelError(f"tensor {p.source} is stored as {str(got[1]).removeprefix('torch.')} but experts need floating-point "
                                 "weights (a quantized or corrupt checkpoint; use an unquantized one)")
    return mapping, {p.name: p.expert for pieces in plan.units.values() for p in pieces if p.sliced}


class SourceMap(dict):
    """{name in the shard set: source tensor}; `sliced` names those that are one expert's slice [e] of a fused source tensor."""

    def __init__(self, mapping: dict[str, str], sliced: dict[str, int]) -> None:
        super().__init__(mapping)
        self.sliced = sliced
        self._last: tuple[str, torch.Tensor] | None = None  # the fused tensor read last: its experts come one unit at a time

    def read(self, source: Source, name: str) -> torch.Tensor:
        src = self[name]
        if name not in self.sliced:
            return source.read(src)
        if self._last is None or self._last[0] != src:
            self._last = (src, source.read(src))
        return self._last[1][self.sliced[name]]

    def numel(self, source: Source, name: str) -> int:
        n = _numel(source.shapes[self[name]][0])
        return n // source.shapes[self[name]][0][0] if name in self.sliced else n


def _common_module(names: list[str]) -> str:
    parts = [n.split(".")[:-1] for n in names]
    common = []
    for group in zip(*parts):
        if len(set(group)) != 1:
            break
        common.append(group[0])
    return ".".join(common)


def _renamed_by_transformers(model, names: list[str], meta: dict) -> dict[str, str]:
    """{name the model uses: source name} after transformers' own key renamings (e.g. embed_out -> lm_head).

    Only pure renamings are applied; a converter that merges tensors (fused MoE experts) is not.
    """
    out = {n: n for n in names}
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import (
            WeightConverter,
            WeightRenaming,
            rename_source_key,
        )
    except ImportError:  # transformers 4.x: checkpoints already use the module names
        return out
    try:
        renamings = [t for t in get_model_conversion_mapping(model) if isinstance(t, WeightRenaming) and not isinstance(t, WeightConverter)]
    except Exception:  # noqa: BLE001 - no mapping for this model: names are used as they are
        return out
    if not renamings:
        return out
    for n in names:
        new, _ = rename_source_key(n, renamings, [], None, None)
        if new != n and new not in out:
            out[new] = n
    return out


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
