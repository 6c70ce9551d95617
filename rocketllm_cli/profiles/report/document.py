"""The doctor report as one document (dict): the --json output, and the source the Markdown is rendered from."""

from __future__ import annotations

import os

from ... import __version__
from ...checkpoint.modelfacts import ModelFacts
from ...redact import redact_env_value, redact_tree
from ...threads import COMPUTE_THREADS, wait_policy
from ..cost import plan_tier_bytes, project
from ..hardware import BUSY_SHARE, HardwareProfile
from ..knobs.resolve import resolve_knobs
from ..probe.machine import package_version
from ..probe.nativepaths import native_paths

# (distribution, import name, what its absence costs)
OPTIONAL_PACKAGES = (
    (
        "nvidia-ml-py",
        "pynvml",
        "no NVML: GPU driver, PCIe link and live VRAM come from torch only (slower, fewer facts)",
    ),
    (
        "py-cpuinfo",
        "cpuinfo",
        "CPU ISA flags come from /proc/cpuinfo only: elsewhere bf16 support is unknown and fp32 is used",
    ),
    ("gguf", "gguf", "cannot shard .gguf checkpoints"),
    ("accelerate", "accelerate", "cannot build the empty (meta-device) model skeleton: shard and generate fail"),
    ("fastapi", "fastapi", "no HTTP server: `rocketllm serve` unavailable"),
    ("uvicorn", "uvicorn", "no HTTP server: `rocketllm serve` unavailable"),
)
VERSIONED = ("torch", "transformers", "safetensors", "accelerate", "gguf")


def build(
    profile: HardwareProfile,
    model: ModelFacts | None,
    model_source: str | None,
    model_path=None,
    log=None,
    kernels: list[dict] | None = None,
    measure_layers=None,
) -> dict:
    """Every field of the report; strings are redacted (no home path, user or host name, secrets). `model_path`: the
    shard set the facts describe, whose own reads are measured where it streams from storage. `kernels`: rows the
    layers above add to the capabilities (the packed-kernel probe's, packed/probe.py report_rows). `measure_layers`:
    the layers above's measure of a decoder layer's own work (stream/layerprobe.py), for a model's projection."""
    facts = profile.facts
    doc = {
        "versions": {
            "rocketllm": __version__,
            "python": facts.get("python"),
            "os": facts.get("os"),
            **{name: package_version(name) or "not installed" for name in VERSIONED},
        },
        "cpu": {**facts.get("cpu", {}), "cores_used": profile.cpu_cores},
        "memory": {"ram_total": profile.ram_total, "ram_available": profile.ram_available},
        "accelerators": _accelerators(profile),
        "capabilities": [c.to_dict() for c in profile.capabilities.values()] + list(kernels or ()),
        "native_kernels": native_paths(profile),  # which path each GGUF block type takes, at what speed
        "optional_packages": [_package(*p) for p in OPTIONAL_PACKAGES],
        "measurements": [m.to_dict() for m in profile.measurements.values()],
        "storage": {k: profile.storage.get(k) for k in ("directory", "mount_point", "fstype", "kind")},
        "model": None,
        "projection": None,
        "environment": _environment(profile),
        "profile": {
            "fingerprint": profile.fingerprint,
            "from_cache": profile.from_cache,
            "measured_at": profile.measured_at,
            "tiers": profile.tier_meaning(),
            "warnings": _busy_warnings(profile),
        },
    }
    if model is not None:
        from ..knobs.expression import evaluate
        from ..knobs.memory import memory_floor
        from ..knobs.shape import pass_shape_of
        from ..probe.decodecompute import with_layer_overhead
        from ..probe.kernelrates import with_kernel_rates

        shape = pass_shape_of(model_path) if model_path is not None else None
        knobs = resolve_knobs(profile, model, shape=shape)
        if model_path is not None:  # a shard set: its own units read cold (probe/unitreads.py), shown for any set
            from ..probe.unitreads import with_own_reads

            model, knobs = with_own_reads(
                profile, model, model_path, knobs, lambda f: resolve_knobs(profile, f, shape=shape), log, always=True
            )
            model = _with_decode_compute(profile, model, model_path, knobs)
        model = with_kernel_rates(profile, model, str(knobs.value("kernel")))  # a GGUF's blocks: each type's kernel
        # what other sets' layers cost here
        model = with_layer_overhead(
            profile, model, str(knobs.value("compute_dtype")), str(knobs.value("kernel")), measure=measure_layers
        )
        floor = memory_floor(profile, model, knobs, shape=shape)
        tier_bytes = plan_tier_bytes(model, knobs)
        doc["model"] = {**model.to_dict(), "source": model_source, "note": _model_note(model)}
        per_token = model.bytes_per_token
        doc["projection"] = {
            **project(profile, model, tier_bytes).to_dict(),
            "plan": {
                "device_cache_bytes": knobs.value("device_cache_bytes"),
                "host_cache_bytes": knobs.value("host_cache_bytes"),
                "runtime_bytes": knobs.value("runtime_bytes"),
                "kv_cache_bytes": knobs.value("kv_cache_bytes"),
                "memory_floor": evaluate(floor.formula, floor.inputs),
                "memory_floor_formula": floor.formula,
                "memory_floor_inputs": floor.inputs,
            },
            # each of bench's regimes: every byte a token reads from that one tier
            "regimes": {
                regime: project(
                    profile, model, {**{t: 0 for t in ("device", "host", "storage")}, tier: per_token}
                ).to_dict()
                for regime, tier in (("resident", "device"), ("host", "host"), ("storage", "storage"))
            },
        }
    chosen = knobs if model is not None else resolve_knobs(profile, None)  # the model's own knobs where one is given
    doc["native_kernels"]["kernel"] = str(chosen.value("kernel"))
    return redact_tree(doc)


