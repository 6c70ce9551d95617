"""`rocketllm plan` as a document (--json), as a table and details for people, and as one line to paste into an
issue."""

from __future__ import annotations

import io
import shutil
from dataclasses import asdict

from ..profiles.knobs.resolve import describe_input
from ..redact import redact, redact_tree
from ..sizes import format_bytes, format_rate
from .commandlines import commands
from .planner import Plan
from .rows import Row


def document(plan: Plan, model: str, measured: list[dict] | None = None) -> dict:
    """Every row with its commands; `measured`: what `plan --verify` measured, one entry per row it ran."""
    s, f = plan.source, plan.source.facts
    doc = {
        "model": {
            "path": model,
            "kind": s.kind,
            "name": s.name,
            "dtype": f.dtype,
            "total_bytes": f.total_bytes,
            "num_layers": f.num_layers,
            "max_positions": f.max_positions,
            "formats": [fmt.label for fmt in s.formats()],
        },
        "hardware": {**hardware(plan), "what_if": plan.hardware},
        "request": asdict(plan.request),
        "rows": [{**row.to_dict(), "commands": commands(row, s, model)} for row in plan.rows],
        "defaults_rank": plan.default.rank if plan.default else None,
        "left_out": plan.left_out,
        "seconds": round(plan.seconds, 4),
        "summary": summary(plan),
    }
    if measured is not None:
        doc["verify"] = measured
    return redact_tree(doc)


def hardware(plan: Plan) -> dict:
    p = plan.profile
    return {
        "fingerprint": p.fingerprint,
        "compute_device": p.compute_device,
        "cpu": (p.facts.get("cpu") or {}).get("model"),
        "cpu_cores": p.cpu_cores,
        "ram_total": p.ram_total,
        "ram_available": p.ram_available,
        "vram_total": p.vram_total,
        "vram_free": p.vram_free,
        "storage_read_bps": p.storage_read_bps,
        "compute_dtype": p.compute_dtype,
        "matvec_bps": p.matvec_bps(),
        "from_cache": p.from_cache,
    }


def hardware_line(plan: Plan) -> str:
    h = hardware(plan)
    vram = f", VRAM {format_bytes(h['vram_total'])}" if h["vram_total"] else ""
    return (
        f"{h['cpu'] or '?'}, {h['cpu_cores']} cores, RAM {format_bytes(h['ram_total'])} "
        f"({format_bytes(h['ram_available'])} free){vram}, device {h['compute_device']}, storage "
        f"{format_rate(h['storage_read_bps'])}, matvec {h['compute_dtype']} {format_rate(h['matvec_bps'])}; "
        f"fingerprint {h['fingerprint']}"
    )


def summary(plan: Plan) -> str:
    """One line: the model, the best row, the defaults' row, the machine (what-if included)."""
    best, d = plan.rows[0], plan.default
    defaults = (
        "the defaults' row"
        if best.default
        else f"defaults #{d.rank} {_speed(d)}"
        if d and d.rank
        else "the defaults' row does not meet the request"
        if d
        else "the defaults do not fit"
    )
    what_if = f" [what-if: {'; '.join(plan.hardware)}]" if plan.hardware else ""
    return redact(
        f"rocketllm plan {plan.source.name}: {len(plan.rows)} rows; best {_speed(best)}: {_settings(best)} "
        f"({defaults}); on {hardware_line(plan)}{what_if}"
    )


def render(plan: Plan, model: str, top: int, measured: list[dict] | None = None) -> str:
    f = plan.source.facts
    lines = [
        f"model: {plan.source.name} ({plan.source.kind}, {f.dtype}, {format_bytes(f.total_bytes)}, {f.num_layers} "
        f"layers, context at most {f.max_positions})",
        *(
            f"format {fmt.label}: {format_bytes(fmt.facts.total_bytes)}; KL "
            f"{'%g' % fmt.kl if fmt.kl is not None else 'not measured'}: {fmt.kl_note}"
            for fmt in plan.source.formats()
        ),
        f"hardware: {hardware_line(plan)}",
        *(f"what-if: {line}" for line in plan.hardware),
    ]
    asked = _asked(plan)
    if asked:
        lines.append(f"request: {asked}")
    shown = [r for r in plan.rows if not _twin(r, plan.rows)][:top]
    lines += ["", _table(shown, measured)]
    for row in shown:
        lines += _details(row, plan, model)
    hidden = len(plan.rows) - len(shown)
    if hidden:
        lines.append(
            f"{hidden} more rows (--top N shows more; speculation-off twins of a shown row, same projection, "
            f"are in --json)"
        )
    for why, count in plan.left_out.items():
        lines.append(f"left out: {count} x {why}")
    if measured is not None:
        lines += ["", *verify_lines(measured)]
    lines += ["", f"summary: {summary(plan)}"]
    return redact("\n".join(lines))


