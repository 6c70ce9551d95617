"""The frame the conversation and grammar benches share: the set found (or written) once, the knob flags the mode sets
itself dropped with a warning, each regime measured or skipped with the reason, and the hardware line, the model and
the load average around it all."""

from __future__ import annotations

from pathlib import Path


def over_regimes(
    model: str | None,
    synthetic: str | None,
    regimes: tuple[str, ...],
    knob_flags: dict,
    owned: tuple[str, ...],
    what: str,
    measure,
    log,
) -> dict:
    """measure(shards, regime, flags) -> (run, profile) for each regime that can run here; owned: knobs the mode sets
    itself (a flag for one of them is ignored, with a warning); what: the mode's name in that warning."""
    from ..auto import ensure_shards
    from .regimes import REGIME_KNOBS, skip_reason
    from .report import hardware_line, load_average
    from .sources import synthetic_checkpoint
    from .suite import _profile_and_facts, _ram_available

    load = {"before": load_average()}
    source = str(synthetic_checkpoint(synthetic, log)) if synthetic else model
    manifest, shards = ensure_shards(source, log=log)
    flags = {k: v for k, v in knob_flags.items() if k not in (*REGIME_KNOBS, *owned)}
    for name in set(knob_flags) - set(flags):
        log(f"warning: --{name.replace('_', '-')} is set by the {what} bench; the flag is ignored")
    runs, profile = [], None
    for regime in regimes:
        why = skip_reason(regime, manifest.total_bytes, _ram_available(), bool(manifest.experts))
        if why:
            log(f"{regime}: skipped, {why}")
            runs.append({"regime": regime, "status": "skipped", "reason": why})
            continue
        run, profile = measure(shards, regime, flags)
        runs.append(run)
    if profile is None:
        profile, _ = _profile_and_facts(shards, manifest)
    load["after"], load["cores"] = load_average(), profile.cpu_cores
    return {
        "hardware": hardware_line(profile),
        "model": {
            "name": synthetic or Path(model).name,
            "dtype": manifest.dtype,
            "total_bytes": manifest.total_bytes,
            "num_layers": len(manifest.layers),
        },
        "load": load,
        "runs": runs,
    }
