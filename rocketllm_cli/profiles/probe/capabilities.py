"""Capability decisions for the compute device, each with the fallback taken and why; made once, when measuring."""

from __future__ import annotations

from ..records import Capability, Measurement

FP16_WARNING = (
    "fp16 overflows above 65504: models trained in bf16 can produce inf/nan activations; "
    "if output turns to garbage, pass --dtype fp32"
)


def compute_dtype(device: str, isa: list[str], measurements: dict[str, Measurement]) -> Capability:
    """bf16 where the hardware runs it natively, else fp16 (GPUs, with the overflow warning), else fp32."""
    rates = _rates(measurements)
    if device == "cpu":
        native = [flag for flag in ("amx_bf16", "avx512_bf16", "bf16") if flag in isa]
        if native:
            return Capability("compute_dtype", "bf16", None, f"CPU has {native[0]}: native bf16 dot products ({rates})")
        return Capability(
            "compute_dtype",
            "fp32",
            "fp32",
            f"no avx512_bf16/amx_bf16 in the CPU's ISA, so bf16 would be emulated; fp16 on CPU has no fast matmul "
            f"kernels ({rates})",
        )
    import torch

    if device.startswith("cuda"):
        if torch.cuda.is_bf16_supported():
            return Capability("compute_dtype", "bf16", None, f"torch.cuda.is_bf16_supported() ({rates})")
        if measurements.get("matmul_fp16", Measurement.unavailable("", "", "")).available:
            return Capability("compute_dtype", "fp16", "fp16", f"this GPU has no bf16; {FP16_WARNING}")
        return Capability("compute_dtype", "fp32", "fp32", "neither bf16 nor fp16 matmul ran on this GPU")
    # MPS / XPU: whichever reduced precision actually ran in the matmul measurement
    for dtype in ("bf16", "fp16"):
        if measurements.get(f"matmul_{dtype}", Measurement.unavailable("", "", "")).available:
            fallback = None if dtype == "bf16" else "fp16"
            warning = "" if dtype == "bf16" else f"; {FP16_WARNING}"
            return Capability("compute_dtype", dtype, fallback, f"{dtype} matmul ran on {device} ({rates}){warning}")
    return Capability("compute_dtype", "fp32", "fp32", f"no reduced-precision matmul ran on {device}")


def pin_memory(device: str, measurements: dict[str, Measurement]) -> Capability:
    if not device.startswith("cuda"):
        return Capability(
            "pin_memory",
            False,
            "pageable host memory",
            f"page-locked buffers only speed up copies to a CUDA device; the compute device is {device}",
        )
    pinned = measurements.get("h2d_pinned")
    if pinned is None or not pinned.available:
        return Capability(
            "pin_memory",
            False,
            "pageable host memory",
            f"pinned allocation failed: {pinned.reason if pinned else 'not measured'}",
        )
    pageable = measurements.get("h2d_pageable")
    versus = f" vs pageable {pageable.value / 1e9:.2f} GB/s" if pageable and pageable.available else ""
    return Capability("pin_memory", True, None, f"pinned host-to-device {pinned.value / 1e9:.2f} GB/s{versus}")


def non_blocking(device: str, pin: Capability) -> Capability:
    if device.startswith("cuda") and pin.value:
        return Capability(
            "non_blocking", True, None, "copies from pinned memory run on a side CUDA stream while layers compute"
        )
    why = "no CUDA device" if not device.startswith("cuda") else "no pinned memory, so copies are synchronous"
    return Capability("non_blocking", False, "synchronous copies", why)


def sdpa(device: str) -> Capability:
    """Whether torch's fused scaled_dot_product_attention runs on the compute device."""
    try:
        import torch

        q = torch.zeros(1, 1, 4, 8, device=device)
        torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
        return Capability("sdpa", True, None, f"torch.nn.functional.scaled_dot_product_attention ran on {device}")
    except Exception as exc:  # noqa: BLE001 - missing in old torch, or unsupported on the device
        return Capability(
            "sdpa", False, "eager attention", f"scaled_dot_product_attention unusable: {type(exc).__name__}"
        )


def _rates(measurements: dict[str, Measurement]) -> str:
    parts = []
    for dtype in ("bf16", "fp16", "fp32"):
        m = measurements.get(f"matmul_{dtype}")
        parts.append(f"{dtype} {m.value / 1e9:.0f} GFLOP/s" if m and m.available else f"{dtype} unavailable")
    return "matmul " + ", ".join(parts)
