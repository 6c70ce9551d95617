"""Packed weights in a transformers model: a Linear computes on the low-bit bytes it is bound to.

A Linear whose weight a shard stores packed gets a subclass of its own class whose forward calls packed.linear on
the bound weight (the int4/int8 kernel where the device has one, else dequantize into the scratch buffer). Its
`weight` stays the Unbound placeholder: shape, dtype and device answer as for a float weight, and any other use
raises. A table tied to such a head (SmolLM2's embedding, stored int8) answers lookups through the placeholder's
row reader (store.gather_rows), like any streamed table.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.modules import module as _module

from ..checkpoint.manifest import RESHARD
from ..checkpoint.packedformat import PackedFormat, PackedTensor
from ..dtypes import torch_dtype
from ..errors import ShardError
from ..packed import compute
from ..packed.bound import BoundWeight
from .unbound import UnboundWeightError

_CLASSES: dict[type, type] = {}


class _PackedForward:
    """Mixed in before a Linear class: forward on `packed_weight` (a packed.BoundWeight while the unit is bound)."""

    packed_weight = None
    packed_where = ""
    packed_bias = True  # the Linear has a bias (then compute.linear adds it)

    def __call__(self, x, *args, **kwargs):
        # nn.Module.__call__ checks for hooks and tracing on every call (a fifth of a small matvec's time): a call
        # with none of them goes straight to forward, any other through nn.Module as before.
        if module_call_needed(self, args, kwargs):
            return nn.Module.__call__(self, x, *args, **kwargs)
        return self.forward(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bound = self.packed_weight
        if bound is None:
            raise UnboundWeightError(f"{self.packed_where} was used while its unit is not bound")
        if not self.packed_bias and bound.serves_fast(x):
            return bound.fast(x)
        return compute.linear(x, bound, self.bias)  # per call: no import machinery (the package's names are lazy)


class _FusedForward(_PackedForward):
    """Mixed in before a Linear class whose weight is stored fused with its siblings': forward asks the group."""

    fused_group = None  # the FusedGroup this Linear is a member of
    fused_index = 0  # its place in the group (its rows' place in the fused weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fused_group.call(self.fused_index, x)


class FusedGroup:
    """Linears whose packed weights are stored as one (shard/fusion.py): the first member called on an input computes
    the fused product and hands each other member its columns when that member is called on the same input.

    "The same input" is the same tensor object at the same version: a member called on anything else (another
    tensor, the same one changed in place, a second call) computes the fused product again and takes its own
    columns, so a result never depends on the grouping the shard chose, only the time does."""

    __slots__ = ("members", "splits", "bound", "where", "_x", "_version", "_outs", "_left")

    def __init__(self, members: list[nn.Linear], splits: list[int], where: str) -> None:
        self.members, self.splits, self.where = members, splits, where
        self.bound = None  # the fused weight's packed.BoundWeight while its unit is bound
        self.clear()

    def clear(self) -> None:
        self._x = self._version = self._outs = None
        self._left = 0

    def call(self, index: int, x: torch.Tensor) -> torch.Tensor:
        outs = self._outs
        if outs is not None and outs[index] is not None and self._x is x and tensor_version(x) == self._version:
            out, outs[index] = outs[index], None
            self._left -= 1
            if not self._left:
                self.clear()  # every member has its columns: let go of the input
            return out
        bound = self.bound
        if bound is None:
            raise UnboundWeightError(f"{self.where} was used while its unit is not bound")
        if bound.serves_fast(x):
            y = bound.fast(x)
        else:
            y = compute.linear(x, bound, None)
        parts = list(y.split_with_sizes(self.splits, -1))  # Tensor.split's Python wrapper doubled its cost
        for i, (part, member) in enumerate(zip(parts, self.members)):
            if not part.is_contiguous():  # several rows: a member's columns are strided; transformers may view() them
                part = parts[i] = part.contiguous()
            bias = member._parameters.get("bias")
            if bias is not None:
                part.add_(bias)
        out, parts[index] = parts[index], None
        self._x, self._version, self._outs, self._left = x, tensor_version(x), parts, len(parts) - 1
        return out


def tensor_version(x: torch.Tensor):
    # An inference tensor has no version counter (nothing in a layer changes its input in place). Asked first: reading
    # its _version raises, and raising cost SmolLM2 4 ms of a 20.8 ms resident token (150 calls a token).
    return None if x.is_inference() else x._version


