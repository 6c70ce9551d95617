"""`rocketllm plan --verify K`: the top K rows that can run here, each measured by `rocketllm bench` in a process of its
own (the row's regime and flags; a requantised set sharded first, into the cache), projected beside measured.

A row planned for less RAM than this machine has cannot be held to it without a memory cgroup: where
ROCKETLLM_WITH_RAM names a `with-ram LIMIT -- CMD` wrapper the bench runs under it, else the row says it was measured
without the cap. Either way the row's caches are the row's (bench's regime, or pinned by the knobs' variables).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from ..planning.commandlines import bench_args, set_path
from ..sizes import format_bytes

WITH_RAM = "ROCKETLLM_WITH_RAM"
TIMEOUT_S = 1800  # one row: sharding a requantised set and a bench run of a large model
MiB = 1024**2
# Decode tokens a speculating row is benched over: its rate is tokens over passes, and bench's default 8 tokens are
# three passes at 2.7 tokens a pass, too few to average which drafts were accepted (0.74-1.10 of the projection
# from one run to the next on a random 2.8B under 1.2 GiB)
SPECULATING_TOKENS = 32


def verify_rows(plan, model: str, count: int, log, progress=None) -> list[dict]:
    """Measure the top COUNT runnable rows of PLAN; one entry per row tried (skipped ones say why)."""
    from ..profiles.probe.machine import memory

    ram_total, ram_free = memory()
    wrapper = os.environ.get(WITH_RAM, "").strip()
    out, ran = [], 0
    for row in plan.rows:
        if ran == count:
            break
        entry = {
            "rank": row.rank,
            "projected_tokens_per_s": row.tokens_per_s,
            "tokens_per_s": None,
            "status": "skipped",
            "notes": [],
        }
        out.append(entry)
        if row.hosts > 1:
            entry["reason"] = f"needs {row.hosts} hosts: run its torchrun lines on each"
            continue
        if row.memory["used"] > ram_free:
            entry["reason"] = (
                f"needs {format_bytes(row.memory['used'])}, this machine has {format_bytes(ram_free)} free"
            )
            continue
        ran += 1
        target = set_path(row, plan.source, model)
        if not row.format.stored:
            target = _requantised(plan.source, model, row, log)
        words, env = bench_args(row, str(target), SPECULATING_TOKENS if row.speculate != "off" else None)
        command = [sys.executable, "-m", "rocketllm_cli", *words, "--json"]
        if plan.profile.ram_total < ram_total:
            limit = f"{plan.profile.ram_total // MiB}M"
            # A machine of that much RAM holds none of the weights in its page cache beyond what the run reads: the
            # files this one cached (earlier rows, sharding) would serve the capped run from memory outside its cap.
            evicted = _evict_model(Path(target), Path(model), *_sets_of(Path(model)))
            entry["notes"].append(f"started cold: {evicted} evicted from the page cache")
            if wrapper:
                command = [wrapper, limit, "--", *command]
                entry["notes"].append(f"under {Path(wrapper).name} {limit}")
            else:
                entry["notes"].append(
                    f"measured without the {format_bytes(plan.profile.ram_total)} cap the row assumes (no cgroup tool: "
                    f"set {WITH_RAM} to a `with-ram LIMIT -- CMD` wrapper); its caches are the row's"
                )
        if plan.hardware or plan.profile.fingerprint != _here(plan):
            entry["notes"].append("planned for other hardware than this machine's: measured here")
        entry["command"] = " ".join([*(f"{k}={v}" for k, v in env.items()), "rocketllm", *words])
        log(f"verify #{row.rank}: {entry['command']}")
        phase = progress(f"verify #{row.rank}", announce=False) if progress else _nothing()
        with phase:
            entry.update(_measure(command, {**os.environ, **env, "ROCKETLLM_KEEP_ALIVE": "0"}, row.batch))
        entry.update(_at_disk_now(row, entry))
    return out


def _at_disk_now(row, entry: dict) -> dict:
    """The row's own formula with the storage bandwidth bench read off the disk just after the run (disk_now) in place
    of the profile's: a shared disk delivers what it delivers this hour (1.7 and 2.5 GB/s within one hour here), and
    this says whether the model holds at the bandwidth the run had. {} where nothing streamed or it was not measured."""
    from ..profiles.cost import own_reads
    from ..profiles.knobs.expression import evaluate

    disk = entry.pop("disk_now", None)
    if not disk or "storage_bps" not in row.inputs or entry.get("status") != "measured":
        return {}
    # like for like: a row projected at the set's own reads (the way the knobs read) is re-projected at that way's
    # rate now, one projected at the storage probe's at the fastest way now
    own = own_reads(row.format.facts) is not None
    now = disk.get("run_way") if own and disk.get("run_way") else disk
    projected = evaluate(row.formula, {**row.inputs, "storage_bps": now["bps"]})
    return {"disk_now": {"bps": now["bps"], "how": now.get("how", ""), "projected_tokens_per_s": projected}}


def _measure(command: list[str], env: dict, batch: int) -> dict:
    try:
        done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired:
        return {"status": "failed", "reason": f"bench ran past {TIMEOUT_S} s"}
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no message"])[-1]
        return {"status": "failed", "reason": f"bench exited {done.returncode}: {last}"}
    try:
        doc = json.loads(done.stdout)
    except ValueError:
        return {"status": "failed", "reason": "bench printed no JSON document"}
    if batch > 1 and doc.get("batch"):
        row = doc["batch"]["rows"][0]
        return {"status": "measured", "tokens_per_s": row["tokens_per_s"], "ms_per_token": row["ms_per_step"]["median"]}
    row = next((r for r in doc.get("rows", []) if r.get("name") == "rocketllm"), None)
    if row is None or row.get("status") != "measured":
        return {"status": "failed", "reason": (row or {}).get("reason") or "bench measured no row"}
    ms = row["ms_per_token"]["median"]
    # tokens/s as bench's table defines it, 1000 / the median ms per token, except where the run speculated: a pass's
    # time is shared among the tokens it made, so the median token sits in the passes that made the most (3 of 3
    # accepted: a third of a pass) and overstates the rate; there the mean, tokens over time, is the rate
    speculated = bool((row.get("speculation") or {}).get("passes"))
    rate = row.get("tokens_per_s") if speculated and row.get("tokens_per_s") else 1000 / ms if ms else None
    return {
        "status": "measured",
        "tokens_per_s": rate,
        "ms_per_token": ms,
        "rate": "mean" if speculated else "median",
        "ms_p10_p90": [row["ms_per_token"].get("p10"), row["ms_per_token"].get("p90")],
        "bench_projected_ms": row.get("projected_ms"),
        "bytes_per_token": row.get("bytes_per_token"),
        "speculation": row.get("speculation"),
        "disk_now": row.get("disk_now"),
    }


def _requantised(source, model: str, row, log) -> Path:
    """The row's requantised set, written once into the cache (`shard --quantize ... --out`)."""
    from ..profiles import cache_dir

    target = cache_dir() / "plan" / f"{source.name}-{row.format.quantize}"
    if not (target / "manifest.json").is_file():
        log(f"verify #{row.rank}: rocketllm shard {model} --quantize {row.format.quantize} --out {target}")
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "rocketllm_cli",
                "shard",
                model,
                "--quantize",
                row.format.quantize,
                "--out",
                str(target),
            ],
            capture_output=True,
            text=True,
            timeout=TIMEOUT_S,
            check=False,
        )
        if done.returncode != 0:
            from ..errors import ShardError

            raise ShardError((done.stderr.strip().splitlines() or ["shard failed"])[-1].removeprefix("error: "))
    return target


def _here(plan) -> str:
    from ..profiles.probe.machine import fingerprint, fingerprint_facts

    return fingerprint(fingerprint_facts())


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _evict_model(*paths: Path) -> str:
    """Evict every file of PATHS (a GGUF, a shard set) from the page cache; says how much, in words."""
    from ..profiles.probe.storage import evict_file

    files = {f for p in paths for f in ([p] if p.is_file() else p.rglob("*") if p.is_dir() else []) if f.is_file()}
    for f in files:
        evict_file(f)
    return f"{len(files)} file{'s' if len(files) != 1 else ''} ({format_bytes(sum(f.stat().st_size for f in files))})"


def _sets_of(model: Path) -> list[Path]:
    """The shard sets in the cache made from MODEL (by its name: every dtype and packing), which a bench of it loads."""
    from ..shard.target import shards_root

    if not model.is_file():
        return []
    return sorted(p for p in shards_root().glob(f"{model.stem}-*") if p.is_dir())
