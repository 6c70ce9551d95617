"""What a decoder layer of an architecture costs here beside its products: the probe's figure, kept per machine.

The cost model's compute term is a set's products at the speeds the kernels measured (kernelrates.py). A decode step
also runs each layer's own work: norms, rotary, the cache update, attention, the framework's calls, a few µs each and
hundreds a token. On a small model that is most of the token (SmolLM2 135M on 2 cores: products 5 ms of 16), so a
projection of the products alone is a floor at a third of the truth. `bench` measures a set's whole token and keeps
it (decodecompute.py); until it has, the layers' work is measured on small models of the architecture at the set's
widths, as the engine runs them (stream/layerprobe.py: the engine's layer, given here as `measure` by the layers
above), once per architecture, widths, compute dtype, kernel mode, threads and transformers version.

Kept beside the profile in one small JSON file, written atomically; a read-only cache, or other processes busy on a
quarter of the CPUs meanwhile, keeps the answer in this process only. An architecture transformers cannot build this
way keeps the reason, and its projection stays the products' floor.
"""

from __future__ import annotations

from .keptfile import KeptFile

FILE = "layer-cost.json"
VERSION = 5  # of the method: a figure measured otherwise is measured again (2: at the set's shape, products off;
# 3: its RMS norms fused as the engine's are; 4: its rotary embedding in the engine's form too; 5: its norms on the
# native kernels as the engine's are)
KEPT = KeptFile(FILE)  # the file as read or written in this process, per profile fingerprint


def layer_cost(
    profile, architecture: str, compute_dtype: str, kernel: str = "", measure=None, shape: dict | None = None
) -> dict | None:
    """{"seconds": one decoder layer's own work a decode token, "token_seconds": a token's outside the layers,
    "architecture", "sets": [], "source": "probe"} for ARCHITECTURE (a transformers model type) of SHAPE (ModelFacts
    layer_shape: its widths) computing in COMPUTE_DTYPE on this machine's CPU, its products on the native kernels in
    mode KERNEL (a GGUF set's; "" for none): as kept, else measured now by MEASURE (stream/layerprobe.py measure)
    where given; None where the compute device is not the CPU, nothing is kept and MEASURE is not given or PROFILE is
    another machine's, or the architecture could not be built (its reason kept: not tried again)."""
    if not architecture or not profile.is_cpu:
        return None
    import torch

    from .machine import BUSY_SHARE, cpu_snapshot, is_this_machine, others_cpu_share, package_version

    threads, version = torch.get_num_threads(), package_version("transformers")
    widths = "-".join(f"{k}{v}" for k, v in sorted((shape or {}).items()))
    key = f"{VERSION}-{architecture}-{widths}-{compute_dtype}-{kernel or 'torch'}-t{threads}-transformers{version}"
    stored = KEPT.load(profile)
    entry = stored.get(key)
    if entry is None:
        if measure is None or not is_this_machine(profile):
            return None
        before = cpu_snapshot()
        entry = measure(architecture, compute_dtype, kernel, shape)
        others = others_cpu_share(before, cpu_snapshot())
        stored[key] = entry
        KEPT.save(profile, stored, keep=others is None or others < BUSY_SHARE)
    if not isinstance(entry, dict) or not isinstance(entry.get("seconds"), (int, float)):
        return None
    return {
        "seconds": float(entry["seconds"]),
        "token_seconds": float(entry.get("token_seconds") or 0.0),
        "architecture": architecture,
        "sets": [],
        "source": "probe",
    }
