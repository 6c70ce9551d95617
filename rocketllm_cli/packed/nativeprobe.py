"""From how many rows of x GGUF blocks multiply faster densely than on the native kernel: a chunk of rows dequantized
to exact mode's fp32 weights by the kernels' own decoder, then torch's fp32 GEMM (dense.py), against the kernel in
the CPU's default mode (int16). Timed in turns on one thread as probe.py times the int4/int8 crossover, on Q4_0
blocks at its TIMING_SHAPE, from DENSE_ROWS rows down while dense stays faster; once per machine and kernel build
(a fraction of a second), kept in kernels.json beside the profile under the build's key.

    rows = native_dense_rows("cpu")   # 0: every pass on the kernel (no kernels, another device, never faster)
"""

from __future__ import annotations

import torch

from .probe import DENSE_ROUNDS, DENSE_ROWS, TIMING_SHAPE, _best_in_turns, stored_path

KEY = "native-dense"  # kernels.json's entry: {"build": the kernel build's key, "rows": the crossover, "format": ...}
FORMAT = 1  # of the method: another way of measuring is measured again
TYPE, MODE = "Q4_0", "int16"  # the blocks timed, and the mode the kernel runs them in (the CPU's default)

_CACHE: dict[str, int] = {}  # kernel build -> rows, this process's
_UNSTORED: set[str] = set()  # kernel builds this process found no stored crossover for (native_dense_plan)


def native_dense_rows(device) -> int:
    """Rows of x from which a native-kernel weight multiplies densely on `device` (0: never): stored, else measured
    now and stored."""
    build = _build(device)
    return 0 if build is None else _settled(build)


def native_dense_plan(device) -> tuple[int, object]:
    """(rows, None) where the crossover is known in this process or stored; else (the fewest rows it can be, a call
    that measures it): a weight bound before it is known multiplies on the kernel below that many rows, as it would
    for any crossover measured, and measures it on the first pass of as many (a first run's short prompt measures
    nothing: 0.24 s of a first generate's 5.7 on a 2-core AMD EPYC)."""
    build = _build(device)
    if build is None:
        return 0, None
    if build not in _CACHE:
        rows = None if build in _UNSTORED else _stored(build)
        if rows is None:  # looked for once a process: the stored file's path takes the machine's fingerprint
            _UNSTORED.add(build)
            return min(DENSE_ROWS), lambda: _settled(build)
        _CACHE[build] = rows
    return _CACHE[build], None


def _build(device) -> str | None:
    """The native kernels' build where GGUF blocks (TYPE's) multiply on them on `device`, else None."""
    if torch.device(device).type != "cpu":
        return None
    from ..native import kernels

    nk = kernels()
    return nk.build if nk is not None and nk.supported(TYPE) else None


def _settled(build: str) -> int:
    """The crossover for kernel build BUILD: this process's, else stored, else measured now and stored."""
    if build not in _CACHE:
        rows = _stored(build)
        if rows is None:
            rows = _measure()
            _store(build, rows)
        _CACHE[build] = rows
        _UNSTORED.discard(build)
    return _CACHE[build]


def stored_row(device) -> dict | None:
    """doctor's row for the crossover where one is stored for this machine's kernel build (never measured here: a
    report does not build the kernels), else None."""
    if torch.device(device).type != "cpu":
        return None
    from ..native import kernels

    nk = kernels()
    rows = _CACHE.get(nk.build, _stored(nk.build)) if nk is not None else None
    if rows is None:
        return None
    return {
        "name": "packed_native_dense",
        "value": f"from {rows} rows" if rows else "never",
        "fallback_taken": None,
        "reason": (
            f"GGUF blocks: a pass of {rows} rows of x or more (a prefill) is multiplied as exact fp32 weights by "
            f"torch's GEMM, measured faster than the native {MODE} kernel on {TYPE} [{TIMING_SHAPE[0]}, "
            f"{TIMING_SHAPE[1]}] in turns on one thread; fewer rows, and every decode step, take the kernel"
            if rows
            else f"GGUF blocks: every pass on the native kernel (a dense multiply was not faster than {MODE} on "
            f"{TYPE} at {DENSE_ROWS[0]} rows)"
        ),
    }


def _measure() -> int:
    from ..checkpoint.packedformat import PackedFormat, PackedTensor
    from ..native.sample import sample_blocks
    from . import dense
    from .bound import BoundWeight
    from .scratch import Scratch

    n, k = TIMING_SHAPE
    blocks = sample_blocks(TYPE, n, k, seed=2)
    fmt = PackedFormat("gguf", (n, k), 32, gguf_type=TYPE, block_bytes=blocks.shape[1] // (k // 32))
    weight = BoundWeight(
        fmt, torch.float32, torch.device("cpu"), "native", portable=PackedTensor(fmt, {"blocks": blocks}), mode=MODE
    )
    scratch, found = Scratch(), 0
    for rows in DENSE_ROWS:
        x = torch.randn(rows, k)
        runs = {"kernel": lambda x=x: weight.fast(x), "dense": lambda x=x: dense.dense_linear(x, weight, scratch)}
        best = _best_in_turns(runs, "cpu", DENSE_ROUNDS)
        if best["dense"] >= best["kernel"]:
            break
        found = rows
    return found


def _stored(build: str) -> int | None:
    from ..cachehome import read_json

    try:
        doc = (read_json(stored_path()) or {}).get(KEY) or {}
        if doc.get("build") == build and doc.get("format") == FORMAT:
            return int(doc["rows"])
    except (OSError, KeyError, TypeError, ValueError):
        pass
    return None


def _store(build: str, rows: int) -> None:
    from ..cachehome import read_json, write_json

    try:
        path = stored_path()
        doc = read_json(path) or {}
        doc[KEY] = {"build": build, "rows": rows, "format": FORMAT}
        write_json(path, doc)
    except OSError:
        pass  # a read-only cache: the answer stays this process's
