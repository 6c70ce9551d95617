"""rocketllm stop: end warm models (ollama's `stop`)."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from ..errors import RocketError, UsageError
from ..output import Output

NAME = "stop"
HELP = """Stop warm models: the background servers generate keeps a model loaded in (--keep-alive).

MODEL is the model as generate was given it (a path, .gguf file or hub id) or its name as `rocketllm ps` shows it;
--all stops every one. A request running in one is cancelled.

Examples: `rocketllm stop ./SmolLM2.gguf`, `rocketllm stop --all`.
"""


def run(
    model: Annotated[
        Optional[str],
        typer.Argument(
            help="The model to stop (as given to generate, or as `rocketllm ps` names it).", show_default=False
        ),
    ] = None,
    all_models: Annotated[bool, typer.Option("--all", help="Stop every warm model.")] = False,
) -> None:
    from pathlib import Path

    from ..warm.launch import stop
    from ..warm.registry import alive, entries

    output = Output()
    if (model is None) == (not all_models):
        raise UsageError("give MODEL or --all (one of them)")
    live = []
    for entry in entries():
        if alive(entry):
            live.append(entry)
        else:
            entry.remove()  # a server that died without removing its entry
    if model is not None:
        path = Path(model).expanduser()
        wanted = {str(path.resolve()) if path.exists() else model, model}
        live = [e for e in live if e.model in wanted or e.model_id in wanted]
        if not live:
            raise RocketError(f"no warm model {model}; `rocketllm ps` lists the warm ones")
    for entry in live:
        if stop(entry):
            output.log(f"stopped {entry.model_id} (pid {entry.pid})")
        else:
            raise RocketError(
                f"{entry.model_id} (pid {entry.pid}) did not stop within 10 s; kill it with `kill {entry.pid}`"
            )
    if not live:
        output.log("no warm models")
