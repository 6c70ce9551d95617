"""The command lines that run a `rocketllm plan` row: `generate` and `bench` with the row's flags, `shard` first where
the row's set is requantised, and `torchrun` on every host for pipeline stages.

`bench` sets the caches itself per regime (resident, host, storage); a row that splits the weights between tiers is
benched in the `auto` regime with its caches pinned by ROCKETLLM_DEVICE_CACHE_BYTES and ROCKETLLM_HOST_CACHE_BYTES,
the variables every knob reads, so what is measured is the row's residency and not what this machine would derive.
"""

from __future__ import annotations

import shlex

from ..profiles.knobs.table import KNOBS_BY_NAME

CACHE_KNOBS = ("device_cache_bytes", "host_cache_bytes")
TORCHRUN = (
    "torchrun --nnodes {hosts} --node-rank R --nproc-per-node 1 --rdzv-backend c10d --rdzv-endpoint HOST0:29500 -m "
    "rocketllm_cli"
)


def flag_of(name: str) -> str:
    spec = KNOBS_BY_NAME[name]
    return spec.flags[0] if spec.flags else spec.flag


def knob_args(row, bench: bool = False) -> list[str]:
    """The row's knob flags as command-line words (bench: less the caches its regime sets)."""
    words = []
    for name, value in row.flags.items():
        if not (bench and name in CACHE_KNOBS):
            words += [flag_of(name), str(value)]
    return words


def set_path(row, source, model: str) -> str:
    """What generate and bench take for the row: MODEL itself, or the requantised set `shard --out` writes."""
    return model if row.format.stored else f"{source.name}-{row.format.quantize}"


def bench_regime(row) -> tuple[str, dict[str, str]]:
    """(bench --regime, environment) that measure the row's residency."""
    if row.stages:
        return "auto", {}
    total = row.format.facts.total_bytes
    device, host = row.memory["device"]["weights"], row.memory["host"]["weights"]
    if device >= total:
        return "resident", {}
    if not device and host >= total:
        return "host", {}
    if not device and not host:
        return "storage", {}
    return "auto", {"ROCKETLLM_DEVICE_CACHE_BYTES": str(device), "ROCKETLLM_HOST_CACHE_BYTES": str(host)}


def bench_args(row, target: str, tokens: int | None = None) -> tuple[list[str], dict[str, str]]:
    """`rocketllm bench` arguments (after the program) and environment that measure ROW."""
    regime, env = bench_regime(row)
    words = ["bench", target, "--regime", regime, *knob_args(row, bench=True)]
    if row.batch > 1:
        words += ["--batch", str(row.batch)]
    if tokens is not None:
        words += ["--tokens", str(tokens)]
    return words, env


def commands(row, source, model: str) -> dict[str, str | None]:
    """{shard, generate, bench}: the lines that run ROW (shard None where MODEL runs as it is)."""
    target = set_path(row, source, model)
    program = TORCHRUN.format(hosts=row.hosts) if row.hosts > 1 else "rocketllm"
    shard = None
    if not row.format.stored:
        shard = f"rocketllm shard {shlex.quote(model)} --quantize {row.format.quantize} --out {shlex.quote(target)}"
    generate = " ".join([program, "generate", shlex.quote(target), *map(shlex.quote, knob_args(row))])
    if row.batch > 1:
        generate += " --batch < prompts.txt"
    words, env = bench_args(row, target)
    bench = " ".join([*(f"{k}={v}" for k, v in env.items()), program, *map(shlex.quote, words)])
    return {"shard": shard, "generate": generate, "bench": bench}
