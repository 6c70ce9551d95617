"""The one output object: results on stdout, everything else on stderr."""

from __future__ import annotations

import json
import os
import sys
from contextlib import contextmanager
from typing import Any, Iterator


class StdoutClosed(Exception):
    """Whoever read stdout went away (`| head -c 20`): the command stops and the CLI exits 0, quietly, as `yes | head` does."""


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
            write_stdout(text if text.endswith("\n") else text + "\n")

    def stream(self, text: str) -> None:
        """A piece of a streamed result (generated text), written as it comes."""
        write_stdout(text)

    def json(self, document: Any) -> None:
        write_stdout(json.dumps(document, indent=2, default=_jsonable) + "\n")

    # -- diagnostics (stderr) ---------------------------------------------
    def log(self, message: str) -> None:
        if not self.quiet:
            write_stderr(message)

    def warn(self, message: str) -> None:
        write_stderr(f"warning: {message}")

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


def write_stdout(text: str) -> None:
    """Write and flush a result; a reader that went away ends the command with StdoutClosed, not a traceback."""
    try:
        sys.stdout.write(text)
        sys.stdout.flush()
    except BrokenPipeError:
        raise stdout_closed() from None


def stdout_closed() -> StdoutClosed:
    """After a broken pipe on stdout: what is left in its buffer goes to /dev/null, so the interpreter's final
    flush does not fail again; returns the exception that ends the command quietly."""
    _to_devnull(sys.stdout)
    return StdoutClosed()


def write_stderr(line: str) -> None:
    """One line on stderr. A closed stderr drops it and every later line: diagnostics never stop the work."""
    try:
        print(line, file=sys.stderr, flush=True)
    except BrokenPipeError:
        _to_devnull(sys.stderr)


def _to_devnull(stream) -> None:
    try:
        fd = stream.fileno()
    except (AttributeError, OSError, ValueError):  # not a file descriptor (a test's captured stream): nothing to flush later
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, fd)
    os.close(devnull)


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
