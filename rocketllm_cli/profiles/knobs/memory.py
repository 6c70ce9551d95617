"""The knobs that share out memory: the reserve, the runtime beside the model, the KV cache and the context it
holds, the device and host budgets of the weights, and the memory floor below which a load is refused."""

from __future__ import annotations

from math import ceil

from ...checkpoint.modelfacts import ModelFacts
from ...dtypes import KV_INT4_GROUP, int4_kv_value_bytes
from ...sizes import format_bytes
from ..hardware import HardwareProfile
from .derivation import (
    CGROUP_RESERVE_FRACTION,
    CONTEXT_SHARE,
    FLOOR_CONTEXT,
    MIN_CONTEXT,
    Context,
    Derivation,
    GiB,
    MiB,
)
from .expression import evaluate
from .shape import PassShape


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
        return Derivation.default(
            "0",
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


def kv_cache_dtype(c: Context) -> Derivation:
    return Derivation.default(
        "'auto'",
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
    left, fixed, per_token = context_terms(inputs)
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


def context_terms(inputs: dict) -> tuple[str, str, str]:
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
    left, fixed, per_token = context_terms(int4)
    return int(evaluate(f"max(0, min(max_positions, floor(({left} - ({fixed})) / ({per_token}))))", int4))


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
    model at any residency: AutoModel refuses it before loading (stream/residency.py check_floor), comparing it with
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
