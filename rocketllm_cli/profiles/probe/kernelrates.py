"""What the native kernels read per second on this machine for a GGUF set's own products, per block type and shape.

The cost model's compute floor is every weight byte at the dense fp32 matvec speed; a GGUF set computes on its
blocks instead, at a speed of each type's own (a Q6_K block decodes slower than a Q8_0 one), each mode's (exact fp32
or int8 activations) and each shape's (Gemma 3's 262,144 x 640 Q8_0 head reads 4.2 GB/s on one thread where a 4096 x
4096 Q8_0 weight reads 9.3). So each (type, N x K) product a set holds is timed as a decode runs it: one activation
row, over as many weights of that shape as the set's blocks fill (up to POOL_BYTES: what stays in the caches between
two tokens does here too), on the threads a decode gives the kernels (every free core: threads.py native_pass). A type
the kernels do not cover (the IQ1-3, TQ and MXFP4 grids), or every type where they cannot be built, is timed on the
torch decoder the engine then runs (the blocks dequantized per use, multiplied in fp32): ten to a hundred times
slower, which a projection must show. Measured the first time a set is planned, reported or benched here (tens of
ms a shape, the library built once per machine), kept beside the profile in one small JSON file, written atomically;
a read-only cache, or other processes busy on a quarter of the CPUs meanwhile, keeps the answer in this process
only. The blocks are random bytes: a kernel's speed does not depend on their values.
"""

from __future__ import annotations

import time
from dataclasses import replace

from ..knobs.table import native_mode
from .keptfile import KeptFile

FILE = "kernel-rates.json"
# at most this much weight per shape: more than most caches, less than a small machine's RAM
POOL_BYTES = 256 * 1024 * 1024
REPEATS = 2  # timed sweeps after a warm-up one; the faster counts
VERSION = 2  # of the method: a measurement made otherwise (one thread for a small product) is made again
KEPT = KeptFile(FILE)  # the file as read or written in this process, per profile fingerprint


def block_shapes_of(facts) -> dict[str, dict[str, int]]:
    """{GGUF type: {"NxK": bytes a decode token reads}} of FACTS (ModelFacts.block_bytes), scaled for a mixture of
    experts' active share."""
    blocks = getattr(facts, "block_bytes", None) or {}
    share = facts.bytes_per_token / facts.total_bytes if facts.total_bytes else 1.0
    return {t: {shape: int(b * share) for shape, b in shapes.items()} for t, shapes in blocks.items()}


def with_kernel_rates(profile, facts, mode: str = "exact"):
    """FACTS with `kernel_rates` (ModelFacts) for its block products on this machine, measured now where not yet:
    rates()'s document. FACTS unchanged where the compute device is not the CPU, the set holds no blocks, or it has
    its decode measured."""
    blocks = getattr(facts, "block_bytes", None) or {}
    if not blocks or not profile.is_cpu or getattr(facts, "decode_compute", None):
        return facts
    found = rates(profile, blocks, native_mode(mode))
    return replace(facts, kernel_rates=found) if found else facts


def pass_extra_seconds(profile, facts, mode: str, positions: int) -> tuple[float, str] | None:
    """(seconds, how): what a pass of POSITIONS positions (a verified draft, a batch) costs in block products beyond a
    pass of one, each of FACTS' products timed here at both row counts (rates()); None where the set holds no blocks,
    the compute device is not the CPU, or a rate is missing. A pass's other work (norms, attention, the hooks) is
    counted as one token's: with a few positions it is per call, not per position."""
    blocks = getattr(facts, "block_bytes", None) or {}
    if positions <= 1 or not blocks or not profile.is_cpu:
        return None
    mode = native_mode(mode)
    one, many = rates(profile, blocks, mode), rates(profile, blocks, mode, rows=positions)
    if not one or not many:
        return None
    active = block_shapes_of(facts)
    single = sum(sec for _, sec in type_rates(one, active).values())
    passing = sum(sec for _, sec in type_rates(many, active).values())
    extra = max(0.0, passing - single)
    how = (
        f"a pass of {positions} positions: the block products {1000 * passing:.2f} ms against {1000 * single:.2f} ms "
        f"for one ({many['isa']}, {mode}, each type and shape timed here at both row counts)"
    )
    return extra, how