def module_call_needed(module: nn.Module, args, kwargs) -> bool:
    """Whether a call of MODULE must go through nn.Module.__call__: extra arguments, a hook of its own or a global one,
    a tracer, or a compiled call; else its fast path may skip that machinery (a packed Linear's, a fused norm's)."""
    d, m = module.__dict__, _module
    return bool(
        args
        or kwargs
        or d["_forward_pre_hooks"]
        or d["_forward_hooks"]
        or d["_backward_hooks"]
        or d["_backward_pre_hooks"]
        or d.get("_compiled_call_impl") is not None
        or m._global_forward_pre_hooks
        or m._global_forward_hooks
        or m._global_backward_pre_hooks
        or m._global_backward_hooks
        or m._global_forward_hooks_always_called
        or torch._C._get_tracing_state()
    )


def make_packed(module: nn.Linear, name: str, where: str) -> None:
    """Turn `module` (an nn.Linear or a subclass) into its packed-computing subclass, in place; `name` is its
    weight's, `where` the module whose forward binds it."""
    cls = type(module)
    if issubclass(cls, _PackedForward):
        return
    packed_cls = _CLASSES.get(cls)
    if packed_cls is None:
        packed_cls = _CLASSES[cls] = type(f"Packed{cls.__name__}", (_PackedForward, cls), {"__module__": __name__})
    module.__class__ = packed_cls
    module.packed_where = f"{name} (packed) is bound only inside the forward of {where}, and"
    module.packed_bias = module._parameters.get("bias") is not None


def make_fused(
    modules: list[nn.Linear], members: list[str], rows: list[int], fmt: PackedFormat, where: str
) -> FusedGroup:
    """Turn MODULES (the Linears whose weights MEMBERS are stored fused in FMT, ROWS each) into members of one
    FusedGroup, in place."""
    for module, member, n in zip(modules, members, rows):
        shape = tuple(module.weight.shape)
        if shape != (n, fmt.shape[1]) or not isinstance(module, nn.Linear):
            raise ShardError(
                f"fused weight member {member} is {[n, fmt.shape[1]]}, the model's is {list(shape)}; {RESHARD}"
            )
    group = FusedGroup(
        modules, rows, f"{' + '.join(members)} (packed, fused) is bound only inside the forward of {where}, and"
    )
    for index, module in enumerate(modules):
        cls = type(module)
        fused_cls = _FUSED_CLASSES.get(cls)
        if fused_cls is None:
            fused_cls = _FUSED_CLASSES[cls] = type(
                f"Fused{cls.__name__}", (_FusedForward, cls), {"__module__": __name__}
            )
        module.__class__ = fused_cls
        module.fused_group, module.fused_index = group, index
        module.packed_where = group.where
    return group


_FUSED_CLASSES: dict[type, type] = {}


class PackedBinding:
    """A packed weight bound to a Linear: bind(bytes) makes the kernel's form and hands it to the module's forward.

    `persistent`: the unit's bytes are the same objects on every use (host tier on a CPU), so the kernel form made
    for them is kept; otherwise it is made at each bind (for int4 in the kernel's own code order, only the
    scales are converted) and dropped on unbind. With `group` (a FusedGroup), the weight is several Linears' stored
    as one, and the group computes with it."""

    __slots__ = (
        "module",
        "attr",
        "tensor",
        "format",
        "device",
        "dtype",
        "persistent",
        "is_buffer",
        "placeholder",
        "_source",
        "_bound",
        "_direct",
        "_by_buffer",
        "group",
        "mode",
    )

    def __init__(
        self,
        module: nn.Linear,
        tensor: str,
        fmt: PackedFormat,
        device: torch.device,
        dtype: torch.dtype,
        placeholder,
        persistent: bool = False,
        group: FusedGroup | None = None,
        mode: str = "exact",
    ) -> None:
        self.mode = mode  # the native kernels' mode (packed/bound.py NATIVE_MODES)
        shape = tuple(module.weight.shape) if group is None else fmt.shape
        if shape != fmt.shape:
            raise ShardError(f"packed weight {tensor} is {list(fmt.shape)}, the model's is {list(shape)}; {RESHARD}")
        self.group = group
        self.module, self.attr, self.tensor, self.format = module, "weight", tensor, fmt
        self.device, self.dtype, self.persistent = device, dtype, persistent
        self.is_buffer, self.placeholder = False, placeholder
        self._source = self._bound = None
        self._direct = _direct_int4(fmt, device, dtype)
        # The kernel form of a streamed unit read into a buffer, kept per buffer where it is only views of the
        # bytes (the scales stored in the kernel's dtype): the unit's next read into that buffer reuses it.
        stored = _direct_views_only(fmt, dtype) if self._direct is not None else False
        self._by_buffer = PerBuffer() if stored else None

    def bind(self, data: torch.Tensor) -> None:
        if data is not self._source or self._bound is None:
            kept = self._by_buffer.get(data) if self._by_buffer is not None else None
            if kept is not None:
                self._bound = kept
            elif self._direct is not None:
                self._bound = self._direct(data)  # a view of the bytes: the kernel's own form, no checks per token
                if self._by_buffer is not None:
                    self._by_buffer.put(data, self._bound)  # views only: holds no memory
            else:
                self._bound = compute.bind(
                    PackedTensor.from_bytes(self.format, data), self.device, self.dtype, mode=self.mode
                )
            self._source = data
        if self.group is not None:
            self.group.bound = self._bound
            return
        self.module.__dict__["packed_weight"] = self._bound  # not nn.Module.__setattr__: 420 of these per token

    def unbind(self) -> None:
        if self.group is not None:
            self.group.bound = None
            self.group.clear()
        else:
            self.module.__dict__["packed_weight"] = None
        if not self.persistent:
            self._source = self._bound = None

    @property
    def path(self) -> str:
        """Which way the weight computes on this device: int4, int8 (a kernel) or scratch (dequantized per use)."""
        return compute.kernel_path(self.format, self.dtype, self.device)


