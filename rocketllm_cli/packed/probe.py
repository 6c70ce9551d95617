"""Which low-bit kernels compute correctly on a device, and for which activation dtypes: found by running each
once on a tiny weight and comparing with F.linear on its dequantized form, then kept for the process and stored
beside the hardware profile (kernels.json under its fingerprint, which names the CPU, its ISA ceiling and torch's
version), so a later process reads the answer instead of spending ~0.2 s of its start-up re-running the probe.
`rocketllm profile --refresh` runs it again.

Nothing is assumed from the device's name or torch's version: an op that is missing, refuses the dtype or
gives a wrong answer (a layout this code does not know) is simply not used, and its layers dequantize into
the scratch buffer instead.

For the fastest dtype it also finds from how many rows of x a dense multiply (dense.py: dequantize a block of rows,
F.linear) beats the kernel, whose time grows with every row, and in which dtype: the kernel's own or fp32, whichever
multiplies DENSE_ROWS[0] rows faster (bf16 matmuls are slow without native bf16), then halving while dense stays faster.

Which dtype is fastest is timed so that a busy machine cannot reverse the answer: the dtypes take turns, round
after round, on one thread, and each keeps its fastest call. Timed one dtype after another on every core, a
burst of other work (a compiler on one of two cores) once stalled bf16's three ~30 us calls for a scheduler slice
each and the answer stored fp16, whose CPU int4 kernel is ~50x slower: every later process converted each packed
Linear's input to fp16 and ran ~10x slower per token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import dtypes
from . import dense, layout
from .dequant import dequantize
from .rtn import quantize_rtn

TRIAL_SHAPE = (32, 256)  # (N, K): fits every kernel's multiples (N % 16, K % (16·8 tiles), group 32)
TRIAL_ROWS = 3  # activation rows
TRIAL_TOLERANCE = 0.05  # of the reference's largest magnitude: bf16 rounding is ~0.01, a wrong layout ~1
TIMING_SHAPE = (1024, 1024)  # (N, K) a decode-shaped call is timed at to find each kernel's fastest dtype
TIMING_ROUNDS = 12  # each dtype's best of this many turns, after a warm-up call
TIMING_BUDGET_S = 0.25  # rounds stop once they have taken this long (at least three are run)
DENSE_ROWS = (512, 256, 128, 64, 32, 16)  # rows of x tried for the dense crossover, largest first
DENSE_ROUNDS = 3  # each side's best of this many turns at each row count
# stored answers of another method are probed again (1: one dtype after another, all cores; 2-3: no dense dtype)
PROBE_FORMAT = 4

_CACHE: dict[str, Capabilities] = {}


@dataclass(frozen=True)
class Capabilities:
    """The activation dtypes (short names) each kernel computes correctly on one device."""

    device: str
    int4: tuple[str, ...]
    int8: tuple[str, ...]
    seconds: tuple[tuple[str, str, float], ...] = ()  # (kind, dtype, best seconds of a decode-shaped call)
    # (kind, rows of x from which a dense multiply was faster (0: never), its dtype)
    dense: tuple[tuple[str, int, str], ...] = ()

    def supports(self, kind: str, dtype: torch.dtype) -> bool:
        return dtypes.short_name(dtype) in getattr(self, kind, ())

    def fastest(self, kind: str) -> str | None:
        """The activation dtype in which `kind`'s kernel ran a decode-shaped call fastest here."""
        timed = [(t, d) for k, d, t in self.seconds if k == kind]
        return min(timed)[1] if timed else None

    def dense_from(self, kind: str) -> tuple[int, str | None]:
        """(rows of x from which `kind`'s weights multiply faster dequantized than through the kernel, in which dtype);
        (0, None): never."""
        return next(((rows, dtype) for k, rows, dtype in self.dense if k == kind and rows), (0, None))


def capabilities(device="cpu") -> Capabilities:
    """The probe's answer for `device`: this process's, else the stored one, else run now and stored."""
    key = _key(device)
    if key not in _CACHE:
        found = _stored(key)
        if found is None:
            found = probe(key)
            _store(found)
        _CACHE[key] = found
    return _CACHE[key]


def stored_path():
    """kernels.json beside this machine's hardware profile."""
    from ..profiles.cache import profile_dir
    from ..profiles.probe.machine import fingerprint, fingerprint_facts

    return profile_dir(fingerprint(fingerprint_facts())) / "kernels.json"


