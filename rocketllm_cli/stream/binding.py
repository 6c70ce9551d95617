"""A unit's tensors bound to the (module, attribute) pairs they fill, and put back to placeholders after use."""

from __future__ import annotations

import torch
from torch import nn

from .packedbind import PerBuffer
from .unbound import Unbound


class Binding:
    """One (module, attribute) a unit's tensor is bound to.

    `persistent`: the unit's tensors are the same objects on every use (host tier on a CPU), so the Parameter made
    for them is kept and a bind is a dict assignment. Otherwise the Parameter is dropped on unbind: it may wrap a
    copy converted to the compute dtype, and keeping one per layer would hold the whole model converted in memory.
    A streamed tensor read unconverted is a view of a streaming buffer, the same object each time the unit lands in
    that buffer (WeightStore keeps the views per buffer): its Parameter is kept per buffer, costing no memory.
    """

    __slots__ = (
        "module",
        "attr",
        "tensor",
        "is_buffer",
        "placeholder",
        "persistent",
        "_source",
        "_param",
        "_by_buffer",
    )

    def __init__(
        self,
        module: nn.Module,
        attr: str,
        tensor: str,
        is_buffer: bool,
        placeholder: torch.Tensor | None,
        persistent: bool = False,
    ) -> None:
        self.module, self.attr, self.tensor, self.is_buffer, self.placeholder = (
            module,
            attr,
            tensor,
            is_buffer,
            placeholder,
        )
        self.persistent = persistent
        self._source: torch.Tensor | None = None
        self._param: nn.Parameter | None = None
        self._by_buffer = PerBuffer()

    def bind(self, t: torch.Tensor) -> None:
        if self.is_buffer:
            self.module._buffers[self.attr] = t
            return
        if t is not self._source:  # persistent views (host tier on CPU) reuse their Parameter every token
            kept = self._by_buffer.get(t)
            if kept is not None:
                self._param = kept
            else:
                self._param = nn.Parameter(t, requires_grad=False)
                if t._is_view():  # not a converted copy: no memory held
                    self._by_buffer.put(t, self._param)
            self._source = t
        self.module._parameters[self.attr] = self._param

    def unbind(self) -> None:
        (self.module._buffers if self.is_buffer else self.module._parameters)[self.attr] = self.placeholder
        if not self.persistent:
            self._source = self._param = None


def assign(group: list[Binding], tensors: dict[str, torch.Tensor]) -> None:
    for b in group:
        b.bind(tensors[b.tensor])


def called_site(model: nn.Module, hook: str, module_path: str) -> str:
    """Where a tensor of MODULE_PATH is bound: HOOK, or the member on its path if HOOK is a container (a ModuleList's
    forward never runs; the model calls its members directly, so each member binds its own tensors)."""
    while isinstance(model.get_submodule(hook), (nn.ModuleList, nn.ModuleDict)) and module_path.startswith(hook + "."):
        hook = f"{hook}.{module_path[len(hook) + 1 :].split('.', 1)[0]}"
    return hook


def is_lookup(module: nn.Module, group: list[Binding]) -> bool:
    """An embedding table bound alone: what reads it are lookups, by its forward or its model (F.embedding, w[ids])."""
    return (
        isinstance(module, nn.Embedding) and len(group) == 1 and group[0].attr == "weight" and group[0].module is module
    )


def move_buffers(model: nn.Module, device: torch.device) -> None:
    for module in model.modules():
        for name, buf in module._buffers.items():
            if buf is not None and not isinstance(buf, Unbound) and buf.device != device:
                module._buffers[name] = buf.to(device)
