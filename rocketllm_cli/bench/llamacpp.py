"""The llama.cpp baseline: llama-cpp-python on the GGUF file itself, its weights computed on as stored (quantized).

Measured like every other row (timing.py): the fixed prompt of --prompt-tokens tokens, greedy decoding, 1 + warm-up
+ --tokens tokens, the warm-up left out; each step is timed from one yielded token to the next, as the streamer does.
The file is mapped (use_mmap, llama.cpp's default), so its weights sit in the page cache as our host tier's do on a
CPU; n_threads is the profile's usable cores; every layer goes to the GPU when the compute device is one, none on a CPU.
It runs in a process of its own (llamacpp_worker.py): a crash in native code is a skipped row saying so. A build whose
repacked weights crash (extra buffer types, such as its AMX or repacked CPU kernels, on a CPU that refuses them) is
measured once more with those off, and the row says so.
llama-cpp-python is not a dependency: without it the row is a skip with the install command.
"""

from __future__ import annotations

import importlib.util
import json
import signal
import subprocess
import sys
from itertools import pairwise
from pathlib import Path

from .timing import PROMPT_TEXT, WARMUP, ms_summary

NOT_INSTALLED = "llama-cpp-python is not installed (pip install llama-cpp-python)"
WORKER = "rocketllm_cli.bench.llamacpp_worker"  # run with -m: the package, not torch, is all it imports of ours


def gguf_file(model: str | None, manifest) -> tuple[Path | None, str]:
    """The GGUF file MODEL is, or (None, why not) for a checkpoint, a shard set or a synthetic model."""
    from ..checkpoint.manifest import MANIFEST

    path = Path(model).expanduser() if model else None
    if path is not None and path.is_file() and path.suffix == ".gguf":
        return path, ""
    if path is not None and path.is_dir() and not (path / MANIFEST).is_file() and not (path / "config.json").is_file():
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:  # a directory holding one GGUF is that GGUF (shard/source.py reads it so too)
            return ggufs[0], ""
    if manifest.source.get("kind") == "gguf":
        return None, (
            f"MODEL is a shard set of {manifest.source.get('name')}.gguf: pass the .gguf file to measure llama.cpp"
        )
    return None, "the model has no GGUF file (llama.cpp runs GGUF files; MODEL was not sharded from one)"


def installed() -> bool:
    """llama_cpp importable, judged without importing it (its native libraries stay out of this process)."""
    try:
        return importlib.util.find_spec("llama_cpp") is not None
    except ValueError:  # in sys.modules without a spec: imported somehow, so present
        return True


def run_llamacpp(gguf: Path | None, no_gguf: str, regime: str, tokens: int, prompt_tokens: int, profile, log) -> dict:
    """One baseline row: measured, or skipped with the reason (never an exception)."""
    row = {"name": "llamacpp", "regime": regime, "status": "skipped", "reason": ""}
    if not installed():
        row["reason"] = NOT_INSTALLED
        return row
    if gguf is None:
        row["reason"] = no_gguf
        return row
    threads = int(profile.cpu_cores)
    gpu_layers = 0 if profile.compute_device == "cpu" else -1
    new = 1 + WARMUP + tokens
    from ..stream.context import run_tokens

    # n_ctx: the tokens this run holds, as our row's KV cache is sized (regimes.py)
    request = {
        "gguf": str(gguf),
        "n_ctx": run_tokens([prompt_tokens], new),
        "n_threads": threads,
        "n_gpu_layers": gpu_layers,
        "prompt_text": PROMPT_TEXT,
        "prompt_tokens": prompt_tokens,
        "new_tokens": new,
    }
    answer, why = _run_worker(request)
    extra = ""
    if answer is None and why.startswith("llama.cpp crashed"):  # perhaps in its repacked weights: once more without
        crash = why.removeprefix("llama.cpp ")
        answer, why = _run_worker({**request, "extra_buffers": False})
        extra = f"its default {crash}; measured with its extra buffer types off (use_extra_bufts=False)"
        if answer is None or "skip" in answer:
            why = f"{why or answer['skip']} (with its extra buffer types off; with them on it {crash})"
    if answer is None or "skip" in answer:
        row["reason"] = why or answer["skip"]
        return row
    times, marks = answer["times"], answer["marks"]
    if len(times) < new:
        row["reason"] = f"llama.cpp stopped after {len(times)} tokens; expected {new}"
        return row
    gaps = [b - a for a, b in pairwise(times)][WARMUP:]
    first, last = marks[WARMUP], marks[-1]
    where = "no GPU layers" if gpu_layers == 0 else "every layer on the GPU"
    log(
        f"{regime}: llama.cpp {answer['version']} on {gguf.name}, {threads} threads, "
        f"{where}{'; ' + extra if extra else ''}"
    )
    row.update(
        status="measured",
        ttft_ms=round(1000 * (times[0] - answer["start"]), 1),
        ms_per_token=ms_summary(gaps),
        storage_witnessed_per_token=(last - first) // len(gaps) if first is not None and last is not None else None,
        bytes_per_token=None,
        llamacpp={
            "version": answer["version"],
            "n_threads": threads,
            "n_gpu_layers": gpu_layers,
            "use_mmap": True,
            "gguf": gguf.name,
            "gguf_bytes": gguf.stat().st_size,
            **({"extra_buffers": extra} if extra else {}),
        },
    )
    return row


def _run_worker(request: dict) -> tuple[dict | None, str]:
    """(the worker's answer, "") or (None, why it gave none)."""
    run = subprocess.run(
        [sys.executable, "-m", WORKER], input=json.dumps(request), capture_output=True, text=True, check=False
    )
    last_err = next((line.strip() for line in reversed(run.stderr.splitlines()) if line.strip()), "")
    if run.returncode != 0:
        how = f"signal {_signal_name(-run.returncode)}" if run.returncode < 0 else f"exit status {run.returncode}"
        return None, " ".join(f"llama.cpp crashed ({how}){': ' + last_err if last_err else ''}".split())[:300]
    try:
        return json.loads(run.stdout.strip().splitlines()[-1]), ""
    except (ValueError, IndexError):
        return None, " ".join(f"llama.cpp gave no answer: {last_err or run.stdout[-200:]}".split())[:300]


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return str(number)
