"""The one place where exceptions become one-line messages and exit codes."""

from __future__ import annotations

import errno
import os


class RocketError(Exception):
    """A user-facing error: one line that names the problem and what to do. Exit code 1."""

    exit_code = 1


class UsageError(RocketError):
    """A bad combination of arguments. Exit code 2."""

    exit_code = 2


class Interrupted(KeyboardInterrupt):
    """Ctrl-C (SIGINT) during work that says what it leaves behind. Still a KeyboardInterrupt to library callers
    (`except Exception` does not swallow it); the CLI prints its message, exit code 130 as for any interrupt."""

    exit_code = 130


class ModelError(RocketError):
    """The model path, checkpoint or architecture cannot be used."""


class ShardError(RocketError):
    """A shard set is missing, incomplete or does not match its manifest."""


class KnobError(RocketError):
    """A knob override has a value that cannot be parsed or is out of range."""


class ImageError(RocketError):
    """An image that cannot be used: it does not decode, its format or count is not accepted, or the model takes text
    only."""


class ParameterError(RocketError):
    """A library argument out of range. The message names parameters as `{name}` fields, so each caller spells
    them its own way: the library as the keyword (`max_new_tokens must be at least 1`), the CLI as its flag
    (`--max-new-tokens must be at least 1`), the server as its request field."""

    def __init__(self, template: str, *params: str) -> None:
        self.template, self.params = template, params
        super().__init__(self.spelled(lambda name: name))

    def spelled(self, spell) -> str:
        """The message with every parameter written as spell(name)."""
        return self.template.format(**{name: spell(name) for name in self.params})


def debug_enabled() -> bool:
    return os.environ.get("ROCKETLLM_DEBUG", "") not in ("", "0", "false", "no")


def describe(exc: BaseException) -> tuple[str, int]:
    """Map any exception to (one-line message, exit code)."""
    if isinstance(exc, RocketError):
        return _one_line(str(exc)), exc.exit_code
    if isinstance(exc, Interrupted):
        return _one_line(str(exc)), 130
    if isinstance(exc, KeyboardInterrupt):
        return "interrupted", 130
    if isinstance(exc, MemoryError):
        return "out of memory: lower --device-cache-bytes or --host-cache-bytes, or free memory", 1
    if isinstance(exc, FileNotFoundError):
        return _one_line(f"file not found: {exc.filename or exc}"), 1
    if isinstance(exc, OSError) and exc.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
        cache = _in_cache(exc.filename)
        if cache is not None:
            return _one_line(
                f"cannot write {exc.filename} ({exc.strerror}): the cache directory {cache} is not "
                f"writable; "
                "set ROCKETLLM_CACHE to a writable directory"
            ), 1
    if isinstance(exc, PermissionError):
        return _one_line(f"permission denied: {exc.filename or exc}"), 1
    if isinstance(exc, OSError) and exc.errno == errno.EROFS:
        return _one_line(f"read-only file system: {exc.filename or exc}"), 1
    if isinstance(exc, OSError) and exc.errno == 28:
        return _one_line(
            f"no space left on device: {exc.filename or ''} (free space, or shard with --out on another disk)"
        ), 1
    if isinstance(exc, ValueError):
        return _one_line(f"invalid value: {exc}"), 1
    return _one_line(f"internal error ({type(exc).__name__}: {exc}); rerun with ROCKETLLM_DEBUG=1 and report it"), 1


def _in_cache(filename) -> str | None:
    """The cache directory when `filename` lies in it (or is it), else None."""
    if not filename:
        return None
    from pathlib import Path

    from .cachehome import cache_root

    root = cache_root().absolute()
    path = Path(os.fsdecode(filename)).absolute()
    return str(root) if path == root or root in path.parents else None


def _one_line(message: str) -> str:
    return " ".join(message.split()) or "error"
