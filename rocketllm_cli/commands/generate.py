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
from ..replies import DEFAULT_REPLY_TOKENS
from ..text.sampling import SamplingParams

NAME = "generate"
DEFAULT_KEEP_ALIVE = "5m"  # ollama's: how long a model stays loaded after a generate
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
    api_key: Annotated[
        Optional[str],
        typer.Option(
            "--api-key",
            envvar="ROCKETLLM_API_KEY",
            show_envvar=True,
            show_default=False,
            help="With --server: the server's key (serve --api-key); prefer the environment variable, which other "
            "users cannot read from the process list.",
        ),
    ] = None,
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
    from ..distributed.launch import launched

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
        return _through_server(
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
    text = _read_prompt(prompt, output)
    system = None if system is None else _argument_text(system, "--system", output)
    prompts = [line for line in text.splitlines() if line.strip()] if batch else [text]
    # a bad picture, or pictures for a text-only model, refused before loading
    pictures = _read_images(image or [], model)
    keep_s = _keep_alive(keep_alive)
    if launch is not None:
        keep_s = 0  # the stages are this launch's processes: they end with it
        from ..distributed.stages import join

        join(launch, knob_flags)  # every rank joins now; rank 0 loads after
    if keep_s > 0:
        cold = _cold_reason(batch, bool(pictures), logprobs, constraint, chat)
        if cold is None:
            from ..shard.source import check_locatable

            check_locatable(model)  # a mistyped path is one line here, not a server that fails to start
            cold = _no_run_dir()
        if cold is None:
            return _warm(model, text, params, chat, system, stats, json, knob_flags or {}, output, constraint, keep_s)
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
            ids, inputs = _with_images(streamed, model, text, system, pictures)
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


def _read_images(paths: list[str], model: str) -> list:
    import json as _json
    from pathlib import Path

    from ..errors import ImageError
    from ..text.images import check_count, read_image

    if not paths:
        return []
    check_count(len(paths))
    pictures = [read_image(p) for p in paths]
    path = Path(str(model)).expanduser()
    config = path / "config.json"
    text_only = path.suffix == ".gguf"  # a GGUF file holds a text model (a projector comes in a separate file)
    if not text_only and config.is_file():
        try:
            text_only = "vision_config" not in _json.loads(config.read_text())
        except (OSError, ValueError):
            pass  # loading says what is wrong with it
    if text_only:
        raise ImageError(f"{model} takes text only (no vision config); send the prompt without images")
    return pictures


def _with_images(streamed, model: str, text: str, system: str | None, pictures: list) -> tuple[list[list[int]], dict]:
    """The prompt with its pictures, through the model's processor: ([ids], the processor's other tensors)."""
    from ..text.images import check_accepts, processor_inputs, user_content

    check_accepts(streamed, str(model))
    messages = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": user_content(text, pictures)}
    ]
    ids, inputs = processor_inputs(streamed.processor, messages)
    return [ids], inputs


def _through_server(
    url,
    model,
    prompt,
    model_option,
    params,
    chat,
    system,
    stats,
    batch,
    json,
    knob_flags,
    output,
    constraint,
    api_key=None,
) -> None:
    """generate --server: the same prompt rules and output, the generation done by a running server."""
    from ..server.client import default_model_id, served_model, server_url

    url = server_url(url)
    if constraint is not None and (constraint.kind != "json_schema" or chat is False):
        raise RocketError(
            "--grammar goes with a model loaded here (the server's APIs take JSON Schemas); drop --server"
            if constraint.kind != "json_schema"
            else "--json-schema with --server goes through the chat API; drop --raw, or drop --server"
        )
    if batch:
        raise RocketError(
            "--batch runs the prompts as one batch in this process; with --server send them one by one, "
            "or drop --server"
        )
    if knob_flags:
        from ..profiles.knobs.table import KNOBS_BY_NAME

        flag = KNOBS_BY_NAME[sorted(knob_flags)[0]].flag
        raise RocketError(
            f"{flag} tunes the engine of this process, but --server uses the server's; "
            "set it on `rocketllm serve`, or drop --server"
        )
    served = served_model(url, api_key)
    if model_option is None and prompt is None and model is not None and not _names_model(model, served):
        # one argument with --server, not a model: the server has the model, this is the prompt
        model, prompt = None, model
    model = pick_model(model, model_option, required=False)
    text = _read_prompt(prompt, output)
    system = None if system is None else _argument_text(system, "--system", output)
    if model is not None and default_model_id(model) != served:
        raise RocketError(
            f"the server at {url} serves '{served}', not '{default_model_id(model)}'; "
            "start a server for that model, or drop MODEL to use the one it serves"
        )
    _remote(url, served, text, chat, system, params, stats, json, output, constraint, api_key)


