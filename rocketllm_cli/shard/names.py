"""Which source tensor fills each parameter of the model: checkpoint names against the module tree's names.

A tensor may carry the base-model prefix or not, legacy gamma/beta names, or a name transformers renames on
load; a parameter transformers computes from several source tensors on load (Chunk, Split, Concatenate ... of
non-expert weights) is computed at shard time by transformers' own converter; routed experts get one unit each,
cut from fused source tensors where the checkpoint fuses them.
The runtime resolves stored expert pieces with candidate_names too, so it lives here and not in the writer.
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass, field

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
    """The names a tensor may carry in a checkpoint or a module tree: with and without the base-model prefix, legacy
    gamma/beta."""
    out = [name]
    if prefix and name.startswith(prefix + "."):
        out.append(name[len(prefix) + 1 :])
    elif prefix:
        out.append(f"{prefix}.{name}")
    legacy = re.sub(r"\.weight$", ".gamma", name), re.sub(r"\.bias$", ".beta", name)
    return out + [c for c in legacy if c != name]


def map_names(source: Source, model: torch.nn.Module, layout: Layout) -> tuple[dict[str, str], dict[str, Conversion]]:
    """canonical parameter name -> source tensor name (for a converted one: its first source), and the parameters
    transformers' conversion mapping computes -> their Conversion; missing parameters are an error."""
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
                raise ModelError(
                    f"tensor {found} has shape {list(got)} but the config expects {list(want)} (config "
                    f"and weights disagree)"
                )
            if want is not None and meta[name].is_floating_point() and not stored.is_floating_point:
                # Converting integers to weights would shard "successfully" and generate garbage.
                raise ModelError(
                    f"tensor {found} is stored as {str(stored).removeprefix('torch.')} but the model "
                    f"needs floating-point weights "
                    "(a quantized or corrupt checkpoint; use an unquantized one)"
                )
            mapping[name] = found
    converted = find_conversions(source, model, set(missing))
    for name, conv in converted.items():
        mapping[name] = conv.members[0][0]
    missing = [name for name in missing if name not in converted]
    if missing:
        raise ModelError(
            f"checkpoint lacks {len(missing)} tensors this {model.config.model_type} model needs (e.g. {missing[0]}); "
            "the config does not match the weights, or this checkpoint layout is not supported yet"
        )
    return mapping, converted


@dataclass
class Conversion:
    """Parameters transformers computes on load from several source tensors: its own WeightConverter, run here.

    `first` is the key transformers collects the sources under; `members` the (source tensor, matched pattern) pairs
    in its load order; `targets` parameter -> key in the converter's output; `shapes` parameter -> shape."""

    first: str
    members: list[tuple[str, str]]
    converter: object
    model: object
    targets: dict[str, str] = field(default_factory=dict)
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)

    def run(self, read) -> dict[str, torch.Tensor]:
        """The converter's output by its own keys, from read(source tensor name)."""
        # a converter collects tensors: one fresh copy per run, as transformers does
        conv = copy.deepcopy(self.converter)
        for src, pattern in self.members:
            conv.add_tensor(self.first, src, pattern, read(src))
        out = conv.convert(self.first, model=self.model, config=self.model.config)
        return {k: v[0] if isinstance(v, list) else v for k, v in out.items()}

    def describe(self) -> str:
        ops = ", ".join(type(op).__name__ for op in self.converter.operations)
        return f"{' + '.join(src for src, _ in self.members)} ({ops})"


def find_conversions(source: Source, model: torch.nn.Module, wanted: set[str]) -> dict[str, Conversion]:
    """The WANTED parameters that transformers' conversion mapping computes from source tensors -> their Conversion.

    Sources are grouped as transformers groups them on load; each group runs once on meta tensors to learn the
    parameters and shapes it makes. Groups that make none of WANTED (experts, handled by split_experts) are left."""
    renamings, converters = conversion_rules(model)
    if not converters or not wanted:
        return {}
    from transformers.core_model_loading import dot_natural_key, rename_source_key

    prefix = getattr(model, "base_model_prefix", "") or ""
    params = dict(model.named_parameters())
    by_pattern = {p: c for c in converters for p in c.source_patterns}
    groups: dict[str, Conversion] = {}
    for src in sorted(source.shapes, key=dot_natural_key):
        try:
            first, pattern = rename_source_key(src, renamings, converters, prefix, params)
        except Exception:  # noqa: BLE001 - a key transformers' rules cannot rename is used as it is
            continue
        if pattern is not None:
            groups.setdefault(first, Conversion(first, [], by_pattern[pattern], model)).members.append((src, pattern))
    found: dict[str, Conversion] = {}
    for conv in groups.values():
        try:
            out = conv.run(lambda s: torch.empty(source.shapes[s][0], dtype=source.shapes[s][1], device="meta"))
        except Exception:  # noqa: BLE001 - an operation that needs values, or sources that do not fit: not this group
            continue
        for key, tensor in out.items():
            param = next((c for c in candidate_names(key, prefix) if c in wanted), None)
            if param is None:
                continue
            if tuple(tensor.shape) != tuple(params[param].shape):
                raise ModelError(
                    f"{conv.describe()} makes {param} of shape {list(tensor.shape)} but the config expects "
                    f"{list(params[param].shape)} (config and weights disagree)"
                )
            conv.targets[param], conv.shapes[param] = key, tuple(tensor.shape)
            found[param] = conv
    return found


