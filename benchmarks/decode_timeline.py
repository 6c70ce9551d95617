"""Where a resident decode's time goes on the native kernels: the products, the code between them, and the same
decode with every product stubbed out.

    python benchmarks/decode_timeline.py MODEL.gguf [--tokens 32] [--prompt "The capital of France is"]

Loads MODEL with `AutoModel` as the defaults plan it (its residency printed), decodes greedily twice: once as it is,
timing every native product (`NativeKernels.bound_matmul`), and once with the products replaced by calls that only
zero their output, so the second run is the forward's own code (transformers' modules, torch's small ops, the pass
hooks) without a single weight streamed through the cores' caches. Prints ms/token for both, each product shape's
median time and the median gap before it, and the gap from the head's product to the next token's first product
(the loop between tokens). Run it before and after a change to the per-token path; numbers from one process are
comparable, a busy or drifting machine's across processes less so. Not part of the tests.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict

import torch

from rocketllm import AutoModel
from rocketllm_cli.native.kernels import NativeKernels

EVENTS: list[tuple[int, float, float]] = []  # (output rows of the weight, start, end) per product call
STUB = {"on": False}
_bound = NativeKernels.bound_matmul


def _timed(self, blocks, gguf_type, k, mode="exact"):
    product, rows = _bound(self, blocks, gguf_type, k, mode), blocks.shape[0]

    def call(x, m, out, threads):
        started = time.perf_counter()
        if STUB["on"]:
            out.zero_()
        else:
            product(x, m, out, threads)
        EVENTS.append((rows, started, time.perf_counter()))

    return call


def decode(model, ids, tokens: int) -> float:
    """ms per new token of a greedy decode of at most TOKENS (it may end sooner), its prompt's pass included."""
    model.generate(ids, max_new_tokens=2, do_sample=False)  # warm
    EVENTS.clear()
    started = time.perf_counter()
    out = model.generate(ids, max_new_tokens=tokens, do_sample=False)
    return (time.perf_counter() - started) * 1e3 / max(1, out.shape[1] - ids.shape[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--prompt", default="The capital of France is")
    args = parser.parse_args()
    NativeKernels.bound_matmul = _timed  # before the model binds its weights
    model = AutoModel.from_pretrained(args.model)
    print(model.residency_text())
    ids = model.tokenizer(args.prompt, return_tensors="pt").input_ids
    real = decode(model, ids, args.tokens)
    events = [e for e in EVENTS if e[2] - e[1] >= 0]
    head = max(e[0] for e in events)
    durations, gaps = defaultdict(list), defaultdict(list)
    for before, event in zip(events, events[1:]):
        durations[event[0]].append(event[2] - event[1])
        gaps[(before[0] == head, event[0])].append(event[1] - before[2])
    STUB["on"] = True
    stubbed = decode(model, ids, args.tokens)
    print(f"decode: {real:.2f} ms/token; products stubbed out: {stubbed:.2f} ms/token (the code between products)")
    print("| weight rows | calls | median µs | median gap before, µs |")
    print("|---|---|---|---|")
    for rows, values in sorted(durations.items()):
        inside = [g for (after_head, r), v in gaps.items() if r == rows and not after_head for g in v]
        gap = statistics.median(inside) * 1e6 if inside else float("nan")
        print(f"| {rows} | {len(values)} | {statistics.median(values) * 1e6:.1f} | {gap:.1f} |")
    between = [g for (after_head, _), v in gaps.items() if after_head for g in v]
    if between:
        print(f"between tokens (head's product to the next first product): {statistics.median(between) * 1e3:.2f} ms")


if __name__ == "__main__":
    with torch.inference_mode():
        main()
