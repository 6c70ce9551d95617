"""One bench run: shard (or reuse), each regime, each baseline where it means something, the batch sweep; one
document."""

from __future__ import annotations

import gc
from dataclasses import dataclass, field
from pathlib import Path

from ..checkpoint.manifest import Manifest
from ..errors import UsageError
from ..output import no_progress
from .baselines import BASELINES, ON_GGUF, REGIMES_OF, run_baseline
from .defaults import BATCH_REGIME, DECODE_TOKENS, PROMPT_TOKENS
from .llamacpp import gguf_file, run_llamacpp
from .regimes import (
    DEFAULT_REGIMES,
    REGIME_KNOBS,
    REGIMES,
    read_method,
    regime_overrides,
    run_regime,
    skip_reason,
)
from .timing import WARMUP, fixed_prompt


@dataclass
class BenchRequest:
    model: str | None = None
    synthetic: str | None = None
    regimes: tuple[str, ...] = ()  # empty: every regime, or BATCH_REGIME alone for a batch sweep
    tokens: int = DECODE_TOKENS
    prompt_tokens: int = PROMPT_TOKENS
    baselines: tuple[str, ...] = ()
    batch: tuple[int, ...] = ()
    knob_flags: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if (self.model is None) == (self.synthetic is None):
            raise UsageError("give MODEL or --synthetic ARCH:SIZE (one of them)")
        if self.tokens < 1:
            raise UsageError(f"--tokens must be at least 1 (got {self.tokens})")
        if self.prompt_tokens < 1:
            raise UsageError(f"--prompt-tokens must be at least 1 (got {self.prompt_tokens})")
        for regime in self.regimes:
            if regime not in REGIMES:
                raise UsageError(f"bad --regime {regime!r}: expected {', '.join(REGIMES)} or all")
        for name in self.baselines:
            if name not in BASELINES:
                raise UsageError(f"bad --baseline {name!r}: expected one of {', '.join(BASELINES)}")
        for n in self.batch:
            if n < 1:
                raise UsageError(f"--batch sizes must be at least 1 (got {n})")
        if self.batch and len(self.regimes) > 1:
            raise UsageError(
                f"--batch measures one regime: pass --regime resident, host or storage (default {BATCH_REGIME})"
            )
        if not self.regimes:
            self.regimes = (BATCH_REGIME,) if self.batch else ()  # () = every regime that applies to the model


