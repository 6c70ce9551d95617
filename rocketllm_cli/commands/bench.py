"""rocketllm bench: per regime, measured ms/token next to the cost model's projection and the physical limit, baselines
beside."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from ..bench.defaults import (
    BATCH_REGIME,
    CONVERSATION_REGIME,
    DECODE_TOKENS,
    GRAMMAR_TOKENS,
    PERPLEXITY_REGIME,
    PERPLEXITY_WINDOW,
    PROMPT_TOKENS,
    REPLY_TOKENS,
)
from ..options import (
    JsonOpt,
    ModelOpt,
    pick_model,
    validate_knob_flags,
    with_knob_options,
)
from ..output import Output

NAME = "bench"
NO_ARGS_IS_HELP = True
HELP = """Benchmark MODEL (or a --synthetic one) in the resident, host and storage regimes (and expert-cache for a MoE
model).

Prints a one-line hardware profile and a Markdown table (paste it into docs/HARDWARE.md): ms/token
median and spread, time to first token, bytes per token per tier, storage bytes witnessed by
/proc/self/io, the cost model's projection, the physical limit and efficiency = limit / measured.

Examples:
  rocketllm bench ./SmolLM2.gguf --regime all --baseline transformers accelerate naive airllm
  rocketllm bench --synthetic llama:1B --tokens 4
  rocketllm bench ./big.gguf --regime auto --baseline llamacpp --speculate off
  rocketllm bench ./SmolLM2.gguf --batch 1 4 8
  rocketllm bench ./SmolLM2.gguf --conversation 3
  rocketllm bench ./SmolLM2.gguf --json-schema benchmarks/schemas/cities.json
  rocketllm bench ./SmolLM2-Q4.gguf --perplexity tests/fixtures/perplexity.txt --reference ./SmolLM2-bf16
  rocketllm bench --kernels
