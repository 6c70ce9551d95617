"""Which low-bit kernels compute correctly on a device, and for which activation dtypes: found by running each
once on a tiny weight and comparing with F.linear on its dequantized form, then kept for the process.

Nothing is assumed from the device's name or torch's version: an op that is missing, refuses the dtype or
gives a wrong answer (a layout this code does not know) is simply not used, and its layers dequantize into
the scratch buffer instead.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import dtypes
from . import layout
from .dequant import dequantize
from .rtn import quantize_rtn

TRIAL_SHAPE = (32, 256)  # (N, K): fits every kernel's multiples (N % 16, K % (16·8 tiles), group 32)
TRIAL_ROWS = 3  # activation rows
TRIAL_TOLERANCE = 0.05  # of the reference's largest magnitude: bf16 rounding is ~0.01, a wrong layout ~1

_CACHE: dict[str, Capabilities] = {}


@dataclass(frozen=True)
class Capabilities:
    """The activation dtypes (short names) each kernel computes correctly on one device."""

    device: str
    int4: tuple[str, ...]
    int8: tuple[str, ...]

    def supports(self, kind: str, dtype: torch.dtype) -> bool:
        return dtypes.short_name(dtype) in getattr(self, kind, ())


def capabilities(device="cpu") -> Capabilities:
    """The probe's answer for `device`, run the first time the device is asked about."""
    key = _key(device)
    if key not in _CACHE:
        _CACHE[key] = probe(key)
    return _CACHE[key]


def probe(device) -> Capabilities:
    """Run every kernel for every activation dtype on `device` now (capabilities() caches this)."""
    device = torch.device(device)
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(TRIAL_SHAPE, generator=generator)
    x = torch.randn(TRIAL_ROWS, TRIAL_SHAPE[1], generator=generator)
    found: dict[str, list[str]] = {"int4": [], "int8": []}
    for kind, bits, group in (("int4", 4, 32), ("int8", 8, None)):
        packed = quantize_rtn(weight, bits=bits, group=group)
        reference = torch.nn.functional.linear(x, dequantize(packed))
        for name in dtypes.NAMES:
            dtype = dtypes.torch_dtype(name)
            try:
                got = _run(kind, packed, x.to(device, dtype), dtype, device).float().cpu()
            except (RuntimeError, NotImplementedError, AttributeError, TypeError):
                continue  # op missing on this torch, or refused on this device or dtype
            if got.shape == reference.shape and bool(((got - reference).abs().max() <= TRIAL_TOLERANCE * reference.abs().max())):
                found[kind].append(name)
    return Capabilities(str(device), tuple(found["int4"]), tuple(found["int8"]))


def _run(kind: str, packed, x: torch.Tensor, dtype: torch.dtype, device) -> torch.Tensor:
    if kind == "int4":
        return layout.int4_mm(x, layout.int4_for_kernel(packed, dtype, device), packed.format.group)
    return layout.int8_mm(x, layout.int8_for_kernel(packed, dtype, device))


def _key(device) -> str:
    """'cuda' and 'cuda:0' are one device: the key names its index."""
    device = torch.device(device)
    if device.type != "cpu" and device.index is None:
        module = getattr(torch, device.type, None)
        if module is not None and hasattr(module, "current_device"):
            device = torch.device(device.type, module.current_device())
    return str(device)