def rates(profile, blocks: dict[str, dict[str, int]], mode: str, rows: int = 1) -> dict | None:
    """{"mode", "isa", "threads", "rows", "rates": {type: {"NxK": B/s}}, "paths": {type: path}} for BLOCKS' types:
    those the native kernels cover on them ("native"), the others (a grid type, or every type where the kernels cannot
    be built) on the torch decoder the engine then uses, blocks dequantized per use and multiplied in fp32 ("torch
    decoder"). ROWS: the activation rows of each product (a pass of that many positions: a verified draft, a batch);
    its rate is still weight bytes per second. None where a rate is missing and PROFILE is another machine's (plan
    --profile FILE)."""
    from ...native import kernels
    from .machine import BUSY_SHARE, cpu_snapshot, is_this_machine, others_cpu_share

    nk = kernels()
    import torch

    threads = torch.get_num_threads()
    pool = _pool_bytes(sum(b for shapes in blocks.values() for b in shapes.values()))
    stored = KEPT.load(profile)
    paths = {t: "native" if nk is not None and nk.supported(t) else "torch decoder" for t in blocks if _decodable(t)}
    isa = nk.isa if nk is not None else "none"
    build = nk.build if nk is not None else ""

    def key(t: str, shape: str) -> str:  # a rate of another build of the kernels is measured again
        how = f"{isa}-{build}-{mode}" if paths[t] == "native" else "torch"
        return f"{VERSION}-{how}-t{threads}-p{pool >> 20}-{t}-{shape}" + (f"-m{rows}" if rows > 1 else "")

    keys = {(t, shape): key(t, shape) for t in paths for shape in blocks[t]}
    missing = [ts for ts, k in keys.items() if not isinstance(stored.get(k), (int, float))]
    if missing:
        if not is_this_machine(profile):
            return None
        native = [ts for ts in missing if paths[ts[0]] == "native"]
        before = cpu_snapshot()
        measured = measure_native(nk, native, mode, threads, pool, rows) if native else {}
        measured.update(_measure_decoder([ts for ts in missing if paths[ts[0]] != "native"], threads, rows))
        stored.update({keys[ts]: bps for ts, bps in measured.items()})
        others = others_cpu_share(before, cpu_snapshot())
        # a busy machine measures low (a Q4_1 product at 1.6 GB/s beside a test run, 12-20 idle): this process
        # uses what it measured, and the next one measures again rather than projecting from it for good
        KEPT.save(profile, stored, keep=others is None or others < BUSY_SHARE)
    found: dict[str, dict[str, float]] = {}
    for (t, shape), k in keys.items():
        found.setdefault(t, {})[shape] = float(stored[k])
    return {"mode": mode, "isa": isa, "threads": threads, "rows": rows, "rates": found, "paths": paths}


def _decodable(name: str) -> bool:
    from ...checkpoint.ggmlblocks import SUPPORTED

    return name in SUPPORTED


