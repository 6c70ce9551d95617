"""rocketllm generate: one prompt in, generated text out (stdout carries only the text)."""

from __future__ import annotations

import sys
from typing import Annotated, Optional

import typer

from ..errors import RocketError
from ..options import JsonOpt, validate_knob_flags, with_knob_options
from ..output import Output

NAME = "generate"
NO_ARGS_IS_HELP = True
HELP = """Generate text from PROMPT (or stdin) with MODEL streamed layer by layer.

Shards MODEL on first use and reuses the shards afterwards. Only the generated text goes
to stdout, so it composes in pipelines; --stats reports speed and bytes per tier on stderr.

Example: echo "The capital of France is" | rocketllm generate ./SmolLM2.gguf --raw --max-new-tokens 8
"""


@with_knob_options
def run(
    model: Annotated[str, typer.Argument(help="Model directory, .gguf file, hub id, or shard directory.", show_default=False)],
    prompt: Annotated[Optional[str], typer.Argument(help="The prompt; read from stdin when absent or '-'.", show_default=False)] = None,
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens", "-n", help="Tokens to generate at most.")] = 256,
    temperature: Annotated[float, typer.Option("--temperature", help="0 = greedy.")] = 0.0,
    top_p: Annotated[float, typer.Option("--top-p", help="Nucleus sampling mass.")] = 1.0,
    top_k: Annotated[int, typer.Option("--top-k", help="Sample among the k most likely (0 = off).")] = 0,
    seed: Annotated[Optional[int], typer.Option("--seed", help="Random seed for sampling.")] = None,
    chat: Annotated[Optional[bool], typer.Option("--chat/--raw", help="Apply the chat template (default when the tokenizer has one).", show_default=False)] = None,
    system: Annotated[Optional[str], typer.Option("--system", help="System message.")] = None,
    stats: Annotated[bool, typer.Option("--stats", help="Print speed, bytes per tier, peak RSS and the residency plan to stderr.")] = False,
    json: JsonOpt = False,
    knob_flags: dict | None = None,
) -> None:
    from ..core.textgen import SamplingParams, check_context, encode_prompt, generate_text

    output = Output(as_json=json)
    params = SamplingParams(max_new_tokens, temperature, top_p, top_k, seed)
    validate_knob_flags(knob_flags or {})
    text = _read_prompt(prompt)

    from ..core.auto import AutoModel

    streamed = AutoModel.from_pretrained(model, flags=knob_flags, progress=output.progress, log=output.log)
    try:
        ids = encode_prompt(streamed.tokenizer, text, chat, system)
        check_context(ids.shape[1], params.max_new_tokens, int(streamed.knobs.value("max_context")))
        result = generate_text(streamed, ids, params, on_text=None if json else output.stream)
    finally:
        streamed.close()
    if json:
        output.json({**result.to_dict(), "model": model})
        return
    output.stream("\n")
    if stats:
        output.log(format_stats(result.stats, result.prompt_tokens, result.new_tokens))


def _read_prompt(prompt: Optional[str]) -> str:
    if prompt is None or prompt == "-":
        if sys.stdin is None or sys.stdin.isatty():
            raise RocketError("no prompt: pass PROMPT or pipe it on stdin")
        prompt = sys.stdin.read()
    if not prompt.strip():
        raise RocketError("empty prompt: pass PROMPT or pipe non-empty text on stdin")
    return prompt.rstrip("\n")


def format_stats(stats: dict, prompt_tokens: int, new_tokens: int) -> str:
    from ..sizes import format_bytes

    per = stats.get("bytes_per_token") or {}
    tiers = ", ".join(f"{t} {format_bytes(b)}" for t, b in per.items())
    witnessed = stats.get("storage_bytes_per_token_witnessed")
    return "\n".join([
        f"tokens: {prompt_tokens} prompt, {new_tokens} generated; time to first token {stats.get('time_to_first_token_s')} s",
        f"decode: {stats.get('per_token_ms')} ms/token ({stats.get('decode_tokens_per_s')} tok/s) on {stats.get('device')} in {stats.get('compute_dtype')}",
        f"bytes per token: {tiers or 'n/a'}; storage read witnessed {format_bytes(witnessed) if witnessed is not None else 'n/a'}",
        f"peak RSS: {format_bytes(stats.get('peak_rss_bytes'))}",
        stats.get("residency", ""),
    ])
