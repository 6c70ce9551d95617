"""What a decode token of one shard set costs to compute on this machine, as `bench` measured it resident.

The cost model's compute term is every weight byte at the measured matvec bandwidth: a floor that leaves out what
a real pass adds per layer (attention, norms, the framework's own calls) and what a packed kernel runs at. `bench`
measures the whole of it in the resident regime (nothing to read: compute alone); the figure is kept beside the
profile, per set and compute dtype, so `doctor --model SET` projects every regime from it rather than from the floor.
One small JSON file, written atomically; a read-only cache keeps the answer in this process only.
"""

from __future__ import annotations

import time
from pathlib import Path

FILE = "decode-compute.json"


def _key(directory: Path, manifest, compute_dtype: str, kernel: str = "exact") -> str:
    from .unitreads import set_key

    # a run on the int8 kernels is its own figure: it must not stand for the exact default's (nor the other way)
    return f"{set_key(directory, manifest)}-{compute_dtype}" + ("" if kernel == "exact" else f"-{kernel}")


def record(
    profile,
    directory: Path,
    manifest,
    compute_dtype: str,
    ms: dict,
    threads: int | None,
    facts=None,
    kernel: str = "exact",
) -> None:
    """Keep a resident decode measurement of the set (`ms`: bench's median/p10/p90 in milliseconds). With its FACTS,
    also what the cost model's floor (its products alone, on the kernels KERNEL picks) left out per layer, which
    projects the sets of this machine that bench has not measured (layer_overhead)."""
    from ...cachehome import read_json, write_json
    from ..cache import profile_dir

    where = profile_dir(profile.fingerprint) / FILE
    stored = read_json(where) or {}
    stored.pop("cache_format", None)
    entry = {
        "seconds": ms["median"] / 1000,
        "p10_seconds": ms["p10"] / 1000,
        "tokens": ms.get("n"),
        "threads": threads,
        "compute_dtype": compute_dtype,
        "kernel": kernel,
        "measured_at": time.strftime("%Y-%m-%d %H:%M", time.gmtime()) + " UTC",
    }
    floor = compute_floor(profile, facts, compute_dtype, kernel) if facts is not None and facts.num_layers else None
    if floor is not None:
        entry.update(name=facts.name, architecture=facts.architecture, layers=facts.num_layers, floor_seconds=floor)
    stored[_key(directory, manifest, compute_dtype, kernel)] = entry
    try:
        write_json(where, stored)
    except OSError:
        pass  # a read-only cache: doctor projects from the matvec floor, and says so


def lookup(profile, directory: Path, manifest, compute_dtype: str, kernel: str = "exact") -> dict | None:
    """The stored measurement for this set, compute dtype and kernel on this machine, or None."""
    from ...cachehome import read_json
    from ..cache import profile_dir

    stored = read_json(profile_dir(profile.fingerprint) / FILE) or {}
    entry = stored.get(_key(directory, manifest, compute_dtype, kernel))
    if not isinstance(entry, dict) or not isinstance(entry.get("seconds"), (int, float)) or entry["seconds"] <= 0:
        return None
    return entry


def compute_floor(profile, facts, compute_dtype: str, kernel: str = "exact") -> float | None:
    """The cost model's compute seconds for one resident decode token of FACTS: its products alone (each block type on
    the native kernel measured for it, other weights at the matvec of COMPUTE_DTYPE), no per-layer work."""
    from dataclasses import replace

    from ..cost import project
    from .kernelrates import with_kernel_rates

    as_computed = profile.computing_in(_engine_dtype(profile, facts, compute_dtype), "the engine's")
    bare = replace(facts, decode_compute=None, layer_overhead=None)
    return project(
        as_computed, with_kernel_rates(profile, bare, kernel), {"device": facts.bytes_per_token}
    ).compute_seconds


def layer_overhead(profile, compute_dtype: str, architecture: str = "", kernel: str = "exact") -> dict | None:
    """What a decoder layer costs here beside its products, from the sets bench measured resident on this machine in
    COMPUTE_DTYPE on KERNEL's kernels, those of ARCHITECTURE where there are any (a Gemma 3 layer's four norms and
    q/k norms cost 0.7 ms where a Llama layer's two cost 0.27, 2 cores): the median of (measured - floor) / layers,
    {"seconds", "sets": [names], "architecture": what they are}; None where none was."""
    from ...cachehome import read_json
    from ..cache import profile_dir

    found = []
    for entry in (read_json(profile_dir(profile.fingerprint) / FILE) or {}).values():
        if (
            isinstance(entry, dict)
            and entry.get("compute_dtype") == compute_dtype
            and entry.get("kernel", "exact") == kernel
            and isinstance(entry.get("layers"), int)
            and entry["layers"] > 0
            and isinstance(entry.get("floor_seconds"), (int, float))
        ):
            found.append(
                (
                    max(0.0, (float(entry["seconds"]) - entry["floor_seconds"]) / entry["layers"]),
                    str(entry.get("name", "?")),
                    str(entry.get("architecture") or ""),
                )
            )
    same = [f for f in found if architecture and f[2] == architecture]
    found = sorted(same or found)
    if not found:
        return None
    return {
        "seconds": found[len(found) // 2][0],
        "sets": list(dict.fromkeys(name for _, name, _ in found)),
        "architecture": architecture if same else "any",
    }


def with_layer_overhead(profile, facts, compute_dtype: str, kernel: str = "exact", measured: bool = True, measure=None):
    """FACTS with `layer_overhead` where bench measured another set here and not this one (layer_overhead(); not
    where MEASURED is False), else what the probe measured for its architecture (layercost.py; MEASURE, the layers
    above's stream/layerprobe.py measure, measures it where it is not kept yet)."""
    from dataclasses import replace

    from .layercost import layer_cost

    if facts.decode_compute or not facts.num_layers:
        return facts
    found = layer_overhead(profile, compute_dtype, facts.architecture, kernel) if measured else None
    if not found:
        from ..knobs.table import NATIVE_KERNELS

        native = kernel if facts.gguf_blocks and kernel in NATIVE_KERNELS else ""
        dtype = _engine_dtype(profile, facts, compute_dtype)
        found = layer_cost(profile, facts.architecture, dtype, native, measure, facts.layer_shape)
    return replace(facts, layer_overhead=found) if found else facts


def _engine_dtype(profile, facts, compute_dtype: str) -> str:
    """The dtype the engine computes FACTS' set in where the compute_dtype knob says COMPUTE_DTYPE (a GGUF's blocks on
    a CPU: fp32)."""
    from ..knobs.derivation import engine_compute_dtype

    return engine_compute_dtype(compute_dtype, False, facts.dtype, profile.compute_device, facts.gguf_blocks)