def _with_decode_compute(profile: HardwareProfile, model: ModelFacts, model_path, knobs) -> ModelFacts:
    """The facts with the set's resident decode as bench measured it here, where it has (decodecompute.py)."""
    from dataclasses import replace
    from pathlib import Path

    from ...checkpoint.manifest import Manifest
    from ..probe.decodecompute import lookup

    directory = Path(model_path)
    if not (directory / "manifest.json").is_file():
        return model
    try:
        measured = lookup(
            profile, directory, Manifest.load(directory), str(knobs.value("compute_dtype")), str(knobs.value("kernel"))
        )
    except Exception:  # noqa: BLE001 - an unreadable record: the floor stands
        return model
    return replace(model, decode_compute=measured) if measured else model


def _model_note(model: ModelFacts) -> str:
    if model.decode_compute:
        notes = ["compute as `rocketllm bench` measured this set resident here (per-layer work and kernels included)"]
    else:
        notes = [
            "bytes and the matvec floor only: per-layer work (attention, norms, the framework's calls) and packed "
            "kernels' own speed are left out until `rocketllm bench` measures this set once (doctor then projects from "
            "that)"
        ]
    if model.layer_overhead and not model.decode_compute:
        notes[0] = (
            "bytes, "
            + (
                "each block product at the speed the native kernels measured for its type and shape here, the rest "
                if model.kernel_rates
                else ""
            )
            + "at the matvec floor, and per layer "
            + (
                "the work the probe measured on small models of its architecture here"
                if model.layer_overhead.get("source") == "probe"
                else "what bench measured beyond the products for other sets here"
            )
            + ", until `rocketllm bench` measures this set once (doctor then projects from that)"
        )
    elif model.kernel_rates and not model.decode_compute:
        notes[0] = (
            "bytes, each block product at the speed the native kernels measured for its type and shape here and the "
            "rest at the matvec floor: per-layer work (attention, norms, the framework's calls) is left out until "
            "`rocketllm bench` measures this set once (doctor then projects from that)"
        )
    if model.dtype.startswith("gguf"):
        notes.insert(
            0,
            "sizes of the shard set `shard` writes by default, predicted from the GGUF header (every quantized matrix "
            "kept as the file's blocks, the float tensors as stored); run doctor on the shard directory for the set "
            "itself",
        )
    return "; ".join(notes)


def _busy_warnings(profile: HardwareProfile) -> list[str]:
    warnings = []
    for part in ("host", "storage"):
        share = profile.measured_at.get(f"{part}_others_cpu_share")
        if share is not None and share >= BUSY_SHARE:
            warnings.append(
                f"other processes used {share:.0%} of the CPUs while the {part} figures were measured: "
                "they may be low; rerun with --refresh on an idle machine"
            )
    return warnings


def _accelerators(profile: HardwareProfile) -> dict:
    facts = profile.facts
    devices = facts.get("accelerators") or []
    nvml = facts.get("gpus") or []
    reason = facts.get("device_reason", "")
    if not devices:
        reason = f"none: {reason}; NVML: {facts.get('gpus_reason') or 'no GPUs listed'}"
    return {
        "compute_device": profile.compute_device,
        "reason": reason,
        "devices": devices,
        "nvml": nvml,
        "driver": facts.get("driver"),
        "vram_total": profile.vram_total,
        "vram_free": profile.vram_free,
    }


def _package(dist: str, module: str, cost: str) -> dict:
    version = package_version(dist)
    return {
        "package": dist,
        "import": module,
        "installed": version is not None,
        "version": version,
        "cost_if_missing": cost,
    }


def _environment(profile: HardwareProfile) -> dict:
    names = sorted(n for n in os.environ if n.startswith("ROCKETLLM_")) + [
        "PYTORCH_CUDA_ALLOC_CONF",
        "OMP_WAIT_POLICY",
        "GOMP_SPINCOUNT",
        "OMP_NUM_THREADS",
    ]
    variables = {n: (redact_env_value(n, os.environ[n]) if n in os.environ else None) for n in names}
    warnings = []
    if profile.compute_device.startswith("cuda") and not os.environ.get("PYTORCH_CUDA_ALLOC_CONF"):
        warnings.append(
            "PYTORCH_CUDA_ALLOC_CONF is unset: set expandable_segments:True so reused layer buffers do not "
            "fragment VRAM"
        )
    COMPUTE_THREADS.poll()
    return {
        "variables": variables,
        "openmp_wait": wait_policy(),
        "compute_threads": COMPUTE_THREADS.describe(),
        "warnings": warnings,
    }
