"""rocketllm profile: every knob with its value, formula, inputs and source."""

from __future__ import annotations

from ..options import JsonOpt, ModelPathOpt, RefreshOpt, with_knob_options
from ..output import Output

NAME = "profile"
HELP = """Print every knob: its value, the formula that derived it from the measured hardware, the formula's inputs, and
its source.

Overrides (a --<knob> flag, or ROCKETLLM_<NAME> in the environment) are marked [OVERRIDDEN].
Examples: `rocketllm profile`, `rocketllm profile --model ./shards --prefetch-depth 2`, `rocketllm profile --json`.
"""


@with_knob_options
def run(
    model: ModelPathOpt = None,
    refresh: RefreshOpt = False,
    json_output: JsonOpt = False,
    *,
    knob_flags: dict,
) -> None:
    from ..profiles import HardwareProfile, model_facts_from_path, resolve_knobs
    from ..profiles.knobs.expression import evaluate
    from ..profiles.knobs.memory import memory_floor
    from ..profiles.knobs.resolve import describe_input
    from ..profiles.knobs.shape import pass_shape_of
    from ..redact import redact

    facts = model_facts_from_path(model) if model is not None else None
    shape = pass_shape_of(model) if model is not None else None
    out = Output(as_json=json_output)
    profile = HardwareProfile.load(storage_path=model, refresh=refresh, log=out.log)
    knobs = resolve_knobs(profile, facts, flags=knob_flags, shape=shape)
    floor = None
    if facts is not None:  # a shard set streamed from storage: its own units' reads decide the read knobs
        from ..profiles.probe.unitreads import with_own_reads

        facts, knobs = with_own_reads(
            profile, facts, model, knobs, lambda f: resolve_knobs(profile, f, flags=knob_flags, shape=shape), out.log
        )
        floor = memory_floor(profile, facts, knobs, shape=shape)
    from ..distributed.torchrun import launched

    launch, stages = launched(), None  # under torchrun: every rank measures itself and its link; rank 0 shows the plan
    if launch is not None:
        if facts is None:
            from ..errors import UsageError

            raise UsageError("under torchrun, profile plans stages for a model: give --model PATH")
        from ..distributed.opening import plan_for_doctor

        stages = plan_for_doctor(launch, profile, facts, knobs, knob_flags)
        if not launch.is_first:
            return
    if json_output:
        out.json(
            {
                "fingerprint": profile.fingerprint,
                "compute_device": profile.compute_device,
                "from_cache": profile.from_cache,
                "tiers": profile.tier_meaning(),
                "model": facts.to_dict() if facts else None,
                "knobs": knobs.to_dict(),
                "memory_floor": {
                    "value": evaluate(floor.formula, floor.inputs),
                    "formula": floor.formula,
                    "inputs": floor.inputs,
                    "note": floor.note,
                }
                if floor
                else None,
                **({"stages": stages} if stages else {}),
            }
        )
        return
    lines = [
        f"fingerprint {profile.fingerprint} ({'cached' if profile.from_cache else 'measured now'}), compute "
        f"device {profile.compute_device}",
        f"tiers: {profile.tier_meaning()}",
        f"model: {facts.name}" if facts else "model: none (--model PATH sizes the model-dependent knobs)",
        "",
    ]
    for knob in knobs.values():
        mark = " [OVERRIDDEN]" if knob.overridden else ""
        lines.append(f"{knob.name:<20} {knob.display():>12}  {knob.source}{mark}")
        lines.append(f"    = {knob.formula}")
        if knob.inputs:
            lines.append("    with " + ", ".join(describe_input(k, v) for k, v in knob.inputs.items()))
        if knob.note:
            lines.append(f"    ({knob.note})")
    if floor is not None:  # not a knob: what the knobs above need at the least, all the process holds
        from ..sizes import format_bytes

        lines.append(f"{'memory floor':<20} {format_bytes(evaluate(floor.formula, floor.inputs)):>12}  derived")
        lines += [
            f"    = {floor.formula}",
            "    with " + ", ".join(describe_input(k, v) for k, v in floor.inputs.items()),
            f"    ({floor.note})",
        ]
    if stages:
        lines += ["", *stages["ranks"], stages["text"], f"    = {stages['formula']}"]
    out.result(redact("\n".join(lines)))
