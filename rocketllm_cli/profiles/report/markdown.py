"""Render the doctor document as paste-able Markdown: one section per top-level field, same order."""

from __future__ import annotations

from ...sizes import format_bytes


def render(doc: dict) -> str:
    lines = ["# RocketLLM doctor report", ""]
    for key, (heading, section) in SECTIONS.items():
        lines += [f"## {heading}", "", *section(doc[key]), ""]
    if doc.get("stages"):  # under torchrun: every rank's measurements and the plan
        st = doc["stages"]
        lines += [
            "## Pipeline stages",
            "",
            *[f"- {r}" for r in st["ranks"]],
            f"- plan: {st['text']}",
            f"- formula: {st['formula']}",
            f"- hidden state crossing each link: {st['hidden_bytes']} bytes (estimated from the layer size)",
            "",
        ]
    return "\n".join(lines).rstrip() + "\n"


def _versions(v: dict) -> list[str]:
    return [f"- {name}: {value}" for name, value in v.items()]


def _cpu(c: dict) -> list[str]:
    return [
        f"- model: {c.get('model')}",
        f"- cores: {c.get('cores_used')} used ({c.get('cores_logical')} logical, {c.get('cores_physical')} physical)",
        f"- ISA flags that matter: {', '.join(c.get('isa') or []) or 'none found'} (from {c.get('isa_source')})",
    ]


def _memory(m: dict) -> list[str]:
    return [f"- RAM total: {format_bytes(m['ram_total'])}", f"- RAM available now: {format_bytes(m['ram_available'])}"]


def _accelerators(a: dict) -> list[str]:
    lines = [f"- compute device: {a['compute_device']} ({a['reason']})"]
    for d in a["devices"]:
        lines.append(
            f"- {d.get('backend')} {d.get('index')}: {d.get('name')}, {format_bytes(d.get('memory_total'))}, "
            f"compute capability {d.get('compute_capability', 'n/a')}"
        )
    for g in a["nvml"]:
        lines.append(
            f"- NVML {g.get('index')}: {g.get('name')}, PCIe gen {g.get('pcie_gen')}/{g.get('pcie_gen_max')} "
            f"x{g.get('pcie_width')}/{g.get('pcie_width_max')}"
        )
    if a["driver"]:
        lines.append(f"- driver: {a['driver']}")
    if a["vram_total"] is not None:
        lines.append(f"- VRAM: {format_bytes(a['vram_free'])} free of {format_bytes(a['vram_total'])}")
    return lines


def _capabilities(caps: list) -> list[str]:
    rows = [[c["name"], str(c["value"]), c["fallback_taken"] or "-", c["reason"]] for c in caps]
    return _table(["capability", "decision", "fallback taken", "why"], rows)


def _native_kernels(n: dict) -> list[str]:
    from ..probe.nativepaths import lines

    return lines(n, n.get("kernel", "exact"))


def _optional_packages(pkgs: list) -> list[str]:
    rows = [[p["package"], p["version"] or "missing", "-" if p["installed"] else p["cost_if_missing"]] for p in pkgs]
    return _table(["package", "installed", "cost of its absence"], rows)


def _measurements(ms: list) -> list[str]:
    rows = []
    for m in ms:
        value = _rate(m["value"], m["unit"]) if m["available"] else f"unavailable: {m['reason']}"
        rows.append([m["name"], value, m["method"], format_bytes(m["bytes_moved"]), f"{m['seconds']:.4f}"])
    return _table(["measurement", "value", "method", "bytes", "seconds"], rows)


def _storage(s: dict) -> list[str]:
    return [f"- measured in: {s['directory']} (mount {s['mount_point']}, {s['fstype']}, kind {s['kind']})"]


def _model(m: dict | None) -> list[str]:
    if m is None:
        return ["- none given (--model PATH or --model-size 70B --weight-bits 4 projects the cost per token)"]
    return [
        f"- {m['name']} ({m['source']}): {format_bytes(m['total_bytes'])} as {m['dtype']}, {m['num_layers']} layers of "
        f"up to {format_bytes(m['layer_bytes'])}, largest unit {format_bytes(m['largest_unit_bytes'])}, KV "
        f"{format_bytes(m['kv_bytes_per_token'])}/token, context {m['max_positions']}"
        + (
            f"; mixture-of-experts: {format_bytes(m['active_bytes'])} read per decode token (dense part + routed "
            f"experts)"
            if m.get("active_bytes")
            else ""
        ),
        *_unit_reads(m.get("unit_reads")),
        f"- note: {m['note']}",
    ]


def _unit_reads(reads: dict | None) -> list[str]:
    """The set's own units read cold (profiles/probe/unitreads.py): one row per method and reads in flight."""
    if not reads:
        return []
    cells = ", ".join(
        f"{'O_DIRECT' if r['direct'] else 'buffered'} x{r['in_flight']} "
        f"{r['bytes'] / max(r['seconds'], 1e-9) / 1e9:.2f} GB/s "
        f"({r['cpu_seconds'] / max(r['seconds'], 1e-9):.2f} cores)"
        for r in reads["rows"]
    )
    return [
        f"- its own units read cold ({reads['units']} of ~{format_bytes(reads['unit_bytes'])}, one pread each, that "
        f"many in flight; direct_io, io_workers and prefetch_depth follow the cheapest): {cells}"
    ]


