"""The compute device, chosen by capability query (never by name), and what torch says about accelerators."""

from __future__ import annotations

import os

from .nvml import nvml_free_memory


def choose_device() -> tuple[str, str]:
    """(device string, why): CUDA/ROCm, then XPU, then MPS, else the CPU. Imports torch."""
    import torch

    if torch.cuda.is_available():
        backend = (
            f"ROCm/HIP {torch.version.hip}" if getattr(torch.version, "hip", None) else f"CUDA {torch.version.cuda}"
        )
        return "cuda:0", f"torch.cuda.is_available() with {backend}"
    xpu = getattr(torch, "xpu", None)
    if xpu is not None and _safe(xpu.is_available):
        return "xpu:0", "torch.xpu.is_available()"
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and _safe(mps.is_available):
        return "mps", "torch.backends.mps.is_available()"
    reasons = ["torch.cuda.is_available() is False"]
    if "+cpu" in torch.__version__:
        reasons.append(f"torch {torch.__version__} is a CPU-only build")
    return "cpu", "; ".join(reasons)


def torch_accelerators(device: str) -> list[dict]:
    """Each accelerator torch can use: name, memory, compute capability. Empty on the CPU."""
    import torch

    found = []
    if device.startswith("cuda"):
        for i in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(i)
            found.append(
                {
                    "index": i,
                    "backend": "rocm" if getattr(torch.version, "hip", None) else "cuda",
                    "name": props.name,
                    "memory_total": int(props.total_memory),
                    "compute_capability": f"{props.major}.{props.minor}",
                }
            )
    elif device.startswith("xpu"):
        props = torch.xpu.get_device_properties(0)
        found.append({"index": 0, "backend": "xpu", "name": props.name, "memory_total": int(props.total_memory)})
    elif device == "mps":
        total = _safe(lambda: int(torch.mps.recommended_max_memory()))
        found.append({"index": 0, "backend": "mps", "name": "Apple GPU (unified memory)", "memory_total": total})
    return found


def device_memory(device: str) -> tuple[int | None, int | None]:
    """(total, free) bytes of the compute device's own memory, read live; (None, None) on the CPU."""
    if device == "cpu":
        return None, None
    if device.startswith("cuda") and "CUDA_VISIBLE_DEVICES" not in os.environ:
        from .nvml import nvml_gpus

        gpus, _ = nvml_gpus()
        if len(gpus) == 1:  # one GPU: NVML's index 0 is torch's cuda:0, and NVML needs no torch import
            return gpus[0]["memory_total"], nvml_free_memory(0)
    import torch

    if device.startswith("cuda"):
        free, total = torch.cuda.mem_get_info(0)
        return int(total), int(free)
    if device.startswith("xpu"):
        info = _safe(lambda: torch.xpu.mem_get_info(0))
        total = int(torch.xpu.get_device_properties(0).total_memory)
        return total, int(info[0]) if info else None
    if device == "mps":
        total = _safe(lambda: int(torch.mps.recommended_max_memory()))
        used = _safe(lambda: int(torch.mps.driver_allocated_memory())) or 0
        return total, (total - used) if total else None
    return None, None


def synchronize(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()
    elif device.startswith("xpu"):
        torch.xpu.synchronize()
    elif device == "mps":
        torch.mps.synchronize()


def _safe(call):
    try:
        return call()
    except Exception:  # noqa: BLE001 - a capability query that raises means "no"
        return None
