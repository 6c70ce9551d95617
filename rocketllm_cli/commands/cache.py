"""rocketllm cache: see and remove the shard sets (and see the profiles) that rocketllm keeps on disk."""

from __future__ import annotations

import sys
import time
from typing import Annotated, Optional

import typer

from ..errors import UsageError
from ..options import JsonOpt
from ..output import Output
from ..sizes import format_bytes

NAME = "cache"
HELP = """See and remove what rocketllm keeps on disk: shard sets and measured profiles.

Shards go to the cache unless --out is given: ROCKETLLM_CACHE if set, else ~/.cache/rocketllm
($XDG_CACHE_HOME/rocketllm). A GGUF's set indexes the file in place (SOURCE "gguf in place": a few MB of
manifest, tokenizer and config; removing it leaves the file alone); `shard --copy` writes its weights into the set.

Examples: `rocketllm cache ls`, `rocketllm cache rm NAME -y`, `rocketllm cache rm --all`, `du -sh "$(rocketllm cache
path)"`.
"""
LS_HELP = """List every shard set in the cache: model, source, dtype, units, size on disk, when last used, state.

State: complete; damaged (would not load: re-run `rocketllm shard` or remove it); partial (an interrupted `shard`,
resumed by the next one); leftover (an interrupted removal). Last used: the last load by generate, serve or bench, else
when it was sharded.

Examples: `rocketllm cache ls`, `rocketllm cache ls --json`.
"""
RM_HELP = """Remove shard sets by NAME (as `rocketllm cache ls` shows it), with what interrupted runs left of them.

Asks first on a terminal; -y removes without asking (needed off a terminal). A set another process is sharding is
refused. Nothing outside the cache is ever deleted.

Examples: `rocketllm cache rm SmolLM2-135M-Instruct.Q4_1-0123456789abcdef-bf16`, `rocketllm cache rm --all -y`.
"""
PATH_HELP = """Print the cache directory: ROCKETLLM_CACHE if set, else the default ~/.cache/rocketllm.

Example: `du -sh "$(rocketllm cache path)"`; move the cache with `ROCKETLLM_CACHE=/big/disk/rocketllm`.
"""

NamesArg = Annotated[
    Optional[list[str]],
    typer.Argument(metavar="NAME", help="Shard set names, from `rocketllm cache ls`.", show_default=False),
]
AllOpt = Annotated[bool, typer.Option("--all", help="Remove every shard set in the cache.")]
YesOpt = Annotated[bool, typer.Option("--yes", "-y", help="Remove without asking.")]


def ls(json: JsonOpt = False) -> None:
    from ..shard.cachedir import list_sets, other_usage, profiles_usage
    from ..shard.target import shards_root

    output = Output(as_json=json)
    sets, profiles, other = list_sets(), profiles_usage(), other_usage()
    total = sum(s.bytes for s in sets)
    if json:
        output.json(
            {
                "shards_dir": str(shards_root()),
                "sets": [s.to_dict() for s in sets],
                "total_bytes": total,
                "profiles": profiles,
                "other": other,
            }
        )
        return
    rows = [("NAME", "MODEL", "SOURCE", "DTYPE", "UNITS", "LAYERS", "SIZE", "LAST USED", "STATE")]
    for s in sets:
        implied = {"partial": "partial", "leftover": "old"}.get(s.state)  # the leftover the state itself names
        state = " +".join([s.state, *(kind for kind in (n.rsplit(".", 1)[1] for n in s.leftovers) if kind != implied)])
        rows.append(
            (
                s.name,
                s.model or "-",
                (s.source_kind or "-") + (" in place" if s.indexes else ""),
                s.dtype or "-",
                _count(s.units),
                _count(s.layers),
                format_bytes(s.bytes),
                _ago(s.last_used),
                state,
            )
        )
    if sets:
        widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
        output.result("\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows))
    noun = "shard set" if len(sets) == 1 else "shard sets"
    output.result(f"total: {len(sets)} {noun}, {format_bytes(total)} in {shards_root()}")
    machines = "machine" if profiles["machines"] == 1 else "machines"
    output.result(
        f"profiles: {profiles['count']} measured ({profiles['machines']} {machines}), {format_bytes(profiles['bytes'])}"
    )
    if other:
        output.result("other: " + ", ".join(f"{name}/ {format_bytes(size)}" for name, size in other.items()))


def rm(names: NamesArg = None, all_sets: AllOpt = False, yes: YesOpt = False, json: JsonOpt = False) -> None:
    from ..shard.cachedir import disk_bytes, find, remove

    if all_sets == bool(names):
        raise UsageError(
            "give shard set names (see `rocketllm cache ls`) or --all, not both"
            if names
            else "name the shard sets to remove (see `rocketllm cache ls`), or pass --all"
        )
    output = Output(as_json=json)
    chosen = find(None if all_sets else names)
    if chosen and not yes:
        if not sys.stdin.isatty():
            raise UsageError(
                "`rocketllm cache rm` asks before deleting and stdin is not a terminal; pass -y to remove "
                "without asking"
            )
        sizes = {name: sum(disk_bytes(p) for p in pieces) for name, pieces in chosen.items()}
        for name, size in sizes.items():
            output.log(f"  {name}  {format_bytes(size)}")
        noun = "shard set" if len(chosen) == 1 else "shard sets"
        if not typer.confirm(f"Remove {len(chosen)} {noun} ({format_bytes(sum(sizes.values()))})?", err=True):
            output.log("nothing removed")
            return
    freed = remove(list(chosen))
    if json:
        output.json(
            {
                "removed": [{"name": name, "bytes": size} for name, size in freed.items()],
                "freed_bytes": sum(freed.values()),
            }
        )
        return
    for name, size in freed.items():
        output.result(f"removed {name} ({format_bytes(size)})")
    output.result(
        f"freed {format_bytes(sum(freed.values()))}" if freed else "nothing to remove: the cache holds no shard sets"
    )


def path(json: JsonOpt = False) -> None:
    from ..cachehome import cache_dir
    from ..shard.cachedir import cache_origin

    output = Output(as_json=json)
    where, origin = cache_dir(), cache_origin()
    if json:
        output.json({"path": str(where), "from": origin})
        return
    output.result(str(where))  # alone on stdout, for "$(rocketllm cache path)"
    output.log(
        "from ROCKETLLM_CACHE"
        if origin == "ROCKETLLM_CACHE"
        else "the default; set ROCKETLLM_CACHE=/big/disk/rocketllm to move it"
    )


SUBCOMMANDS = {"ls": (ls, LS_HELP), "rm": (rm, RM_HELP), "path": (path, PATH_HELP)}


def _count(n: int | None) -> str:
    return "-" if n is None else str(n)


def _ago(when: float | None) -> str:
    if when is None:
        return "-"
    seconds = max(0.0, time.time() - when)
    for unit, size in (("day", 86400), ("hour", 3600), ("minute", 60)):
        if seconds >= size:
            n = int(seconds // size)
            return f"{n} {unit}{'s' if n != 1 else ''} ago"
    return "just now"