def verify_lines(measured: list[dict]) -> list[str]:
    """Projected beside measured, one line per row --verify tried."""
    lines = ["verify: projected vs measured (rocketllm bench, one process per row)"]
    for m in measured:
        projected = f"{m['projected_tokens_per_s']:.3g}" if m.get("projected_tokens_per_s") else "n/a"
        if m["status"] != "measured":
            lines.append(f"  #{m['rank']}: projected {projected} tokens/s, {m['status']}: {m.get('reason', '')}")
            continue
        ratio = (
            f", measured/projected {m['tokens_per_s'] / m['projected_tokens_per_s']:.2f}"
            if m.get("projected_tokens_per_s")
            else ""
        )
        how = (
            f"tokens over decode time, speculating: "
            f"{m['speculation'].get('decode_tokens_per_pass', m['speculation'].get('tokens_per_pass'))} tokens a "
            f"decode pass"
            if m.get("rate") == "mean"
            else f"{m['ms_per_token']:.1f} ms/token median"
        )
        lines.append(
            f"  #{m['rank']}: projected {projected} tokens/s, measured {m['tokens_per_s']:.3g} tokens/s ({how}){ratio}"
        )
        disk = m.get("disk_now")
        if disk:
            lines.append(
                f"      at the {disk['bps'] / 1e9:.2f} GB/s the disk read just after the run ({disk['how']}) instead "
                f"of the projection's: projected {disk['projected_tokens_per_s']:.3g} tokens/s, measured/projected "
                f"{m['tokens_per_s'] / disk['projected_tokens_per_s']:.2f}"
            )
        lines.append(f"      {m['command']}")
        lines += [f"      note: {note}" for note in m.get("notes", [])]
    return lines


def _table(rows: list[Row], measured: list[dict] | None) -> str:
    from rich import box
    from rich.console import Console
    from rich.table import Table

    got = {m["rank"]: m for m in measured or []}
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False)
    for name, justify in (
        ("#", "right"),
        ("tokens/s", "right"),
        *((("measured", "right"),) if measured else ()),
        ("format", "left"),
        ("compute", "left"),
        ("KV", "left"),
        ("context", "right"),
        ("residency", "left"),
        ("speculate", "left"),
        ("memory", "right"),
        ("", "left"),
    ):
        table.add_column(name, justify=justify)
    for row in rows:
        cells = [str(row.rank), f"{row.tokens_per_s:.3g}" if row.tokens_per_s else "n/a"]
        if measured:
            m = got.get(row.rank)
            cells.append(f"{m['tokens_per_s']:.3g}" if m and m.get("tokens_per_s") else "-")
        batch = f" x{row.batch}" if row.batch > 1 else ""
        cells += [
            row.format.label,
            row.compute_dtype,
            row.kv_dtype,
            f"{row.context}{batch}" if row.context else "?",
            row.residency_text(),
            row.speculate,
            format_bytes(row.memory["used"]),
            "defaults" if row.default else "",
        ]
        table.add_row(*cells)
    width = max(100, shutil.get_terminal_size((120, 24)).columns)
    buffer = io.StringIO()
    Console(file=buffer, width=width, force_terminal=False, color_system=None, highlight=False).print(table)
    return buffer.getvalue().rstrip()


def _details(row: Row, plan: Plan, model: str) -> list[str]:
    m = row.memory
    head = f"#{row.rank} {_speed(row)}" + (" [defaults]" if row.default else "")
    lines = ["", head]
    if row.why:
        lines.append(f"    why the defaults differ: {row.why}")
    lines.append(f"    = {row.formula}")
    if row.inputs:
        lines.append("    with " + ", ".join(describe_input(k, v) for k, v in row.inputs.items()))
    budget = ", ".join(f"{'' if k == 'memory' else k + ' '}{format_bytes(v)}" for k, v in m["budget"].items())
    tokens = f"{m['tokens']} tokens" if m.get("tokens") is not None else "context unknown"
    where = "busiest host: " if row.stages else ""
    lines.append(
        f"    memory ({where}budget {budget or 'n/a'} after the {format_bytes(m['reserve'])} reserve): device "
        f"{format_bytes(m['device']['weights'])} weights + {format_bytes(m['device']['kv'])} KV ({tokens}) + "
        f"{format_bytes(m['device']['buffers'])} buffers{_runtime(m)} = {format_bytes(m['device']['total'])}; host "
        f"{format_bytes(m['host']['weights'])}; storage {format_bytes(m['storage']['set'])} (the set on disk)"
    )
    lines.append(
        "    KL against the unquantised weights: "
        + (f"{row.format.kl:g}" if row.format.kl is not None else "not measured")
    )
    lines += [f"    note: {note}" for note in row.notes]
    for name, line in commands(row, plan.source, model).items():
        if line:
            lines.append(f"    {name + ':':<9} {line}")
    return lines


def _runtime(memory: dict) -> str:
    runtime = memory["device"].get("runtime")
    return f" + {format_bytes(runtime)} runtime" if runtime else ""


def _twin(row: Row, rows: list[Row]) -> bool:
    """A speculation-off row whose twin with speculation on ranks with it (same projection, one flag more): until bench
    has measured the set's tokens per pass, both project at one; after, the twin is slower and shown."""
    return row.flags.get("speculate") == "off" and any(
        r is not row
        and r.flags == {k: v for k, v in row.flags.items() if k != "speculate"}
        and r.format is row.format
        and r.tokens_per_s == row.tokens_per_s
        for r in rows
    )


def _asked(plan: Plan) -> str:
    r = plan.request
    parts = [
        f"--min-context {r.min_context}" if r.min_context is not None else "",
        f"--max-memory {format_bytes(r.max_memory)}" if r.max_memory is not None else "",
        f"--batch {r.batch}" if r.batch > 1 else "",
        f"--quality {r.quality:g}" if r.quality is not None else "",
        f"--hosts {r.hosts} --link-bw {format_rate(r.link_bps)}" if r.hosts > 1 else "",
    ]
    return " ".join(p for p in parts if p)


def _speed(row: Row) -> str:
    return f"{row.tokens_per_s:.3g} tokens/s projected" if row.tokens_per_s else "speed unavailable"


def _settings(row: Row) -> str:
    batch = f" x{row.batch}" if row.batch > 1 else ""
    return (
        f"{row.format.label}, compute {row.compute_dtype}, KV {row.kv_dtype}, {row.context}{batch} tokens, "
        f"{row.residency_text()}, {format_bytes(row.memory['used'])}"
    )
