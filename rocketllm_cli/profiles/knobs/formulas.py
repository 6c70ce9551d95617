"""How each knob is derived from the profile and the model: a readable expression and its inputs.

Every derivation returns (expression, inputs); the knob's value IS eval(expression, inputs),
so a printed knob can always be recomputed from what was printed.

On a CPU the compute device's memory is host RAM: the 'device' tier is weights resident in
process RAM and the 'host' tier is the page cache holding shard files (mapped zero-copy), so
both budgets come out of the same free RAM, device first.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from math import ceil

from ...checkpoint.modelfacts import ModelFacts
from ...dtypes import ITEMSIZE, KV_INT4_GROUP, int4_kv_value_bytes
from ...replies import DEFAULT_REPLY_TOKENS
from ...sizes import format_bytes
from ..hardware import HardwareProfile
from ..probe.storage import IN_FLIGHT, IN_FLIGHT_NOTE, in_flight_inputs
from .expression import evaluate
from .shape import ACTIVATION_VALUE_BYTES, PassShape

GiB, MiB = 1024**3, 1024**2
# A knob's value where the profile lacks what derives it; EngineConfig's defaults are the same values.
FALLBACK_COMPUTE_DTYPE = "fp32"  # runs on every device
FALLBACK_PREFETCH_DEPTH = 2  # double buffering
FALLBACK_DIRECT_IO = False  # buffered reads work on every filesystem
DEFAULT_EXPERT_CACHE_POLICY = "lfu"  # why: see expert_cache_policy() below
DEFAULT_DRAFT_TOKENS = 10  # transformers' prompt-lookup default; a streaming pass costs its bytes, not its tokens
CGROUP_RESERVE_FRACTION = 0.10  # the reserve inside a memory cgroup: a tenth of its limit (reserve_bytes)
MIN_CONTEXT = 2048  # a server's KV cache holds at least this many tokens where memory allows (kv_cache_bytes)
CONTEXT_SHARE = 0.5  # ... and at most this share of what the runtime and the least streaming buffers leave
FLOOR_CONTEXT = 256  # the least context the floor counts for a server (a one-shot run: its own tokens)


@dataclass
class Derivation:
    formula: str
    inputs: dict = field(default_factory=dict)
    source: str = "derived"  # derived | measured | default
    note: str = ""


class Context:
    """What derivations read: the profile, the model (or None) and the knob values resolved so far."""

    def __init__(
        self,
        profile: HardwareProfile,
        model: ModelFacts | None,
        values: dict,
        overridden: set[str],
        run_tokens: int | None = None,
        shape: PassShape | None = None,
    ) -> None:
        self.profile, self.model, self.values, self.overridden = profile, model, values, overridden
        self.run_tokens = run_tokens  # the tokens of KV a one-shot run holds at most (every row); None: any request
        self.shape = shape  # the widths a pass fills per token (its activations); None: not known, not counted
        self.cpu = profile.compute_device == "cpu"
        # CPU and Apple MPS: the device tier and the host tier are carved out of the same RAM.
        self.unified = profile.compute_device in ("cpu", "mps")
        # The compute device's free memory: VRAM on a GPU; RAM on the CPU (and on unified-memory devices).
        self.device_free = profile.vram_free if profile.vram_free is not None else profile.ram_available

    def compute_dtype(self) -> str:
        """The dtype the engine will compute in (auto.py engine_config applies the same rule)."""
        return engine_compute_dtype(
            str(self.values["compute_dtype"]),
            "compute_dtype" in self.overridden,
            self.model.dtype if self.model else "",
            self.profile.compute_device,
            bool(self.model and self.model.gguf_blocks),
        )

    def kv_dtype(self) -> str:
        chosen = str(self.values["kv_cache_dtype"])
        return self.compute_dtype() if chosen == "auto" else chosen

    def kv_values(self) -> dict:
        """K and V values per token of the layers whose cache grows, how many layers, and the bytes each value takes."""
        m = self.model
        compute = ITEMSIZE.get(self.compute_dtype(), 2)
        values = m.kv_values_per_token or m.kv_bytes_per_token // ITEMSIZE.get(m.dtype, 2)
        kv = self.kv_dtype()
        stored = int4_kv_value_bytes(m.kv_head_dim) if kv == "int4" else ITEMSIZE.get(kv, compute)
        return {
            "kv_values_per_token": values,
            "kv_layers": m.kv_growing_layers or m.num_layers,
            "kv_value_bytes": stored,
            "compute_value_bytes": compute,
            **self.activations(),
        }

    def activations(self) -> dict:
        """A pass's activations per token of it, where the model's shape is known (every context token may be one
        pass's: a prefill); {} where it is not."""
        if self.shape is None:
            return {}
        return {
            "activation_values_per_token": self.shape.activation_values_per_token,
            "activation_value_bytes": ACTIVATION_VALUE_BYTES,
        }

    def runtime(self) -> dict:
        """runtime_bytes as an input of a budget of the compute device's memory: RAM's (a CPU, unified memory), not
        a GPU's, whose budgets the runtime takes nothing from."""
        return {"runtime_bytes": self.values["runtime_bytes"]} if self.unified or self.profile.vram_free is None else {}

    def kv_per_token(self) -> dict:
        # K and V per token as the KV cache stores them (the compute dtype, another float dtype, or int4 with its
        # scales).
        v = self.kv_values()
        return {"kv_bytes_per_token": ceil(v["kv_values_per_token"] * v["kv_value_bytes"])}


def engine_compute_dtype(chosen: str, overridden: bool, stored: str, device: str, gguf_blocks: bool = False) -> str:
    """Run in the dtype the shards hold where the device runs it well: converting costs a copy per use.
    fp32 runs everywhere; fp16 is slow on a CPU; bf16 only where the profile chose it. A GGUF's blocks on a CPU: fp32,
    what the native kernels (and the exact decoder) compute in: bf16 activations would only add two roundings per
    product and a conversion at each one (SmolLM2 Q4_1: mean KL against transformers fp32 1.1e-3 in bf16, 1.5e-5 in
    fp32, and 12% fewer ms/token), while the weights' bytes, which bound the speed, are the blocks either way."""
    if overridden:
        return chosen
    if gguf_blocks and device == "cpu":
        return "fp32"
    if stored == "fp32" or (stored == "fp16" and device != "cpu"):
        return stored
    return chosen


def reserve_bytes(c: Context) -> Derivation:
    if c.profile.ram_bound == "cgroup":
        # A memory cgroup's limit: the OS, its page tables and other programs live outside it, so what the limit
        # needs kept free is activations and allocator slack. A 1.2 GiB limit reserved 300 MiB by the machine's rule,
        # and left 430 MiB of itself unused while a 2.8 B model streamed 1.35 GiB a token (docs/HARDWARE.md).
        return Derivation(
            "floor(reserve_fraction * ram_total)",
            {"reserve_fraction": CGROUP_RESERVE_FRACTION, "ram_total": c.profile.ram_total},
            note="ram_total is this process's memory cgroup limit: the OS lives outside it",
        )
    return Derivation(MACHINE_RESERVE, machine_reserve_inputs(c.profile.ram_total))


# The floor is a quarter of a small machine (a 1 GiB container would otherwise reserve all of itself).
MACHINE_RESERVE = (
    "max(min(min_reserve_bytes, floor(small_machine_fraction * ram_total)), floor(reserve_fraction * ram_total))"
)


def machine_reserve_inputs(ram_total: int) -> dict:
    """The reserve knob's inputs on a machine (not a cgroup) of RAM_TOTAL bytes; warm/launch.py sizes room with them."""
    return {"min_reserve_bytes": GiB, "small_machine_fraction": 0.25, "reserve_fraction": 0.10, "ram_total": ram_total}


def runtime_bytes(c: Context) -> Derivation:
    """The Python runtime beside the model: measured once per machine in a fresh interpreter (probe/runtime.py), less
    what this process holds already (memory_available excludes that): 0 in a load that has imported everything."""
    measured = c.profile.runtime_rss
    if measured is None:
        return Derivation(
            "0",
            {},
            "default",
            "the runtime's memory was not measured (a profile cached before it was, or the import failed): `rocketllm "
            "profile --refresh` measures it",
        )
    return Derivation(
        "max(0, runtime_rss_bytes - process_rss_bytes)",
        {"runtime_rss_bytes": measured, "process_rss_bytes": c.profile.process_rss},
        "measured",
        "resident memory of a Python with torch, transformers, a model class and the engine imported, less this "
        "process's own; the weights, streaming buffers, KV cache and activations are counted apart",
    )


def compute_dtype(c: Context) -> Derivation:
    cap = c.profile.capabilities.get("compute_dtype")
    if cap is None:
        return Derivation(repr(FALLBACK_COMPUTE_DTYPE), {}, "default", "compute dtype capability was not measured")
    return Derivation("decided_dtype", {"decided_dtype": cap.value}, note=cap.reason)


def kv_cache_bytes(c: Context) -> Derivation:
    share = {
        "kv_fraction": 0.10,
        "memory_available": c.device_free,
        "reserve_bytes": c.values["reserve_bytes"],
        **c.runtime(),
    }
    free = "memory_available - reserve_bytes" + (" - runtime_bytes" if "runtime_bytes" in share else "")
    if c.model is None or not c.model.kv_bytes_per_token:
        return Derivation(
            f"max(0, floor(kv_fraction * ({free})))",
            share,
            note="no model: a share of free memory (missing kv_bytes_per_token, max_positions)",
        )
    activations = c.activations()
    per_token = (
        "(kv_bytes_per_token + activation_values_per_token * activation_value_bytes)"
        if activations
        else "kv_bytes_per_token"
    )
    if "max_context" in c.overridden:
        return Derivation(
            f"max_context * {per_token}",
            {"max_context": c.values["max_context"], **c.kv_per_token(), **activations},
            note="sized for the max_context override" + (", and a pass's activations over it" if activations else ""),
        )
    if c.run_tokens:
        # A one-shot run (generate that keeps no server, a bench run) knows the tokens it will hold, as llama.cpp's
        # n_ctx does: KV held back for a context it never reaches is weights streamed every token instead. Sized with
        # max_context's own cost terms, so max_context comes out at least run_tokens (resolve_knobs checks it).
        inputs = {
            "max_positions": c.model.max_positions,
            "run_tokens": c.run_tokens,
            **c.kv_values(),
            "kv_window_values": c.model.kv_window_values,
        }
        if c.kv_dtype() == "int4":
            inputs["kv_full_precision_tokens"] = c.values["kv_residual_tokens"] + 2 * KV_INT4_GROUP
        fixed, per_token = _kv_cost_terms(inputs)
        # one token more than the run's: max_context divides the room back by a cost per token that is not whole
        return Derivation(
            f"ceil({fixed} + (min(max_positions, run_tokens) + 1) * ({per_token}))",
            inputs,
            note="sized for this run's tokens (prompt + new tokens + a margin, every row): a run that keeps no server",
        )
    # At least MIN_CONTEXT tokens, but no more than CONTEXT_SHARE of what the runtime and the least streaming buffers
    # leave: under a small memory limit 2048 tokens of KV and activations would leave the weights nothing.
    inputs = {
        "max_positions": c.model.max_positions,
        "min_context": MIN_CONTEXT,
        "context_share": CONTEXT_SHARE,
        **share,
        **c.kv_per_token(),
        **activations,
        "layer_bytes": c.model.layer_bytes,
        "largest_unit_bytes": c.model.largest_unit_bytes,
    }
    least = f"min(min_context, floor(context_share * ({free} - {STREAMING_MIN}) / {per_token}))"
    note = (
        "10% of free device memory, at least 2048 tokens (where they take at most half of what the least streaming "
        "buffers leave), at most the model's context"
    )
    if activations:
        note += "; per token its K and V, and the activations of a pass over it (a prefill)"
    return Derivation(
        f"min(max_positions, max(0, {least}, floor(kv_fraction * ({free}) / {per_token}))) * {per_token}",
        inputs,
        note=note,
    )


# What streaming needs at least: two buffers of a layer (one read while one computes) and one more for a larger unit.
STREAMING_MIN = "(2 * layer_bytes + max(0, largest_unit_bytes - layer_bytes))"


def kernel(c: Context) -> Derivation:
    return Derivation(
        "'exact'",
        {},
        "default",
        "packed Linears compute in the compute dtype, so the logits are the model's; torch trades that for speed where "
        "its low-bit kernel runs faster in another dtype (bf16 on x86: ~10x on an fp32 CPU)",
    )


def kv_cache_dtype(c: Context) -> Derivation:
    return Derivation(
        "'auto'",
        {},
        "default",
        "the dtype the model computes in; int4 stores about 0.3x the bytes of bf16 (docs/HARDWARE.md)",
    )


def kv_residual_tokens(c: Context) -> Derivation:
    return Derivation(
        "kv_group_tokens",
        {"kv_group_tokens": KV_INT4_GROUP},
        "default",
        "one quantization group: keys are quantized per channel a whole group of tokens at a time, so the "
        "full-precision window holds between this and twice this many tokens",
    )


def max_context(c: Context) -> Derivation:
    """What the memory left after the weights, the streaming buffers and the reserve holds of KV, capped by the model.

    Resolved after the weight budgets: on a model that fits, everything they leave is the cache's; on one that
    streams, they leave kv_cache_bytes. An override of kv_cache_bytes caps it."""
    if c.model is None or not c.model.kv_bytes_per_token:
        return Derivation("None", {}, note="needs a model (missing kv_bytes_per_token, max_positions): pass --model")
    v = c.values
    inputs = {
        "max_positions": c.model.max_positions,
        "memory_available": c.device_free,
        "reserve_bytes": v["reserve_bytes"],
        "device_cache_bytes": v["device_cache_bytes"],
        "prefetch_depth": v["prefetch_depth"],
        "total_bytes": c.model.total_bytes,
        "largest_unit_bytes": c.model.largest_unit_bytes,
        **c.kv_values(),
        "kv_window_values": c.model.kv_window_values,
        **c.runtime(),
    }
    if 0 < c.model.layer_bytes < c.model.largest_unit_bytes:  # a tied embedding and head: resident if it fits
        inputs.update(layer_bytes=c.model.layer_bytes)
    if c.unified:  # the host tier's page cache is the same RAM
        inputs["host_cache_bytes"] = v["host_cache_bytes"]
    if "kv_cache_bytes" in c.overridden:
        inputs["kv_cache_bytes"] = v["kv_cache_bytes"]
    if c.kv_dtype() == "int4":
        inputs["kv_full_precision_tokens"] = v["kv_residual_tokens"] + 2 * KV_INT4_GROUP
    left, fixed, per_token = _context_terms(inputs)
    where = (
        "left for KV of kv_cache_bytes, within what the weights, buffers, runtime and reserve leave"
        if "kv_cache_bytes" in c.overridden
        else "left for KV after the weights, buffers, runtime and reserve"
    )
    room, each = evaluate(f"max(0, {left} - ({fixed}))", inputs), evaluate(per_token, inputs)
    return Derivation(
        f"max(0, min(max_positions, floor(({left} - ({fixed})) / ({per_token}))))",
        inputs,
        note=f"{format_bytes(room)} {where}, {format_bytes(ceil(each))} per token in {c.kv_dtype()}; "
        f"kv_values_per_token = layers keeping every token x 2 (K, V) x kv heads x head dim"
        + (
            "; activation_values_per_token = 4 x intermediate + 6 x hidden, what a pass over the context holds in a "
            "layer per token"
            if "activation_values_per_token" in inputs
            else ""
        ),
    )


def _context_terms(inputs: dict) -> tuple[str, str, str]:
    """max_context's room, fixed cost and cost per token, as the inputs present call for."""
    # a cache budget holds at most the model: `--device-cache-bytes 1TB` (everything resident) takes the model's bytes
    held = "min(device_cache_bytes, total_bytes)" if "total_bytes" in inputs else "device_cache_bytes"
    # The streaming buffers fit the units that stream: layers, where the device cache holds the largest unit (not a
    # layer), as device_cache_bytes sized them; else one more buffer for it.
    buffered = (
        "(prefetch_depth + 2) * layer_bytes + (0 if min(device_cache_bytes, total_bytes) >= largest_unit_bytes "
        "else largest_unit_bytes - layer_bytes)"
        if "layer_bytes" in inputs
        else "(prefetch_depth + 2) * largest_unit_bytes"
    )
    left = f"memory_available - reserve_bytes - {held} - ({buffered})"
    if "runtime_bytes" in inputs:
        left += " - runtime_bytes"
    if "host_cache_bytes" in inputs:  # on a CPU (and unified memory)
        left += " - min(host_cache_bytes, total_bytes)" if "total_bytes" in inputs else " - host_cache_bytes"
    if "kv_cache_bytes" in inputs:  # overridden: it caps the room
        left = f"min(kv_cache_bytes, {left})"
    fixed, per_token = _kv_cost_terms(inputs)
    return left, fixed, per_token


def _kv_cost_terms(inputs: dict) -> tuple[str, str]:
    """The KV cache's fixed cost and cost per token, as the inputs present call for."""
    # Fixed: what sliding-window layers hold at most, and int4's full-precision tokens: the window (residual + one
    # group filling) and, while speculative decoding records the past, the last quantized group.
    fixed = "kv_window_values * compute_value_bytes"
    if "kv_full_precision_tokens" in inputs:
        fixed += " + kv_full_precision_tokens * kv_values_per_token * compute_value_bytes"
    # Per token: as stored, plus one layer's keys and values in the compute dtype while attention reads them
    # (a float cache's concatenation copies a layer; int4 dequantizes one).
    per_token = "kv_values_per_token * (kv_value_bytes + compute_value_bytes / kv_layers)"
    if "activation_values_per_token" in inputs:  # and what a pass over the context holds per token (a prefill's)
        per_token += " + activation_values_per_token * activation_value_bytes"
    return fixed, per_token


def int4_max_context(inputs: dict, residual_tokens: int, head_dim: int) -> int:
    """What max_context's formula gives for the same room (INPUTS: a derived max_context knob's) with the KV stored
    in int4 of this head dimension and RESIDUAL_TOKENS kept in full precision."""
    int4 = {
        **inputs,
        "kv_value_bytes": int4_kv_value_bytes(head_dim),
        "kv_full_precision_tokens": residual_tokens + 2 * KV_INT4_GROUP,
    }
    left, fixed, per_token = _context_terms(int4)
    return int(evaluate(f"max(0, min(max_positions, floor(({left} - ({fixed})) / ({per_token}))))", int4))


def _unit_reads(c: Context):
    """The set's own cold reads (UnitReads), where measured for this model."""
    if c.model is None or not c.model.unit_reads:
        return None
    from ..probe.unitreads import UnitReads

    return UnitReads.from_dict(c.model.unit_reads)


UNIT_READS_NOTE = (
    "this set's own units read cold, one pread per unit, each method at its cheapest reads in flight "
    "(profiles/probe/unitreads.py)"
)


def io_workers(c: Context) -> Derivation:
    reads = _unit_reads(c)
    if reads is not None:
        direct, buffered = reads.best(True), reads.best(False)
        if direct is not None and buffered is not None:
            return Derivation(
                "unit_in_flight_direct if direct_io else unit_in_flight_buffered",
                {
                    "direct_io": int(bool(c.values["direct_io"])),
                    "unit_in_flight_direct": direct.in_flight,
                    "unit_in_flight_buffered": buffered.in_flight,
                    "unit_bytes": reads.unit_bytes,
                },
                "measured",
                UNIT_READS_NOTE,
            )
    kind = str(c.profile.capability("storage_kind") or "unknown")
    return Derivation(
        IN_FLIGHT, in_flight_inputs(kind, c.profile.cpu_cores, c.values["direct_io"]), note=IN_FLIGHT_NOTE
    )


def prefetch_depth(c: Context) -> Derivation:
    # whole bytes per second, as printed: a figure under 1 B/s is no measurement to divide by
    storage = round(c.profile.storage_read_bps or 0)
    compute = round(c.profile.matvec_bps(c.values["compute_dtype"]) or c.profile.device_memory_bps or 0)
    if storage <= 0 or compute <= 0:
        return Derivation(
            repr(FALLBACK_PREFETCH_DEPTH), {}, "default", "storage or compute bandwidth unmeasured: double buffering"
        )
    inputs = {"max_depth": 4, "compute_read_bps": compute, "storage_read_bps": storage}
    # Units that compute in the time one unit is read: that many reads in flight keep the reader ahead.
    formula = "max(1, min(max_depth, ceil(compute_read_bps / storage_read_bps)))"
    if c.model is None:
        return Derivation(formula, inputs, note="no model: not limited by buffer memory (missing largest_unit_bytes)")
    inputs.update(
        buffer_share=0.25,
        memory_available=c.device_free,
        reserve_bytes=c.values["reserve_bytes"],
        kv_cache_bytes=c.values["kv_cache_bytes"],
        largest_unit_bytes=c.model.largest_unit_bytes,
        **c.runtime(),
    )
    free = "memory_available - reserve_bytes - kv_cache_bytes" + (
        " - runtime_bytes" if "runtime_bytes" in inputs else ""
    )
    buffers = f"floor(buffer_share * ({free}) / largest_unit_bytes) - 2"
    reads = _unit_reads(c)
    chosen = reads.best(bool(c.values["direct_io"])) if reads is not None else None
    if chosen is not None:
        # The set's units measured: read ahead at least the reads in flight that served them cheapest, at the
        # bandwidth they were read at.
        inputs.update(storage_read_bps=round(chosen.bps), io_workers=c.values["io_workers"])
        formula = (
            f"max(1, min(max(max_depth, io_workers), max(io_workers, ceil(compute_read_bps / "
            f"storage_read_bps)), {buffers}))"
        )
        return Derivation(
            formula,
            inputs,
            "measured",
            note="storage_read_bps: this set's units read cold; buffers limited to a quarter of free memory",
        )
    formula = f"max(1, min(max_depth, ceil(compute_read_bps / storage_read_bps), {buffers}))"
    return Derivation(formula, inputs, note="buffers limited to a quarter of free memory")


def device_cache_bytes(c: Context) -> Derivation:
    v, p = c.values, c.profile
    if c.cpu or p.vram_free is None:
        inputs = {
            "memory_available": c.device_free,
            "reserve_bytes": v["reserve_bytes"],
            "runtime_bytes": v["runtime_bytes"],
            "kv_cache_bytes": v["kv_cache_bytes"],
        }
        free = "memory_available - reserve_bytes - runtime_bytes - kv_cache_bytes"
    else:
        inputs = {
            "vram_free": p.vram_free,
            "vram_total": p.vram_total or 0,
            "vram_reserve_min_bytes": 512 * MiB,
            "vram_reserve_fraction": 0.05,
            "kv_cache_bytes": v["kv_cache_bytes"],
        }
        free = "vram_free - max(vram_reserve_min_bytes, floor(vram_reserve_fraction * vram_total)) - kv_cache_bytes"
    if c.model is None:
        return Derivation(
            f"max(0, {free})",
            inputs,
            note="no model: not capped at its size, no streaming buffers (missing total_bytes, largest_unit_bytes)",
        )
    inputs.update(
        total_bytes=c.model.total_bytes,
        prefetch_depth=v["prefetch_depth"],
        largest_unit_bytes=c.model.largest_unit_bytes,
    )
    whole = f"max(0, min(total_bytes, {free} - (prefetch_depth + 2) * largest_unit_bytes))"
    layer = c.model.layer_bytes
    if 0 < layer < c.model.largest_unit_bytes:
        # The largest unit is not a layer (a tied embedding and head): kept resident, the streaming buffers only
        # need to fit a layer, which frees (prefetch_depth + 2) * (largest - layer) bytes for the caches. Streamed, it
        # has one buffer of its own beside the layers' (stream/store.py).
        inputs.update(layer_bytes=layer)
        by_layer = f"{free} - (prefetch_depth + 2) * layer_bytes"
        by_largest = f"{free} - (prefetch_depth + 2) * layer_bytes - (largest_unit_bytes - layer_bytes)"
        return Derivation(
            f"max(0, min(total_bytes, ({by_layer}) if {by_layer} >= largest_unit_bytes else {by_largest}))",
            inputs,
            note="streaming buffers sized for a layer where the largest unit (not a layer) fits resident, else one "
            "more buffer for it",
        )
    return Derivation(whole, inputs)


def host_cache_bytes(c: Context) -> Derivation:
    v, p = c.values, c.profile
    inputs = {
        "ram_available": p.ram_available,
        "reserve_bytes": v["reserve_bytes"],
        "runtime_bytes": v["runtime_bytes"],
    }
    if c.unified:  # the same RAM as the device tier: what is left after it
        inputs.update(kv_cache_bytes=v["kv_cache_bytes"], device_cache_bytes=v["device_cache_bytes"])
        free = "ram_available - reserve_bytes - runtime_bytes - kv_cache_bytes - device_cache_bytes"
    else:
        free = "ram_available - reserve_bytes - runtime_bytes"
    if c.model is None:
        return Derivation(
            f"max(0, {free})", inputs, note="no model: not capped at its size (missing total_bytes, largest_unit_bytes)"
        )
    inputs.update(
        total_bytes=c.model.total_bytes,
        device_cache_bytes=v["device_cache_bytes"],
        prefetch_depth=v["prefetch_depth"],
        largest_unit_bytes=c.model.largest_unit_bytes,
    )
    staging = "(prefetch_depth + 2) * largest_unit_bytes"  # streaming buffers (pinned staging on a GPU)
    return Derivation(f"max(0, min(total_bytes - device_cache_bytes, {free} - {staging}))", inputs)


def direct_io(c: Context) -> Derivation:
    reads = _unit_reads(c)
    if reads is not None:
        direct, buffered = reads.best(True), reads.best(False)
        if direct is not None and buffered is not None:
            # Seconds per GB, CPU time counted where reads share the CPU with compute (read_cost's rule).
            return Derivation(
                "unit_direct_s_per_gb <= unit_buffered_s_per_gb",
                {
                    "unit_direct_s_per_gb": round(direct.cost(reads.cpu_shared) * 1e9, 4),
                    "unit_buffered_s_per_gb": round(buffered.cost(reads.cpu_shared) * 1e9, 4),
                    "cpu_shared": reads.cpu_shared,
                    "unit_bytes": reads.unit_bytes,
                },
                "measured",
                note=UNIT_READS_NOTE + "; O_DIRECT wins ties",
            )
    direct, buffered = c.profile.measurements.get("storage_read_direct"), c.profile.measurements.get("storage_read")
    if all(m and m.available and m.bytes_moved > 0 and m.seconds > 0 for m in (direct, buffered)):
        # Cost per byte: wall time plus, where compute shares the CPU, the CPU time the read itself uses.
        shared = 1 if c.profile.compute_device == "cpu" else 0
        inputs = {
            "direct_seconds": direct.seconds,
            "direct_cpu_seconds": direct.cpu_seconds,
            "direct_bytes": direct.bytes_moved,
            "buffered_seconds": buffered.seconds,
            "buffered_cpu_seconds": buffered.cpu_seconds,
            "buffered_bytes": buffered.bytes_moved,
            "cpu_shared": shared,
        }
        return Derivation(
            "(direct_seconds + cpu_shared * direct_cpu_seconds) / direct_bytes <= (buffered_seconds + cpu_shared * "
            "buffered_cpu_seconds) / buffered_bytes",
            inputs,
            "measured",
            note="O_DIRECT wins ties: it skips the page-cache copy and never evicts the resident set",
        )
    cap = c.profile.capabilities.get("direct_io")
    return Derivation(repr(FALLBACK_DIRECT_IO), {}, "default", cap.reason if cap else "storage was not measured")


def pin_memory(c: Context) -> Derivation:
    pinned = c.profile.measurements.get("h2d_pinned")
    return Derivation(
        "device_kind == 'cuda' and pinned_copy_measured",
        {
            "device_kind": c.profile.compute_device.split(":")[0],
            "pinned_copy_measured": bool(pinned and pinned.available),
        },
    )


GRAPH_MIN_RUN_TOKENS = 256  # a one-shot run shorter than this does not earn back the compile (tens of seconds)


def decode_graphs(c: Context) -> Derivation:
    if c.model is None:
        return Derivation(
            "'auto'", {}, "default", "needs a model (missing total_bytes): on where a CUDA GPU holds every unit"
        )
    inputs = {
        "device_kind": c.profile.compute_device.split(":")[0],
        "device_cache_bytes": c.values["device_cache_bytes"],
        "total_bytes": c.model.total_bytes,
        "run_tokens": c.run_tokens or 0,
        "min_run_tokens": GRAPH_MIN_RUN_TOKENS,
    }
    return Derivation(
        "'on' if device_kind == 'cuda' and device_cache_bytes >= total_bytes and "
        "(run_tokens == 0 or run_tokens >= min_run_tokens) else 'off'",
        inputs,
        note="a resident decode step is hundreds of kernel launches: as CUDA graphs the GPU, not Python, bounds it; "
        "run_tokens 0 is a server or session, whose first request pays the compile once",
    )


def prefix_cache(c: Context) -> Derivation:
    return Derivation("'auto'", {}, "default", "reuse the KV cache when a prompt repeats a cached prefix")


def draft_model(c: Context) -> Derivation:
    return Derivation("None", {}, "default", "no draft model: speculation drafts by prompt lookup")


def speculate(c: Context) -> Derivation:
    if c.model is None:
        return Derivation(
            "'auto'",
            {},
            "default",
            "needs a model (missing total_bytes): on where layers stream, off where every unit is resident",
        )
    # On a CPU the host tier is the page cache mapped zero-copy: a pass from it costs compute, like a resident one.
    inputs = {
        "draft_model": c.values["draft_model"],
        "device_cache_bytes": c.values["device_cache_bytes"],
        "host_tier_is_memory": int(c.unified),
        "host_cache_bytes": c.values["host_cache_bytes"],
        "total_bytes": c.model.total_bytes,
    }
    return Derivation(
        "('draft' if draft_model else 'prompt-lookup') if device_cache_bytes + host_tier_is_memory * host_cache_bytes "
        "< total_bytes else 'off'",
        inputs,
        note="a pass that streams layers costs the bytes it moves whatever its tokens, so verifying drafted tokens is "
        "nearly free; where every unit is in memory a pass costs its compute, which grows with its tokens",
    )


def draft_tokens(c: Context) -> Derivation:
    return Derivation(
        str(DEFAULT_DRAFT_TOKENS),
        {},
        "default",
        "tokens drafted per pass (a drafted run longer than what is accepted costs only its share of one pass's "
        "compute)",
    )


REPLY_BUDGET_S = 60  # what a request that gives no max_tokens may run for, at the projected speed
REPLY_TOKENS_MIN, REPLY_TOKENS_MAX = 64, 2048


def default_max_tokens(c: Context) -> Derivation:
    """The reply length `serve` gives a request that sets none: what the cost model projects fits in a minute, within
    [64, 2048] and the context (a reply with no bound ran for 12 minutes of noise on a streamed model)."""
    from ..cost import project

    bounds = {"reply_budget_s": REPLY_BUDGET_S, "min_tokens": REPLY_TOKENS_MIN, "max_tokens": REPLY_TOKENS_MAX}
    if c.model is None:
        return Derivation(str(DEFAULT_REPLY_TOKENS), {}, "default", "needs a model to project its speed: pass --model")
    v = c.values
    device = min(c.model.total_bytes, int(v["device_cache_bytes"] or 0))
    host = min(c.model.total_bytes - device, int(v["host_cache_bytes"] or 0))
    projection = project(
        c.profile, c.model, {"device": device, "host": host, "storage": c.model.total_bytes - device - host}
    )
    seconds = projection.overlapped_seconds or projection.serial_seconds
    # six significant digits, not decimals: a small model on a fast GPU projects well under a microsecond a token
    seconds = float(f"{seconds:.6g}") if seconds and math.isfinite(seconds) else 0.0
    if seconds <= 0:
        return Derivation(
            str(DEFAULT_REPLY_TOKENS), {}, "default", f"no projected speed ({projection.reason or 'unmeasured'})"
        )
    inputs = {
        **bounds,
        "seconds_per_token": seconds,
        "max_context": v["max_context"] if v["max_context"] is not None else 1 << 30,
    }
    return Derivation(
        "min(max_context, max(min_tokens, min(max_tokens, floor(reply_budget_s / seconds_per_token))))",
        inputs,
        note="the cost model's projected seconds per token at this residency; a request's max_tokens wins",
    )


def expert_cache_policy(c: Context) -> Derivation:
    return Derivation(
        repr(DEFAULT_EXPERT_CACHE_POLICY),
        {},
        "default",
        "measured: a decode pass walks the layers in a cycle, so LRU with room for fewer experts "
        "than one pass routes evicts each just before its layer comes round again (docs/ARCHITECTURE.md)",
    )


# a pass streaming a large model from disk takes seconds; a heartbeat comes every timeout / 8
DEFAULT_STAGE_TIMEOUT_S = 30


def stages(c: Context) -> Derivation:
    return Derivation(
        "'auto'",
        {},
        "default",
        "under torchrun, contiguous layer ranges that minimise the slowest stage's projected seconds per token, from "
        "every rank's own profile and measured link (distributed/plan.py)",
    )


def stage_timeout_s(c: Context) -> Derivation:
    return Derivation(
        str(DEFAULT_STAGE_TIMEOUT_S),
        {},
        "default",
        "a rank whose heartbeat has not moved this long is stopped or hung: the command exits naming it, the server "
        "answers 503",
    )


# Resolution order: each derivation may read the values resolved before it.
DERIVATIONS = {
    "reserve_bytes": reserve_bytes,
    "runtime_bytes": runtime_bytes,
    "compute_dtype": compute_dtype,
    "kernel": kernel,
    "kv_cache_dtype": kv_cache_dtype,
    "kv_residual_tokens": kv_residual_tokens,
    "kv_cache_bytes": kv_cache_bytes,
    "direct_io": direct_io,
    "io_workers": io_workers,
    "prefetch_depth": prefetch_depth,
    "device_cache_bytes": device_cache_bytes,
    "host_cache_bytes": host_cache_bytes,
    "max_context": max_context,
    "pin_memory": pin_memory,
    "decode_graphs": decode_graphs,
    "prefix_cache": prefix_cache,
    "draft_model": draft_model,
    "speculate": speculate,
    "draft_tokens": draft_tokens,
    "expert_cache_policy": expert_cache_policy,
    "default_max_tokens": default_max_tokens,
    "stages": stages,
    "stage_timeout_s": stage_timeout_s,
}


def memory_floor(
    profile: HardwareProfile,
    model: ModelFacts,
    knobs,
    run_tokens: int | None = None,
    shape: PassShape | None = None,
    resident_bytes: int = 0,
) -> Derivation:
    """The least memory these knobs need for MODEL, all of what the process holds: on a CPU, the runtime (this
    process's own memory, or the measured runtime where that is more), the reserve, the units that stay resident
    whatever the budgets (RESIDENT_BYTES: hooked on the whole model, vision towers), the least streaming buffers (two
    of a layer, one more for a larger unit), and the smallest context the run needs: a one-shot run's own tokens
    (RUN_TOKENS), max_context or kv_cache_bytes where given, else a server's FLOOR_CONTEXT, each token its K and V and
    the activations of a pass over it (SHAPE; not counted without). A memory that does not hold it cannot run the
    model at any residency: AutoModel refuses it before loading (stream/plan.py check_floor), comparing it with
    memory_available + process_rss_bytes.

    KNOBS: resolved for this profile and model (resolve_knobs' Knobs)."""
    values = knobs.values_dict()
    overridden = {name for name in values if knobs[name].overridden}
    c = Context(profile, model, values, overridden, run_tokens, shape)
    ram = c.runtime()  # the runtime lives in RAM: counted where the compute device's memory is RAM
    inputs = {
        "memory_available": c.device_free,
        **({"process_rss_bytes": profile.process_rss} if ram else {}),
        **ram,
        "reserve_bytes": values["reserve_bytes"],
        "resident_bytes": resident_bytes,
        "layer_bytes": model.layer_bytes or model.largest_unit_bytes,
        "largest_unit_bytes": model.largest_unit_bytes,
    }
    terms = (["process_rss_bytes", "runtime_bytes"] if ram else []) + ["reserve_bytes", "resident_bytes", STREAMING_MIN]
    if "kv_cache_bytes" in overridden or not model.kv_bytes_per_token:
        inputs["kv_cache_bytes"] = values["kv_cache_bytes"]
        terms.append("kv_cache_bytes")
        note = "the context is kv_cache_bytes"
    else:
        given = "max_context" in overridden and values.get("max_context")
        tokens = int(values["max_context"]) if given else (run_tokens or FLOOR_CONTEXT)
        inputs.update(
            max_positions=model.max_positions,
            floor_tokens=tokens,
            **c.kv_values(),
            kv_window_values=model.kv_window_values,
        )
        if c.kv_dtype() == "int4":
            inputs["kv_full_precision_tokens"] = values["kv_residual_tokens"] + 2 * KV_INT4_GROUP
        fixed, per_token = _kv_cost_terms(inputs)
        terms.append(f"ceil({fixed} + min(max_positions, floor_tokens) * ({per_token}))")
        note = (
            "the context: this run's own tokens"
            if run_tokens and not given
            else "the context: max_context"
            if given
            else f"the context: a server's least, {FLOOR_CONTEXT} tokens"
        )
        if shape is None:
            note += " (their activations not counted: the model's shape is not known)"
    return Derivation(" + ".join(terms), inputs, note=note + "; below it a load is refused before any weight is read")