def _stored(key: str) -> Capabilities | None:
    from ..cachehome import read_json

    try:
        doc = (read_json(stored_path()) or {}).get(key)
        if doc is None or doc.get("probe_format") != PROBE_FORMAT:
            return None
        seconds = tuple((str(k), str(d), float(t)) for k, d, t in doc.get("seconds", ()))
        dense = tuple((str(k), int(rows), str(dtype)) for k, (rows, dtype) in doc.get("dense_rows", {}).items())
        return Capabilities(key, tuple(doc["int4"]), tuple(doc["int8"]), seconds, dense)
    except (OSError, KeyError, TypeError, ValueError):
        return None  # unreadable or of another shape: probe again


def _store(caps: Capabilities) -> None:
    from ..cachehome import read_json, write_json

    try:
        path = stored_path()
        doc = read_json(path) or {}
        doc.pop("cache_format", None)
        doc[caps.device] = {
            "int4": list(caps.int4),
            "int8": list(caps.int8),
            "seconds": [list(s) for s in caps.seconds],
            "dense_rows": {k: [rows, dtype] for k, rows, dtype in caps.dense},
            "probe_format": PROBE_FORMAT,
        }
        write_json(path, doc)
    except OSError:
        pass  # a read-only cache: the answer stays this process's


def probe(device) -> Capabilities:
    """Run every kernel for every activation dtype on `device` now (capabilities() caches this)."""
    device = torch.device(device)
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(TRIAL_SHAPE, generator=generator)
    x = torch.randn(TRIAL_ROWS, TRIAL_SHAPE[1], generator=generator)
    found: dict[str, list[str]] = {"int4": [], "int8": []}
    timed: list[tuple[str, str, float]] = []
    dense_from: list[tuple[str, int, str]] = []
    for kind, bits, group in (("int4", 4, 32), ("int8", 8, None)):
        packed = quantize_rtn(weight, bits=bits, group=group)
        reference = torch.nn.functional.linear(x, dequantize(packed))
        for name in dtypes.NAMES:
            dtype = dtypes.torch_dtype(name)
            try:
                got = _run(kind, packed, x.to(device, dtype), dtype, device).float().cpu()
            except (RuntimeError, NotImplementedError, AttributeError, TypeError):
                continue  # op missing on this torch, or refused on this device or dtype
            if got.shape == reference.shape and bool(
                ((got - reference).abs().max() <= TRIAL_TOLERANCE * reference.abs().max())
            ):
                found[kind].append(name)
        best = _time_in_turns(kind, bits, group, [dtypes.torch_dtype(n) for n in found[kind]], device)
        timed += [(kind, name, best[name]) for name in found[kind]]
        if best and dense.supported(kind, device):
            dense_from.append(
                (kind, *_dense_crossover(kind, bits, group, dtypes.torch_dtype(min(best, key=best.get)), device))
            )
    return Capabilities(str(device), tuple(found["int4"]), tuple(found["int8"]), tuple(timed), tuple(dense_from))


def _time_in_turns(kind: str, bits: int, group, candidates: list[torch.dtype], device) -> dict[str, float]:
    """Per dtype (short name): best seconds of one [1, K] x [K, N] call at TIMING_SHAPE, what a decode step asks
    of the kernel."""
    weight = torch.randn(TIMING_SHAPE, generator=torch.Generator().manual_seed(1))
    packed = quantize_rtn(weight, bits=bits, group=group)
    runs = {}
    for dtype in candidates:
        kernel = layout.for_kernel(kind, packed, dtype, device)
        x = torch.randn(1, TIMING_SHAPE[1]).to(device, dtype)
        runs[dtypes.short_name(dtype)] = lambda x=x, kernel=kernel: layout.kernel_mm(kind, x, kernel, group)
    return _best_in_turns(runs, device, TIMING_ROUNDS, TIMING_BUDGET_S)