def _remote(
    url, served, text, chat, system, params, stats, json, output, constraint=None, api_key=None, keep_s=None
) -> None:
    """Generate through the server at URL (a running serve, or a warm model's socket) and print as a local run does.
    keep_s: a warm model's keep-alive from this request on (the server takes each request's, as ollama does)."""
    from ..server.client import remote_generate

    result = remote_generate(
        url,
        served,
        text,
        chat=chat,
        system=system,
        params=params,
        on_text=None if json else output.stream,
        json_schema=constraint.source if constraint is not None else None,
        api_key=api_key,
        keep_alive_s=keep_s,
    )
    if json:
        output.json(
            {k: result[k] for k in ("text", "prompt_tokens", "new_tokens")}
            | {"stats": result["stats"], "model": served}
        )
        return
    output.stream("\n")
    if stats:
        output.log(format_stats(result["stats"], result["prompt_tokens"], result["new_tokens"]))


def _keep_alive(value: str | None) -> float:
    from ..sizes import parse_duration

    try:
        return parse_duration(DEFAULT_KEEP_ALIVE if value is None or not value.strip() else value)
    except ValueError:
        raise RocketError(
            f"bad --keep-alive {value!r} (or ROCKETLLM_KEEP_ALIVE): expected seconds or a duration such "
            f"as 30s, 5m "
            "or 1h; 0 loads, answers and exits"
        ) from None


def _cold_reason(batch: bool, pictures: bool, logprobs, constraint, chat) -> str | None:
    """Why this generate runs in its own process rather than through a warm server (None: it can go warm)."""
    if batch:
        return "--batch runs its prompts as one batch"
    if pictures:
        return "--image goes through this process's processor"
    if logprobs is not None:
        return "--logprobs reads this process's own scores"
    if constraint is not None and (constraint.kind != "json_schema" or chat is False):
        return "--grammar (or --json-schema with --raw) is applied by this process"
    return None


def _no_run_dir() -> str | None:
    """Why warm servers cannot be kept here (their directory cannot be made or written), or None."""
    from ..cachehome import unwritable
    from ..warm.registry import run_dir, run_path

    try:
        run_dir()
    except RocketError:
        path = run_path()
        return f"{path} cannot hold warm models ({unwritable(path) or 'not usable'}; ROCKETLLM_CACHE moves it)"
    return None


def _warm(model, text, params, chat, system, stats, json, knob_flags, output, constraint, keep_s) -> None:
    """generate with a warm model: attach to its background server, or start one that stays loaded for keep_s seconds
    after each request (docs/ARCHITECTURE.md, "A warm model"); this process imports neither torch nor transformers."""
    from ..sizes import format_duration
    from ..warm.launch import warm_server

    entry, started = warm_server(model, knob_flags, keep_s, output.log)
    if started:
        output.log(
            f"note: {entry.model_id} stays loaded for {format_duration(keep_s)} after each request, in a background "
            f"server (pid {entry.pid}): `rocketllm ps` lists it, `rocketllm stop` ends it, --keep-alive 0 loads and "
            f"exits as before"
        )
    _remote(
        f"unix:{entry.socket}",
        entry.model_id,
        text,
        chat,
        system,
        params,
        stats,
        json,
        output,
        constraint,
        keep_s=keep_s,
    )


def _names_model(word: str, served: str) -> bool:
    """A lone argument with --server is MODEL when it is the served model's id or an existing path, else the PROMPT."""
    from pathlib import Path

    return word == served or Path(word).expanduser().exists()


def _result(outcome) -> dict:
    doc = {"text": outcome.text, "prompt_tokens": outcome.prompt_tokens, "new_tokens": outcome.new_tokens}
    if outcome.logprobs is not None:
        doc["logprobs"] = [
            {"token": e.token, "logprob": round(e.logprob, 6), "top": [[t, round(lp, 6)] for t, lp in e.top]}
            for e in outcome.logprobs
        ]
    return doc


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
    """An argument as text: bytes the locale could not decode arrive as surrogate escapes; os.fsencode gives them
    back."""
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
        output.warn(
            f"{where} is not valid {encoding.upper()} (first bad byte at offset {exc.start}); "
            "undecodable bytes were replaced with U+FFFD"
        )
        return raw.decode(encoding, errors="replace")


