"""The storage probe's own file: written now or ahead of time, always deleted.

A first run writes it on a thread of its own beside its imports (write_ahead), for the measurement to come; only
its reads are timed, later. A file no measurement takes is deleted at exit, and a write under way at exit stops.
"""

from __future__ import annotations

import atexit
import os
import threading
import time
from pathlib import Path


def written(directories: list[Path], size: int) -> tuple[Path | None, OSError | None]:
    """(the probe file written in the first of DIRECTORIES that takes it, None) or (None, the last error)."""
    error: OSError | None = None
    for directory in directories:
        path = directory / f".rocketllm-probe-{os.getpid()}-{time.monotonic_ns()}"
        try:
            _write_probe(path, size)
            return path, None
        except OSError as exc:
            remove(path)
            error = exc
    return None, error


# A probe file written ahead (write_ahead): (its directories, size, the writing thread, [its (path, error)])
_ahead: list[tuple[tuple[Path, ...], int, threading.Thread, list]] = []
_stop_ahead = threading.Event()  # set at exit: a write ahead still under way stops and its file goes


def write_ahead(directories: list[Path], size: int) -> None:
    """Write the probe file now, on a thread of its own, for the measure_storage call to come (a first run: the
    write is not timed, and takes a second of a disk beside the imports). Only its reads are measured, later, as
    always. A file no measurement takes is deleted at exit."""
    if _ahead:
        return
    free = free_bytes(directories[0])
    if free is not None and free < 2 * size:
        return  # measure_storage shrinks its file: no file of this size will be asked for
    box: list = []
    thread = threading.Thread(target=lambda: box.append(written(directories, size)), name="rocketllm-probe-write")
    thread.daemon = True
    _ahead.append((_real(directories), size, thread, box))
    atexit.unregister(_discard_ahead)  # registered once, however many files a process writes ahead
    atexit.register(_discard_ahead)
    thread.start()


def take_written(directories: list[Path], size: int) -> tuple[Path, None] | None:
    """The file write_ahead wrote for these DIRECTORIES and SIZE (waiting for it), or None."""
    if not _ahead or _ahead[0][:2] != (_real(directories), size):
        return None
    _, _, thread, box = _ahead.pop()
    thread.join()
    path = box[0][0] if box else None
    return (path, None) if path is not None else None


def _real(directories: list[Path]) -> tuple[str, ...]:
    """One spelling per directory: a file written ahead in `/a/b/../m` is the one the profile asks for in `/a/m`
    (unmatched, the first run waited 0.8 s on writing a second one)."""
    return tuple(os.path.realpath(d) for d in directories)


def wait_written() -> None:
    """Wait for a probe file being written ahead to land (other measurements must not share the machine with it)."""
    for _, _, thread, _ in list(_ahead):
        thread.join()


def _discard_ahead() -> None:
    _stop_ahead.set()
    while _ahead:
        _, _, thread, box = _ahead.pop()
        thread.join(timeout=30)
        if box and box[0][0] is not None:
            remove(box[0][0])


def _write_probe(path: Path, size: int) -> None:
    block = os.urandom(4 * 1024**2)  # random, so compressing or deduplicating storage cannot flatter the read
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        written = 0
        while written < size:
            if _stop_ahead.is_set():  # the process is leaving (an error before any measurement): no file to finish
                raise OSError("the probe file's write was stopped")
            written += os.write(fd, memoryview(block)[: min(len(block), size - written)])
        os.fsync(fd)  # dirty pages cannot be evicted; after fsync they are clean and DONTNEED drops them
    finally:
        os.close(fd)


def remove(path: Path) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def free_bytes(directory: Path) -> int | None:
    try:
        st = os.statvfs(directory)
        return st.f_bavail * st.f_frsize
    except OSError:
        return None
