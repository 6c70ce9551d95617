"""rocketllm generate: one prompt in, generated text out (stdout carries only the text)."""

from __future__ import annotations

import time
from typing import Annotated, Optional

import typer

from ..errors import RocketError
from ..oneshot.elsewhere import (
    DEFAULT_KEEP_ALIVE,
    cold_reason,
    keep_alive_seconds,
    no_run_dir,
    no_server_extra,
    through_server,
    warm,
)
from ..oneshot.inputs import argument_text, read_images, read_prompt, with_images
from ..options import (
    JsonOpt,
    api_key_option,
    ModelArg,
    ModelOpt,
    pick_model,
    validate_knob_flags,
    with_knob_options,
)
from ..output import Output
from ..replies import DEFAULT_REPLY_TOKENS
from ..text.sampling import SamplingParams
from ..text.statslines import format_stats

NAME = "generate"
NO_ARGS_IS_HELP = True
HELP = """Generate text from PROMPT (or stdin) with MODEL streamed layer by layer.

Shards MODEL on first use and reuses the shards afterwards. Only the generated text goes
to stdout, so it composes in pipelines; --stats reports speed and bytes per tier on stderr.
In --json and --stats, load_s is finding or writing the shards plus loading them, and total_s is generation alone.
A prompt byte that is not valid UTF-8 (the locale's encoding) becomes U+FFFD, with a warning saying where.
With --server URL (or ROCKETLLM_SERVER) the prompt goes to a running `rocketllm serve` and nothing is loaded here:
a lone argument is then the PROMPT unless it is the served model's id or an existing path; MODEL, when given,
must be what that server serves.

With --image PATH (repeatable) a vision-language model sees the pictures before the prompt, through its own processor
and chat template (PNG, JPEG, WebP, GIF or BMP; needs Pillow: pip install -e '.[vision]' in the rocketllm source
directory).

Example: echo "The capital of France is" | rocketllm generate ./SmolLM2.gguf --raw --max-new-tokens 8
Example: rocketllm generate ./SmolLM2.gguf "Name a city and its country" --json-schema city.json
Example: rocketllm generate ./Qwen2.5-VL-3B "What is in this picture?" --image photo.jpg
"""


