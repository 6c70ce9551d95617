"""A `rocketllm plan` row's memory per tier and projection, from the knobs' own terms and the cost model.

Memory: max_context's room (memory available less the reserve, the resident weights, the streaming buffers, the
runtime where the knobs count it, and on a CPU the host tier's page cache) holds the row's KV as kv_cache_bytes sizes
it.
Projection: `cost.project` of the bytes per tier `cost.plan_tier_bytes` gives (what `doctor --model` prints), computing
in the row's dtype, written as a formula whose value is the row's tokens per second.
"""

from __future__ import annotations

from ..profiles.cost import project
from ..profiles.hardware import HardwareProfile
from ..profiles.knobs import formulas
from ..profiles.knobs import memory as memory_knobs
from ..profiles.knobs.derivation import Context
from ..profiles.knobs.expression import evaluate
from ..profiles.knobs.resolve import Knobs


def speculation_note(mode: str, measured: dict | None = None) -> str:
    """What a speculating row's projection assumes of its tokens per pass: MEASURED (probe/acceptance.py) or one."""
    if measured:
        positions = measured.get("positions_per_pass")
        computed = (
            f"a pass moves one token's bytes and computes {positions:.2f} positions (its last token and the drafts it "
            "verified, as measured)"
            if isinstance(positions, (int, float))
            else "a pass is costed as one token's bytes and compute (this record has no positions a pass: bench it "
            "again to count its drafts' compute)"
        )
        return (
            f"speculation {mode}: {measured['tokens_per_pass']:.2f} tokens a pass, as bench measured this set here "
            f"({measured['tokens']} tokens in {measured['passes']} passes, {measured['measured_at']}); {computed}"
        )
    return (
        f"speculation {mode}: projected at one token a pass, a floor: how many drafts are accepted is a property of "
        "the model and the text, not yet measured for this set here (`rocketllm bench` measures it)"
    )


def tokens_per_pass(speculate: str, measured: dict) -> float:
    """Tokens a pass of a row speculating in mode SPECULATE makes: bench's figure for the set (MEASURED: mode ->
    figures), else one."""
    entry = measured.get(speculate) if speculate != "off" else None
    return float(entry["tokens_per_pass"]) if entry else 1.0


def positions_per_pass(speculate: str, measured: dict, batch: int) -> int:
    """Positions a pass of BATCH sequences computes: each sequence's last token, and where the row speculates the
    drafts bench measured a pass verifying for this set (MEASURED: mode -> figures); at least BATCH."""
    entry = measured.get(speculate) if speculate != "off" else None
    each = entry.get("positions_per_pass") if entry else None
    return max(batch, round(batch * float(each))) if isinstance(each, (int, float)) and each >= 1 else batch


def pass_tokens(inputs: dict, batch: int, per_pass: float) -> str:
    """The numerator of a row's tokens per second, BATCH sequences making PER_PASS tokens each a pass (speculation):
    its term, its values put in INPUTS."""
    inputs["batch"] = batch
    if per_pass == 1.0:
        return "batch"
    inputs["tokens_per_pass"] = round(per_pass, 3)
    return "batch * tokens_per_pass"


def row_memory(profile: HardwareProfile, facts, knobs: Knobs, tokens: int | None) -> dict | None:
    """Bytes per tier a configuration holds, from the knobs' own terms; None where its KV does not fit what is left.

    The room for KV is max_context's: memory available less the reserve, the resident weights, the streaming buffers,
    the runtime where the knobs count it, and (on a CPU) the host tier's page cache. The context is TOKENS where given
    (its KV as kv_cache_bytes sizes it for a --max-context), else the most that room holds."""
    c = context_of(profile, facts, knobs)
    values = c.values
    derived = memory_knobs.max_context(c)
    capacity = evaluate(derived.formula, derived.inputs)
    total = facts.total_bytes
    device = min(int(values["device_cache_bytes"] or 0), total)
    host = min(int(values["host_cache_bytes"] or 0), total - device)
    if capacity is None:  # no KV facts: weights alone
        return {
            "device": {"weights": device, "kv": 0, "buffers": 0, "runtime": 0, "total": device},
            "host": {"weights": host, "total": host},
            "storage": {"set": total},
            "reserve": values["reserve_bytes"],
            "budget": {},
            "used": device + host,
            "tokens": tokens,
        }
    need = tokens if tokens is not None else capacity
    if need < 1:
        return None
    inputs = derived.inputs
    left = evaluate(memory_knobs.context_terms(inputs)[0], inputs)
    budget = inputs["memory_available"] - inputs["reserve_bytes"]
    charged = min(int(values["device_cache_bytes"] or 0), total) + (
        min(int(values["host_cache_bytes"] or 0), total) if c.unified else 0
    )
    # the Python runtime beside the model
    runtime = int(values.get("runtime_bytes") or 0) if "runtime_bytes" in inputs else 0
    buffers = max(0, budget - left - charged - runtime)
    sized = context_of(profile, facts, knobs, max_context=need)
    kv_derivation = memory_knobs.kv_cache_bytes(sized)
    kv = int(evaluate(kv_derivation.formula, kv_derivation.inputs))
    on_device = device + kv + buffers + runtime
    memory = {
        "device": {"weights": device, "kv": kv, "buffers": buffers, "runtime": runtime, "total": on_device},
        "host": {"weights": host, "total": host},
        "storage": {"set": total},
        "reserve": values["reserve_bytes"],
        "used": on_device + host,
        "tokens": need,
    }
    if c.unified:
        memory["budget"] = {"memory": budget}
        fits = on_device + host <= budget
    else:
        room = (
            knobs["host_cache_bytes"].derived_value
            if knobs["host_cache_bytes"].overridden
            else values["host_cache_bytes"]
        )
        memory["budget"] = {"device": budget, "host": profile.ram_available - values["reserve_bytes"]}
        fits = on_device <= budget and host <= max(0, int(room or 0))
    return memory if fits else None