def run_bench(req: BenchRequest, log, progress=None) -> dict:
    """progress: Output.progress or alike; first-use sharding gets its bar, and each phase a status line beside its log
    line."""
    from ..auto import ensure_shards
    from ..profiles import cache_dir
    from .report import hardware_line, load_average
    from .sources import hf_checkpoint, synthetic_checkpoint

    load = {"before": load_average()}
    source = str(synthetic_checkpoint(req.synthetic, log)) if req.synthetic else req.model
    manifest, shards = ensure_shards(source, log=log, progress=progress)
    phase = progress or no_progress
    flags = dict(req.knob_flags)
    for name in REGIME_KNOBS:
        if flags.pop(name, None) is not None:
            log(f"warning: --{name.replace('_', '-')} is set by each regime; the flag is ignored")

    rows: list[dict] = []
    residency: dict[str, dict] = {}
    profile = facts = None
    ram = _ram_available()
    hf_dir, no_hf = (None, "")
    if set(req.baselines) - set(ON_GGUF):  # a GGUF is dequantized into a copy only for the baselines that load one
        hf_dir, no_hf = hf_checkpoint(source, manifest, log)
    gguf, no_gguf = gguf_file(None if req.synthetic else req.model, manifest)
    work = cache_dir() / "bench" / "work"
    dtype = None
    regimes = req.regimes or DEFAULT_REGIMES + (("expert-cache",) if manifest.experts else ())
    for regime in () if req.batch else regimes:
        why = skip_reason(regime, manifest.total_bytes, ram, bool(manifest.experts))
        if why:
            log(f"{regime}: skipped, {why}")
            rows.append({"name": "rocketllm", "regime": regime, "status": "skipped", "reason": why})
            continue
        log(f"{regime}: measuring RocketLLM ({req.tokens} tokens after {WARMUP} warm-up)")
        with phase(f"{regime}: RocketLLM", announce=False):
            row = run_regime(shards, regime, req.tokens, req.prompt_tokens, flags, log)
        profile, facts = row.pop("_profile"), row.pop("_facts")
        dtype = row["knobs"]["compute_dtype"]
        if (
            regime == "resident"
            and row.get("status") == "measured"
            and (row.get("speculation") or {}).get("mode", "off") == "off"
        ):
            from ..profiles.probe.decodecompute import record

            record(
                profile,
                shards,
                manifest,
                dtype,
                row["ms_per_token"],
                str(row.get("compute_threads") or "").split(":")[0] or None,
                facts,
                str(row["knobs"].get("kernel") or "exact"),
            )
        if row.get("status") == "measured" and (row.get("speculation") or {}).get("passes"):
            from ..profiles.probe import acceptance

            acceptance.record(shards, manifest, row["speculation"])
        residency[regime] = row["residency"]
        rows.append(row)
        for name in req.baselines:
            if regime not in REGIMES_OF[name]:
                continue
            if name in ON_GGUF:
                log(f"{regime}: measuring baseline {name}")
                with phase(f"{regime}: baseline {name}", announce=False):
                    rows.append(run_llamacpp(gguf, no_gguf, regime, req.tokens, req.prompt_tokens, profile, log))
                continue
            if hf_dir is None:
                rows.append({"name": name, "regime": regime, "status": "skipped", "reason": no_hf})
                continue
            log(f"{regime}: measuring baseline {name}")
            with phase(f"{regime}: baseline {name}", announce=False):
                rows.append(
                    run_baseline(name, regime, hf_dir, _torch_dtype(dtype), req.tokens, req.prompt_tokens, work, log)
                )
    batch = None
    if req.batch:
        regime = req.regimes[0]
        batch, profile, facts = run_batch(shards, regime, req, flags, log, phase)
    if profile is None:
        profile, facts = _profile_and_facts(shards, manifest)
    from .accounting import finish_rows

    finish_rows(rows, profile, facts)
    load["after"], load["cores"] = load_average(), profile.cpu_cores
    return {
        "hardware": hardware_line(profile),
        "profile": {
            "fingerprint": profile.fingerprint,
            "summary": hardware_line(profile),
            "compute_device": profile.compute_device,
            "tiers": profile.tier_meaning(),
        },
        "model": {
            "name": req.synthetic or Path(req.model).name,
            "total_bytes": manifest.total_bytes,
            "dtype": manifest.dtype,
            "num_layers": len(manifest.layers),
            "synthetic": req.synthetic,
        },
        "tokens": req.tokens,
        "prompt_tokens": req.prompt_tokens,
        "warmup": WARMUP,
        "load": load,
        "residency": residency,
        "rows": rows,
        "batch": batch,
    }


def run_batch(
    shards: Path, regime: str, req: BenchRequest, flags: dict, log, phase=no_progress
) -> tuple[dict, object, object]:
    """Throughput vs batch size N in one regime: each step of a batch of N is one streaming pass."""
    from ..auto import AutoModel
    from .timing import ms_summary, percentile, timed_batch

    streamed = AutoModel.from_pretrained(
        shards, flags=flags, log=log, **regime_overrides(regime, Manifest.load(shards))
    )
    rows = []
    try:
        base = fixed_prompt(streamed.tokenizer, req.prompt_tokens + max(req.batch))
        for n in req.batch:
            log(f"batch {n}: measuring ({regime} regime)")
            prompts = [base[i : i + req.prompt_tokens] for i in range(n)]  # distinct prompts of equal length
            with phase(f"batch {n}: RocketLLM", announce=False):
                stats = timed_batch(streamed, prompts, req.tokens)  # every sequence runs the full count: no early EOS
            median = 1000 * percentile(sorted(stats.gaps_s), 50)
            rows.append(
                {
                    "batch": n,
                    "ms_per_step": ms_summary(stats.gaps_s),
                    "tokens_per_s": round(1000 * n / median, 3),
                    "storage_witnessed_per_step": stats.storage_witnessed_per_token,
                }
            )
        one = next((r for r in rows if r["batch"] == 1), rows[0])
        for r in rows:
            r["speedup_vs_1"] = round(r["tokens_per_s"] / one["tokens_per_s"], 2)
        doc = {
            "regime": regime,
            "read_method": read_method(streamed.knobs),
            "rows": rows,
            "speedup_base": one["batch"],
            "residency": streamed.plan.to_dict(),
        }
        return doc, streamed.profile, streamed.facts
    finally:
        streamed.close()
        del streamed
        gc.collect()


def _profile_and_facts(shards: Path, manifest):
    from transformers import AutoConfig

    from ..checkpoint.modelfacts import facts_from_manifest
    from ..profiles import HardwareProfile

    return HardwareProfile.load(storage_path=shards), facts_from_manifest(manifest, AutoConfig.from_pretrained(shards))


def _ram_available() -> int:
    from ..profiles.probe.machine import memory

    return memory()[1]


def _torch_dtype(name: str | None):
    from ..dtypes import torch_dtype

    return torch_dtype(name or "fp32")
