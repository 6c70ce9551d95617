"""Static facts about this machine: OS, versions, CPU, RAM, GPUs.

Every probe that fails degrades to "unavailable" with the reason; nothing is guessed.
No serial numbers, UUIDs or host names are read.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import time
from importlib import metadata

from ...native.build import cpuinfo_flags
from .cgroup import cpu_quota, memory_limit
from .nvml import driver_version, nvml_gpus

# ISA flags that decide kernels and dtypes (x86 names as in /proc/cpuinfo; the last four are Arm's).
RELEVANT_ISA = (
    "sse4_2",
    "avx",
    "avx2",
    "fma",
    "f16c",
    "avx512f",
    "avx512bw",
    "avx512_vnni",
    "avx512_bf16",
    "avx512_fp16",
    "amx_tile",
    "amx_bf16",
    "amx_int8",
    "asimd",
    "sve",
    "bf16",
    "i8mm",
)
GIB = 1024**3

# The ISA torch and oneDNN are told to stop at (ATEN_CPU_CAPABILITY, ONEDNN_MAX_CPU_ISA): flags above the lower of
# the two are not used by any kernel, so the decisions must not count them. Each ceiling names the flags it hides.
_AVX512 = ("avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "avx512_fp16")
_AMX = ("amx_tile", "amx_bf16", "amx_int8")
_ATEN_HIDES = {"default": ("avx", "avx2", "fma", *_AVX512, *_AMX), "avx2": (*_AVX512, *_AMX)}
_ONEDNN_HIDES = {
    "sse41": ("avx", "avx2", "fma", *_AVX512, *_AMX),
    "avx": ("avx2", *_AVX512, *_AMX),
    "avx2": (*_AVX512, *_AMX),
    "avx2_vnni": (*_AVX512, *_AMX),
    "avx2_vnni_2": (*_AVX512, *_AMX),
    "avx512_core": ("avx512_bf16", "avx512_fp16", *_AMX),
    "avx512_core_vnni": ("avx512_bf16", "avx512_fp16", *_AMX),
    "avx512_core_bf16": ("avx512_fp16", *_AMX),
    "avx512_core_fp16": _AMX,
}


def package_version(dist: str) -> str | None:
    """Installed version from package metadata, without importing the package (transformers costs seconds)."""
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def os_name() -> str:
    return f"{platform.system()} {platform.release()}"


def cpu_model() -> str:
    for line in _read_lines("/proc/cpuinfo"):
        key, _, value = line.partition(":")
        if key.strip() in ("model name", "Model", "Hardware") and value.strip():
            return value.strip()
    return platform.processor() or platform.machine() or "unknown"


def cpu_flags() -> tuple[list[str], str]:
    """(relevant ISA flags present, where they came from): /proc/cpuinfo, else py-cpuinfo (which on Linux reads the
    same file through a subprocess of its own: a second of a first run on 2 cores)."""
    flags = cpuinfo_flags() or set()
    source = "/proc/cpuinfo"
    if not flags:
        try:
            import cpuinfo

            flags = set(cpuinfo.get_cpu_info().get("flags", []))
            source = "py-cpuinfo (no /proc/cpuinfo flags)"
        except Exception as exc:  # noqa: BLE001 - py-cpuinfo raises anything on odd platforms
            what = "missing" if isinstance(exc, ImportError) else f"failed ({type(exc).__name__})"
            source = f"unavailable: no /proc/cpuinfo flags and py-cpuinfo {what}"
    hidden, ceiling = isa_ceiling()
    if hidden & flags:
        source += f"; {', '.join(f for f in RELEVANT_ISA if f in hidden & flags)} left out by {ceiling}"
    return [f for f in RELEVANT_ISA if f in flags and f not in hidden], source


def isa_ceiling() -> tuple[set[str], str]:
    """(flags the kernels are told not to use, the settings that say so); empty when nothing caps the ISA."""
    hidden: set[str] = set()
    said = []
    for var, table in (("ATEN_CPU_CAPABILITY", _ATEN_HIDES), ("ONEDNN_MAX_CPU_ISA", _ONEDNN_HIDES)):
        value = os.environ.get(var, "").strip()
        if value.lower() in table:
            hidden.update(table[value.lower()])
            said.append(f"{var}={value}")
    return hidden, " and ".join(said)


def usable_cores() -> int:
    """CPUs this process may run on: the affinity mask, lowered by a cgroup CPU quota if one is set."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    quota = cpu_quota()
    return max(1, min(cores, quota)) if quota else cores


