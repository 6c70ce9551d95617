"""A one-shot generate answered by a model loaded elsewhere: a running `rocketllm serve` (--server) or a warm
model kept by a background server (--keep-alive), printed as a local run prints."""

from __future__ import annotations

from ..errors import RocketError
from ..options import pick_model
from ..text.statslines import format_stats
from .inputs import argument_text, read_prompt

DEFAULT_KEEP_ALIVE = "5m"  # ollama's: how long a model stays loaded after a generate


def through_server(
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
    text = read_prompt(prompt, output)
    system = None if system is None else argument_text(system, "--system", output)
    if model is not None and default_model_id(model) != served:
        raise RocketError(
            f"the server at {url} serves '{served}', not '{default_model_id(model)}'; "
            "start a server for that model, or drop MODEL to use the one it serves"
        )
    remote(url, served, text, chat, system, params, stats, json, output, constraint, api_key)


def remote(
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


def keep_alive_seconds(value: str | None) -> float:
    from ..sizes import parse_duration

    try:
        return parse_duration(DEFAULT_KEEP_ALIVE if value is None or not value.strip() else value)
    except ValueError:
        raise RocketError(
            f"bad --keep-alive {value!r} (or ROCKETLLM_KEEP_ALIVE): expected seconds or a duration such "
            f"as 30s, 5m "
            "or 1h; 0 loads, answers and exits"
        ) from None


def cold_reason(batch: bool, pictures: bool, logprobs, constraint, chat) -> str | None:
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


def no_run_dir() -> str | None:
    """Why warm servers cannot be kept here (their directory cannot be made or written), or None."""
    from ..cachehome import unwritable
    from ..warm.registry import run_dir, run_path

    try:
        run_dir()
    except RocketError:
        path = run_path()
        return f"{path} cannot hold warm models ({unwritable(path) or 'not usable'}; ROCKETLLM_CACHE moves it)"
    return None


def no_server_extra() -> str | None:
    """Why this install cannot start a warm server (the server extra's packages are missing), or None. Looked up, not
    imported: importing fastapi and uvicorn would cost every generate ~0.3 s."""
    from importlib.util import find_spec

    missing = [name for name in ("fastapi", "uvicorn") if find_spec(name) is None]
    if not missing:
        return None
    verb = "is" if len(missing) == 1 else "are"
    return f"{' and '.join(missing)} {verb} not installed (pip install fastapi uvicorn keeps models warm)"


def warm(model, text, params, chat, system, stats, json, knob_flags, output, constraint, keep_s) -> None:
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
    remote(
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
