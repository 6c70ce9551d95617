"""Fused projections: packed Linears of one layer that read the same input, stored as one packed weight.

A decode step calls q_proj, k_proj and v_proj on the same hidden state, and gate_proj and up_proj on the same
normed state: three (two) small matvecs, each paying a kernel call and its binding. Stored as one weight of
N = n_q + n_k + n_v rows they are one call, whose output the members share (stream/packedbind.py, FusedGroup).

Which Linears share an input is discovered, not declared per class: the model is built from its config with
fake tensors (torch's FakeTensorMode: shapes only, no memory), the stack's first layer is reached once by a real
forward call, and every layer is then called with those inputs while pre-hooks record which tensor object each
nn.Linear received. Linears of one parent module that each ran exactly once on the same object form a group
(q/k/v, gate/up, an MLA's q_a/kv_a; never o_proj, whose input is attention's output). A layer whose fake call fails
part way (a data-dependent router) keeps the groups recorded before the failure; a model whose trace fails keeps
nothing fused and says why in the manifest. Wrong grouping could only cost time, never change a result: a member
called with another input than its group's computes the fused product itself (FusedGroup).

Members are fused only where their packed formats agree in everything but N and the code order allows it (int4 in
a CPU kernel's blocked order: every member but the last a whole number of blocks), so the fused bytes are the
members' rows one after another, part by part.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from ..checkpoint.manifest import fused_name


class _Reached(Exception):
    """The stack's first layer was reached: its inputs are captured, the rest of the model need not run."""


def shared_input_groups(config, stack: str, dtype: torch.dtype | None = None) -> tuple[list[tuple[str, ...]], str]:
    """([(module path, ...)] of Linears in the decoder stack that read one input once per pass, in call order), and
    why nothing was found where the trace could not run ("" when it ran)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from .discover import build_meta_model

    try:
        model = build_meta_model(config, dtype)
    except Exception as exc:  # noqa: BLE001 - a config the meta build refuses is refused again, in words, by the sharder
        return [], f"the model could not be built for the trace ({_short(exc)})"
    layers = model.get_submodule(stack)
    if not isinstance(layers, nn.ModuleList) or len(layers) == 0:
        return [], "no decoder stack to trace"
    captured: dict = {}

    def capture(module, args, kwargs):
        captured["args"], captured["kwargs"] = args, kwargs
        raise _Reached

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    groups: list[tuple[str, ...]] = []
    try:
        with mode, torch.no_grad():
            model.to_empty(device="cpu")  # fake tensors: shapes and dtypes, no memory
            handle = layers[0].register_forward_pre_hook(capture, with_kwargs=True)
            try:
                model(input_ids=torch.zeros((1, 4), dtype=torch.long), use_cache=False)
            except _Reached:
                pass
            finally:
                handle.remove()
            if "args" not in captured:
                return [], "the trace never reached the decoder stack"
            traced: dict[tuple, tuple[int, list]] = {}  # a layer's build -> (its index, its groups)
            for index, layer in enumerate(layers):
                build = _build_of(layer)
                if build not in traced:  # a layer built like one already traced runs the same calls (~40 ms a trace)
                    traced[build] = (
                        index,
                        _layer_groups(layer, f"{stack}.{index}", captured["args"], captured["kwargs"]),
                    )
                first, found = traced[build]
                groups += [tuple(f"{stack}.{index}.{m[len(f'{stack}.{first}.') :]}" for m in group) for group in found]
    except Exception as exc:  # noqa: BLE001 - the trace is an optimisation: a model it cannot run keeps every weight apart
        return [], f"the fake-tensor trace failed ({_short(exc)})"
    finally:
        del model
    return groups, ""


def _build_of(layer: nn.Module) -> tuple:
    """What decides a layer's calls but its position: each submodule's path, class and plain settings (a sliding
    window, an is-sliding flag, a shared-KV flag), the layer's own index left out."""
    parts = []
    for name, module in layer.named_modules():
        settings = tuple(
            sorted(
                (k, v)
                for k, v in vars(module).items()
                if isinstance(v, (bool, int, float, str, type(None)))
                and not k.startswith("_")
                and k not in ("layer_idx", "layer_id", "layer_number", "idx")
            )
        )
        parts.append((name, type(module).__qualname__, settings))
    return tuple(parts)


def _layer_groups(layer: nn.Module, prefix: str, args, kwargs) -> list[tuple[str, ...]]:
    calls: dict[str, list] = {}
    handles = []
    for name, module in layer.named_modules():
        if isinstance(module, nn.Linear):
            handles.append(
                module.register_forward_pre_hook(
                    lambda m, a, name=name: calls.setdefault(name, []).append(a[0] if a else None)
                )
            )
    try:
        layer(*args, **kwargs)
    except Exception:  # noqa: BLE001 - a data-dependent step (a router's top-k): what ran before it still counts
        pass
    finally:
        for h in handles:
            h.remove()
    by_input: dict[tuple[str, int], list[str]] = {}
    for name, inputs in calls.items():  # dicts keep call order
        if len(inputs) == 1 and isinstance(inputs[0], torch.Tensor):
            parent = name.rpartition(".")[0]
            by_input.setdefault((parent, id(inputs[0])), []).append(name)
    return [tuple(f"{prefix}.{n}" for n in names) for names in by_input.values() if len(names) > 1]


