"""The one output object: results on stdout, everything else on stderr."""

from __future__ import annotations

import json
import os
import sys
import threading
from contextlib import contextmanager
from typing import Any, Callable, Iterator

BLINK_S = 0.5  # a bar for a phase shorter than this would only flicker: phases that are usually quick wait this long
# off a terminal, a phase gets its one line only once it lasts this long (quick failures stay one line)
ANNOUNCE_AFTER_S = 2.0


class StdoutClosed(Exception):
    """Whoever read stdout went away (`| head -c 20`): the command stops and the CLI exits 0, quietly, as `yes | head`
    does."""


class Output:
    """Results go to stdout; logs, warnings and progress to stderr (rich only on a TTY)."""

    def __init__(self, as_json: bool = False, quiet: bool = False) -> None:
        self.as_json = as_json
        self.quiet = quiet
        self._err_is_tty = sys.stderr.isatty()
        self._bars = None  # the one rich Progress on screen while any phase runs: rich shows one live display at a time
        self._lock = threading.Lock()

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
    def progress(
        self,
        description: str,
        total: int | None = None,
        *,
        units: int | None = None,
        after: float = 0.0,
        announce: bool = True,
    ) -> Iterator["Phase"]:
        """One phase on stderr: `total` bytes (None: a phase without a measure, shown with its elapsed time), in
        `units` pieces if given; the caller advances it with phase.advance(nbytes, units=1).

        On a terminal: a transient bar (`sharding X  12/32 units · 96/257 MiB · 14 MB/s`), shown once the phase has
        lasted `after` seconds. Off one: no bar; one line (`sharding X (32 units, 256.57 MiB)…`) once the phase has
        lasted ANNOUNCE_AFTER_S, unless announce=False (the caller logs its own line).
        """
        if self.quiet:
            yield Phase()
        elif not self._err_is_tty:
            line = _announcement(description, total, units)
            with _after(ANNOUNCE_AFTER_S if announce else None, lambda: write_stderr(line)):
                yield Phase()
        else:
            with self._bar(description, total, units, after) as phase:
                yield phase

    @contextmanager
    def _bar(self, description: str, total: int | None, units: int | None, after: float) -> Iterator["Phase"]:
        with self._lock:
            bars = self._bars = self._bars or _new_bars()
            task = bars.add_task(description, total=total, visible=False, units=units, units_done=0)
        done = [0]

        def show() -> None:
            with self._lock:
                bars.update(task, visible=True)
                if not bars.live.is_started:
                    bars.start()

        def advance(nbytes: int, count: int) -> None:
            done[0] += count
            bars.update(task, advance=nbytes, units_done=done[0])

        try:
            with _after(after, show):  # left before the task goes: `show` never runs for a removed task
                yield Phase(advance)
        finally:
            with self._lock:
                bars.remove_task(task)
                if not bars.tasks:
                    bars.stop()
                    self._bars = None


_line_open = [False]  # the last text written to stdout did not end its line


def write_stdout(text: str) -> None:
    """Write and flush a result; a reader that went away ends the command with StdoutClosed, not a traceback."""
    try:
        sys.stdout.write(text)
        sys.stdout.flush()
    except BrokenPipeError:
        raise stdout_closed() from None
    if text:
        _line_open[0] = not text.endswith("\n")


def stdout_closed() -> StdoutClosed:
    """After a broken pipe on stdout: what is left in its buffer goes to /dev/null, so the interpreter's final
    flush does not fail again; returns the exception that ends the command quietly."""
    _to_devnull(sys.stdout)
    return StdoutClosed()


def write_stderr(line: str) -> None:
    """One line on stderr. A closed stderr drops it and every later line: diagnostics never stop the work.

    Where stdout and stderr are one terminal and streamed text left its line open (a reply cut by Ctrl-C), the line
    starts on a line of its own; a pipe or a file gets the text exactly as generated."""
    try:
        if _line_open[0] and _same_terminal():
            line = "\n" + line
            _line_open[0] = False
        print(line, file=sys.stderr, flush=True)
    except BrokenPipeError:
        _to_devnull(sys.stderr)


def _same_terminal() -> bool:
    try:
        return sys.stdout.isatty() and sys.stderr.isatty()
    except (AttributeError, ValueError):
        return False


def _to_devnull(stream) -> None:
    try:
        fd = stream.fileno()
    # not a file descriptor (a test's captured stream): nothing to flush later
    except (AttributeError, OSError, ValueError):
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, fd)
    os.close(devnull)


