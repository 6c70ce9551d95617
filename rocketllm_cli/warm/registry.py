"""Where warm servers are: a directory only this user can enter ($XDG_RUNTIME_DIR/rocketllm, else the cache's run/),
holding for each model and set of load-time knobs `<key>.sock` (the server's unix socket, mode 0600), `<key>.json`
(written by the server once it listens, removed when it stops) and `<key>.lock` (held while one is started)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import socket
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..errors import RocketError


@dataclass
class Entry:
    key: str
    pid: int
    model: str  # what the user gave: a path (resolved) or a hub id
    model_id: str  # what the server serves it as
    socket: str
    knobs: dict = field(default_factory=dict)  # the load-time knob flags it was started with
    keep_alive_s: float = 0.0
    started: float = 0.0  # time.time() when it began listening
    log: str = ""  # its stderr

    def write(self) -> None:
        path = Path(self.socket).with_suffix(".json")
        partial = path.with_suffix(".partial")
        partial.write_text(json.dumps(asdict(self)))
        partial.replace(path)  # a reader sees the whole entry or none

    def remove(self) -> None:
        for suffix in (".json", ".sock"):
            with contextlib.suppress(FileNotFoundError):
                Path(self.socket).with_suffix(suffix).unlink()


def run_path() -> Path:
    """Where warm servers are registered; nothing is created here."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and os.path.isabs(runtime) and os.access(runtime, os.W_OK):
        return Path(runtime) / "rocketllm"
    from ..cachehome import cache_root

    return cache_root() / "run"


def run_dir() -> Path:
    """The directory of warm servers, created with mode 0700 (sockets and entries of this user only)."""
    path = run_path()
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        path.chmod(0o700)
    except OSError as exc:
        raise RocketError(
            f"cannot use {path} for warm models ({exc.strerror}); set ROCKETLLM_CACHE to a writable "
            "directory, or pass --keep-alive 0"
        ) from None
    return path


def model_name(model: str) -> str:
    """How an entry names its model: a path resolved, else what was given (a hub id)."""
    path = Path(str(model)).expanduser()
    return str(path.resolve()) if path.exists() else str(model)


def model_identity(model: str) -> str:
    """What makes two models the same warm model: a GGUF's content (a copy elsewhere attaches to the server the first
    one started), else its name."""
    path = Path(str(model)).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        from ..shard.identity import content_fingerprint

        return f"gguf:{content_fingerprint(path)}"
    return model_name(model)


def key_for(model: str, knob_flags: dict) -> str:
    """The same model with the same load-time knobs is the same warm server."""
    return hashlib.sha256(json.dumps([model_identity(model), sorted(knob_flags.items())]).encode()).hexdigest()[:16]


def socket_path(key: str) -> Path:
    return run_dir() / f"{key}.sock"


def entries() -> list[Entry]:
    """Every registered warm server, alive or not (see alive())."""
    found = []
    directory = run_path()  # only read: where it cannot be made there are no warm models to list
    for path in sorted(directory.glob("*.json")) if directory.is_dir() else ():
        try:
            found.append(Entry(**json.loads(path.read_text())))
        except (OSError, ValueError, TypeError):
            continue  # being written or removed: not an entry yet
    return found


def find(key: str) -> Entry | None:
    path = run_path() / f"{key}.json"
    try:
        return Entry(**json.loads(path.read_text()))
    except (OSError, ValueError, TypeError):
        return None


def alive(entry: Entry, timeout: float = 1.0) -> bool:
    """The process is there and its socket accepts a connection (a stale entry, of a server killed, is neither)."""
    try:
        os.kill(entry.pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return False  # another user's process took the pid: not ours
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(timeout)
        try:
            probe.connect(entry.socket)
        except OSError:
            return False
    return True


@contextlib.contextmanager
def starting(key: str):
    """Held while a server for KEY is found or started: two first calls at once start one server."""
    import fcntl

    with open(run_dir() / f"{key}.lock", "a+") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def process_rss(pid: int) -> int | None:
    """Resident memory of PID in bytes (Linux /proc), None where it cannot be read."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def wait_gone(pid: int, timeout: float) -> bool:
    """Whether PID has exited within TIMEOUT seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


def register_server(key: str, sock, model: str, state, knob_flags: dict, idle_s):
    """The warm-model registry's entry for this server (generate started it), written once it listens."""
    path = Path(str(model)).expanduser()
    entry = Entry(
        key=key,
        pid=os.getpid(),
        model=str(path.resolve()) if path.exists() else str(model),
        model_id=state.model_id,
        socket=sock.getsockname(),
        knobs=dict(knob_flags),
        keep_alive_s=idle_s or 0.0,
        started=time.time(),
        log=str(Path(sock.getsockname()).with_suffix(".log")),
    )
    entry.write()
    return entry