def projection(
    profile: HardwareProfile,
    facts,
    tiers: dict[str, int],
    compute_dtype: str,
    batch: int,
    per_pass: float = 1.0,
    positions: int = 1,
    kernel: str = "exact",
) -> tuple[float | None, str, dict, str]:
    """(tokens/s, formula, inputs, note): the cost model's overlapped seconds per pass for TIERS, computing in
    COMPUTE_DTYPE, as a formula whose value (evaluate) is the tokens per second of BATCH sequences making PER_PASS
    tokens each a pass (speculation: tokens_per_pass). A pass computes POSITIONS positions (positions_per_pass): its
    block products' time beyond one position's, measured on the KERNEL mode's kernels, is added to its compute."""
    decided = profile.capabilities.get("compute_dtype")
    reason = f"this row computes in {compute_dtype}" + (f" (the profile decided {decided.value})" if decided else "")
    as_computed = profile.computing_in(compute_dtype, reason)
    p = project(as_computed, facts, tiers)
    if not p.available or p.overlapped_seconds is None:
        return None, "unavailable", {}, f"no projection: {p.reason or 'compute bandwidth unmeasured'}"
    inputs, io = {}, []
    tokens = pass_tokens(inputs, batch, per_pass)
    for tier in ("host", "storage"):
        cost = p.tiers[tier]
        if cost.bytes:
            inputs[f"{tier}_bytes"], inputs[f"{tier}_bps"] = cost.bytes, cost.bandwidth_bps
            io.append(f"{tier}_bytes / {tier}_bps")
    # measured: the decode, the kernels, other sets
    if facts.decode_compute or facts.kernel_rates or facts.layer_overhead:
        inputs["compute_s"], compute = p.compute_seconds, "compute_s"
    else:
        inputs["compute_bytes"] = sum(t.bytes for t in p.tiers.values())
        inputs["compute_bps"] = as_computed.matvec_bps() or as_computed.device_memory_bps
        compute = "compute_bytes / compute_bps"
    note = f"compute: {p.compute_bandwidth}"
    if p.tiers["storage"].bytes:
        note += f"; storage: {p.tiers['storage'].bandwidth}"
    if positions > 1:
        from ..profiles.probe.kernelrates import pass_extra_seconds

        extra = pass_extra_seconds(profile, facts, kernel, positions)
        if extra is not None:
            inputs["pass_extra_s"] = round(extra[0], 6)
            compute, note = f"({compute} + pass_extra_s)", f"{note}; pass_extra_s: {extra[1]}"
        else:
            note += f"; a pass of {positions} positions is costed as one (no row-count measurement for this set here)"
    formula = f"{tokens} / max({' + '.join(io)}, {compute})" if io else f"{tokens} / ({compute})"
    return evaluate(formula, inputs), formula, inputs, note


def context_of(profile: HardwareProfile, facts, knobs: Knobs, **values) -> Context:
    """The derivations' Context for these resolved knobs (VALUES replacing some): every value a derivation reads,
    those the knob table does not list derived again in resolution order."""
    known = {**knobs.values_dict(), **values}
    overridden = {name for name, k in knobs.items() if k.overridden} | set(values)
    for name, derive in formulas.DERIVATIONS.items():
        if name not in known:
            d = derive(Context(profile, facts, known, overridden))
            known[name] = evaluate(d.formula, d.inputs)
    return Context(profile, facts, known, overridden)


def engine_dtype(profile: HardwareProfile, facts, knobs: Knobs) -> str:
    return context_of(profile, facts, knobs).compute_dtype()


def kv_dtype_of(profile: HardwareProfile, facts, knobs: Knobs) -> str:
    """What the KV cache stores: int4, or a float dtype (auto: the compute dtype)."""
    return context_of(profile, facts, knobs).kv_dtype()
