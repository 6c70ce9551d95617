"""rocketllm serve: an OpenAI- and Anthropic-compatible HTTP server over one streaming model."""

from __future__ import annotations

import gc
import socket
from pathlib import Path
from typing import Annotated, Optional

import typer

from ..errors import RocketError
from ..options import ModelArg, ModelOpt, api_key_option, pick_model, with_knob_options
from ..output import Output
from ..server.sockets import bind, bind_unix, freeze_loaded_heap
from ..warm.registry import register_server

NAME = "serve"
NO_ARGS_IS_HELP = True
HELP = """Serve MODEL over HTTP with the OpenAI and Anthropic APIs, streamed layer by layer.

POST /v1/chat/completions, /v1/completions and /v1/messages (each with stream: true); GET /v1/models, /health and
/metrics. One model instance: requests queue and run one at a time, and a client that disconnects has its generation
cancelled. Listens on 127.0.0.1 unless --host says otherwise. Needs the server extra: pip install -e '.[server]' in the
rocketllm source directory.

Example: rocketllm serve ./SmolLM2.gguf --port 8000, then point an OpenAI client at http://127.0.0.1:8000/v1 or an
Anthropic client at http://127.0.0.1:8000 (any API key, unless --api-key or ROCKETLLM_API_KEY sets one).
"""
MISSING_EXTRA = (
    "rocketllm serve needs the server extra: pip install -e '.[server]' in the rocketllm source directory "
    "(or pip install fastapi uvicorn)"
)
BACKLOG = 2048  # connections the kernel queues before uvicorn accepts them


@with_knob_options
def run(
    model: ModelArg = None,
    model_option: ModelOpt = None,
    host: Annotated[
        str,
        typer.Option("--host", help="Address to listen on; 0.0.0.0 listens on every interface (set --api-key there)."),
    ] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", help="Port to listen on (0 picks a free one).")] = 8000,
    served_model_name: Annotated[
        Optional[str],
        typer.Option(
            "--served-model-name",
            help="The model id clients send and /v1/models lists. Default: the model directory's or file's name.",
            show_default=False,
        ),
    ] = None,
    tool_parser: Annotated[
        Optional[str],
        typer.Option(
            "--tool-parser",
            help="Tool-call format: hermes, llama3_json or mistral. Default: read from the model's chat template.",
            show_default=False,
        ),
    ] = None,
    api_key: Annotated[
        Optional[str],
        api_key_option(
            "Require this key on every endpoint but /health (OpenAI clients send it as Authorization: Bearer, "
            "Anthropic clients as x-api-key)"
        ),
    ] = None,
    max_queue: Annotated[
        Optional[int],
        typer.Option(
            "--max-queue",
            show_default=False,
            help="Requests that may wait for the model; more get 429 with retry-after. Default: min(256, open-file "
            "limit // 4).",
        ),
    ] = None,
    access_log: Annotated[
        bool, typer.Option("--access-log/--no-access-log", help="Log one line per request on stderr.")
    ] = True,
    json: Annotated[
        bool,
        typer.Option(
            "--json",
            help="Once listening, print one JSON document on stdout: URL, model "
            "id, residency, tool parser, prefix cache.",
        ),
    ] = False,
    unix: Annotated[
        Optional[str],
        typer.Option(
            "--unix",
            metavar="PATH",
            help="Listen on a unix socket at PATH (mode "
            "0600: this user only) instead of TCP; --host and --port are then unused.",
            show_default=False,
        ),
    ] = None,
    keep_alive: Annotated[
        Optional[str],
        typer.Option(
            "--keep-alive",
            metavar="DURATION",
            help="Stop after this long without a request (300, 30s, 5m, 1h); default: serve until stopped.",
            show_default=False,
        ),
    ] = None,
    warm_key: Annotated[
        Optional[str],
        typer.Option("--warm-key", hidden=True, help="The warm-model registry key generate started this server under."),
    ] = None,
    knob_flags: dict | None = None,
) -> None:
    from ..options import validate_knob_flags
    from ..server.tools import FAMILIES

    output = Output(as_json=json)
    model = pick_model(model, model_option)
    if not 0 <= port <= 65535:
        raise RocketError(f"--port must be between 0 and 65535 (got {port})")
    if tool_parser is not None and tool_parser not in FAMILIES:
        raise RocketError(f"bad --tool-parser {tool_parser!r}: expected one of {', '.join(FAMILIES)}")
    if served_model_name is not None and not served_model_name.strip():
        raise RocketError("--served-model-name is empty; give the name clients should send, or leave it out")
    if max_queue is not None and max_queue < 1:
        raise RocketError(f"--max-queue must be at least 1 (got {max_queue})")
    if api_key is not None and not api_key.strip():
        raise RocketError("--api-key is empty (or ROCKETLLM_API_KEY is set but empty); give a key, or leave both out")
    validate_knob_flags(knob_flags or {})
    from ..distributed.torchrun import launched

    launch = launched()  # under torchrun: rank 0 serves HTTP, the other ranks run their layers for it
    if launch is not None and not launch.is_first:
        from ..auto import run_later_stage

        return run_later_stage(model, knob_flags)
    idle_s = None
    if keep_alive is not None:
        from ..sizes import parse_duration

        try:
            idle_s = parse_duration(keep_alive)
        except ValueError:
            raise RocketError(
                f"bad --keep-alive {keep_alive!r}: expected seconds or a duration such as 30s, 5m or 1h"
            ) from None
    from ..shard.source import check_locatable

    check_locatable(model)  # a mistyped path is refused before the server, torch and transformers are imported
    from ..shard.identity import hash_in_background

    hash_in_background(model)  # a GGUF's first content hash runs beside the imports below
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError:
        raise RocketError(MISSING_EXTRA) from None
    sock = bind_unix(unix) if unix else bind(host, port)
    if launch is not None:
        from ..distributed.opening import join

        try:
            join(launch, knob_flags)  # every rank joins now; rank 0 loads after
        except BaseException:
            sock.close()
            raise
    try:
        _serve(
            sock,
            model,
            host,
            served_model_name,
            tool_parser,
            access_log,
            knob_flags or {},
            output,
            api_key,
            max_queue,
            idle_s,
            warm_key,
        )
    finally:
        sock.close()
        if unix:
            Path(unix).unlink(missing_ok=True)