class Phase:
    """What a caller of progress() holds: advance(nbytes, units=0) as the work gets done."""

    def __init__(self, sink: Callable[[int, int], None] | None = None) -> None:
        self._sink = sink

    def advance(self, nbytes: int = 0, units: int = 0) -> None:
        if self._sink is not None:
            self._sink(nbytes, units)


@contextmanager
def no_progress(description: str, total: int | None = None, **_) -> Iterator[Phase]:
    """progress() for a caller given none: the same calls, nothing shown."""
    yield Phase()


def quiet_libraries() -> None:
    """Our progress replaces transformers' and the hub's bars; off a terminal no tqdm bar draws at all; the
    libraries' warnings are noise to a CLI user unless ROCKETLLM_DEBUG=1. The environment reaches the libraries
    not imported yet (tqdm reads TQDM_DISABLE at import), the calls those imported already."""
    import warnings

    from .errors import debug_enabled

    if not sys.stderr.isatty():
        os.environ["TQDM_DISABLE"] = "1"
    os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"  # transformers 5 follows the hub's setting at import
    debug = debug_enabled()
    if not debug:
        os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # else tokenizers warns on every fork after use
        warnings.simplefilter("ignore")  # library warnings (torch, transformers); ours go through Output.warn
    if "transformers" in sys.modules:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        if not debug:
            hf_logging.set_verbosity_error()
    if "huggingface_hub" in sys.modules:
        from huggingface_hub.utils import disable_progress_bars

        disable_progress_bars()


@contextmanager
def _after(seconds: float | None, action: Callable[[], None]) -> Iterator[None]:
    """Run `action` once the block has lasted `seconds` (at once for 0, never for None); never after the block."""
    if seconds is None:
        yield
        return
    if seconds <= 0:
        action()
        yield
        return
    timer = threading.Timer(seconds, action)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
        timer.join()  # an action under way finishes before the block's own next line


def _announcement(description: str, total: int | None, units: int | None) -> str:
    from .sizes import format_bytes

    measure = ", ".join(
        [*([f"{units} units"] if units is not None else []), *([format_bytes(total)] if total is not None else [])]
    )
    return f"{description} ({measure})…" if measure else f"{description}…"


def _new_bars():
    from rich.console import Console
    from rich.progress import BarColumn, Progress, ProgressColumn, TextColumn
    from rich.text import Text

    class Figures(ProgressColumn):
        """`12/32 units · 96/257 MiB · 14 MB/s` for bytes; the elapsed time for a phase without a measure."""

        def render(self, task) -> Text:
            parts = []
            if task.fields.get("units") is not None:
                parts.append(f"{task.fields['units_done']}/{task.fields['units']} units")
            if task.total is None:
                parts.append(f"{int(task.elapsed or 0)} s")
            else:
                parts.append(_amounts(int(task.completed), int(task.total)))
                if task.speed:
                    parts.append(f"{task.speed / 1e6:.{0 if task.speed >= 1e7 else 1}f} MB/s")
            return Text(" · ".join(parts))

    # stdout stays stdout: a result written while a bar shows must not end up on stderr; a slow refresh costs a bench
    # little
    return Progress(
        TextColumn("{task.description}"),
        BarColumn(bar_width=24),
        Figures(),
        transient=True,
        console=Console(stderr=True),
        redirect_stdout=False,
        refresh_per_second=4,
    )


def _amounts(done: int, total: int) -> str:
    """`96/257 MiB`: both in the unit that suits the total."""
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if total >= size:
            digits = 1 if unit == "GiB" else 0
            return f"{done / size:.{digits}f}/{total / size:.{digits}f} {unit}"
    return f"{done}/{total} B"


def _jsonable(value: Any) -> Any:
    if hasattr(value, "to_dict"):
        return value.to_dict()
    if hasattr(value, "__fspath__"):
        return str(value)
    if isinstance(value, set):
        return sorted(value)
    return str(value)


def report(exc: BaseException) -> int:
    """Print the exception the way the CLI does (errors.describe's one line; the traceback too under
    ROCKETLLM_DEBUG=1) and return the exit code."""
    from .errors import debug_enabled, describe

    message, code = describe(exc)
    if getattr(exc, "rank0_reports", False) and os.environ.get("RANK", "0") != "0":
        return code  # a pipeline's refusal every rank reached: rank 0 prints it once for all
    if debug_enabled():
        import traceback

        traceback.print_exception(exc)
    write_stderr(f"error: {message}")  # a closed stderr loses the line, not the exit code
    return code
