"""`bench --kernels`' llama.cpp column: llama.cpp's own speed on the same product, per GGUF block type.

The product is ours (one fp32 activation row times a 4096 x 4096 weight, cycled over a pool of such weights, on the
same threads, the best of the same sweeps after a warm-up one), computed by llama-cpp-python's own ggml libraries as
its CPU backend computes a decode (ggmlkernels_worker.py: the weights in the buffer type its model loader picks, AMX
or repacked where one takes them, its mul_mat quantizing the activations to its q8 types). The blocks are the
well-formed random ones bench times the torch decoder on, handed over in a temporary file; the worker returns the
first weight's product too, so bench can check it against ours.
It runs in a process of its own: a crash in native code is a note, and that type is measured once more with the
extra buffer types off (the plain CPU buffer, as llamacpp.py retries a model), its note saying so. llama-cpp-python
is not a dependency: without it the column reads "-" and the note says how to install it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from .llamacpp import NOT_INSTALLED, installed

WORKER = "rocketllm_cli.bench.ggmlkernels_worker"  # run with -m: numpy and ctypes, neither torch nor llama_cpp
TIMEOUT_S = 300  # a hung worker is a note too


class LlamaCppRates:
    """Blocks handed over one type at a time (add), then measured in one worker run (measure); a context manager
    that removes the blocks' files."""

    def __init__(self):
        self.reason = "" if installed() else NOT_INSTALLED
        self._dir = None if self.reason else tempfile.TemporaryDirectory(prefix="rocketllm-ggml-")
        self._products: list[dict] = []

    @property
    def wanted(self) -> bool:
        return not self.reason

    def add(self, name: str, ggml_type: int, blocks, cols: int) -> None:
        """BLOCKS (uint8 [rows, row bytes], a tensor or an array) of type NAME, for a [1, COLS] activation."""
        if self._dir is None:
            return
        path = Path(self._dir.name) / f"{name}.blocks"
        data = blocks.numpy() if hasattr(blocks, "numpy") else blocks
        try:
            data.tofile(path)
        except OSError as e:  # a full temporary directory: the column is "-", the bench goes on
            self.reason = f"the blocks could not be handed over: {e}"
            self.close()
            return
        self._products.append(
            {"type": name, "ggml_type": ggml_type, "rows": int(data.shape[0]), "cols": cols, "file": str(path)}
        )

    def measure(self, x: list[float], threads: int, pool_bytes: int, repeats: int) -> dict:
        """{"version", "reason" (why nothing was measured, else ""), "rows": {type: {"bytes_per_s", "buffer", "y"}},
        "notes": [one line per type not measured, or measured otherwise]}; never raises for llama.cpp's sake."""
        found: dict = {"version": None, "reason": self.reason, "rows": {}, "notes": []}
        if self.reason or not self._products:
            return found
        request = {"threads": threads, "repeats": repeats, "pool_bytes": pool_bytes, "x": x, "extra_buffers": True}
        pending = list(self._products)
        while pending:
            answers, why = _run_worker({**request, "products": pending})
            version = next((a["ready"] for a in answers if "ready" in a), None)
            if version is None:  # the libraries did not load, or ggml crashed binding them: nothing is measured
                skip = next((a["skip"] for a in answers if "skip" in a), "")
                found["reason"] = skip or why or "llama.cpp gave no answer"
                return found
            found["version"] = version
            done = _take(answers, found)
            pending = [p for p in pending if p["type"] not in done]
            if not pending:
                break
            if not why:
                found["notes"].append(f"{', '.join(p['type'] for p in pending)}: llama.cpp gave no answer")
                break
            crashed, pending = pending[0], pending[1:]  # in its product: once more on the plain CPU buffer
            name = crashed["type"]
            again, why_again = _run_worker({**request, "products": [crashed], "extra_buffers": False})
            if name in _take(again, found) and name in found["rows"]:
                found["rows"][name]["extra_buffers"] = False
                found["notes"].append(f"{name}: llama.cpp {why} with its extra buffer types on; measured with them off")
            elif name not in found["rows"]:
                found["notes"].append(
                    f"{name}: llama.cpp {why} (with its extra buffer types off: {why_again or 'it failed'})"
                )
        return found

    def close(self) -> None:
        if self._dir is not None:
            self._dir.cleanup()
            self._dir = None

    def __enter__(self) -> LlamaCppRates:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _take(answers: list[dict], found: dict) -> set[str]:
    """The types ANSWERS settle, their rates into FOUND's rows, their errors into its notes."""
    done = set()
    for a in answers:
        if "bytes_per_s" in a:
            found["rows"][a["type"]] = {k: a[k] for k in ("bytes_per_s", "buffer", "y")}
        elif "error" in a:
            found["notes"].append(f"{a['type']}: llama.cpp failed: {a['error']}"[:300])
        else:
            continue
        done.add(a["type"])
    return done


def _run_worker(request: dict) -> tuple[list[dict], str]:
    """(the worker's answers, "") or (those it gave before it ended, why it ended early)."""
    env = {**os.environ, "GGML_NO_BACKTRACE": "1"}  # an abort prints its line, not a debugger's backtrace
    try:
        run = subprocess.run(
            [sys.executable, "-m", WORKER],
            input=json.dumps(request),
            capture_output=True,
            text=True,
            check=False,
            timeout=TIMEOUT_S,
            env=env,
        )
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else e.stdout or ""
        return _answers(out), f"ran past {TIMEOUT_S} s"
    answers = _answers(run.stdout)
    if run.returncode == 0:
        return answers, ""
    last_err = next((line.strip() for line in reversed(run.stderr.splitlines()) if line.strip()), "")
    how = f"signal {_signal_name(-run.returncode)}" if run.returncode < 0 else f"exit status {run.returncode}"
    return answers, " ".join(f"crashed ({how}){': ' + last_err if last_err else ''}".split())[:300]


def _answers(stdout: str) -> list[dict]:
    found = []
    for line in stdout.splitlines():
        try:
            answer = json.loads(line)
        except ValueError:
            continue
        if isinstance(answer, dict):
            found.append(answer)
    return found


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return str(number)
