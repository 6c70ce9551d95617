"""A `rocketllm plan` row over several hosts: pipeline stages planned by the stage planner (distributed/stageplan.py,
torch-free) from hosts like this one, the way `doctor --model` under torchrun plans them: each host's budgets are its
knobs for the whole model, its layers an even share of the layer bytes, the first host also holds the embeddings and
the head; one stream's seconds per token are its stages in turn plus the hidden state over every link.
"""

from __future__ import annotations

from ..dtypes import ITEMSIZE
from ..profiles.cost import tier_bandwidth
from ..profiles.hardware import HardwareProfile
from ..profiles.knobs.expression import evaluate
from ..profiles.knobs.resolve import resolve_knobs
from .formats import ModelSource, WeightFormat


def stage_row(
    profile: HardwareProfile,
    source: ModelSource,
    fmt: WeightFormat,
    dtype: str | None,
    kv: str,
    context: int,
    request,
    hosts: int,
    extra: dict | None = None,
):
    """The row of FMT over HOSTS hosts like PROFILE, each holding CONTEXT tokens a sequence, EXTRA knob flags set
    (planner.py SPECULATION_TWINS); a string why not."""
    from ..distributed.stageplan import RankFacts, plan_stages
    from .projection import (
        engine_dtype,
        kv_dtype_of,
        pass_tokens,
        row_memory,
        tokens_per_pass,
    )
    from .rows import Row

    facts = fmt.facts
    if hosts > facts.num_layers:
        return f"more hosts than the model's {facts.num_layers} layers"
    tokens = context * request.batch
    flags = {
        **(extra or {}),
        "max_context": tokens,
        **({"compute_dtype": dtype} if dtype else {}),
        **({"kv_cache_dtype": kv} if kv != "auto" else {}),
    }
    knobs = resolve_knobs(profile, facts, flags=flags, env={})
    memory = row_memory(profile, facts, knobs, tokens)
    if memory is None:
        return "does not fit memory"
    compute = engine_dtype(profile, facts, knobs)
    compute_bps = profile.matvec_bps(compute) or profile.device_memory_bps
    device_budget, host_budget = int(knobs.value("device_cache_bytes")), int(knobs.value("host_cache_bytes"))
    ranks = [
        RankFacts(
            r,
            f"host{r}",
            device_budget,
            host_budget,
            compute_bps,
            tier_bandwidth(profile, "host")[0],
            tier_bandwidth(profile, "storage")[0],
            f"decode-shaped matvec in {compute}, measured",
            request.link_latency_s,
            request.link_bps,
            profile.compute_device,
        )
        for r in range(hosts)
    ]
    n = max(1, facts.num_layers)
    layer = (facts.total_bytes - facts.non_layer_bytes) // n
    share = facts.bytes_per_token / facts.total_bytes if facts.total_bytes else 1.0
    hidden = source.hidden_size or int((max(1, facts.layer_bytes) / (12 * ITEMSIZE.get(facts.dtype, 2))) ** 0.5)
    hidden_bytes = hidden * ITEMSIZE.get(compute, 2) * request.batch
    plan = plan_stages(ranks, [layer] * n, [int(layer * share)] * n, facts.non_layer_bytes, 0, hidden_bytes)
    per_host, kv, buffers = [], memory["device"]["kv"], memory["device"]["buffers"] + memory["device"]["runtime"]
    budget = memory["budget"].get("memory", memory["budget"].get("device", 0))
    for r, (a, b) in enumerate(plan.ranges):
        held = layer * (b - a) + (facts.non_layer_bytes if r == 0 else 0)
        device = min(held, device_budget)
        host = min(held - device, host_budget)
        on_device = device + kv * (b - a) // n + buffers
        if on_device + (host if "memory" in memory["budget"] else 0) > budget:
            return "a stage does not fit its host's memory"
        per_host.append(
            {
                "layers": [a, b],
                "device": on_device,
                "host": host,
                "storage": held - device - host,
                "kv": kv * (b - a) // n,
                "weights_device": device,
            }
        )
    busiest = max(per_host, key=lambda h: h["device"] + h["host"])
    tiers = {t: sum(s.get(t, 0) for s in plan.stage_bytes) for t in ("device", "host", "storage")}
    speculate = str(knobs.value("speculate"))
    if any(s is None for s in plan.stage_seconds):
        tps, formula, inputs = None, "unavailable", {}
    else:
        inputs = {}
        numerator = pass_tokens(inputs, request.batch, tokens_per_pass(speculate, fmt.speculation))
        inputs.update({f"stage_{r}_s": s for r, s in enumerate(plan.stage_seconds)}, links_s=plan.link_seconds)
        formula = f"{numerator} / (" + " + ".join(f"stage_{r}_s" for r in range(hosts)) + " + links_s)"
        tps = evaluate(formula, inputs)
    stage_memory = {
        "device": {
            "weights": busiest["weights_device"],
            "kv": busiest["kv"],
            "buffers": memory["device"]["buffers"],
            "runtime": memory["device"]["runtime"],
            "total": busiest["device"],
        },
        "host": {"weights": busiest["host"], "total": busiest["host"]},
        "storage": {"set": facts.total_bytes},
        "reserve": memory["reserve"],
        "budget": memory["budget"],
        "used": busiest["device"] + busiest["host"],
        "tokens": tokens,
        "per_host": per_host,
    }
    notes = [
        f"stages: {plan.formula}",
        f"links: {hosts} hops of {request.link_latency_s * 1e6:.0f} us + {hidden_bytes} bytes at "
        f"{request.link_bps / 1e9:.2f} GB/s (--link-bw); memory shown is the busiest host's",
    ]
    return Row(
        fmt,
        compute,
        kv_dtype_of(profile, facts, knobs),
        "stages",
        context,
        request.batch,
        speculate,
        hosts,
        {**flags, "stages": plan.counts()},
        tps,
        formula,
        inputs,
        stage_memory,
        tiers,
        stages=plan.counts(),
        notes=notes,
    )
