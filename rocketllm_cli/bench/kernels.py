"""`rocketllm bench --kernels`: what the native kernels do here, per GGUF block type and mode, on one standard product.

For each type the kernels cover: GB/s of blocks read by one decode-shaped product (one activation row times a
4096 x 4096 weight, over 64 MiB of such weights, on every thread torch would use), in exact mode (fp32 activations
times gguf's own fp32 weights), int16 mode (activations quantized to 16 bits per 32, integer dot products) and int8
mode (activations quantized to 8 bits per block, integer dot products, as llama.cpp computes); each mode's relative
error ||y - y_ref|| / ||y_ref|| against the fp64 product of gguf's own dequantized weights, on blocks of realistic
scales; the torch decoder's rate (dequantize the blocks, then F.linear in fp32), what a type without a kernel, or a
machine without a compiler, computes with; and, where llama-cpp-python is installed, llama.cpp's own rate on the
same product, threads and sweeps (ggmlkernels.py), against our int8 mode, which computes as it does, and our int16
mode.
"""

from __future__ import annotations

import os
import time

from ..profiles.knobs.table import NATIVE_KERNELS

K = N = 4096
ERROR_ROWS = 256  # rows of the weight the error is measured on (the product of every row would take seconds)
POOL_BYTES = 64 << 20  # the weights each type's sweep cycles over
MODES = NATIVE_KERNELS  # exact, int16, int8
AGREE = 5e-2  # llama.cpp's product further than this from ours (relative): its rate is not this product's, say so


def run_kernels(log=lambda m: None, types: tuple[str, ...] | None = None) -> dict:
    """The table's document; TYPES: those types only (default every one the kernels cover)."""
    import torch
    import torch.nn.functional as F

    from ..checkpoint.ggmlblocks import SUPPORTED, dequantize_blocks
    from ..errors import RocketError
    from ..native import kernels, why_not
    from ..native.kernels import GGML_IDS
    from ..native.sample import sample_blocks
    from ..profiles.probe.kernelrates import REPEATS, measure_native
    from .ggmlkernels import LlamaCppRates

    nk = kernels()
    if nk is None:
        raise RocketError(f"no native kernels on this machine: {why_not()}")
    threads = torch.get_num_threads()
    rows, ours = [], {}
    x = torch.randn(1, K, generator=torch.Generator().manual_seed(2))
    with LlamaCppRates() as theirs:
        for name in types or tuple(GGML_IDS):
            log(f"kernels: {name}")
            qk, block_bytes = SUPPORTED[name]
            speed = {
                mode: measure_native(nk, [(name, f"{N}x{K}")], mode, threads, POOL_BYTES)[(name, f"{N}x{K}")]
                for mode in MODES
            }
            w = sample_blocks(name, ERROR_ROWS, K, seed=1)
            ref = (x.double() @ dequantize_blocks(w, name).double().T)[0]
            error = {
                mode: float((nk.matmul(w, name, x, mode=mode)[0].double() - ref).norm() / ref.norm()) for mode in MODES
            }
            blocks = sample_blocks(name, N, K, seed=3)
            dequantize_blocks(blocks[:64], name)  # warm
            start = time.perf_counter()
            F.linear(x, dequantize_blocks(blocks, name))
            torch_bps = blocks.numel() / (time.perf_counter() - start)
            if theirs.wanted:  # the same blocks, and our exact product of them to check llama.cpp's against
                theirs.add(name, GGML_IDS[name], blocks, K)
                ours[name] = nk.matmul(blocks, name, x)[0].double()
            rows.append(
                {
                    "type": name,
                    "bits_per_weight": round(8 * block_bytes / qk, 2),
                    **{f"{mode}_gb_per_s": round(speed[mode] / 1e9, 2) for mode in MODES},
                    **{f"{mode}_rel_error": error[mode] for mode in MODES},
                    "torch_decoder_gb_per_s": round(torch_bps / 1e9, 2),
                }
            )
        if theirs.wanted:
            log("kernels: llama.cpp")
        found = theirs.measure(x[0].tolist(), threads, POOL_BYTES, REPEATS)
    notes = list(found["notes"])
    for row in rows:
        got = found["rows"].get(row["type"])
        row["llamacpp_gb_per_s"] = round(got["bytes_per_s"] / 1e9, 2) if got else None
        row["llamacpp_buffer"] = got["buffer"] if got else None
        row["llamacpp_rel_error"] = None
        if got:  # against our exact product of the same blocks and x: its q8 activations, ~5e-3
            y, mine = torch.tensor(got["y"], dtype=torch.float64), ours[row["type"]]
            row["llamacpp_rel_error"] = float((y - mine).norm() / mine.norm())
            if not row["llamacpp_rel_error"] < AGREE:
                notes.append(f"{row['type']}: llama.cpp's product differs from ours by {row['llamacpp_rel_error']:.1e}")
    llamacpp = {"version": found["version"], "notes": notes} if found["version"] else {"reason": found["reason"]}
    return {
        "cpu": _cpu_name(),
        "isa": nk.isa,
        "isas": list(nk.isas),
        "threads": threads,
        "shape": f"[1,{K}] x [{K},{N}]",
        "rows": rows,
        "llamacpp": llamacpp,
    }


