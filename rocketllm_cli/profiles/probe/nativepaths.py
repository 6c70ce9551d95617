"""Which path each GGUF block type computes on here, and what each native kernel mode costs, for `doctor`.

A GGUF type the native kernels cover computes on its own blocks (native/, the variant this CPU's capabilities pick);
the other types the sharder reads (the IQ1-3 grids, TQ, MXFP4), and every type where the kernels cannot be built
(no compiler: native.why_not() says so), decode through the torch reference (blocks dequantized per use, then an
fp32 product). For each covered type one fixed product, [1, K] x [N, K] of well-formed random blocks
(native/sample.py), is timed in each mode over a small pool of copies of it, on every core this process may use;
and int16's and int8's errors are measured against exact on it, ||y_mode - y_exact|| / ||y_exact||. Measured once
per machine and kernel build (about two seconds), kept beside the profile in one small JSON file, written
atomically; a read-only cache measures again in the next process. A set's own products, at its own shapes, are
kernelrates.py's.
"""

from __future__ import annotations

from ..knobs.table import NATIVE_KERNELS

FILE = "native-paths.json"
N, K = 1024, 4096  # the fixed product: one activation row, a 1024 x 4096 weight
POOL_BYTES = 16 << 20  # weights of that shape swept per timing (the rate per byte is the same over more)
VERSION = 2  # of the method: another way of measuring is measured again
FLOATS = ("F32", "F16", "BF16")  # not blocks: a float tensor is multiplied as it is stored
MODES = NATIVE_KERNELS  # exact, int16, int8: the table's columns in that order


def native_paths(profile) -> dict:
    """{"built", "why_not", "isa", "isas", "build", "threads", "shape", "types": [{"type", "path", "exact_bps",
    "int16_bps", "int8_bps", "int16_rel_error", "int8_rel_error"}], "decoder_types": [names]}: measured where not yet
    stored for this build."""
    from ... import native
    from ...checkpoint.ggmlblocks import SUPPORTED
    from ...native.kernels import GGML_IDS

    decoder_only = sorted(t for t in SUPPORTED if t not in GGML_IDS and t not in FLOATS)
    if not profile.is_cpu:
        return {
            "built": False,
            "why_not": f"the compute device is {profile.compute_device}: the kernels are the CPU's",
            "types": [{"type": t, "path": "torch decoder on the device"} for t in GGML_IDS],
            "decoder_types": decoder_only,
        }
    nk = native.kernels()
    if nk is None:
        return {
            "built": False,
            "why_not": native.why_not(),
            "types": [{"type": t, "path": "torch decoder"} for t in GGML_IDS],
            "decoder_types": decoder_only,
        }
    threads = _threads()
    key = f"{VERSION}-{nk.isa}-{nk.build}-t{threads}-{N}x{K}"
    stored = _load(profile)
    if not isinstance(stored.get(key), dict):
        stored = {key: _measure(nk, threads)}  # one build's figures: earlier builds' go
        _save(profile, stored)
    rows = stored[key]
    return {
        "built": True,
        "why_not": "",
        "isa": nk.isa,
        "isas": list(nk.isas),
        "build": nk.build,
        "threads": threads,
        "shape": f"[1,{K}] x [{N},{K}]",
        "types": [{"type": t, "path": f"native ({nk.isa})", **rows.get(t, {})} for t in GGML_IDS if nk.supported(t)],
        "decoder_types": decoder_only,
    }


def _threads() -> int:
    """The cores this process may run on (a decode gives the kernels the free ones): a count that does not move with
    what other processes use this second, so a measurement is found again."""
    import os

    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def _measure(nk, threads: int) -> dict:
    import torch

    from ...native.kernels import GGML_IDS
    from ...native.sample import sample_blocks
    from .kernelrates import sweep_rate

    x = torch.randn(1, K, generator=torch.Generator().manual_seed(2))
    found = {}
    for name in GGML_IDS:
        if not nk.supported(name):
            continue
        w = sample_blocks(name, N, K, seed=1)
        pool = [w.clone() for _ in range(max(1, POOL_BYTES // w.numel()))]  # read from memory, as a decode does
        exact = nk.matmul(w, name, x)[0].double()
        found[name] = {f"{mode}_bps": sweep_rate(nk, name, pool, x, mode, threads) for mode in MODES}
        for mode in MODES[1:]:
            y = nk.matmul(w, name, x, mode=mode)[0].double()
            found[name][f"{mode}_rel_error"] = float((y - exact).norm() / exact.norm()) if exact.norm() > 0 else 0.0
    return found


def _where(profile):
    from ..cache import profile_dir

    return profile_dir(profile.fingerprint) / FILE


def _load(profile) -> dict:
    from ...cachehome import read_json

    stored = read_json(_where(profile)) or {}
    stored.pop("cache_format", None)
    return stored


def _save(profile, stored: dict) -> None:
    from ...cachehome import write_json

    try:
        write_json(_where(profile), stored)
    except OSError:
        pass  # a read-only cache: measured again by the next process


def lines(doc: dict, kernel: str = "exact") -> list[str]:
    """The doctor section: the library and its variant (or why there is none), the kernel knob, and per type its
    path, each mode's rate and the error of the two that quantize the activations."""
    if not doc["built"]:
        if doc["types"] and doc["types"][0]["path"] != "torch decoder":  # another compute device
            return [f"- not used: {doc['why_not']}; GGUF blocks decode there (the torch reference) per use"]
        return [
            f"- not built: {doc['why_not']}",
            "- every GGUF block type decodes through the torch reference (dequantized per use, then an fp32 product: "
            "ten to a hundred times slower); install g++ and run again to build them",
        ]
    out = [
        f"- variant: {doc['isa']} (built here: {', '.join(doc['isas'])}; ROCKETLLM_NATIVE_ISA caps it), "
        f"library build {doc['build']}, {doc['threads']} thread{'s' if doc['threads'] != 1 else ''}",
        f"- kernel: {kernel} (exact: the blocks' own fp32 weights times fp32 activations; int16: activations "
        "quantized to 16 bits per 32, integer dot products, at the error below; int8: to 8 bits per block as llama.cpp "
        "does, faster still, at its larger error; `--kernel` or ROCKETLLM_KERNEL chooses)",
        f"- one product {doc['shape']} per type, GB/s of blocks read; errors ||y_mode - y_exact|| / ||y_exact||:",
        "",
        "| type | path | exact GB/s | int16 GB/s | int8 GB/s | int16 speed-up | int8 speed-up | int16 error "
        "| int8 error |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in doc["types"]:
        exact = row.get("exact_bps")
        rates = " | ".join(_gbps(row.get(f"{mode}_bps")) for mode in MODES)
        speedups = " | ".join(
            f"{row[f'{mode}_bps'] / exact:.2f}x" if exact and row.get(f"{mode}_bps") else "-" for mode in MODES[1:]
        )
        errors = " | ".join(_error(row.get(f"{mode}_rel_error")) for mode in MODES[1:])
        out.append(f"| {row['type']} | {row['path']} | {rates} | {speedups} | {errors} |")
    if doc.get("decoder_types"):
        out += ["", f"- through the torch reference (no kernel): {', '.join(doc['decoder_types'])}"]
    return out


def _error(value: float | None) -> str:
    return f"{value:.1e}" if value is not None else "-"


def _gbps(bps: float | None) -> str:
    return f"{bps / 1e9:.2f}" if bps else "-"
