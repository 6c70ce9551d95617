"""NVIDIA GPUs through NVML (nvidia-ml-py): names, memory, compute capability, PCIe link; never serials or UUIDs.

NVML answers without importing torch or creating a CUDA context, so the cached path stays fast.
"""

from __future__ import annotations


def nvml_gpus() -> tuple[list[dict], str | None]:
    """GPUs as NVML sees them (name, memory, compute capability, PCIe link), or ([], why not)."""
    try:
        import pynvml
    except ImportError:
        return [], "nvidia-ml-py (pynvml) not installed"
    try:
        pynvml.nvmlInit()
    except Exception as exc:  # noqa: BLE001 - NVMLError subclasses, OSError from the loader
        return [], f"NVML not usable ({type(exc).__name__}: {exc})"
    try:
        gpus = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            name = pynvml.nvmlDeviceGetName(handle)
            gpu = {"index": i, "name": name.decode() if isinstance(name, bytes) else name}
            gpu["memory_total"] = _nvml(lambda: int(pynvml.nvmlDeviceGetMemoryInfo(handle).total))
            gpu["compute_capability"] = _nvml(lambda: "%d.%d" % pynvml.nvmlDeviceGetCudaComputeCapability(handle))
            gpu["pcie_gen"] = _nvml(lambda: pynvml.nvmlDeviceGetCurrPcieLinkGeneration(handle))
            gpu["pcie_gen_max"] = _nvml(lambda: pynvml.nvmlDeviceGetMaxPcieLinkGeneration(handle))
            gpu["pcie_width"] = _nvml(lambda: pynvml.nvmlDeviceGetCurrPcieLinkWidth(handle))
            gpu["pcie_width_max"] = _nvml(lambda: pynvml.nvmlDeviceGetMaxPcieLinkWidth(handle))
            gpus.append(gpu)
        return gpus, None
    except Exception as exc:  # noqa: BLE001
        return [], f"NVML query failed ({type(exc).__name__}: {exc})"
    finally:
        _nvml(pynvml.nvmlShutdown)


def nvml_free_memory(index: int = 0) -> int | None:
    """Live free memory of one GPU through NVML (cheap: no torch import), or None."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:  # noqa: BLE001
        return None
    try:
        return int(pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(index)).free)
    except Exception:  # noqa: BLE001
        return None
    finally:
        _nvml(pynvml.nvmlShutdown)


def driver_version() -> str | None:
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:  # noqa: BLE001
        return None
    try:
        version = pynvml.nvmlSystemGetDriverVersion()
        return version.decode() if isinstance(version, bytes) else version
    except Exception:  # noqa: BLE001
        return None
    finally:
        _nvml(pynvml.nvmlShutdown)


def _nvml(call):
    try:
        return call()
    except Exception:  # noqa: BLE001 - one unsupported query must not lose the others
        return None
