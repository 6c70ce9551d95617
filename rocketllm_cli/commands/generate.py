"""rocketllm generate: one prompt in, generated text out (stdout carries only the text)."""

from __future__ import annotations

import os
import sys
import time
from typing import Annotated, Optional

import typer

from ..errors import RocketError
from ..options import (
    JsonOpt,
    ModelArg,
    ModelOpt,
    pick_model,
    validate_knob_flags,
    with_knob_options,
)
from ..output import Output
from ..text.sampling import DEFAULT_MAX_NEW_TOKENS, SamplingParams

NAME = "generate"
NO_ARGS_IS_HELP = True
HELP = """Generate text from PROMPT (or stdin) with MODEL streamed layer by layer.

Shards MODEL on first use and reuses the shards afterwards. Only the generated text goes
to stdout, so it composes in pipelines; --stats reports speed and bytes per tier on stderr.
In --json and --stats, load_s is finding or writing the shards plus loading them, and total_s is generation alone.
A prompt byte that is not valid UTF-8 (the locale's encoding) becomes U+FFFD, with a warning saying where.

Example: echo "The capital of France is" | rocketllm generate ./SmolLM2.gguf --raw --max-new-tokens 8
"""


@with_knob_options
def run(
    model: ModelArg = None,
    prompt: Annotated[Optional[str], typer.Argument(help="The prompt; read from stdin when absent or '-'.", show_default=False)] = None,
    model_option: ModelOpt = None,
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens", "-n", help="Tokens to generate at most.")] = DEFAULT_MAX_NEW_TOKENS,
    temperature: Annotated[float, typer.Option("--temperature", help="0 = greedy.")] = SamplingParams.temperature,
    top_p: Annotated[float, typer.Option("--top-p", help="Nucleus sampling mass.")] = SamplingParams.top_p,
    top_k: Annotated[int, typer.Option("--top-k", help="Sample among the k most likely (0 = off).")] = SamplingParams.top_k,
    seed: Annotated[Optional[int], typer.Option("--seed", help="Random seed for sampling.")] = None,
    chat: Annotated[Optional[bool], typer.Option("--chat/--raw", help="Apply the chat template (default when the tokenizer has one).", show_default=False)] = None,
    system: Annotated[Optional[str], typer.Option("--system", help="System message.")] = None,
    stats: Annotated[bool, typer.Option("--stats", help="Print speed, bytes per tier, peak RSS and the residency plan to stderr.")] = False,
    batch: Annotated[bool, typer.Option("--batch", help="One prompt per stdin line, generated as one batch; one output line per prompt, in order (newlines in outputs written as \\n).")] = False,
    json: JsonOpt = False,
    knob_flags: dict | None = None,
) -> None:
    output = Output(as_json=json)
    if model_option is not None and prompt is None:  # `generate --model M PROMPT`: the one word is the prompt
        model, prompt = None, model
    model = pick_model(model, model_option)
    params = SamplingParams(max_new_tokens, temperature, top_p, top_k, seed)
    validate_knob_flags(knob_flags or {})
    if batch and prompt not in (None, "-"):
        raise RocketError("--batch reads one prompt per line from stdin; do not pass PROMPT as well")
    text = _read_prompt(prompt, output)
    system = None if system is None else _argument_text(system, "--system", output)
    prompts = [line for line in text.splitlines() if line.strip()] if batch else [text]

    # cheap: from_pretrained checks MODEL before torch and transformers are imported
    from ..stream.auto import AutoModel

    started = time.perf_counter()
    streamed = AutoModel.from_pretrained(model, flags=knob_flags, progress=output.progress, log=output.log)
    load_s = round(time.perf_counter() - started, 3)  # sharding or finding the shards, plus loading
    try:
        from ..text.loop import GenerationRequest, Generator
        from ..text.prompts import check_context, context_reason, encode_prompt

        ids = [encode_prompt(streamed.tokenizer, p, chat, system)[0].tolist() for p in prompts]
        for one in ids:  # before any forward pass: a context the memory cannot hold is refused with the numbers
            check_context(len(one), params.max_new_tokens, int(streamed.knobs.value("max_context")), context_reason(streamed.knobs))
        on_text = None if json or batch else output.stream
        results = Generator(streamed).run_batch([GenerationRequest(one, params, on_text=on_text) for one in ids])
        figures = {**results[0].stats.to_dict(), "residency": streamed.plan.describe(streamed.manifest), "device": str(streamed.device),
                 "compute_dtype": str(streamed.dtype).replace("torch.", ""), **({"batch": len(results)} if batch else {}),
                 "load_s": load_s}  # total_s stays generation alone
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
    return {"text": outcome.text, "prompt_tokens": outcome.prompt_tokens, "new_tokens": outcome.new_tokens}


