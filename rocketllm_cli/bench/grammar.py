"""`bench --json-schema SCHEMA`: what constrained decoding costs per token, per regime, in the same run.

Each regime times the same prompt twice over, alternating REPEATS times: a greedy reply constrained by SCHEMA, and a
free reply of exactly as many tokens (end-of-sequence held off), so both decode the same count on the same weights.
The overhead is the constrained median ms/token over the free one, minus one; the mask's own cost on the generating
thread (what the grammar thread could not hide behind the forward pass) is reported beside it. Speculative decoding is
off in both: a speculative pass makes several tokens and would blur the per-token figure.
"""

from __future__ import annotations

import gc
import statistics
from dataclasses import dataclass, field

from ..errors import UsageError
from .defaults import GRAMMAR_TOKENS
from .timing import WARMUP

GRAMMAR_PROMPT = (
    "List the largest cities of Europe with their country, population and a one-line note on each, as JSON."
)
REPEATS = 3  # constrained and free runs per regime, interleaved; medians are reported


@dataclass
class GrammarRequest:
    model: str | None
    synthetic: str | None
    schema: dict
    tokens: int = GRAMMAR_TOKENS
    regimes: tuple[str, ...] = ()
    knob_flags: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if (self.model is None) == (self.synthetic is None):
            raise UsageError("give MODEL or --synthetic ARCH:SIZE (one of them)")
        if self.tokens < 4:
            raise UsageError(f"--tokens must be at least 4 with --json-schema (got {self.tokens})")
        self.regimes = tuple(self.regimes) or ("resident", "storage")


def run_grammar(req: GrammarRequest, log) -> dict:
    from .frame import over_regimes

    def measure(shards, regime: str, flags: dict):
        log(f"{regime}: {REPEATS} constrained and {REPEATS} free replies, interleaved")
        return _measure(shards, regime, req, flags, log)

    doc = over_regimes(
        req.model, req.synthetic, req.regimes, req.knob_flags, ("speculate",), "--json-schema", measure, log
    )
    return {**doc, "tokens": req.tokens, "repeats": REPEATS}


def _measure(shards, regime: str, req: GrammarRequest, flags: dict, log) -> tuple[dict, object]:
    from ..auto import AutoModel
    from ..checkpoint.manifest import Manifest
    from ..text.constraints import Constraint
    from ..text.loop import GenerationRequest, Generator
    from ..text.promptids import encode_prompt
    from ..text.sampling import SamplingParams
    from ..text.stats import measure
    from .regimes import regime_overrides

    model = AutoModel.from_pretrained(shards, flags=flags, log=log, **regime_overrides(regime, Manifest.load(shards)))
    try:
        generator = Generator(model, speculate="off")
        constraint = Constraint.json_schema(req.schema)
        generator.grammars.compile(constraint)
        ids = encode_prompt(model.tokenizer, GRAMMAR_PROMPT, None, None)[0].tolist()
        generator.run(GenerationRequest(ids, SamplingParams(max_new_tokens=2)))  # warm-up: one-off costs are no side's
        budget = 1 + WARMUP + req.tokens
        constrained_ms, free_ms, blocking, made = [], [], [], []
        for _ in range(REPEATS):
            bound = generator.run(GenerationRequest(ids, SamplingParams(max_new_tokens=budget), constraint=constraint))
            count = bound.new_tokens
            if count < 2 + WARMUP:
                raise UsageError(
                    f"the constrained reply ended after {count} tokens: give a schema whose replies run longer"
                )
            free = generator.run(GenerationRequest(ids, SamplingParams(max_new_tokens=count, min_new_tokens=count)))
            constrained_ms.append(measure(bound.record, WARMUP).per_token_ms)
            free_ms.append(measure(free.record, WARMUP).per_token_ms)
            blocking.append(bound.stats.grammar["blocking_ms_per_mask"])
            made.append(count)
        run = {
            "regime": regime,
            "status": "measured",
            "residency": model.plan.describe(model.manifest),
            "compute_dtype": str(model.dtype).removeprefix("torch."),
            "tokens": made,
            "constrained_ms": _median(constrained_ms),
            "free_ms": _median(free_ms),
            "blocking_ms_per_mask": _median(blocking),
            "samples": {"constrained_ms": constrained_ms, "free_ms": free_ms},
        }
        run["overhead"] = round(run["constrained_ms"] / run["free_ms"] - 1, 4) if run["free_ms"] else None
        log(
            f"{regime}: {run['constrained_ms']} ms/token constrained, {run['free_ms']} free "
            f"({100 * run['overhead']:+.1f}%)"
        )
        return run, model.profile
    finally:
        model.close()
        del model
        gc.collect()


def _median(values: list[float]) -> float:
    return round(statistics.median(values), 3)


COLUMNS = ("regime", "tokens", "ms/token free", "ms/token with the schema", "overhead", "mask wait ms/token")


def render_grammar(doc: dict) -> str:
    from .report import load_note, table_head

    model = doc["model"]
    lines = [
        f"**Hardware:** {doc['hardware']}",
        "",
        f"**Model:** {model['name']} ({model['dtype']}, {model['num_layers']} layers); greedy, speculation off; median "
        f"of {doc['repeats']} interleaved runs each way, {WARMUP} warm-up token left out; {load_note(doc['load'])}",
        "",
        *table_head(COLUMNS),
    ]
    for run in doc["runs"]:
        if run["status"] != "measured":
            lines.append(f"| {run['regime']} | skipped: {run['reason']} | | | | |")
            continue
        lines.append(
            f"| {run['regime']} | {', '.join(map(str, run['tokens']))} | {run['free_ms']:.2f} | "
            f"{run['constrained_ms']:.2f} | {100 * run['overhead']:+.1f}% | {run['blocking_ms_per_mask']:.3f} |"
        )
    lines += [""] + [
        f"- {run['regime']}: computing in {run['compute_dtype']}; {run['residency']}"
        for run in doc["runs"]
        if run["status"] == "measured"
    ]
    return "\n".join(lines)
