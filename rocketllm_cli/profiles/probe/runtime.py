"""What the Python runtime holds before any weight: measured once per machine, and this process's own now.

A process that computes imports torch and transformers, and building a model imports transformers' model code, which
pulls in torch._dynamo and torch.distributed.tensor: on a 2-core AMD EPYC (torch 2.13, transformers 5.24) 163 MiB of
anonymous memory after `import torch, transformers`, 276 MiB once LlamaForCausalLM is imported, and 340 MiB with
SmolLM2's 49,152-token tokenizer loaded beside it; the libraries' pages it maps add about 100 MiB more. A memory
cgroup charges all of it (the mapped pages where nothing outside it read them first), none of the anonymous part is
reclaimable without swap, and evicting the mapped part only reads it back, so the knobs count it beside the weights
(runtime_bytes) instead of leaving it to the reserve.

A first run measures it in its own process before it loads anything (`start`: the imports its load makes anyway,
made first), otherwise `measure_runtime` imports them in a fresh interpreter; either way the process's resident
memory is read then, and the profile caches it. (A process that held more before would only raise the figure: a
higher floor, never a lower one.)

`process_memory` is this process's own, read live: memory_available already excludes what a process holds (its
mapped pages too, where the cgroup charged them: cgroup.py), so what the runtime still adds to it is the measured
figure less that (0 once a load has imported everything), and the floor compares itself with memory_available + it.
"""

from __future__ import annotations

import subprocess
import sys
import time

from ..records import Measurement

RUNTIME_IMPORTS = (
    "torch",
    "transformers",
    "transformers.LlamaForCausalLM",
    "rocketllm_cli.stream.model",
    "rocketllm_cli.text.loop",
)
_SCRIPT = """
import importlib, sys
for name in sys.argv[1:]:
    module, _, attr = name.rpartition(".") if name.startswith("transformers.") else (name, "", "")
    loaded = importlib.import_module(module or name)
    if attr:
        getattr(loaded, attr)
from rocketllm_cli.profiles.probe.runtime import process_memory
print(process_memory())
"""
TIMEOUT_S = 300
METHOD = (
    "resident memory (RssAnon + RssFile + RssShmem) of a Python that has imported "
    + ", ".join(RUNTIME_IMPORTS)
    + " and loaded nothing else yet (a first run's own process before its model, or a fresh interpreter): what a "
    "load holds before its tokenizer, model and weights"
)


def process_memory(status: str = "/proc/self/status") -> int:
    """This process's resident memory in bytes (RssAnon + RssFile + RssShmem: its own memory and the pages it maps,
    which a memory cgroup charges and cannot take back without the process reading them again); 0 without /proc."""
    found = 0
    try:
        with open(status, encoding="ascii", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in ("RssAnon", "RssFile", "RssShmem"):
                    found += int(value.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        return 0
    return found


_taken: Measurement | None = None  # what start() measured in this process, which measure_runtime() hands out once


def start() -> None:
    """Measure the runtime now, in this process, which must have loaded no model, tokenizer or weight yet (a first
    run, before it shards): the imports a load makes anyway, made here a little earlier, and its memory read. A
    fresh interpreter doing the same cost a first run's other core 4-5 s of CPU beside the sharding and the native
    build, and the run then waited 2.7 s for it (SmolLM2, 2 cores)."""
    global _taken
    if _taken is not None:
        return
    import importlib

    started = time.perf_counter()
    try:
        for name in RUNTIME_IMPORTS:
            module, _, attr = name.rpartition(".") if name.startswith("transformers.") else (name, "", "")
            loaded = importlib.import_module(module or name)
            if attr:
                getattr(loaded, attr)
    except Exception:  # noqa: BLE001 - measure_runtime() measures in a fresh interpreter and says why it fails
        return
    found = process_memory()
    if found > 0:
        _taken = Measurement(
            "runtime_rss", float(found), METHOD, seconds=round(time.perf_counter() - started, 3), unit="B"
        )


def measure_runtime() -> Measurement:
    """The runtime's memory: what start() measured in this process (once), else a fresh interpreter's; unavailable
    (with the reason) where that fails."""
    global _taken
    if _taken is not None:
        found, _taken = _taken, None
        return found
    started = time.perf_counter()
    try:
        job = subprocess.Popen(
            [sys.executable, "-c", _SCRIPT, *RUNTIME_IMPORTS],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            text=True,
        )
    except OSError:
        return Measurement.unavailable("runtime_rss", METHOD, "could not start Python", unit="B")
    try:
        stdout, stderr = job.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        job.kill()
        job.communicate()
        return Measurement.unavailable("runtime_rss", METHOD, f"the imports ran past {TIMEOUT_S} s", unit="B")
    seconds = time.perf_counter() - started
    lines = stdout.split()
    if job.returncode != 0 or not lines or not lines[-1].isdigit() or int(lines[-1]) <= 0:
        why = (stderr.strip().splitlines() or [f"exit {job.returncode}"])[-1][:200]
        return Measurement.unavailable("runtime_rss", METHOD, f"the import failed: {why}", unit="B")
    return Measurement("runtime_rss", float(lines[-1]), METHOD, seconds=round(seconds, 3), unit="B")