def _projection(p: dict | None) -> list[str]:
    if p is None:
        return ["- no model given"]
    rows = []
    for t in p["tiers"].values():
        seconds = f"{t['seconds']:.4f}" if t["available"] else f"unavailable: {t['reason']}"
        rows.append([t["tier"], format_bytes(t["bytes"]), _rate(t["bandwidth_bps"], "B/s"), seconds, t["bandwidth"]])
    lines = _table(["tier", "bytes/token", "bandwidth", "seconds", "measured as"], rows)
    plan = p["plan"]
    lines += [
        "",
        f"- plan: device_cache_bytes {format_bytes(plan['device_cache_bytes'])}, host_cache_bytes "
        f"{format_bytes(plan['host_cache_bytes'])}"
        + (
            f", beside them runtime_bytes {format_bytes(plan['runtime_bytes'])} and kv_cache_bytes "
            f"{format_bytes(plan['kv_cache_bytes'])}; memory floor {format_bytes(plan['memory_floor'])} (= "
            f"{plan['memory_floor_formula']}; below it a load is refused)"
            if "memory_floor" in plan
            else ""
        ),
        f"- serial (sum of tiers: moving the bytes alone, no compute): {_secs(p['serial_seconds'])}; io (host + "
        f"storage): {_secs(p['io_seconds'])}",
        f"- compute: {_secs(p['compute_seconds'])} via {p['compute_bandwidth']}",
        f"- overlapped max(io, compute): {_secs(p['overlapped_seconds'])}"
        + (f" -> {p['tokens_per_second']:.3g} tokens/s" if p["tokens_per_second"] else "")
        + _compute_caveat(p["compute_bandwidth"]),
    ]
    if p["reason"]:
        lines.append(f"- {p['reason']}")
    regimes = p.get("regimes") or {}
    if regimes:
        lines += [
            "",
            "Each of `rocketllm bench`'s regimes (every byte a token reads from the one tier), from reads fully "
            "overlapped with compute (max(io, compute), what prefetch can reach) to not at all (io + compute):",
            "",
        ]
        rows = []
        for regime, r in regimes.items():
            io, compute = r["io_seconds"], r["compute_seconds"]
            if io is None or compute is None:
                rows.append([regime, "unavailable", "-", "-", "-"])
                continue
            rows.append(
                [
                    regime,
                    f"{1000 * max(io, compute):.1f}",
                    f"{1000 * (io + compute):.1f}",
                    f"{1 / max(io, compute):.3g}",
                    "io" if io > compute else "compute",
                ]
            )
        lines += _table(["regime", "overlapped ms/token", "serial ms/token", "tokens/s at best", "bound by"], rows)
    return lines


def _environment(e: dict) -> list[str]:
    lines = [f"- {name}={value}" if value is not None else f"- {name}: unset" for name, value in e["variables"].items()]
    threads = [f"- compute threads: {e['compute_threads']}"] if e.get("compute_threads") else []
    return lines + [f"- OpenMP wait: {e['openmp_wait']}", *threads] + [f"- warning: {w}" for w in e["warnings"]]


def _profile(p: dict) -> list[str]:
    cached = "cached" if p["from_cache"] else "measured now"
    return [
        f"- fingerprint: {p['fingerprint']} ({cached}; host measured {p['measured_at'].get('host')}, storage "
        f"{p['measured_at'].get('storage')})",
        f"- tiers: {p['tiers']}",
        *(f"- warning: {w}" for w in p["warnings"]),
    ]


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    clean = [[str(cell).replace("|", "\\|") for cell in row] for row in rows]
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header), *("| " + " | ".join(r) + " |" for r in clean)]


def _rate(value: float | None, unit: str) -> str:
    if value is None:
        return "unavailable"
    return f"{value / 1e9:.1f} GFLOP/s" if unit == "FLOP/s" else f"{value / 1e9:.2f} GB/s"


def _secs(value: float | None) -> str:
    return "unavailable" if value is None else f"{value:.4f} s"


# document field -> (Markdown heading, renderer); the JSON document has exactly these fields
SECTIONS = {
    "versions": ("Versions", _versions),
    "cpu": ("CPU", _cpu),
    "memory": ("Memory", _memory),
    "accelerators": ("Accelerators", _accelerators),
    "capabilities": ("Capability decisions", _capabilities),
    "native_kernels": ("Native kernels (GGUF blocks)", _native_kernels),
    "optional_packages": ("Optional packages", _optional_packages),
    "measurements": ("Measured bandwidths", _measurements),
    "storage": ("Storage", _storage),
    "model": ("Model", _model),
    "projection": ("Projected cost per decode token", _projection),
    "environment": ("Environment", _environment),
    "profile": ("Profile", _profile),
}


def _compute_caveat(how: str) -> str:
    """What a projection's compute term leaves to a measurement of the set itself."""
    if "rocketllm bench" in how:
        return ""
    if "models of the set's widths" in how:
        return (
            " (per-layer work as the probe measured it on small models of the architecture; `rocketllm bench` of this "
            "set measures its own)"
        )
    if "per-layer work" in how:
        return (
            " (per-layer work as bench measured it for other sets here; `rocketllm bench` of this set measures its own)"
        )
    return (
        " (an upper bound: per-layer work is left out until `rocketllm bench` measures this set; see the model's note)"
    )
