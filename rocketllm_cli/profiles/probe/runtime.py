"""What the Python runtime holds before any weight: measured once per machine, and this process's own now.

A process that computes imports torch and transformers, and building a model imports transformers' model code, which
pulls in torch._dynamo and torch.distributed.tensor: on a 2-core AMD EPYC (torch 2.13, transformers 5.24) 163 MiB of
anonymous memory after `import torch, transformers`, 276 MiB once LlamaForCausalLM is imported, and 340 MiB with
SmolLM2's 49,152-token tokenizer loaded beside it; the libraries' pages it maps add about 100 MiB more. A memory
cgroup charges all of it (the mapped pages where nothing outside it read them first), none of the anonymous part is
reclaimable without swap, and evicting the mapped part only reads it back, so the knobs count it beside the weights
(runtime_bytes) instead of leaving it to the reserve.

`measure_runtime` imports what a load imports in a fresh interpreter and reads its resident memory; the profile
caches it. `process_memory` is this process's own, read live: memory_available already excludes what a process holds
(its mapped pages too, where the cgroup charged them: cgroup.py), so what the runtime still adds to it is the measured
figure less that (0 once a load has imported everything), and the floor compares itself with memory_available + it.
"""

from __future__ import annotations

import subprocess
import sys
import time

from ...threads import background_priority
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
    "resident memory (RssAnon + RssFile + RssShmem) of a fresh Python after importing "
    + ", ".join(RUNTIME_IMPORTS)
    + ": what a load holds before its tokenizer, model and weights"
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


_started: tuple[subprocess.Popen, float] | None = None  # a measurement start() began, which measure_runtime() collects


def start() -> None:
    """Begin the measurement now in its own interpreter (seconds of imports), so that it runs beside what comes before
    the profile needs it (a first run's sharding); measure_runtime() collects it. Once per process."""
    global _started
    if _started is not None:
        return
    try:
        job = subprocess.Popen(
            [sys.executable, "-c", _SCRIPT, *RUNTIME_IMPORTS],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            text=True,
            preexec_fn=background_priority,  # its imports run on the cores the main work leaves
        )
    except OSError:
        return  # measure_runtime() tries again and says why
    _started = (job, time.perf_counter())


def measure_runtime() -> Measurement:
    """The runtime's anonymous memory, from a fresh interpreter (the one start() began, else one now); unavailable
    (with the reason) where that fails."""
    global _started
    if _started is None:
        start()
    if _started is None:
        return Measurement.unavailable("runtime_rss", METHOD, "could not start Python", unit="B")
    (job, started), _started = _started, None
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