def _read_prompt(prompt: Optional[str], output: Output) -> str:
    if prompt is None or prompt == "-":
        if sys.stdin is None or sys.stdin.isatty():
            raise RocketError("no prompt: pass PROMPT or pipe it on stdin")
        stream = getattr(sys.stdin, "buffer", None)
        prompt = _decode(stream.read(), sys.stdin.encoding, "stdin", output) if stream is not None else sys.stdin.read()
    else:
        prompt = _argument_text(prompt, "PROMPT", output)
    if not prompt.strip():
        raise RocketError("empty prompt: pass PROMPT or pipe non-empty text on stdin")
    return prompt.rstrip("\n")


def _argument_text(value: str, where: str, output: Output) -> str:
    """An argument as text: bytes the locale could not decode arrive as surrogate escapes; os.fsencode gives them back."""
    try:
        value.encode("utf-8")
        return value
    except UnicodeEncodeError:
        return _decode(os.fsencode(value), sys.getfilesystemencoding(), where, output)


def _decode(raw: bytes, encoding: str | None, where: str, output: Output) -> str:
    """The one policy for prompt bytes (docs/ERRORS.md): the locale's encoding (UTF-8 nearly everywhere); a byte
    it cannot decode becomes U+FFFD, with one warning, never an error."""
    import codecs

    encoding = codecs.lookup(encoding or "utf-8").name
    try:
        return raw.decode(encoding)
    except UnicodeDecodeError as exc:
        output.warn(f"{where} is not valid {encoding.upper()} (first bad byte at offset {exc.start}); "
                    "undecodable bytes were replaced with U+FFFD")
        return raw.decode(encoding, errors="replace")


def format_stats(stats: dict, prompt_tokens: int, new_tokens: int) -> str:
    from ..sizes import format_bytes

    per = stats.get("bytes_per_token") or {}
    tiers = ", ".join(f"{t} {format_bytes(b)}" for t, b in per.items())
    witnessed = stats.get("storage_bytes_per_token_witnessed")
    return "\n".join([
        f"tokens: {prompt_tokens} prompt, {new_tokens} generated; time to first token {stats.get('time_to_first_token_s')} s",
        f"time: {stats.get('load_s')} s to find or write the shards and load them, then {stats.get('total_s')} s to generate",
        (f"decode: {stats.get('per_token_ms')} ms per step of a batch of {stats['batch']} "
         f"({stats['batch'] * (stats.get('decode_tokens_per_s') or 0):.2f} tok/s) on {stats.get('device')} in {stats.get('compute_dtype')}"
         if stats.get("batch") else
         f"decode: {stats.get('per_token_ms')} ms/token ({stats.get('decode_tokens_per_s')} tok/s) on {stats.get('device')} in {stats.get('compute_dtype')}"),
        f"bytes per token: {tiers or 'n/a'}; storage read witnessed {format_bytes(witnessed) if witnessed is not None else 'n/a'}",
        *([_experts_line(stats)] if stats.get("experts_per_token") is not None else []),
        f"peak RSS: {format_bytes(stats.get('peak_rss_bytes'))}",
        stats.get("residency", ""),
    ])


def _experts_line(stats: dict) -> str:
    cache = stats.get("expert_cache") or {}
    rate = cache.get("hit_rate")
    hits = f"{100 * rate:.1f}% ({cache['hits']} of {cache['lookups']} lookups)" if rate is not None else "n/a (no expert cache in use)"
    return f"experts: {stats['experts_per_token']:.1f} routed expert uses per token (all layers); expert cache hit rate {hits}"
