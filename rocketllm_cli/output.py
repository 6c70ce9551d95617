"""The one output object: results on stdout, everything else on stderr."""

from __future__ import annotations

import json
import sys
from contextlib import contextmanager
from typing import Any, Iterator


class Output:
    """Results go to stdout; logs, warnings and progress to stderr (rich only on a TTY)."""

    def __init__(self, as_json: bool = False, quiet: bool = False) -> None:
        self.as_json = as_json
        self.quiet = quiet
        self._err_is_tty = sys.stderr.isatty()

    # -- results (stdout) -------------------------------------------------
    def result(self, text: str) -> None:
        """A human-readable result; suppressed in --json mode (the JSON document is the result)."""
        if not self.as_json:
            sys.stdout.write(text if text.endswith("\n") else text + "\n")
            sys.stdout.flush()

    def stream(self, text: str) -> None:
        """A piece of a streamed result (generated text), written as it comes."""
        sys.stdout.write(text)
        sys.stdout.flush()

    def json(self, document: Any) -> None:
        sys.stdout.write(json.dumps(document, indent=2, default=_jsonable) + "\n")
        sys.stdout.flush()

    # -- diagnostics (stderr) ---------------------------------------------
    def log(self, message: str) -> None:
        if not self.quiet:
            print(message, file=sys.stderr, flush=True)

    def warn(self, message: str) -> None:
        print(f"warning: {message}", file=sys.stderr, flush=True)

    @contextmanager
    def progress(self, description: str, total: int | None) -> Iterator["_Progress"]:
        """A progress bar on stderr when a person is watching; silent otherwise."""
        if self._err_is_tty and not self.quiet:
            from rich.progress import Progress

            with Progress(transient=True, console=_stderr_console()) as bar:
                task = bar.add_task(description, total=total)
                yield _Progress(lambda n: bar.advance(task, n))
        else:
            yield _Progress(lambda n: None)


class _Progress:
    def __init__(self, advance) -> None:
        self.advance = advance


def _stderr_console():
    from rich.console import Console

    return Console(stderr=True)


def _jsonable(value: Any) -> Any:
    if hasattr(value, "to_dict"):
        return value.to_dict()
    if hasattr(value, "__fspath__"):
        return str(value)
    if isinstance(value, set):
        return sorted(value)
    return str(value)
