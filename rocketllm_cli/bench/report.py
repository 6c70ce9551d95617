"""The Markdown bench report: a one-line hardware profile, then one row per regime and baseline (paste-able into
docs/HARDWARE.md)."""

from __future__ import annotations

import os

from ..sizes import format_bytes, format_rate

COLUMNS = (
    "run",
    "regime",
    "ms/token median [p10–p90]",
    "tokens/s",
    "TTFT ms",
    "bytes/token device / host / storage",
    "storage read/token (witnessed)",
    "projected ms",
    "limit ms",
    "efficiency",
    "speed-up",
)


def hardware_line(profile) -> str:
    """CPU, cores, RAM, storage kind and measured bandwidths, fingerprint: the profile column of a community row."""
    cpu = profile.facts.get("cpu", {}).get("model", "?")
    storage = profile.storage
    rates = [
        f"storage {storage.get('fstype', '?')} ({storage.get('kind', '?')}) cold "
        f"{format_rate(_bps(profile, 'storage_read'))} buffered"
        f" / {format_rate(_bps(profile, 'storage_read_direct'))} O_DIRECT",
        f"page cache {format_rate(profile.page_cache_read_bps)}",
        f"memory {format_rate(profile.host_memory_bps)}",
        f"matvec {profile.compute_dtype} {format_rate(profile.matvec_bps())}",
    ]
    device = (
        profile.compute_device if profile.is_cpu else (f"{profile.compute_device} ({format_bytes(profile.vram_total)})")
    )
    return (
        f"{cpu}, {profile.cpu_cores} cores, {format_bytes(profile.ram_total)} RAM, device {device}; "
        + ", ".join(rates)
        + f"; fingerprint {profile.fingerprint}"
    )


def load_note(load: dict) -> str:
    return f"load average {load['before']:.2f} before, {load['after']:.2f} after ({load['cores']} cores)"


def load_average() -> float:
    try:
        return os.getloadavg()[0]
    except OSError:
        return float("nan")


def table_head(columns) -> list[str]:
    """A markdown table's header row and rule."""
    return ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]


def render(doc: dict) -> str:
    lines = [
        f"**Hardware:** {doc['hardware']}",
        "",
        f"**Model:** {doc['model']['name']} ({format_bytes(doc['model']['total_bytes'])} {doc['model']['dtype']}, "
        f"{doc['model']['num_layers']} layers); prompt {doc['prompt_tokens']} tokens, {doc['tokens']} measured decode "
        f"tokens after {doc['warmup']} warm-up; {load_note(doc['load'])}",
        "",
    ]
    if doc["rows"]:
        lines += table_head(COLUMNS)
        lines += ["| " + " | ".join(_cells(row)) + " |" for row in doc["rows"]]
        notes = _notes(doc["rows"])
        if notes:
            lines += [""] + notes
    if doc.get("batch"):
        lines += ["", *render_batch(doc["batch"])]
    return "\n".join(lines)


def render_batch(batch: dict) -> list[str]:
    lines = [
        f"**Batch** ({batch['regime']} regime): one streaming pass serves every sequence",
        "",
        f"| batch N | ms/step median [p10–p90] | tokens/s (all sequences) | speed-up vs N={batch['speedup_base']} "
        f"| storage read/step (witnessed) |",
        "|---|---|---|---|---|",
    ]
    for r in batch["rows"]:
        ms = r["ms_per_step"]
        lines.append(
            f"| {r['batch']} | {ms['median']:.1f} [{ms['p10']:.1f}–{ms['p90']:.1f}] | {r['tokens_per_s']:.2f} | "
            f"{r['speedup_vs_1']:.2f}× | {format_bytes(r['storage_witnessed_per_step'])} |"
        )
    return lines


def _cells(row: dict) -> list[str]:
    run = row["name"] + (f" ({row['read_method']})" if row.get("read_method") else "")
    spec = row.get("speculation") or {}
    if "proposed" in spec:
        run += f", speculating: {spec['mode']}"
    if row["status"] != "measured":
        return [run, row["regime"], f"skipped: {row['reason']}", *["-"] * (len(COLUMNS) - 3)]
    ms = row["ms_per_token"]
    per = row.get("bytes_per_token")
    tiers = " / ".join(format_bytes(per[t]) for t in ("device", "host", "storage")) if per else "-"
    witnessed = row.get("storage_witnessed_per_token")
    speed = ", ".join(f"{x:.2f}× vs {name}" for name, x in (row.get("speedup") or {}).items()) or "-"
    return [
        run,
        row["regime"],
        f"{ms['median']:.1f} [{ms['p10']:.1f}–{ms['p90']:.1f}]",
        _num(1000 / ms["median"]),
        f"{row['ttft_ms']:.0f}",
        tiers,
        format_bytes(witnessed) if witnessed is not None else "n/a",
        _num(row.get("projected_ms")),
        _num(row.get("limit_ms")),
        f"{row['efficiency']:.2f}" if row.get("efficiency") is not None else "n/a",
        speed,
    ]


