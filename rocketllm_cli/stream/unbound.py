"""The placeholder of a tensor whose unit is not bound: metadata answers, computation raises.

A meta tensor is not a loud placeholder: in torch 2.13 F.linear with a CPU input and a meta weight returns
uninitialised memory. `Unbound` has no storage; it reports the real shape and dtype and the *compute* device (so
`model.device` and code that routes inputs by a weight's device work) and raises UnboundWeightError, naming the
tensor and where it is bound, from any computation. An embedding table that can be read by rows answers lookups
(F.embedding, row indexing) with just those rows, whoever makes them: the embedding's own forward, a positional
table looked up at an offset, a model that reads a pad row from the outside.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import ModelError


class UnboundWeightError(ModelError):
    """A streamed weight took part in a computation outside the forward of the module it is bound for."""


# Queries that read a tensor's metadata, never its values: an unbound placeholder answers them.
_METADATA = frozenset(
    {
        "shape",
        "dtype",
        "device",
        "size",
        "dim",
        "ndim",
        "ndimension",
        "numel",
        "nelement",
        "is_floating_point",
        "is_complex",
        "element_size",
        "itemsize",
        "nbytes",
        "layout",
        "is_cuda",
        "is_cpu",
        "is_meta",
        "is_sparse",
        "is_quantized",
        "is_nested",
        "requires_grad",
        "requires_grad_",
        "grad",
        "grad_fn",
        "is_leaf",
        "__len__",
        "stride",
        "is_contiguous",
    }
)
_LOOKUPS = (F.embedding, torch.embedding)  # (ids, table, ...)


class Unbound(torch.Tensor):
    """Shape, dtype and device of the real tensor, and no data; a Parameter to nn.Module (`_is_param`), so
    transformers can register and tie it. Bound tensors are ordinary Parameters: nothing here runs per token for them.

    `rows`: for an embedding table the store can read by rows, rows(ids) -> a full-shaped table holding those rows.
    """

    @staticmethod
    def __new__(cls, name: str, like: torch.Tensor, device: torch.device, where: str = "", rows=None):
        t = torch.Tensor._make_wrapper_subclass(cls, like.shape, dtype=like.dtype, device=device, requires_grad=False)
        t.unbound_name, t.unbound_where, t.rows, t._is_param = name, where, rows, True
        return t

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in ("__get__", "__set__"):  # a property: Tensor.shape.__get__ ...
            name = getattr(getattr(func, "__self__", None), "__name__", "")
        if name in _METADATA:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        if func in _LOOKUPS and len(args) > 1 and isinstance(args[1], Unbound) and args[1].rows is not None:
            return func(args[0], args[1].rows(args[0]), *args[2:], **kwargs)
        if func is torch.Tensor.__getitem__ and isinstance(args[0], Unbound) and args[0].rows is not None:
            ids = _row_ids(args[0].shape[0], args[1])
            if ids is not None:
                return args[0].rows(ids)[args[1]].clone()  # a copy: the table's memory serves the next lookup
        raise _error(name, args, kwargs)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise _error(str(func), args, kwargs)

    def __repr__(self) -> str:
        return f"Unbound({self.unbound_name}, shape={list(self.shape)}, dtype={self.dtype}, device={self.device})"

    __str__ = __repr__


def _row_ids(n: int, index) -> torch.Tensor | None:
    """The rows an index selects, if it selects whole rows (`w[3]`, `w[ids]`, `w[a:b]`, `w[3, :]`), else None."""
    if isinstance(index, tuple):
        if not index or any(i not in (slice(None), Ellipsis) for i in index[1:]):
            return None
        index = index[0]
    if isinstance(index, bool) or index is None or index is Ellipsis:
        return None
    if isinstance(index, (int, slice)):
        return torch.arange(n)[index].reshape(-1)
    if torch.is_tensor(index) and not index.is_floating_point() and index.dtype != torch.bool:
        return index.reshape(-1)
    return None


def _error(op: str, args, kwargs) -> UnboundWeightError:
    import torch.utils._pytree as pytree

    held = next((a for a in pytree.tree_leaves((args, kwargs or {})) if isinstance(a, Unbound)), None)
    name, where = (held.unbound_name, held.unbound_where) if held is not None else ("a weight", "")
    return UnboundWeightError(
        f"{name} was used ({op}) while its unit is not bound: streamed weights are bound only inside the forward of "
        f"{where or 'the module they stream to'}, and this model uses it elsewhere; streaming does not support that yet"
    )


def unbind_all(model: nn.Module, device: torch.device) -> None:
    """Every tensor still on the meta device becomes an Unbound placeholder reporting the compute device."""
    for path, module in model.named_modules():
        for table in (module._parameters, module._buffers):
            for attr, t in table.items():
                if t is not None and t.is_meta and not isinstance(t, Unbound):
                    table[attr] = Unbound(f"{path}.{attr}" if path else attr, t, device)