def _dense_crossover(kind: str, bits: int, group, dtype: torch.dtype, device) -> tuple[int, str]:
    """(the fewest rows of x, of DENSE_ROWS, from which dense.dense_linear beat the kernel at TIMING_SHAPE and at every
    larger count tried (0: it lost at the most rows), the dtype it multiplied in)."""
    from .bound import BoundWeight
    from .scratch import Scratch

    weight = torch.randn(TIMING_SHAPE, generator=torch.Generator().manual_seed(2))
    packed = quantize_rtn(weight, bits=bits, group=group)
    made = layout.for_kernel(kind, packed, dtype, device)
    choices = [dtype] + ([torch.float32] if dtype != torch.float32 else [])
    bounds = {
        d: BoundWeight(packed.format, dtype, torch.device(device), kind, kernel=made, dense_dtype=d) for d in choices
    }
    scratch = Scratch()
    found, chosen = 0, choices[0]
    for rows in DENSE_ROWS:
        x = torch.randn(rows, TIMING_SHAPE[1]).to(device, dtype)
        runs = {"kernel": lambda kernel=bounds[chosen].fast: kernel(x)}
        for d in choices if rows == DENSE_ROWS[0] else [chosen]:  # the dtype is chosen at the most rows
            runs[d] = lambda b=bounds[d]: dense.dense_linear(x, b, scratch)
        best = _best_in_turns(runs, device, DENSE_ROUNDS)
        kernel_s = best.pop("kernel")
        chosen = min(best, key=best.get)
        if best[chosen] >= kernel_s:
            break
        found = rows
    return found, dtypes.short_name(chosen)


def _best_in_turns(runs: dict, device, rounds: int, budget_s: float | None = None) -> dict:
    """Best seconds of each run after a warm-up call each, the runs taking turns (one call each per round, at least
    three rounds, fewer than `rounds` once `budget_s` is spent), so a burst of other work slows them all alike; on a
    CPU on one thread, so no call waits for a partner thread descheduled by that work."""
    import time

    best = {name: float("inf") for name in runs}
    cpu, cuda = torch.device(device).type == "cpu", torch.device(device).type == "cuda"
    threads = torch.get_num_threads()
    if cpu:
        torch.set_num_threads(1)
    try:
        for run in runs.values():
            run()  # warm-up: first-call allocations and lazy initialisation
        began = time.perf_counter()
        for turn in range(rounds):
            if turn >= 3 and budget_s is not None and time.perf_counter() - began > budget_s:
                break  # the slow runs' calls are long enough that three turns rank them
            for name, run in runs.items():
                if cuda:
                    torch.cuda.synchronize(device)
                started = time.perf_counter()
                run()
                if cuda:
                    torch.cuda.synchronize(device)
                best[name] = min(best[name], time.perf_counter() - started)
    finally:
        if cpu:
            torch.set_num_threads(threads)
    return best


def _run(kind: str, packed, x: torch.Tensor, dtype: torch.dtype, device) -> torch.Tensor:
    return layout.kernel_mm(kind, x, layout.for_kernel(kind, packed, dtype, device), packed.format.group)


def _key(device) -> str:
    """'cuda' and 'cuda:0' are one device: the key names its index."""
    device = torch.device(device)
    if device.type != "cpu" and device.index is None:
        module = getattr(torch, device.type, None)
        if module is not None and hasattr(module, "current_device"):
            device = torch.device(device.type, module.current_device())
    return str(device)


def report_rows(device: str) -> list[dict]:
    """What packed (int4/int8) weights compute with on the compute device: this probe's answer,
    the activation dtype it chose and each dtype's timed call, so a report shows a slow choice at a glance."""
    n, k = TIMING_SHAPE
    try:
        caps = capabilities(device)
    except Exception as exc:  # noqa: BLE001 - a probe that cannot run is a row saying so, never a failed report
        return [
            {
                "name": "packed_kernels",
                "value": False,
                "fallback_taken": "dequantize into scratch",
                "reason": f"the kernel probe failed: {type(exc).__name__}: {exc}",
            }
        ]
    rows = []
    for kind in ("int4", "int8"):
        timed = sorted((t, d) for kd, d, t in caps.seconds if kd == kind)
        if not timed:
            rows.append(
                {
                    "name": f"packed_{kind}",
                    "value": False,
                    "fallback_taken": "dequantize into scratch",
                    "reason": f"no {kind} kernel computed correctly on {device}",
                }
            )
            continue
        calls = ", ".join(f"{d} {t * 1e6:.0f} us" for t, d in timed)
        dense_rows, dense_dtype = caps.dense_from(kind)
        dense = (
            f"; from {dense_rows} rows of x (a prefill) dequantized and multiplied in {dense_dtype}, measured faster"
            if dense_rows
            else "; every pass through the kernel (a dense multiply was not faster)"
        )
        rows.append(
            {
                "name": f"packed_{kind}",
                "value": f"{timed[0][1]} activations",
                "fallback_taken": None,
                "reason": f"{kind} kernel, fastest dtype of one [1,{k}] x [{k},{n}] call timed in turns on one "
                f"thread: {calls}{dense}",
            }
        )
    return rows
