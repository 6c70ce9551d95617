"""Which low-bit kernels compute correctly on a device, and for which activation dtypes: found by running each
once on a tiny weight and comparing with F.linear on its dequantized form, then kept for the process and stored
beside the hardware profile (kernels.json under its fingerprint, which names the CPU, its ISA ceiling and torch's
version), so a later process reads the answer instead of spending ~0.2 s of its start-up re-running the probe.
`rocketllm profile --refresh` runs it again.

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
TIMING_SHAPE = (1024, 1024)  # (N, K) a decode-shaped call is timed at to find each kernel's fastest dtype
TIMING_CALLS = 3  # best of this many after a warm-up (one, for a dtype already 4x slower than the best)

_CACHE: dict[str, Capabilities] = {}


@dataclass(frozen=True)
class Capabilities:
    """The activation dtypes (short names) each kernel computes correctly on one device."""

    device: str
    int4: tuple[str, ...]
    int8: tuple[str, ...]
    seconds: tuple[tuple[str, str, float], ...] = ()  # (kind, dtype, best seconds of a decode-shaped call)

    def supports(self, kind: str, dtype: torch.dtype) -> bool:
        return dtypes.short_name(dtype) in getattr(self, kind, ())

    def fastest(self, kind: str) -> str | None:
        """The activation dtype in which `kind`'s kernel ran a decode-shaped call fastest here."""
        timed = [(t, d) for k, d, t in self.seconds if k == kind]
        return min(timed)[1] if timed else None


def capabilities(device="cpu") -> Capabilities:
    """The probe's answer for `device`: this process's, else the stored one, else run now and stored."""
    key = _key(device)
    if key not in _CACHE:
        found = _stored(key)
        if found is None:
            found = probe(key)
            _store(found)
        _CACHE[key] = found
    return _CACHE[key]


def stored_path():
    """kernels.json beside this machine's hardware profile."""
    from ..profiles.cache import profile_dir
    from ..profiles.probe.machine import fingerprint, fingerprint_facts

    return profile_dir(fingerprint(fingerprint_facts())) / "kernels.json"


def _stored(key: str) -> Capabilities | None:
    from ..profiles.cache import read_json

    try:
        doc = (read_json(stored_path()) or {}).get(key)
        if doc is None:
            return None
        seconds = tuple((str(k), str(d), float(t)) for k, d, t in doc.get("seconds", ()))
        return Capabilities(key, tuple(doc["int4"]), tuple(doc["int8"]), seconds)
    except (OSError, KeyError, TypeError, ValueError):
        return None  # unreadable or of another shape: probe again


def _store(caps: Capabilities) -> None:
    from ..profiles.cache import read_json, write_json

    try:
        path = stored_path()
        doc = read_json(path) or {}
        doc.pop("cache_format", None)
        doc[caps.device] = {"int4": list(caps.int4), "int8": list(caps.int8), "seconds": [list(s) for s in caps.seconds]}
        write_json(path, doc)
    except OSError:
        pass  # a read-only cache: the answer stays this process's


def probe(device) -> Capabilities:
    """Run every kernel for every activation dtype on `device` now (capabilities() caches this)."""
    device = torch.device(device)
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(TRIAL_SHAPE, generator=generator)
    x = torch.randn(TRIAL_ROWS, TRIAL_SHAPE[1], generator=generator)
    found: dict[str, list[str]] = {"int4": [], "int8": []}
    timed: list[tuple[str, str, float]] = []
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
                best = min((t for k, _, t in timed if k == kind), default=None)
                timed.append((kind, name, _time(kind, bits, group, dtype, device, best)))
    return Capabilities(str(device), tuple(found["int4"]), tuple(found["int8"]), tuple(timed))


def _time(kind: str, bits: int, group, dtype: torch.dtype, device, best_so_far: float | None = None) -> float:
    """Best seconds of one [1, K] x [K, N] call at TIMING_SHAPE: what a decode step asks of the kernel."""
    import time

    weight = torch.randn(TIMING_SHAPE, generator=torch.Generator().manual_seed(1))
    packed = quantize_rtn(weight, bits=bits, group=group)
    kernel = layout.int4_for_kernel(packed, dtype, device) if kind == "int4" else layout.int8_for_kernel(packed, dtype, device)
    x = torch.randn(1, TIMING_SHAPE[1]).to(device, dtype)
    run = (lambda: layout.int4_mm(x, kernel, group)) if kind == "int4" else (lambda: layout.int8_mm(x, kernel))
    run()
    best = float("inf")
    for _ in range(TIMING_CALLS):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        started = time.perf_counter()
        run()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - started)
        if best_so_far is not None and best > 4 * best_so_far:
            break  # clearly slower: not worth more calls
    return best


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