def memory() -> tuple[int, int]:
    """(total, available) RAM in bytes, lowered to this process's own cgroup memory limit when one is set."""
    total, available, _ = memory_bound()
    return total, available


def memory_bound() -> tuple[int, int, str]:
    """(total, available, what bounds them): "cgroup" where this process's memory cgroup limit is below the
    machine's RAM (the OS and other programs then live outside the limit), else "machine"."""
    import psutil

    vm = psutil.virtual_memory()
    total, available = int(vm.total), int(vm.available)
    group = memory_limit()
    if group is not None and group.limit < total:
        return group.limit, min(available, group.available), "cgroup"
    return total, available, "machine"


def pci_accelerators() -> list[str]:
    """vendor:device ids of display (0x03) and processing-accelerator (0x12) PCI functions; ids only, no serials."""
    found = []
    base = "/sys/bus/pci/devices"
    try:
        names = sorted(os.listdir(base))
    except OSError:
        return found
    for name in names:
        klass = _read_text(f"{base}/{name}/class")
        if klass[:4] in ("0x03", "0x12"):
            found.append(f"{_read_text(f'{base}/{name}/vendor')}:{_read_text(f'{base}/{name}/device')}")
    return found


def fingerprint_facts() -> dict:
    """The stable facts the cache is keyed on; cheap to gather (no torch import, no py-cpuinfo)."""
    gpus, _ = nvml_gpus()
    facts = {
        "cpu_model": cpu_model(),
        "cpu_cores": usable_cores(),
        "ram_total_gib": round(memory()[0] / GIB),
        "gpus": [(g["name"], round((g["memory_total"] or 0) / GIB)) for g in gpus],
        "pci_accelerators": pci_accelerators(),
        "os": f"{platform.system()} {platform.release().split('.')[0]}",
        "torch": package_version("torch"),
    }
    ceiling = isa_ceiling()[1]
    if ceiling:  # a capped ISA decides differently: its own profile (an uncapped machine keeps its fingerprint)
        facts["isa_ceiling"] = ceiling
    return facts


def fingerprint(facts: dict) -> str:
    return hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).hexdigest()[:16]


def collect_facts() -> dict:
    """Everything static the report shows; gathered once per measurement and cached with it."""
    flags, flags_source = cpu_flags()
    gpus, gpu_reason = nvml_gpus()
    try:
        import psutil

        physical = psutil.cpu_count(logical=False)
    except Exception:  # noqa: BLE001
        physical = None
    return {
        "os": os_name(),
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpu": {
            "model": cpu_model(),
            "isa": flags,
            "isa_source": flags_source,
            "cores_logical": os.cpu_count(),
            "cores_physical": physical,
            "cores_usable": usable_cores(),
        },
        "gpus": gpus,
        "gpus_reason": gpu_reason,
        "driver": driver_version(),
    }


BUSY_SHARE = 0.25  # other processes using this share of the CPUs while measuring make the figures suspect


def cpu_snapshot() -> tuple[float, float, float] | None:
    """(busy CPU-seconds of the whole machine, CPU-seconds of this process, wall time), or None without /proc/stat."""
    fields = _read_lines("/proc/stat")[:1]
    if not fields or not fields[0].startswith("cpu "):
        return None
    ticks = [int(x) for x in fields[0].split()[1:]]
    busy = sum(ticks[:3]) + sum(ticks[5:8])  # user nice system + irq softirq steal (idle and iowait excluded)
    own = os.times()
    return (
        busy / os.sysconf("SC_CLK_TCK"),
        own.user + own.system + own.children_user + own.children_system,
        time.monotonic(),
    )


def others_cpu_share(before: tuple | None, after: tuple | None) -> float | None:
    """Share of all CPUs that other processes (and the hypervisor's steal) used between two snapshots."""
    if before is None or after is None or after[2] <= before[2]:
        return None
    others = (after[0] - before[0]) - (after[1] - before[1])
    return round(max(0.0, min(1.0, others / ((after[2] - before[2]) * (os.cpu_count() or 1)))), 3)


def _read_text(path: str) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read().strip()
    except OSError:
        return ""


def _read_lines(path: str) -> list[str]:
    return _read_text(path).splitlines()


def is_this_machine(profile) -> bool:
    """Whether PROFILE describes the machine this process runs on (not `plan --profile FILE`'s other one): only then
    can what it lacks be measured here."""
    return profile.fingerprint == fingerprint(fingerprint_facts())