def _notes(rows: list[dict]) -> list[str]:
    out = []
    for row in rows:
        if row["status"] == "measured" and row["name"] == "rocketllm":
            phases = ", ".join(f"{p} {v:.1f} ms" for p, v in (row.get("phase_ms_per_token") or {}).items()) or "none"
            experts = ""
            if row.get("experts_per_token") is not None:
                cache = row.get("expert_cache") or {}
                rate = (
                    f"{100 * cache['hit_rate']:.1f}% of {cache['lookups']} lookups"
                    if cache.get("hit_rate") is not None
                    else "n/a (no cache)"
                )
                served = sum((row.get("bytes_per_token") or {}).values())
                experts = (
                    f"experts: {row['experts_per_token']:.1f} routed uses per token, expert cache hit rate {rate}, "
                    f"{format_bytes(served)} per token vs {format_bytes(row['whole_layer_bytes_per_token'])} streaming "
                    f"whole layers; "
                )
            spec = row.get("speculation") or {}
            speculation = (
                f"speculative decoding ({spec['mode']}): {spec['proposed']} tokens proposed, {spec['accepted']} "
                f"accepted, {spec['tokens_per_pass']} tokens per pass; "
                if "proposed" in spec
                else f"speculative decoding {spec['reason']}; "
                if spec.get("reason")
                else ""
            )
            threads = f"compute threads {row['compute_threads']}; " if row.get("compute_threads") else ""
            if row.get("stages"):
                st = row["stages"]
                threads += (
                    f"{st['plan']}; measured: links {st['link_ms_per_pass']} ms, other ranks computing "
                    f"{st['other_ranks_ms_per_pass']} ms per pass (bytes above are every rank's); rank 0's share: "
                )
            disk = row.get("disk_now")
            now = (
                f"; this set's streamed units read cold after the run at {disk['bps'] / 1e9:.2f} GB/s ({disk['how']}): "
                f"at that bandwidth the limit is {row['disk_now_limit_ms']} ms, efficiency "
                f"{row['disk_now_efficiency']:.2f}"
                if disk and row.get("disk_now_limit_ms")
                else ""
            )
            proj = row.get("projection") or {}
            projected = (
                f"projected {row['projected_ms']} ms = products {1000 * proj['products_seconds']:.1f} ms + the layers' "
                f"own work {1000 * proj['layer_work_seconds']:.1f} ms as the probe measured it on small models of the "
                "architecture at the set's widths; "
                if proj.get("layer_work_seconds") and proj.get("products_seconds") and row.get("projected_ms")
                else ""
            )
            out.append(
                f"- {row['regime']}: {projected}limit {row.get('limit_basis')}{now}; per-token phases {phases}; "
                f"{experts}{speculation}{threads}{row.get('residency_text', '')}"
            )
        elif row["status"] == "measured" and row.get("llamacpp"):
            lc = row["llamacpp"]
            gpu = "no GPU layers" if lc["n_gpu_layers"] == 0 else "every layer on the GPU"
            out.append(
                f"- {row['regime']}: llamacpp (llama-cpp-python {lc['version']}) computes on {lc['gguf']} as stored "
                f"({format_bytes(lc['gguf_bytes'])}, mapped), {lc['n_threads']} threads, {gpu}"
                + (f"; {lc['extra_buffers']}" if lc.get("extra_buffers") else "")
            )
    return out


def _num(value) -> str:
    return "n/a" if value is None else f"{value:.2f}" if value < 10 else f"{value:.1f}"


def _bps(profile, name: str) -> float | None:
    m = profile.measurements.get(name)
    return m.value_bps if m and m.available else None


def community_rows(doc: dict, profile_cell: str | None = None) -> list[str]:
    """The rows of docs/HARDWARE.md's community table: the bench row (without tokens/s) plus model and hardware profile
    columns."""
    model = doc["model"]["name"]
    cell = profile_cell or doc["hardware"]
    out = []
    for row in doc["rows"]:
        c = _cells(row)
        out.append("| " + " | ".join([model, c[1], c[0], c[2], *c[4:10], cell]) + " |")
    return out