def split_experts(
    source: Source, model, layout: Layout
) -> tuple[dict[str, str], dict[str, int], dict[str, Conversion]]:
    """Give every expert of every layer a unit of its own, after its layer's unit (which keeps attention,
    norms, router and shared experts). Returns {piece: source tensor}, {piece: expert} for pieces sliced
    from a fused source tensor, and {piece: Conversion} for pieces sliced from what a conversion makes."""
    containers = find_containers(model, layout.stack)
    if not containers:
        return {}, {}, {}
    prefix = getattr(model, "base_model_prefix", "") or ""
    meta = dict(model.named_parameters(remove_duplicate=False))
    renamed = _renamed_by_transformers(model, list(source.shapes), meta)

    def resolve(param: str) -> str | None:
        found = next((c for c in candidate_names(param, prefix) if c in renamed), None)
        return renamed[found] if found is not None else None

    renamings, converters = conversion_rules(model)
    fused = {
        p for c in containers if c.layout == "fused" for p in meta if p.startswith(c.path + ".") and resolve(p) is None
    }
    conversions = find_conversions(source, model, fused)
    plan = plan_expert_pieces(
        model,
        containers,
        source.shapes,
        resolve,
        lambda n: candidate_names(n, prefix),
        renamings,
        converters,
        {p: conv.members[0][0] for p, conv in conversions.items()},
    )
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
                raise ModelError(
                    f"tensor {p.source} is stored as {str(got[1]).removeprefix('torch.')} but experts "
                    f"need floating-point "
                    "weights (a quantized or corrupt checkpoint; use an unquantized one)"
                )
    converted: dict[str, Conversion] = {}
    for p in (p for pieces in plan.units.values() for p in pieces if p.made):
        conv = converted[p.name] = conversions[p.made]
        conv.targets[p.name], conv.shapes[p.name] = conv.targets[p.made], conv.shapes[p.made][1:]
    return mapping, {p.name: p.expert for pieces in plan.units.values() for p in pieces if p.sliced}, converted


class SourceMap(dict):
    """{name in the shard set: source tensor}; `sliced` names those that are one expert's slice [e] of a fused source
    tensor,
    `converted` those transformers' converter computes from several source tensors."""

    def __init__(
        self, mapping: dict[str, str], sliced: dict[str, int], converted: dict[str, Conversion] | None = None
    ) -> None:
        super().__init__(mapping)
        self.sliced = sliced
        self.converted = converted or {}
        # the fused tensor read last: its experts come one unit at a time
        self._last: tuple[str, torch.Tensor] | None = None
        self._made: tuple[Conversion, dict] | None = None  # the conversion run last: its parameters share a unit

    def read(self, source: Source, name: str) -> torch.Tensor:
        src = self[name]
        conv = self.converted.get(name)
        if conv is not None:
            if self._made is None or self._made[0] is not conv:
                self._made = (conv, conv.run(source.read))
            made = self._made[1][conv.targets[name]]
            return made[self.sliced[name]] if name in self.sliced else made
        if name not in self.sliced:
            return source.read(src)
        if self._last is None or self._last[0] != src:
            self._last = (src, source.read(src))
        return self._last[1][self.sliced[name]]

    def source_name(self, name: str) -> str:
        """What the manifest records as NAME's source: the tensor, one expert's slice [e] of it, or a conversion."""
        if name in self.converted:
            return self.converted[name].describe() + (f"[{self.sliced[name]}]" if name in self.sliced else "")
        return f"{self[name]}[{self.sliced[name]}]" if name in self.sliced else self[name]

    def numel(self, source: Source, name: str) -> int:
        if name in self.converted:
            return _numel(self.converted[name].shapes[name])
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
        renamings = [
            t
            for t in get_model_conversion_mapping(model)
            if isinstance(t, WeightRenaming) and not isinstance(t, WeightConverter)
        ]
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
