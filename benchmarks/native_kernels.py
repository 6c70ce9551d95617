"""GB/s of GGUF weight blocks read by the native kernels (rocketllm_cli.native) for one decode matmul, y = x · Wᵀ
with W 4096 × 4096 and x one row, per type × variant × mode × threads; beside them torch's own paths on the same
shapes: dequantize_blocks then F.linear in fp32 (blocks' bytes per second), and F.linear on a dense bf16 and fp32
weight (the dense weight's bytes per second).

    python benchmarks/native_kernels.py [--types Q4_0,Q4_K ...] [--threads 1,2] [--repeat 5] [--json]

"cold": each call reads a different copy of W, enough copies to exceed the L3 cache three times (what decoding
does: every layer's weights come from memory); "hot": the same W again and again (L3-resident when it fits).
The timings are wall-clock, the best of --repeat sweeps (a busy machine lowers them), and with one thread also the
calling thread's CPU time (what another process taking the core away does not change). Prints one Markdown table
(or JSON with --json); the machine's CPU, its flags and the load average go to stderr.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import torch
import torch.nn.functional as F

from rocketllm_cli.checkpoint.ggmlblocks import dequantize_blocks
from rocketllm_cli.native import kernels, why_not
from rocketllm_cli.native.kernels import GGML_IDS
from rocketllm_cli.native.sample import sample_blocks

N = K = 4096


def blocks_for(name: str, seed: int) -> torch.Tensor:
    """uint8 [N, K / QK · bytes]: random codes, modest fp16 scales (the speed does not depend on the values)."""
    return sample_blocks(name, N, K, seed)


def l3_bytes() -> int:
    try:
        with open("/sys/devices/system/cpu/cpu0/cache/index3/size") as f:
            text = f.read().strip()
        return int(text[:-1]) * {"K": 1 << 10, "M": 1 << 20}[text[-1]]
    except (OSError, ValueError, KeyError):
        return 32 << 20


def best_seconds(call, copies: int, repeat: int) -> tuple[float, float]:
    """Seconds per call, wall-clock and the calling thread's CPU time (all of the work when it runs on one
    thread, and then unaffected by other processes taking the core away): the best of `repeat` sweeps over the
    `copies` weights (after one warm-up sweep)."""
    for i in range(copies):
        call(i)
    wall = cpu = math.inf
    for _ in range(repeat):
        start, start_cpu = time.perf_counter(), time.thread_time()
        for i in range(copies):
            call(i)
        wall = min(wall, (time.perf_counter() - start) / copies)
        cpu = min(cpu, (time.thread_time() - start_cpu) / copies)
    return wall, cpu


def cpu_report() -> str:
    name, flags = "unknown CPU", set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name":
                    name = value.strip()
                elif key.strip() == "flags":
                    flags = set(value.split())
    except OSError:
        pass
    shown = " ".join(f"{flag}={'yes' if flag in flags else 'no'}" for flag in ("avx2", "avx512f", "avx512_vnni"))
    return f"{name}, {os.cpu_count()} CPUs, {shown}, load average {os.getloadavg()[0]:.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--types", default=",".join(GGML_IDS))
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    nk = kernels()
    if nk is None:
        sys.exit(f"no native kernels: {why_not()}")
    print(cpu_report(), file=sys.stderr)
    threads = [int(t) for t in args.threads.split(",")]
    x = torch.randn(1, K)
    out = torch.empty(1, N)
    rows = []

    def record(what, variant, mode, th, cache, nbytes, seconds):
        wall, cpu = seconds
        rows.append(
            {
                "weights": what,
                "variant": variant,
                "mode": mode,
                "threads": th,
                "cache": cache,
                "gb_per_s": round(nbytes / wall / 1e9, 2),
                "us_per_call": round(wall * 1e6, 1),
                "gb_per_cpu_s": round(nbytes / cpu / 1e9, 2) if th == 1 else None,
            }
        )
        print(f"{what} {variant} {mode} t{th} {cache}: {rows[-1]['gb_per_s']} GB/s", file=sys.stderr)

    for name in args.types.split(","):
        first = blocks_for(name, 0)
        copies = max(2, math.ceil(3 * l3_bytes() / first.numel()))
        ws = [first] + [blocks_for(name, seed) for seed in range(1, copies)]
        for th in threads:
            for isa in nk.isas:
                kern = nk.with_isa(isa)
                for mode in ("exact", "int8"):
                    for cache, n_copies in (("cold", copies), ("hot", 1)):
                        seconds = best_seconds(
                            lambda i: kern.matmul(ws[i], name, x, mode=mode, out=out, threads=th), n_copies, args.repeat
                        )
                        record(name, isa, mode, th, cache, first.numel(), seconds)
            torch.set_num_threads(th)
            seconds = best_seconds(lambda i: F.linear(x, dequantize_blocks(ws[i], name)), copies, 2)
            record(name, "torch dequantize + F.linear fp32", "exact", th, "cold", first.numel(), seconds)
    for dtype in (torch.bfloat16, torch.float32):
        dense = [torch.randn(N, K, dtype=dtype) for _ in range(max(2, math.ceil(3 * l3_bytes() / (N * K * 2))))]
        xd = x.to(dtype)
        for th in threads:
            torch.set_num_threads(th)
            seconds = best_seconds(lambda i: F.linear(xd, dense[i]), len(dense), args.repeat)
            record(
                f"dense {str(dtype).removeprefix('torch.')}",
                "torch F.linear",
                "-",
                th,
                "cold",
                dense[0].numel() * dense[0].element_size(),
                seconds,
            )
    if args.json:
        print(json.dumps({"cpu": cpu_report(), "rows": rows}, indent=1))
        return
    print("| weights | variant | mode | threads | cache | GB/s | µs/call | GB/s of thread CPU time |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        cpu = "" if r["gb_per_cpu_s"] is None else r["gb_per_cpu_s"]
        print(
            f"| {r['weights']} | {r['variant']} | {r['mode']} | {r['threads']} | {r['cache']} | {r['gb_per_s']} | "
            f"{r['us_per_call']} | {cpu} |"
        )


if __name__ == "__main__":
    main()
