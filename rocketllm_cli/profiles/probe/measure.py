"""Timed measurements of memory, transfer and compute speed. Each records method, bytes and seconds.

Copy bandwidths count each byte once (bytes copied per second), read and write together.
"""

from __future__ import annotations

import time

from ...dtypes import NAMES as DTYPE_NAMES
from ...dtypes import torch_dtype
from ..records import Measurement
from .devices import synchronize

MiB = 1024**2
COPY_BYTES = 256 * MiB  # host_memory's buffers: larger than any CPU cache ...
MIN_COPY_BYTES = 32 * MiB  # ... and still so where free memory is short


def host_memory(size: int = COPY_BYTES) -> Measurement:
    """Host RAM copy bandwidth: tensor.copy_ between two warm host buffers, best of 4."""
    import torch

    size = size // MiB * MiB
    src = torch.ones(size, dtype=torch.uint8)
    dst = torch.zeros(size, dtype=torch.uint8)  # both touched, so page faults are not timed
    seconds = _best(lambda: dst.copy_(src), "cpu", repeats=4)
    method = (
        f"torch copy_ of a {size // MiB} MiB host tensor, {torch.get_num_threads()} threads, best of 4; bytes "
        f"copied per second"
    )
    return Measurement("host_memory", size / seconds, method, size, seconds)


def device_memory(device: str, host: Measurement, size: int = 512 * MiB) -> Measurement:
    """The compute device's memory bandwidth; on the CPU that memory IS host RAM, so it is host_memory."""
    if device == "cpu":
        return Measurement(
            "device_memory",
            host.value,
            f"CPU device: its memory is host RAM ({host.method})",
            host.bytes_moved,
            host.seconds,
            host.available,
            host.reason,
        )
    import torch

    try:
        src = torch.ones(size, dtype=torch.uint8, device=device)
        dst = torch.zeros_like(src)
        seconds = _best(lambda: dst.copy_(src), device, repeats=4)
    except Exception as exc:  # noqa: BLE001 - out of memory, driver errors
        return Measurement.unavailable("device_memory", "device copy_", f"{type(exc).__name__}: {exc}")
    return Measurement(
        "device_memory",
        size / seconds,
        f"copy_ between two {size // MiB} MiB {device} tensors, best of 4; bytes copied per second",
        size,
        seconds,
    )


def host_to_device(device: str, size: int = 256 * MiB) -> dict[str, Measurement]:
    """h2d_pinned and h2d_pageable copy bandwidth; unavailable (with the reason) on the CPU."""
    if device == "cpu":
        why = "the compute device is the CPU: weights are used where they lie, nothing is copied to a device"
        return {
            name: Measurement.unavailable(name, "host-to-device copy_", why) for name in ("h2d_pinned", "h2d_pageable")
        }
    import torch

    out = {}
    try:
        dst = torch.empty(size, dtype=torch.uint8, device=device)
    except Exception as exc:  # noqa: BLE001
        why = f"cannot allocate {size // MiB} MiB on {device}: {type(exc).__name__}"
        return {
            name: Measurement.unavailable(name, "host-to-device copy_", why) for name in ("h2d_pinned", "h2d_pageable")
        }
    for name, pinned in (("h2d_pinned", True), ("h2d_pageable", False)):
        if pinned and not device.startswith("cuda"):
            out[name] = Measurement.unavailable(
                name, "host-to-device copy_", f"pinned host memory is used only with CUDA devices, not {device}"
            )
            continue
        try:
            src = torch.ones(size, dtype=torch.uint8, pin_memory=pinned)
            seconds = _best(lambda: dst.copy_(src, non_blocking=pinned), device, repeats=3)
        except Exception as exc:  # noqa: BLE001
            out[name] = Measurement.unavailable(name, "host-to-device copy_", f"{type(exc).__name__}: {exc}")
            continue
        kind = "pinned (page-locked), non_blocking" if pinned else "pageable"
        out[name] = Measurement(
            name,
            size / seconds,
            f"copy_ of a {size // MiB} MiB {kind} host tensor to {device}, best of 3",
            size,
            seconds,
        )
    return out


def compute(device: str) -> dict[str, Measurement]:
    """Per dtype: matmul_<dt> (FLOP/s, square matmul) and matvec_<dt> (weight bytes per second, the decode shape)."""
    import torch

    out = {}
    on_cpu = device == "cpu"
    n = 512 if on_cpu else 4096
    weight_bytes = 64 * MiB if on_cpu else 256 * MiB  # bigger than most caches, so the weights stream from memory
    for short in DTYPE_NAMES:
        dtype = torch_dtype(short)
        try:
            a = torch.ones(n, n, dtype=dtype, device=device)
            seconds = _best(lambda: a @ a, device, repeats=3, budget=0.15)
            out[f"matmul_{short}"] = Measurement(
                f"matmul_{short}",
                2 * n**3 / seconds,
                f"{n}x{n} @ {n}x{n} on {device}, best of up to 3",
                a.nbytes,
                seconds,
                unit="FLOP/s",
            )
            k = 4096
            w = torch.ones(weight_bytes // (k * a.element_size()), k, dtype=dtype, device=device)
            x = torch.ones(1, k, dtype=dtype, device=device)
            seconds = _best(lambda: x @ w.T, device, repeats=3, budget=0.15)
            out[f"matvec_{short}"] = Measurement(
                f"matvec_{short}",
                w.nbytes / seconds,
                f"[1,{k}] @ [{k},{w.shape[0]}] ({w.nbytes // MiB} MiB of weights) on {device}, best of up to 3",
                w.nbytes,
                seconds,
            )
        except Exception as exc:  # noqa: BLE001 - a dtype the device cannot run
            why = f"{short} on {device} failed: {type(exc).__name__}"
            out.setdefault(f"matmul_{short}", Measurement.unavailable(f"matmul_{short}", "matmul", why, unit="FLOP/s"))
            out[f"matvec_{short}"] = Measurement.unavailable(f"matvec_{short}", "matvec", why)
    return out


def _best(step, device: str, repeats: int, budget: float = 1.0) -> float:
    """Fastest of up to `repeats` timed runs after one warm-up; stops early once `budget` seconds are spent, the
    warm-up's included: a step the device runs slowly is timed once (a 512 x 512 fp16 matmul on a CPU without fp16
    arithmetic, 0.09 s a run on a 2-core EPYC, had a warm-up and two timed runs: the compute probe took 0.39-0.45 s,
    now 0.29-0.31, the same 2.8-2.9 GFLOP/s measured)."""
    spent = time.perf_counter()
    step()
    synchronize(device)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        synchronize(device)
        best = min(best, time.perf_counter() - start)
        if time.perf_counter() - spent > budget:
            break
    return max(best, 1e-9)