def render_kernels(doc: dict) -> str:
    theirs = doc.get("llamacpp") or {"reason": "not measured"}
    lines = [
        f"**Native kernels:** {doc['cpu']}, variant {doc['isa']} (built here: {', '.join(doc['isas'])}), "
        f"{doc['threads']} "
        f"thread{'s' if doc['threads'] != 1 else ''}; one decode product {doc['shape']}, GB/s of blocks read; "
        "errors are ||y - y_ref|| / ||y_ref|| against the fp64 product of gguf's dequantized weights; "
        + (
            f"llama.cpp: {theirs['version']}, its own mul_mat on the same product, threads and sweeps (its "
            "activations quantized to its q8 types, as it computes; the weights in the buffer its model loader "
            "picks, named beside the rate: AMX or CPU_REPACK are its repacked copies, CPU its plain blocks; "
            "well-formed random blocks, those the torch decoder is timed on)"
            if theirs.get("version")
            else f"llama.cpp: not measured: {theirs['reason']}"
        ),
        "",
        "| type | bits/weight | exact GB/s | int16 GB/s | int8 GB/s | int16 speed-up | int8 speed-up | exact error "
        "| int16 error | int8 error | torch decoder GB/s | llama.cpp GB/s | our int16 ÷ llama.cpp "
        "| our int8 ÷ llama.cpp |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in doc["rows"]:
        theirs_gbps = r.get("llamacpp_gb_per_s")
        lines.append(
            f"| {r['type']} | {r['bits_per_weight']} | {r['exact_gb_per_s']} | {r['int16_gb_per_s']} | "
            f"{r['int8_gb_per_s']} | {r['int16_gb_per_s'] / r['exact_gb_per_s']:.2f}x | "
            f"{r['int8_gb_per_s'] / r['exact_gb_per_s']:.2f}x | {r['exact_rel_error']:.1e} | "
            f"{r['int16_rel_error']:.1e} | {r['int8_rel_error']:.1e} | {r['torch_decoder_gb_per_s']} | "
            + (
                f"{theirs_gbps} ({r['llamacpp_buffer']}) | {r['int16_gb_per_s'] / theirs_gbps:.2f}x | "
                f"{r['int8_gb_per_s'] / theirs_gbps:.2f}x |"
                if theirs_gbps
                else "- | - | - |"
            )
        )
    lines += [
        "",
        "`--kernel` chooses: exact multiplies fp32 activations; int16 and int8 trade their error above for speed.",
    ]
    lines += [f"llama.cpp: {note}" for note in theirs.get("notes", ())]
    return "\n".join(lines)


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.partition(":")[2].strip()
    except OSError:
        pass
    return f"{os.cpu_count()} CPUs"
