"""Find the warm server for a model and its load-time knobs, or start one: `rocketllm serve MODEL --unix SOCKET
--keep-alive S` in a session of its own, its stderr in a log beside the socket. The same model with other knobs
replaces its server; another model loads beside the warm ones when the memory free now holds it (its weights plus a
quarter for the KV cache and buffers, plus the reserve), else the oldest are stopped until it does, saying which and
why. While a server starts, its start-up lines (sharding, loading) are relayed to the caller's stderr; if it exits
instead, its last error line is the caller's error.
"""

from __future__ import annotations

import json
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
        others = sorted((o for o in registry.entries() if o.key != key and registry.alive(o)), key=lambda o: o.started)
        name = registry.model_name(model)
        for other in [o for o in others if o.model == name]:  # superseded: the same weights with other knobs
            log(f"note: stopping the warm server of {other.model} (pid {other.pid}): it was started with other knobs")
            stop(other)
        others = [o for o in others if o.model != name]
        while others:
            fits, words = room_for(model)
            if fits:
                log(
                    f"note: {Path(name).name} loads beside {len(others)} warm model{'s' if len(others) > 1 else ''} "
                    f"({', '.join(Path(o.model).name for o in others)}): {words}"
                )
                break
            oldest = others.pop(0)
            log(
                f"note: stopping the warm server of {oldest.model} (pid {oldest.pid}) to make room for {model}: {words}"
            )
            stop(oldest)
        return _start(key, model, knob_flags, keep_alive_s, log), True


KV_SHARE = 0.25  # room beside the weights for the KV cache, streaming buffers and the interpreter


def room_for(model: str) -> tuple[bool, str]:
    """Whether MODEL can load beside the warm servers running now: (fits, the figures in words). From the memory free
    now (what the running servers hold is already taken) against its weights on disk plus KV_SHARE plus the reserve
    (the reserve knob's rule on a machine: profiles/knobs/memory.py MACHINE_RESERVE); a size not known before loading
    does not fit."""
    import psutil

    from ..profiles.knobs.expression import evaluate
    from ..profiles.knobs.memory import MACHINE_RESERVE, machine_reserve_inputs
    from ..sizes import format_bytes

    weights = model_bytes(model)
    memory = psutil.virtual_memory()
    if weights is None:
        return False, "its size is not known before it loads"
    reserve = int(evaluate(MACHINE_RESERVE, machine_reserve_inputs(memory.total)))
    need = int(weights * (1 + KV_SHARE)) + reserve
    words = (
        f"{format_bytes(memory.available)} free, {format_bytes(need)} needed ({format_bytes(weights)} of weights, "
        f"+{KV_SHARE:.0%}, + {format_bytes(reserve)} reserve)"
    )
    return memory.available >= need, words


def model_bytes(model: str) -> int | None:
    """The weights' bytes on disk: a file's size, or a directory's weight files (shards, safetensors, .bin, .gguf);
    None for a hub id or an empty directory."""
    path = Path(str(model)).expanduser()
    if path.is_file():
        return path.stat().st_size
    if not path.is_dir():
        return None
    if (
        path / "manifest.json"
    ).is_file():  # a shard set: its weights, which an indexed set keeps in the file it indexes
        try:
            doc = json.loads((path / "manifest.json").read_text(encoding="utf-8"))
            return sum(int(t["nbytes"]) for u in doc["units"] for t in u["tensors"]) or None
        except (OSError, ValueError, KeyError, TypeError):
            return None
    total = sum(
        f.stat().st_size for pattern in ("*.safetensors", "*.bin", "*.gguf") for f in path.glob(pattern) if f.is_file()
    )
    return total or None


def _start(key: str, model: str, knob_flags: dict, keep_alive_s: float, log) -> registry.Entry:
    sock = registry.socket_path(key)
    sock.unlink(missing_ok=True)
    log_path = sock.with_suffix(".log")
    flags = [arg for name, value in sorted(knob_flags.items()) for arg in ("--" + name.replace("_", "-"), str(value))]
    command = [
        sys.executable,
        "-m",
        "rocketllm_cli",
        "serve",
        str(model),
        "--unix",
        str(sock),
        "--keep-alive",
        f"{keep_alive_s:g}",
        "--warm-key",
        key,
        "--no-access-log",
        *flags,
    ]
    env = {k: v for k, v in os.environ.items() if k != "ROCKETLLM_API_KEY"}  # a user-only socket needs no key
    with open(log_path, "w") as err:
        process = subprocess.Popen(
            command, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err, env=env, start_new_session=True
        )  # not in the caller's process group: Ctrl-C there leaves it
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
        if line.startswith(
            (
                "note:",
                "warning:",
                "sharded",
                "resident modules:",
                "measuring",
                "reading ",
                "sharding ",
                "saving the ",
                "resuming:",
                "loading ",
            )
        ):
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
    return f"the background server exited ({code}) before it listened; its log is {log_path}" + (
        f": {lines[-1]}" if lines else ""
    )


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