"""

RegimeOpt = Annotated[
    Optional[list[str]],
    typer.Option(
        "--regime",
        help=f"resident, host, storage, auto (the residency this machine derives, as generate runs: a model larger "
        f"than memory), expert-cache (MoE models) or all (repeatable; all is every one but auto). [default: all that "
        f"apply; {BATCH_REGIME} with --batch]",
        show_default=False,
    ),
]
BaselineOpt = Annotated[
    Optional[list[str]],
    typer.Option(
        "--baseline",
        help="transformers, accelerate, naive, airllm, llamacpp (a GGUF MODEL, llama-cpp-python installed) or all "
        "(repeatable; several names after one flag work too).",
        show_default=False,
    ),
]
ConversationOpt = Annotated[
    Optional[int],
    typer.Option(
        "--conversation",
        help=f"Replay an N-turn chat with prefix reuse off and on and print each turn's prefill time "
        f"({CONVERSATION_REGIME} regime unless --regime; replies of --tokens, default {REPLY_TOKENS}).",
        show_default=False,
    ),
]
PerplexityOpt = Annotated[
    Optional[str],
    typer.Option(
        "--perplexity",
        metavar="FILE",
        help=f"Teacher-forced perplexity of MODEL on the UTF-8 text FILE (tests/fixtures/perplexity.txt is a 4.7 KB "
        f"one): windows of --window tokens, one streaming pass each ({PERPLEXITY_REGIME} regime unless --regime).",
        show_default=False,
    ),
]
ReferenceOpt = Annotated[
    Optional[str],
    typer.Option(
        "--reference",
        metavar="REF",
        help="With --perplexity: score REF (same tokenizer) too, and print both perplexities, their difference in %, "
        "top-1 agreement and the KL divergence KL(REF || MODEL) per scored token (mean, p99, max; nats). REF runs "
        "the exact kernels whatever --kernel says: REF = MODEL with --kernel int8 measures what int8 costs.",
        show_default=False,
    ),
]
WindowOpt = Annotated[
    Optional[int],
    typer.Option(
        "--window",
        help=f"With --perplexity: tokens per pass. [default: {PERPLEXITY_WINDOW}, or the model's context if shorter]",
        show_default=False,
    ),
]
StrideOpt = Annotated[
    Optional[int],
    typer.Option(
        "--stride",
        help="With --perplexity: tokens between window starts; each token is scored once. [default: half the window]",
        show_default=False,
    ),
]
BatchOpt = Annotated[
    Optional[list[int]],
    typer.Option(
        "--batch", help="Batch sizes to sweep (e.g. --batch 1 4 8): throughput vs N in one regime.", show_default=False
    ),
]
SchemaOpt = Annotated[
    Optional[str],
    typer.Option(
        "--json-schema",
        metavar="SCHEMA",
        help=f"What constrained decoding costs: ms/token of replies constrained by SCHEMA (inline JSON or a file) "
        f"beside free replies of as many tokens, per regime (resident and storage unless --regime; --tokens default "
        f"{GRAMMAR_TOKENS}).",
        show_default=False,
    ),
]


@with_knob_options
def run(
    model: Annotated[
        Optional[list[str]],
        typer.Argument(
            help="Model directory, .gguf file, hub id or shard directory.", show_default=False, metavar="[MODEL]"
        ),
    ] = None,
    model_option: ModelOpt = None,
    synthetic: Annotated[
        Optional[str],
        typer.Option(
            "--synthetic",
            help="Bench a random-weight model ARCH:SIZE (e.g. llama:1B), written once into the cache.",
            show_default=False,
        ),
    ] = None,
    regime: RegimeOpt = None,
    tokens: Annotated[
        Optional[int],
        typer.Option(
            "--tokens",
            help=f"Decode tokens measured (after one warm-up token). [default: {DECODE_TOKENS}]",
            show_default=False,
        ),
    ] = None,
    prompt_tokens: Annotated[
        int, typer.Option("--prompt-tokens", help="Length of the fixed prompt in tokens.")
    ] = PROMPT_TOKENS,
    baseline: BaselineOpt = None,
    batch: BatchOpt = None,
    conversation: ConversationOpt = None,
    perplexity: PerplexityOpt = None,
    reference: ReferenceOpt = None,
    window: WindowOpt = None,
    stride: StrideOpt = None,
    json_schema: SchemaOpt = None,
    kernels: Annotated[
        bool,
        typer.Option(
            "--kernels",
            help="No model: the native kernels' GB/s per GGUF block type, "
            "exact and int8, their error against fp64, and the torch decoder's rate.",
        ),
    ] = False,
    json: JsonOpt = False,
    knob_flags: dict | None = None,
) -> None:
    from ..bench import BASELINES, BenchRequest, render, run_bench

    output = Output(as_json=json)
    validate_knob_flags(knob_flags or {})
    if kernels:
        _kernels(model or [], model_option, synthetic, output)
        return
    model, regime, baseline, batch = _spread(model or [], regime or [], baseline or [], batch or [])
    model = pick_model(model, model_option, required=False)  # no MODEL: --synthetic names one
    from ..distributed.torchrun import launched

    launch = launched()  # under torchrun: rank 0 benches the pipeline, the other ranks run their layers for each load
    if launch is not None:
        if synthetic is not None or model is None:
            from ..errors import UsageError

            raise UsageError(
                "under torchrun, bench a MODEL path every rank can read (write a --synthetic model once "
                "without torchrun)"
            )
        if not launch.is_first:
            from ..auto import run_later_stage

            return run_later_stage(model, knob_flags)
        from ..distributed.opening import join

        join(launch, knob_flags)  # every rank joins now; rank 0 loads after
    if perplexity is not None:
        _perplexity(
            model,
            synthetic,
            perplexity,
            reference,
            window,
            stride,
            regime,
            baseline,
            batch,
            conversation,
            knob_flags or {},
            output,
        )
        return
    if reference is not None or window is not None or stride is not None:
        from ..errors import UsageError

        raise UsageError("--reference, --window and --stride go with --perplexity FILE")
    if conversation is not None:
        _conversation(model, synthetic, conversation, tokens, regime, baseline, batch, knob_flags or {}, output)
        return
    if json_schema is not None:
        _grammar(model, synthetic, json_schema, tokens, regime, baseline, batch, knob_flags or {}, output)
        return
    tokens = DECODE_TOKENS if tokens is None else tokens
    regimes = () if "all" in regime else tuple(dict.fromkeys(regime))  # () = every regime that applies to the model
    baselines = tuple(BASELINES if b == "all" else (b,) for b in baseline)
    req = BenchRequest(
        model,
        synthetic,
        regimes,
        tokens,
        prompt_tokens,
        tuple(dict.fromkeys(b for group in baselines for b in group)),
        tuple(batch or ()),
        knob_flags or {},
    )
    doc = run_bench(req, output.log, output.progress)
    if json:
        output.json(doc)
    else:
        output.result(render(doc))


def _spread(words: list[str], regime: list[str], baseline: list[str], batch: list[int]):
    """`--baseline a b c` and `--batch 1 4 8`: the parser gives the flag its first value and the rest as
    positional words; hand each word back to the flag it can belong to. What is left is MODEL."""
    from ..bench import BASELINES, REGIMES
    from ..errors import UsageError

    rest = []
    for word in words:
        if baseline and word in (*BASELINES, "all"):
            baseline.append(word)
        elif regime and word in (*REGIMES, "all"):
            regime.append(word)
        elif batch and word.isdigit():
            batch.append(int(word))
        else:
            rest.append(word)
    if len(rest) > 1:
        raise UsageError(f"one MODEL only (got {', '.join(rest)})")
    return (rest[0] if rest else None), regime, baseline, batch


def _conversation(model, synthetic, turns, tokens, regime, baseline, batch, knob_flags, output) -> None:
    from ..bench.conversation import (
        ConversationRequest,
        render_conversation,
        run_conversation,
    )

    regimes = _alone("--conversation", regime, baseline, batch)
    req = ConversationRequest(model, synthetic, turns, REPLY_TOKENS if tokens is None else tokens, regimes, knob_flags)
    # a status line beside the bench's own log lines
    with output.progress(f"conversation: {turns} turns", announce=False):
        doc = run_conversation(req, output.log)
    if output.as_json:
        output.json(doc)
    else:
        output.result(render_conversation(doc))


def _alone(mode: str, regime: list[str], baseline: list, batch: list) -> tuple[str, ...]:
    """The regimes a mode that measures RocketLLM alone runs (--regime all: every one), refusing baselines and
    batches."""
    from ..bench import REGIMES
    from ..errors import UsageError

    if baseline or batch:
        raise UsageError(f"{mode} measures RocketLLM alone: drop --baseline and --batch")
    regimes = tuple(dict.fromkeys(r for name in regime for r in (REGIMES if name == "all" else (name,))))
    for name in regimes:
        if name not in REGIMES:
            raise UsageError(f"bad --regime {name!r}: expected {', '.join(REGIMES)} or all")
    return regimes


def _grammar(model, synthetic, schema, tokens, regime, baseline, batch, knob_flags, output) -> None:
    from ..bench.grammar import GrammarRequest, render_grammar, run_grammar
    from ..text.constraints import json_schema_of

    regimes = _alone("--json-schema", regime, baseline, batch)
    req = GrammarRequest(
        model, synthetic, json_schema_of(schema), GRAMMAR_TOKENS if tokens is None else tokens, regimes, knob_flags
    )
    with output.progress("constrained and free replies", announce=False):
        doc = run_grammar(req, output.log)
    if output.as_json:
        output.json(doc)
    else:
        output.result(render_grammar(doc))


def _perplexity(
    model, synthetic, text_file, reference, window, stride, regime, baseline, batch, conversation, knob_flags, output
) -> None:
    from ..bench.perplexity import (
        PerplexityRequest,
        read_text,
        render_perplexity,
        run_perplexity,
    )
    from ..errors import UsageError

    if baseline or batch or conversation is not None:
        raise UsageError("--perplexity scores RocketLLM (and --reference): drop --baseline, --batch and --conversation")
    if len(regime) > 1 or "all" in regime:
        raise UsageError("--perplexity runs one regime: pass --regime resident, host or storage")
    req = PerplexityRequest(
        model, text_file, reference, window, stride, regime[0] if regime else PERPLEXITY_REGIME, synthetic, knob_flags
    )
    read_text(text_file)  # a bad FILE is refused before any model is sharded or loaded
    if reference is not None:
        from ..errors import ModelError
        from ..shard.source import check_locatable

        try:
            check_locatable(reference)
        except ModelError as exc:
            raise ModelError(f"--reference: {exc}") from None
    doc = run_perplexity(req, output.log, output.progress)
    if output.as_json:
        output.json(doc)
    else:
        output.result(render_perplexity(doc))


def _kernels(model, model_option, synthetic, output) -> None:
    from ..bench.kernels import render_kernels, run_kernels
    from ..errors import UsageError

    if model or model_option or synthetic:
        raise UsageError("--kernels measures the kernels alone: drop MODEL and --synthetic")
    with output.progress("timing the native kernels", announce=False):
        doc = run_kernels(output.log)
    if output.as_json:
        output.json(doc)
    else:
        output.result(render_kernels(doc))