class PerBuffer:
    """What a binding made from a streamed tensor, kept per streaming buffer the unit was read into.

    WeightStore hands out the same view objects each time a unit lands in the same buffer, so a bind that gets one
    of them again reuses what it made (a Parameter, an int4 kernel form). Only what holds no memory of its own is
    put here: views of the buffer, never a converted copy."""

    __slots__ = ("_kept",)
    LIMIT = 16  # buffers remembered per binding (a store has prefetch_depth + 1)

    def __init__(self) -> None:
        self._kept: dict[int, tuple[torch.Tensor, object]] = {}

    def get(self, source: torch.Tensor):
        kept = self._kept.get(source.data_ptr())
        return kept[1] if kept is not None and kept[0] is source else None

    def put(self, source: torch.Tensor, made) -> None:
        if len(self._kept) < self.LIMIT:
            self._kept[source.data_ptr()] = (source, made)


def _direct_views_only(fmt: PackedFormat, dtype: torch.dtype) -> bool:
    """_direct_int4's form is views of the bytes only (nothing converted): the scales are stored in `dtype`."""
    from .. import dtypes

    return dtypes.torch_dtype(fmt.scale_dtype) == dtype


def _direct_int4(fmt: PackedFormat, device: torch.device, dtype: torch.dtype):
    """For an int4 weight stored in the order this device's kernel reads: bytes -> BoundWeight with two views (and
    the scales' conversion when the set's dtype is not the kernel's). None where the general bind is needed."""
    from .. import dtypes
    from ..packed import layout
    from ..packed.cpulayout import cpu_layout

    if fmt.kind != "int4" or device.type != "cpu" or fmt.layout == "rows" or fmt.layout != cpu_layout():
        return None
    if compute.kernel_path(fmt, dtype, device) != "int4":
        return None
    offsets, _ = fmt.offsets()
    n, k = fmt.shape
    codes_at, sz_at = offsets["codes"], offsets["sz"]
    stored = dtypes.torch_dtype(fmt.scale_dtype)
    codes_end, sz_end = codes_at + n * k // 2, sz_at + fmt.groups * 2 * n * stored.itemsize
    tiles = layout.inner_k_tiles(k)
    dense_rows, dense_dtype = compute.dense_plan("int4", dtype, device)

    def bound(data: torch.Tensor):
        sz = data[sz_at:sz_end].view(stored).view(fmt.groups, n, 2)
        kernel = {
            "weight": data[codes_at:codes_end].view(n, k // 2),
            "scales_and_zeros": sz if stored == dtype else sz.to(dtype),
            "tiles": tiles,
        }
        return BoundWeight(fmt, dtype, device, "int4", kernel=kernel, dense_rows=dense_rows, dense_dtype=dense_dtype)

    return bound


def activation_dtype(setting: str, fmt, dtype: torch.dtype, device) -> torch.dtype:
    """The activation dtype a packed Linear computes in: the compute dtype (SETTING ""), the kernel's fastest
    ("fastest") or the dtype SETTING names (EngineConfig.packed_dtype)."""
    if setting == "fastest":
        from ..packed.compute import kernel_dtype

        return kernel_dtype(fmt, dtype, device)
    return torch_dtype(setting) if setting else dtype
