"""rocketllm ps: the warm models, kept loaded by generate's keep-alive (ollama's `ps`)."""

from __future__ import annotations

import time

from ..options import JsonOpt
from ..output import Output

NAME = "ps"
HELP = """List the warm models: each background server generate keeps a model loaded in (--keep-alive).

Columns: model, pid, memory the process holds (RSS), the load-time knobs it was started with, and when it stops unless
a request comes first. `rocketllm stop` ends them.

Examples: `rocketllm ps`, `rocketllm ps --json`.
"""


def run(json: JsonOpt = False) -> None:
    from ..sizes import format_bytes, format_duration
    from ..warm.registry import alive, entries, process_rss

    output = Output(as_json=json)
    rows = []
    for entry in entries():
        if not alive(entry):
            entry.remove()  # a server that died without removing its entry
            continue
        health = _health(entry)
        rows.append(
            {
                "model": entry.model_id,
                "path": entry.model,
                "pid": entry.pid,
                "rss_bytes": process_rss(entry.pid),
                "knobs": entry.knobs,
                "keep_alive_s": health.get("keep_alive_s", entry.keep_alive_s),
                "expires_in_s": health.get("expires_in_s"),
                "started": time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(entry.started)),
                "socket": entry.socket,
            }
        )
    if json:
        output.json({"models": rows})
        return
    if not rows:
        output.result("no warm models (generate keeps one loaded for --keep-alive after each request)")
        return
    table = [("MODEL", "PID", "MEMORY", "KNOBS", "KEEP-ALIVE", "EXPIRES IN")]
    for r in rows:
        knobs = " ".join(f"--{k.replace('_', '-')} {v}" for k, v in sorted(r["knobs"].items())) or "-"
        expires = format_duration(r["expires_in_s"]) if r["expires_in_s"] is not None else "?"
        table.append(
            (
                r["model"],
                str(r["pid"]),
                format_bytes(r["rss_bytes"]) if r["rss_bytes"] else "?",
                knobs,
                format_duration(r["keep_alive_s"]),
                expires,
            )
        )
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    output.result("\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in table))


def _health(entry) -> dict:
    """The server's /health: its keep-alive now (a request may have changed it) and when it stops unless a request
    comes; {} where it does not answer in time (the entry's keep-alive stands, the expiry reads "?")."""
    from ..server.client import _call

    try:
        return _call(f"unix:{entry.socket}", "/health", None)
    except Exception:  # noqa: BLE001 - a server that is busy or going away
        return {}
