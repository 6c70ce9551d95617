"""The sockets a server listens on, bound before the model loads so a taken port or a bad host fails at once in
one line (TCP, or a unix socket only this user can reach), and the loaded heap frozen out of the collector's view
before serving."""

from __future__ import annotations

import errno
import gc
import os
import socket
from pathlib import Path

from ..errors import RocketError


def bind_unix(path: str) -> socket.socket:
    """A unix socket at PATH that only this user can connect to (made 0600 before it listens)."""
    target = Path(path).expanduser()
    target.unlink(missing_ok=True)  # a stale socket of a server that died
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    previous = os.umask(0o177)
    try:
        sock.bind(str(target))
    except OSError as exc:
        sock.close()
        raise RocketError(
            f"cannot listen on the unix socket {target} ({exc.strerror}); give another --unix path"
        ) from None
    finally:
        os.umask(previous)
    target.chmod(0o600)
    return sock


def freeze_loaded_heap() -> None:
    """Everything loaded so far (torch, transformers, the model, the app: ~420k objects) leaves the garbage
    collector's view. A full collection over them held the interpreter for 215-245 ms, and under load one comes
    every so often: every request in flight, /health included, waited for it. What serving creates is still
    collected."""
    gc.collect()
    gc.freeze()


def bind(host: str, port: int) -> socket.socket:
    """A bound socket for uvicorn, made before the model loads so a taken port fails at once, in one line."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror:
        raise RocketError(
            f"cannot listen on {host!r}: not a host name or address this machine knows; "
            "pass --host 127.0.0.1 (or 0.0.0.0 for every interface)"
        ) from None
    family, _, proto, _, address = infos[0]
    # IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY on accepted connections only when the listening socket says TCP,
    # and without it every response written in two parts (headers, body) waits ~40 ms for the client's delayed ACK.
    sock = socket.socket(family, socket.SOCK_STREAM, proto or socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise RocketError(
                f"port {port} on {host} is already in use (another server?); stop that program or pass "
                f"--port "
                "with a free port (--port 0 picks one)"
            ) from None
        if exc.errno == errno.EACCES:
            raise RocketError(
                f"not allowed to listen on port {port} (ports below 1024 need privileges); pass --port 1024 or above"
            ) from None
        if exc.errno == errno.EADDRNOTAVAIL:
            raise RocketError(
                f"cannot listen on {host}: not an address of this machine; pass --host 127.0.0.1 "
                "(or 0.0.0.0 for every interface)"
            ) from None
        raise RocketError(f"cannot listen on {host}:{port} ({exc.strerror or exc})") from None
    return sock