def _serve(
    sock,
    model,
    host,
    served_model_name,
    tool_parser,
    access_log,
    knob_flags,
    output,
    api_key=None,
    max_queue=None,
    idle_s=None,
    warm_key=None,
) -> None:
    from ..auto import AutoModel
    from ..server.client import default_model_id
    from ..server.serving import make_server, sigterm_as_ctrl_c
    from ..server.state import ServerState
    from ..server.worker import STOP_WAIT_S

    # a request without max_tokens gets what the measured speed fits in a minute (default_max_tokens)
    streamed = AutoModel.from_pretrained(
        model, flags=knob_flags, progress=output.progress, log=output.log, measured_speed=True
    )
    state = None
    try:
        state = ServerState(
            streamed,
            served_model_name or default_model_id(model),
            tool_parser,
            log=output.log,
            api_key=api_key,
            max_queue=max_queue,
            host=host,
        )
        server = make_server(state, access_log)
        if idle_s is not None:
            state.keep_alive(idle_s, server)
        freeze_loaded_heap()
        if sock.family == socket.AF_UNIX:
            url = f"unix:{sock.getsockname()}"
        else:
            bound_host, bound_port = sock.getsockname()[:2]
            url = f"http://{'[' + bound_host + ']' if ':' in bound_host else bound_host}:{bound_port}"
        sock.listen(BACKLOG)  # from here a client that connects waits in the backlog until uvicorn accepts it
        entry = register_server(warm_key, sock, model, state, knob_flags, idle_s) if warm_key else None

        def announce() -> None:  # once uvicorn holds the signals: whoever reads "listening" may Ctrl-C at once
            for line in state.startup_lines(url):
                output.log(line)
            for warning in state.warnings:  # binding beyond loopback without a key
                output.warn(warning)
            if output.as_json:
                output.json({"url": url, "openai_base_url": f"{url}/v1", "anthropic_base_url": url, **state.health()})

        server.on_started = announce
        with sigterm_as_ctrl_c():
            try:
                server.run(sockets=[sock])
            except KeyboardInterrupt:
                # Ctrl-C or SIGTERM: uvicorn stopped and raised it again, or it came before uvicorn took the signals
                pass
            finally:
                if entry is not None:
                    entry.remove()
    finally:
        if state is None or state.close(STOP_WAIT_S):
            streamed.close()
        else:  # closing the weights under a running forward pass is not safe, and the process ends anyway
            output.log(
                f"note: the running generation step did not end within {STOP_WAIT_S:g} s of the stop; not "
                f"waiting for it"
            )
    output.log("stopped")
    # Nothing is left to collect: spare the interpreter's exit a pass over every object torch and transformers
    # made (seconds of a loaded CPU, for a server that has already stopped).
    gc.freeze()