@with_knob_options
def run(
    model: ModelArg = None,
    prompt: Annotated[
        Optional[str], typer.Argument(help="The prompt; read from stdin when absent or '-'.", show_default=False)
    ] = None,
    model_option: ModelOpt = None,
    max_new_tokens: Annotated[
        int, typer.Option("--max-new-tokens", "-n", help="Tokens to generate at most.")
    ] = DEFAULT_REPLY_TOKENS,
    temperature: Annotated[float, typer.Option("--temperature", help="0 = greedy.")] = SamplingParams.temperature,
    top_p: Annotated[float, typer.Option("--top-p", help="Nucleus sampling mass.")] = SamplingParams.top_p,
    top_k: Annotated[
        int, typer.Option("--top-k", help="Sample among the k most likely (0 = off).")
    ] = SamplingParams.top_k,
    seed: Annotated[Optional[int], typer.Option("--seed", help="Random seed for sampling.")] = None,
    chat: Annotated[
        Optional[bool],
        typer.Option(
            "--chat/--raw", help="Apply the chat template (default when the tokenizer has one).", show_default=False
        ),
    ] = None,
    system: Annotated[Optional[str], typer.Option("--system", help="System message.")] = None,
    stats: Annotated[
        bool, typer.Option("--stats", help="Print speed, bytes per tier, peak RSS and the residency plan to stderr.")
    ] = False,
    batch: Annotated[
        bool,
        typer.Option(
            "--batch",
            help="One prompt per stdin line, generated as one batch; one output "
            "line per prompt, in order (newlines in outputs written as \\n).",
        ),
    ] = False,
    image: Annotated[
        Optional[list[str]],
        typer.Option(
            "--image",
            metavar="PATH",
            help="A picture for a vision-language model to see before the prompt (repeatable).",
            show_default=False,
        ),
    ] = None,
    server: Annotated[
        Optional[str],
        typer.Option(
            "--server",
            envvar="ROCKETLLM_SERVER",
            metavar="URL",
            help="Send the prompt to the rocketllm serve at URL instead of loading MODEL here: no start-up cost.",
            show_default=False,
        ),
    ] = None,
    keep_alive: Annotated[
        Optional[str],
        typer.Option(
            "--keep-alive",
            envvar="ROCKETLLM_KEEP_ALIVE",
            show_envvar=True,
            metavar="DURATION",
            help=f"Keep the model loaded in a background server this long after each request (30s, 5m, 1h), so the "
            f"next generate of it answers at once; 0 loads, answers and exits. Default {DEFAULT_KEEP_ALIVE}.",
            show_default=False,
        ),
    ] = None,
    api_key: Annotated[Optional[str], api_key_option("With --server: the server's key (serve --api-key)")] = None,
    logprobs: Annotated[
        Optional[int],
        typer.Option(
            "--logprobs",
            metavar="K",
            min=0,
            max=20,
            help="With --json: each generated token's log-probability and the K most likely at its step (the model's "
            "distribution before sampling settings).",
            show_default=False,
        ),
    ] = None,
    json_schema: Annotated[
        Optional[str],
        typer.Option(
            "--json-schema",
            metavar="SCHEMA",
            help="The output is JSON valid against SCHEMA: inline JSON or a file holding it (constrained decoding).",
            show_default=False,
        ),
    ] = None,
    grammar: Annotated[
        Optional[str],
        typer.Option(
            "--grammar",
            metavar="FILE",
            help="The output follows the Lark "
            "grammar in FILE (llguidance's syntax, a 'start:' rule; constrained decoding).",
            show_default=False,
        ),
    ] = None,
    json: JsonOpt = False,
    knob_flags: dict | None = None,
) -> None:
    output = Output(as_json=json)
    from ..distributed.torchrun import launched

    launch = launched()  # under torchrun: rank 0 generates, the other ranks run their layers for it
    if launch is not None and not launch.is_first:
        from ..auto import run_later_stage

        validate_knob_flags(knob_flags or {})
        return run_later_stage(
            pick_model(model if model_option is None or prompt is not None else None, model_option), knob_flags
        )
    if logprobs is not None and not json:
        raise RocketError("--logprobs goes in the --json document; add --json")
    if logprobs is not None and server:
        raise RocketError(
            "--logprobs reads this process's own scores; drop --server (or ask the server's API for logprobs)"
        )
    from ..text.constraints import from_flags

    # a schema that is not JSON, or a missing file, is refused before anything loads
    constraint = from_flags(json_schema, grammar)
    if image and (server or batch):
        raise RocketError(f"--image goes with one prompt generated here; drop {'--server' if server else '--batch'}")
    if image and chat is False:
        raise RocketError("--image needs the chat template, which places each picture in the prompt; drop --raw")
    if server:
        return through_server(
            server,
            model,
            prompt,
            model_option,
            SamplingParams(max_new_tokens, temperature, top_p, top_k, seed),
            chat,
            system,
            stats,
            batch,
            json,
            knob_flags or {},
            output,
            constraint,
            api_key,
        )
    if model_option is not None and prompt is None:  # `generate --model M PROMPT`: the one word is the prompt
        model, prompt = None, model
    model = pick_model(model, model_option)
    params = SamplingParams(max_new_tokens, temperature, top_p, top_k, seed)
    validate_knob_flags(knob_flags or {})
    if batch and prompt not in (None, "-"):
        raise RocketError("--batch reads one prompt per line from stdin; do not pass PROMPT as well")
    text = read_prompt(prompt, output)
    system = None if system is None else argument_text(system, "--system", output)
    prompts = [line for line in text.splitlines() if line.strip()] if batch else [text]
    # a bad picture, or pictures for a text-only model, refused before loading
    pictures = read_images(image or [], model)
    keep_s = keep_alive_seconds(keep_alive)
    if launch is not None:
        keep_s = 0  # the stages are this launch's processes: they end with it
        from ..distributed.opening import join

        join(launch, knob_flags)  # every rank joins now; rank 0 loads after
    if keep_s > 0:
        cold = cold_reason(batch, bool(pictures), logprobs, constraint, chat)
        if cold is None:
            from ..shard.source import check_locatable

            check_locatable(model)  # a mistyped path is one line here, not a server that fails to start
            cold = no_run_dir() or no_server_extra()
        if cold is None:
            return warm(model, text, params, chat, system, stats, json, knob_flags or {}, output, constraint, keep_s)
        output.log(f"note: {cold}, so the model loads in this process (no warm server)")

    # cheap: from_pretrained checks MODEL before torch and transformers are imported
    from ..auto import AutoModel

    started = time.perf_counter()
    from ..stream.context import run_tokens
    from ..text.promptids import encode_prompt

    encoded = []

    def counted(tokenizer):  # the prompts' ids, kept: the model keeps this tokenizer
        encoded.extend(encode_prompt(tokenizer, p, chat, system)[0].tolist() for p in prompts)
        return run_tokens([len(one) for one in encoded], params.max_new_tokens)

    # no server kept: the KV cache holds this run's tokens, the rest of the memory goes to the weights
    sized = None if pictures else counted

    streamed = AutoModel.from_pretrained(
        model, flags=knob_flags, progress=output.progress, log=output.log, run_tokens=sized
    )
    load_s = round(time.perf_counter() - started, 3)  # sharding or finding the shards, plus loading
    try:
        from ..stream.context import check_context, context_reason, int4_context
        from ..text.loop import GenerationRequest, Generator

        inputs = None
        if pictures:
            ids, inputs = with_images(streamed, model, text, system, pictures)
        else:
            ids = encoded or [encode_prompt(streamed.tokenizer, p, chat, system)[0].tolist() for p in prompts]
        limit = (
            int(streamed.knobs.value("max_context")),
            context_reason(streamed.knobs),
            int4_context(streamed.knobs, streamed.config),
        )
        for one in ids:  # before any forward pass: a context the memory cannot hold is refused with the numbers
            check_context(len(one), params.max_new_tokens, *limit)
        on_text = None if json or batch else output.stream
        generator = Generator(streamed)
        if constraint is not None:
            generator.grammars.compile(constraint)  # a schema the engine cannot use: one line, before any forward pass
        asked = streamed.knobs["speculate"]
        if asked.overridden and asked.value in ("prompt-lookup", "draft") and not generator.speculation.on:
            output.log(f"note: speculative decoding {generator.speculation.reason}")
        results = generator.run_batch(
            [
                GenerationRequest(
                    one, params, on_text=on_text, model_inputs=inputs, constraint=constraint, logprobs=logprobs
                )
                for one in ids
            ]
        )
        figures = {
            **results[0].stats.to_dict(),
            "residency": streamed.residency_text(),
            "device": str(streamed.device),
            "compute_dtype": str(streamed.dtype).replace("torch.", ""),
            **({"batch": len(results)} if batch else {}),
            "load_s": load_s,  # total_s stays generation alone
            **({"stages": streamed.stage.figures()} if streamed.stage is not None else {}),
        }
    finally:
        streamed.close()
    if batch:
        if json:
            output.json({"model": model, "results": [_result(r) for r in results], "stats": figures})
        else:
            for r in results:
                output.stream(r.text.replace("\\", "\\\\").replace("\n", "\\n") + "\n")
        if stats:
            output.log(format_stats(figures, sum(r.prompt_tokens for r in results), sum(r.new_tokens for r in results)))
        return
    result = results[0]
    if json:
        output.json({**_result(result), "stats": figures, "model": model})
        return
    output.stream("\n")
    if stats:
        output.log(format_stats(figures, result.prompt_tokens, result.new_tokens))


def _result(outcome) -> dict:
    doc = {"text": outcome.text, "prompt_tokens": outcome.prompt_tokens, "new_tokens": outcome.new_tokens}
    if outcome.logprobs is not None:
        doc["logprobs"] = [
            {"token": e.token, "logprob": round(e.logprob, 6), "top": [[t, round(lp, 6)] for t, lp in e.top]}
            for e in outcome.logprobs
        ]
    return doc