def _measure_decoder(products: list[tuple[str, str]], threads: int, rows: int = 1) -> dict[tuple[str, str], float]:
    """The torch decoder's rate on each product: one weight of at most 8 MiB of blocks (the decoder reads far below
    memory speed, so caches do not matter), dequantized and multiplied in fp32 by ROWS activation rows, after a
    warm-up."""
    import torch
    import torch.nn.functional as F

    from ...checkpoint.ggmlblocks import SUPPORTED, dequantize_blocks

    found = {}
    for name, shape in products:
        n, k = (int(v) for v in shape.split("x"))
        qk, block_bytes = SUPPORTED[name]
        row = k // qk * block_bytes
        n = max(1, min(n, (8 << 20) // row))
        w = torch.randint(0, 256, (n, row), dtype=torch.uint8)
        x = torch.randn(rows, k)
        F.linear(x, dequantize_blocks(w[: min(n, 16)], name))
        best = float("inf")
        for _ in range(REPEATS):
            start = time.perf_counter()
            F.linear(x, dequantize_blocks(w, name))
            best = min(best, time.perf_counter() - start)
        found[(name, shape)] = w.numel() / max(best, 1e-9)
    return found


def _pool_bytes(model_bytes: int) -> int:
    """The weights a shape's sweep reads: the set's block bytes, at most POOL_BYTES and an eighth of the free memory,
    rounded up to a power of two MiB (so sets of about one size share measurements)."""
    from .machine import memory_bound

    cap = max(8 << 20, min(POOL_BYTES, memory_bound()[1] // 8))
    wanted = max(8 << 20, min(cap, model_bytes))
    return 1 << max(23, (wanted - 1).bit_length())


def measure_native(
    nk, products: list[tuple[str, str]], mode: str, threads: int, pool_bytes: int, rows: int = 1
) -> dict[tuple[str, str], float]:
    """Weight B/s of each (type, "NxK") product on NK's kernels in MODE with THREADS: ROWS activation rows against
    weights of that shape cut from POOL_BYTES of random bytes, the best of REPEATS sweeps over them after a warm-up
    sweep."""
    import torch

    from ...checkpoint.ggmlblocks import SUPPORTED

    pool = torch.randint(0, 256, (pool_bytes,), dtype=torch.uint8)
    found = {}
    for name, shape in products:
        n, k = (int(v) for v in shape.split("x"))
        qk, block_bytes = SUPPORTED[name]
        size = n * (k // qk * block_bytes)
        if size > pool_bytes:  # one weight larger than the pool: its first rows (the speed per byte is the same)
            n, size = (
                max(1, pool_bytes // (k // qk * block_bytes)),
                pool_bytes // (k // qk * block_bytes) * (k // qk * block_bytes),
            )
        weights = [pool[i * size : (i + 1) * size].view(n, -1) for i in range(max(1, pool_bytes // size))]
        found[(name, shape)] = sweep_rate(nk, name, weights, torch.randn(rows, k), mode, threads)
    return found


def sweep_rate(nk, name: str, weights: list, x, mode: str, threads: int) -> float:
    """Weight B/s of X times each of WEIGHTS (blocks of type NAME, one shape) on NK's kernels in MODE with THREADS:
    the best of REPEATS sweeps over them after a warm-up sweep."""
    import torch

    out = torch.empty(x.shape[0], weights[0].shape[0])
    best = float("inf")
    for sweep in range(REPEATS + 1):
        start = time.perf_counter()
        for w in weights:
            nk.matmul(w, name, x, mode=mode, out=out, threads=threads)
        if sweep:
            best = min(best, time.perf_counter() - start)
    return sum(w.numel() for w in weights) / max(best, 1e-9)


def type_rates(kernel_rates: dict, blocks: dict[str, dict[str, int]]) -> dict[str, tuple[int, float]]:
    """{type: (bytes, seconds)} of BLOCKS ({type: {"NxK": bytes}}) at KERNEL_RATES' measured speeds."""
    out = {}
    for t, shapes in blocks.items():
        measured = kernel_rates["rates"].get(t) or {}
        timed = [(b, b / measured[shape]) for shape, b in shapes.items() if measured.get(shape)]
        if timed:
            out[t] = (sum(b for b, _ in timed), sum(s for _, s in timed))
    return out


def describe(kernel_rates: dict, blocks: dict[str, dict[str, int]]) -> str:
    """One line: each type's bytes, measured rate (over its shapes) and path, for a projection's `how`."""
    timed = type_rates(kernel_rates, blocks)
    paths = kernel_rates.get("paths") or {}
    parts = [
        f"{t} {b / s / 1e9:.2f} GB/s over {b / 2**20:.1f} MiB"
        + (" (torch decoder)" if paths.get(t) == "torch decoder" else "")
        for t, (b, s) in sorted(timed.items(), key=lambda i: -i[1][0])
    ]
    return (
        f"the blocks on the native kernels ({kernel_rates['isa']}, {kernel_rates['mode']}, up to "
        f"{kernel_rates['threads']} "
        f"thread{'s' if kernel_rates['threads'] != 1 else ''}) or where they have none the torch decoder, each "
        f"type and "
        "shape measured here: " + ", ".join(parts)
    )