@dataclass
class FusionPlan:
    """Which packed weights of each layer unit are stored fused: {unit: [[member weight name, ...], ...]}."""

    groups: dict[str, list[list[str]]] = field(default_factory=dict)
    note: str = ""  # why nothing is fused, where nothing is

    def apply(self, unit: str, packed: dict) -> dict[str, list]:
        """Fuse UNIT's groups in PACKED ({weight name: PackedTensor}, changed in place); {fused name: [[member, rows],
        ...]} of what was fused. A group whose formats disagree stays apart."""
        made = {}
        for members in self.groups.get(unit, ()):
            if not all(m in packed for m in members):
                continue
            fused = fuse([packed[m] for m in members])
            if fused is None:
                continue
            name = fused_name(members)
            made[name] = [[m, packed.pop(m).format.shape[0]] for m in members]
            packed[name] = fused
        return made

    def describe(self, units) -> str:
        """The manifest's words for what was fused: each pattern and in how many layers, or why nothing was."""
        counts: dict[str, int] = {}
        for u in units:
            for t in u.tensors:
                if t.fused:
                    pattern = _pattern([m for m, _ in t.fused])
                    counts[pattern] = counts.get(pattern, 0) + 1
        if not counts:
            return f"none: {self.note}" if self.note else "none: no packed Linears of a layer read the same input"
        order = [_pattern(m) for groups in self.groups.values() for m in groups]  # the model's call order
        ranked = sorted(counts, key=lambda p: order.index(p) if p in order else len(order))
        return ", ".join(f"{p} in {counts[p]} layers" for p in ranked)


def plan_fusion(config, layout, packs, dtype: str) -> FusionPlan:
    """The groups to fuse in this set: traced groups whose every member is a packed weight of one layer unit."""
    from ..dtypes import torch_dtype

    if not packs.params:
        return FusionPlan(note="no packed weights")
    groups, why = shared_input_groups(config, layout.stack, torch_dtype(dtype))
    if why:
        return FusionPlan(note=why)
    owner = {p: u for u in layout.units for p in u.params}
    tied = set(layout.aliases) | set(layout.aliases.values())
    plan = FusionPlan()
    for group in groups:
        members = member_weights(group)
        units = {owner[m].name if m in owner else None for m in members}
        unit = owner.get(members[0])
        if (
            len(units) != 1
            or unit is None
            or unit.kind != "layer"
            or any(m not in packs.params or m in tied for m in members)
        ):
            continue
        plan.groups.setdefault(unit.name, []).append(members)
    if not plan.groups:
        plan.note = "no packed Linears of a layer read the same input"
    return plan


def member_weights(group: tuple[str, ...]) -> list[str]:
    """The weight parameter names of a group of module paths."""
    return [f"{m}.weight" for m in group]


def fuse(packed: list) -> object | None:
    """One PackedTensor of the members' rows one after another, or None where their formats do not allow it."""
    from ..checkpoint.packedformat import PackedTensor

    fmt = fused_format([p.format for p in packed])
    if fmt is None:
        return None
    parts = {}
    for name, (shape, _) in fmt.parts().items():
        dim = 1 if name == "sz" else 0  # a kernel order's scales and zeros are [groups, 2N]
        parts[name] = torch.cat([p.parts[name] for p in packed], dim=dim)
    return PackedTensor(fmt, parts)


def fused_format(formats: list):
    """The PackedFormat of FORMATS' rows one after another, or None where they cannot be one weight (known before any
    byte is read: an indexed set fuses its members' pieces of the file by it)."""
    from ..checkpoint.packedformat import PackedFormat
    from ..packed.cpulayout import BLOCK

    first = formats[0]
    for f in formats[1:]:
        if (f.kind, f.shape[1], f.group, f.scale_dtype, f.gguf_type, f.block_bytes, f.layout) != (
            first.kind,
            first.shape[1],
            first.group,
            first.scale_dtype,
            first.gguf_type,
            first.block_bytes,
            first.layout,
        ):
            return None
    block = BLOCK.get(first.layout, 1) if first.kind == "int4" else 1
    if any(f.shape[0] % block for f in formats[:-1]):
        return None  # a partial code block inside the fused weight would be laid out as the last one is
    n = sum(f.shape[0] for f in formats)
    return PackedFormat(
        first.kind,
        (n, first.shape[1]),
        first.group,
        first.scale_dtype,
        first.gguf_type,
        first.block_bytes,
        first.layout,
    )


def _pattern(members: list[str]) -> str:
    return "+".join(m.rsplit(".", 2)[1] for m in members)


def _short(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {text[:120]}" if text else type(exc).__name__
