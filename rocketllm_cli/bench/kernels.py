"""`rocketllm bench --kernels`: what the native kernels do here, per GGUF block type and mode, on one standard product.

For each type the kernels cover: GB/s of blocks read by one decode-shaped product (one activation row times a
4096 x 4096 weight, over 64 MiB of such weights, on every thread torch would use), in exact mode (fp32 activations
times gguf's own fp32 weights) and int8 mode (activations quantized to 8 bits per block, integer dot products, as
llama.cpp computes); each mode's relative error ||y - y_ref|| / ||y_ref|| against the fp64 product of gguf's own
dequantized weights, on blocks of realistic scales; and the torch decoder's rate (dequantize the blocks, then
F.linear in fp32), what a type without a kernel, or a machine without a compiler, computes with.
"""

from __future__ import annotations

import os
import time

K = N = 4096
ERROR_ROWS = 256  # rows of the weight the error is measured on (the product of every row would take seconds)


def run_kernels(log=lambda m: None, types: tuple[str, ...] | None = None) -> dict:
    """The table's document; TYPES: those types only (default every one the kernels cover)."""
    import torch
    import torch.nn.functional as F

    from ..checkpoint.ggmlblocks import SUPPORTED, dequantize_blocks
    from ..errors import RocketError
    from ..native import kernels, why_not
    from ..native.kernels import GGML_IDS
    from ..native.sample import sample_blocks
    from ..profiles.probe.kernelrates import measure_native

    nk = kernels()
    if nk is None:
        raise RocketError(f"no native kernels on this machine: {why_not()}")
    threads = torch.get_num_threads()
    rows = []
    for name in types or tuple(GGML_IDS):
        log(f"kernels: {name}")
        qk, block_bytes = SUPPORTED[name]
        speed = {
            mode: measure_native(nk, [(name, f"{N}x{K}")], mode, threads, 64 << 20)[(name, f"{N}x{K}")]
            for mode in ("exact", "int8")
        }
        w = sample_blocks(name, ERROR_ROWS, K, seed=1)
        x = torch.randn(1, K, generator=torch.Generator().manual_seed(2))
        ref = (x.double() @ dequantize_blocks(w, name).double().T)[0]
        error = {
            mode: float((nk.matmul(w, name, x, mode=mode)[0].double() - ref).norm() / ref.norm())
            for mode in ("exact", "int8")
        }
        blocks = sample_blocks(name, N, K, seed=3)
        dequantize_blocks(blocks[:64], name)  # warm
        start = time.perf_counter()
        F.linear(x, dequantize_blocks(blocks, name))
        torch_bps = blocks.numel() / (time.perf_counter() - start)
        rows.append(
            {
                "type": name,
                "bits_per_weight": round(8 * block_bytes / qk, 2),
                "exact_gb_per_s": round(speed["exact"] / 1e9, 2),
                "int8_gb_per_s": round(speed["int8"] / 1e9, 2),
                "exact_rel_error": error["exact"],
                "int8_rel_error": error["int8"],
                "torch_decoder_gb_per_s": round(torch_bps / 1e9, 2),
            }
        )
    return {
        "cpu": _cpu_name(),
        "isa": nk.isa,
        "isas": list(nk.isas),
        "threads": threads,
        "shape": f"[1,{K}] x [{K},{N}]",
        "rows": rows,
    }


def render_kernels(doc: dict) -> str:
    lines = [
        f"**Native kernels:** {doc['cpu']}, variant {doc['isa']} (runs: {', '.join(doc['isas'])}), "
        f"{doc['threads']} "
        f"thread{'s' if doc['threads'] != 1 else ''}; one decode product {doc['shape']}, GB/s of blocks read; "
        "errors are ||y - y_ref|| / ||y_ref|| against the fp64 product of gguf's dequantized weights",
        "",
        "| type | bits/weight | exact GB/s | int8 GB/s | int8 speed-up | exact error | int8 error | torch decoder "
        "GB/s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in doc["rows"]:
        lines.append(
            f"| {r['type']} | {r['bits_per_weight']} | {r['exact_gb_per_s']} | {r['int8_gb_per_s']} | "
            f"{r['int8_gb_per_s'] / r['exact_gb_per_s']:.2f}x | {r['exact_rel_error']:.1e} | {r['int8_rel_error']:.1e} "
            f"| {r['torch_decoder_gb_per_s']} |"
        )
    lines += ["", "exact is the default (`--kernel exact`); int8 trades its error for speed (`--kernel int8`)."]
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