def format_stats(stats: dict, prompt_tokens: int, new_tokens: int) -> str:
    from ..sizes import format_bytes

    per = stats.get("bytes_per_token") or {}
    tiers = ", ".join(f"{t} {format_bytes(b)}" for t, b in per.items())
    witnessed = stats.get("storage_bytes_per_token_witnessed")
    server = stats.get("server")  # through a warm model or --server: the model was loaded already
    cached = f" ({stats.get('cached_prompt_tokens') or 0} from the server's prefix cache)" if server else ""
    if server:
        when = (
            f"time: {stats.get('total_s')} s through {server}, the model already loaded (nothing to find, write or "
            f"load)"
        )
    else:
        when = (
            f"time: {stats.get('load_s')} s to find or write the shards and load them, then {stats.get('total_s')} "
            f"s to generate"
        )
    if server and "bytes_per_token" not in stats:  # a server that sends no figures of its own (another version)
        return "\n".join(
            [
                f"tokens: {prompt_tokens} prompt{cached}, {new_tokens} generated; time to first token "
                f"{stats.get('time_to_first_token_s')} s",
                when + f"; decode {stats.get('decode_tokens_per_s')} tok/s",
                "bytes per tier: the server's /metrics",
            ]
        )
    return "\n".join(
        [
            f"tokens: {prompt_tokens} prompt{cached}, {new_tokens} generated; time to first token "
            f"{stats.get('time_to_first_token_s')} s",
            when,
            (
                f"decode: {stats.get('per_token_ms')} ms per step of a batch of {stats['batch']} "
                f"({stats['batch'] * (stats.get('decode_tokens_per_s') or 0):.2f} tok/s) on {stats.get('device')} in "
                f"{stats.get('compute_dtype')}"
                if stats.get("batch")
                else f"decode: {stats.get('per_token_ms')} ms/token ({stats.get('decode_tokens_per_s')} tok/s) on "
                f"{stats.get('device')} in {stats.get('compute_dtype')}"
            ),
            f"bytes per token: {tiers or 'n/a'}; storage read witnessed "
            f"{format_bytes(witnessed) if witnessed is not None else 'n/a'}",
            *([_experts_line(stats)] if stats.get("experts_per_token") is not None else []),
            *([speculation_line(stats["speculation"])] if stats.get("speculation") else []),
            *([grammar_line(stats["grammar"])] if stats.get("grammar") else []),
            f"peak RSS: {format_bytes(stats.get('peak_rss_bytes'))}",
            *([stages_line(stats["stages"])] if stats.get("stages") else []),
            stats.get("residency", ""),
        ]
    )


def stages_line(stages: dict) -> str:
    """Under torchrun: the plan, and what the links and the other ranks took per pass (measured; the bytes per token
    above are every rank's)."""
    return (
        f"{stages['plan']}; measured over {stages['passes']} passes: stages: links {stages['link_ms_per_pass']} ms, "
        f"other ranks computing {stages['other_ranks_ms_per_pass']} ms per pass; rank 0's own share below"
    )


def speculation_line(spec: dict) -> str:
    """One line on speculative decoding: what was proposed and accepted and the tokens each pass made, or why it was
    off."""
    if "proposed" not in spec:
        return f"speculative decoding: {spec.get('reason') or spec.get('mode')}"
    rate = f" ({100 * spec['acceptance']:.0f}%)" if spec.get("acceptance") is not None else ""
    return (
        f"speculative decoding ({spec['mode']}, up to {spec['draft_tokens']} drafted per pass): {spec['proposed']} "
        f"tokens proposed, {spec['accepted']} accepted{rate}; {spec['tokens']} tokens in {spec['passes']} passes = "
        f"{spec['tokens_per_pass']} tokens per pass"
    )


def grammar_line(grammar: dict) -> str:
    """One line on constrained decoding: the masks applied and what they cost the generating thread."""
    return (
        f"grammar: {grammar['masks']} masks over {grammar['rows']} constrained row(s); the generating thread waited "
        f"{grammar['blocking_ms_per_mask']} ms per mask (computed while the forward pass ran)"
    )


def _experts_line(stats: dict) -> str:
    cache = stats.get("expert_cache") or {}
    rate = cache.get("hit_rate")
    hits = (
        f"{100 * rate:.1f}% ({cache['hits']} of {cache['lookups']} lookups)"
        if rate is not None
        else "n/a (no expert cache in use)"
    )
    return (
        f"experts: {stats['experts_per_token']:.1f} routed expert uses per token (all layers); expert cache hit "
        f"rate {hits}"
    )
