"""Find the warm server for a model and its load-time knobs, or start one: `rocketllm serve MODEL --unix SOCKET
--keep-alive S` in a session of its own, its stderr in a log beside the socket. One warm model at a time: starting
another stops the others (each holds a model's memory), saying so. While a server starts, its start-up lines
(sharding, loading) are relayed to the caller's stderr; if it exits instead, its last error line is the caller's error.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from ..errors import RocketError
from . import registry

POLL_S = 0.05
STOP_WAIT_S = 10.0


def warm_server(model: str, knob_flags: dict, keep_alive_s: float, log) -> tuple[registry.Entry, bool]:
    """(the live warm server for MODEL and KNOB_FLAGS, whether this call started it)."""
    key = registry.key_for(model, knob_flags)
    entry = registry.find(key)
    if entry is not None and registry.alive(entry):
        return entry, False
    with registry.starting(key):
        entry = registry.find(key)  # another first call may have started it while this one waited
        if entry is not None and registry.alive(entry):
            return entry, False
        if entry is not None:
            entry.remove()  # stale: its process died or no longer answers
        for other in registry.entries():
            if other.key != key and registry.alive(other):
                log(f"note: stopping the warm server of {other.model} (pid {other.pid}) to make room for {model}")
                stop(other)
        return _start(key, model, knob_flags, keep_alive_s, log), True


def _start(key: str, model: str, knob_flags: dict, keep_alive_s: float, log) -> registry.Entry:
    sock = registry.socket_path(key)
    sock.unlink(missing_ok=True)
    log_path = sock.with_suffix(".log")
    flags = [arg for name, value in sorted(knob_flags.items()) for arg in ("--" + name.replace("_", "-"), str(value))]
    command = [sys.executable, "-m", "rocketllm_cli", "serve", str(model), "--unix", str(sock), "--keep-alive", f"{keep_alive_s:g}",
               "--warm-key", key, "--no-access-log", *flags]
    env = {k: v for k, v in os.environ.items() if k != "ROCKETLLM_API_KEY"}  # a user-only socket needs no key
    with open(log_path, "w") as err:
        process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err, env=env,
                                   start_new_session=True)  # not in the caller's process group: Ctrl-C there leaves it
    relayed = 0
    try:
        while True:
            relayed = _relay(log_path, relayed, log)
            entry = registry.find(key)
            if entry is not None and entry.pid == process.pid and registry.alive(entry):
                return entry
            if process.poll() is not None:
                _relay(log_path, relayed, log)
                raise RocketError(_failure(log_path, process.returncode))
            time.sleep(POLL_S)
    except KeyboardInterrupt:
        process.terminate()  # interrupted while it loads: nothing is warm yet, so nothing is left behind
        raise


def _relay(log_path: Path, done: int, log) -> int:
    """The server's start-up lines (sharding, loading, its plan) on the caller's stderr, as a cold run shows them."""
    try:
        text = log_path.read_text(errors="replace")
    except OSError:
        return done
    lines = text.splitlines()
    complete = lines if text.endswith("\n") else lines[:-1]  # a line still being written waits
    for line in complete[done:]:
        if line.startswith(("note:", "warning:", "sharded", "resident modules:", "measuring")):
            log(line)
    return max(done, len(complete))


def _failure(log_path: Path, code: int) -> str:
    """The error a server that could not start printed, as the caller's own (one line)."""
    try:
        lines = [line for line in log_path.read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        lines = []
    errors = [line.removeprefix("error: ") for line in lines if line.startswith("error: ")]
    if errors:
        return errors[-1]
    return f"the background server exited ({code}) before it listened; its log is {log_path}" + (f": {lines[-1]}" if lines else "")


def stop(entry: registry.Entry, timeout: float = STOP_WAIT_S) -> bool:
    """Ask a warm server to stop (SIGTERM: it finishes or cancels what runs and exits); True once it is gone."""
    try:
        os.kill(entry.pid, signal.SIGTERM)
    except ProcessLookupError:
        entry.remove()
        return True
    gone = registry.wait_gone(entry.pid, timeout)
    if gone:
        entry.remove()
    return gone
