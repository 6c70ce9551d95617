"""Milliseconds per y = x·Wᵀ (x [1, K]) for float and packed weights: SmolLM2-135M's shapes and a 4096² layer.

    python benchmarks/packed_linear.py [--gguf SmolLM2-135M-Instruct.Q4_1.gguf] [--repeat 30] [--budget 2] [--threads N]

Each cell is the best of up to --repeat calls (at least 3, fewer once --budget seconds are spent), after one
warm-up: on a machine others are using the best run is the least disturbed one. The header carries the load
average before and after. Weights: the GGUF's own Q4_1 layers and Q8_0 embedding (the tied head) when the file
is given, random ones otherwise; the int4/int8 kernel columns quantize the same weight with RTN (int4 group 32,
int8 one scale a row) where the file's format is not the kernel's. Not a test: nothing is asserted.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from rocketllm_cli.packed import (
    Scratch,
    bind,
    capabilities,
    dequantize,
    from_gguf,
    linear,
    quantize_rtn,
)

# where the tests look for it too: $ROCKETLLM_TEST_GGUF, else ../shared/models/ beside the repository
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_GGUF = Path(
    os.environ.get("ROCKETLLM_TEST_GGUF") or Path(__file__).resolve().parents[2] / "shared" / "models" / GGUF_NAME
)
# (label, GGUF tensor standing for W [N, K], K, N)
SHAPES = (
    ("[1,576]x[576,1536] ffn_up", "blk.0.ffn_up.weight", 576, 1536),
    ("[1,1536]x[1536,576] ffn_down", "blk.0.ffn_down.weight", 1536, 576),
    ("[1,576]x[576,49152] head", "token_embd.weight", 576, 49152),
    ("[1,4096]x[4096,4096]", None, 4096, 4096),
)


def best_ms(call, repeat: int, budget: float) -> float:
    """The fastest of up to `repeat` calls, in ms (one warm-up first; at least 3 timed)."""
    call()
    best, spent, runs = float("inf"), 0.0, 0
    while runs < 3 or (runs < repeat and spent < budget):
        start = time.perf_counter()
        call()
        took = time.perf_counter() - start
        best, spent, runs = min(best, took), spent + took, runs + 1
    return best * 1e3


def weights(tensors: dict, name: str | None, k: int, n: int):
    """(float weight [N, K], its packed form as stored, what that is)."""
    if name is not None and name in tensors:
        tensor = tensors[name]
        packed = from_gguf(tensor.data, tensor.tensor_type)
        return dequantize(packed), packed, tensor.tensor_type.name
    weight = torch.randn(n, k, generator=torch.Generator().manual_seed(0)) * 0.02
    return weight, quantize_rtn(weight, bits=4, group=32), "random, RTN int4 g32"


def q6_k_like(n: int, k: int) -> object:
    """Random Q6_K blocks of W's shape: what a raw-block (dequantize with gguf per use) weight costs."""
    rng = np.random.default_rng(0)
    raw = rng.integers(0, 256, (n, k // 256, 210), dtype=np.uint8)
    raw[..., 208:] = rng.uniform(1e-4, 1e-2, (n, k // 256, 1)).astype(np.float16).view(np.uint8)
    return from_gguf(raw.reshape(n, -1), "Q6_K") if k % 256 == 0 else None


COLUMNS = (
    "bf16 F.linear",
    "fp32 F.linear",
    "int4 kernel bf16",
    "int4 kernel fp16",
    "int4 kernel fp32",
    "int8 kernel bf16",
    "int8 kernel fp16",
    "int8 kernel fp32",
    "int4 scratch+F.linear bf16",
    "stored-format scratch+F.linear bf16",
    "Q6_K raw scratch+F.linear bf16",
    "int4 bind bf16 (once)",
    "int4 bind fp32 (once)",
)


def row(weight: torch.Tensor, native, repeat: int, budget: float) -> dict:
    """{column: ms or None} for one weight."""
    n, k = weight.shape
    x32 = torch.randn(1, k)
    x16 = x32.bfloat16()
    w16 = weight.bfloat16()
    int4 = native if native.format.kind == "int4" else quantize_rtn(weight, bits=4, group=32)
    int8 = quantize_rtn(weight, bits=8, group=None)
    scratch, caps = Scratch(), capabilities("cpu")
    cells = {
        "bf16 F.linear": best_ms(lambda: F.linear(x16, w16), repeat, budget),
        "fp32 F.linear": best_ms(lambda: F.linear(x32, weight), repeat, budget),
    }
    for kind, packed in (("int4", int4), ("int8", int8)):
        for short, dtype, x in (
            ("bf16", torch.bfloat16, x16),
            ("fp16", torch.float16, x32.half()),
            ("fp32", torch.float32, x32),
        ):
            bound = bind(packed, "cpu", dtype) if caps.supports(kind, dtype) else None
            if bound is not None and bound.path == kind:
                cells[f"{kind} kernel {short}"] = best_ms(lambda: linear(x, bound), repeat, budget)
    scratched = {"int4 scratch+F.linear bf16": int4, "stored-format scratch+F.linear bf16": native}
    q6_k = q6_k_like(n, k)
    if q6_k is not None:
        scratched["Q6_K raw scratch+F.linear bf16"] = q6_k
    for column, packed in scratched.items():
        bound = bind(packed, "cpu", torch.bfloat16, kernel=False)
        cells[column] = best_ms(lambda: linear(x16, bound, scratch=scratch), repeat, budget)
    for short, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        if caps.supports("int4", dtype):
            cells[f"int4 bind {short} (once)"] = best_ms(lambda: bind(int4, "cpu", dtype), max(3, repeat // 5), budget)
    return cells


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gguf", type=Path, default=DEFAULT_GGUF, help=f"{GGUF_NAME} (random weights if absent)")
    parser.add_argument("--repeat", type=int, default=30, help="calls per cell at most (best of them is shown)")
    parser.add_argument("--budget", type=float, default=2.0, help="seconds per cell after which no more calls are made")
    parser.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    path = args.gguf / GGUF_NAME if args.gguf.is_dir() else args.gguf
    tensors = {}
    if path.is_file():
        from gguf import GGUFReader

        tensors = {t.name: t for t in GGUFReader(path).tensors}
    load = os.getloadavg()
    print(
        f"# packed linear, ms per call, best of <= {args.repeat} | torch {torch.__version__}, "
        f"{torch.backends.cpu.get_cpu_capability()}, {torch.get_num_threads()} threads, {os.cpu_count()} CPUs | "
        f"load before {load[0]:.2f} {load[1]:.2f} | kernels {capabilities('cpu')}"
    )
    print("\n| shape (stored as; MiB bf16 / int4 g32 / int8 / stored) | " + " | ".join(COLUMNS) + " |")
    print("|---" * (len(COLUMNS) + 1) + "|")
    for label, name, k, n in SHAPES:
        weight, native, origin = weights(tensors, name, k, n)
        sizes = (2 * n * k, n * k // 2 + 4 * n * k // 32, n * k + 2 * n, native.format.nbytes)
        cells = row(weight, native, args.repeat, args.budget)
        mib = " / ".join(f"{size / 2**20:.2f}" for size in sizes)
        values = " | ".join("n/a" if cells.get(c) is None else f"{cells[c]:.3f}" for c in COLUMNS)
        print(f"| {label} ({origin}; {mib}) | {values} |", flush=True)
    load = os.getloadavg()
    print(f"# load after {load[0]:.2f} {load[1]:.2f}")


if __name__ == "__main__":
    main()
