"""rocketllm plan: every whole configuration of a model on this machine (or one to buy), ranked by projected
tokens/s."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from ..errors import UsageError
from ..options import JsonOpt, ModelArg, ModelOpt, pick_model
from ..output import Output

NAME = "plan"
NO_ARGS_IS_HELP = True
HELP = """Rank whole configurations of MODEL by projected tokens/s: weight format, compute dtype, KV dtype and context,
residency per tier, speculation, batch and stages over hosts, each with the memory it takes per tier, its projection's
formula and inputs, and the generate/bench lines that run it. The first row is what the defaults pick, or says why they
differ.

MODEL is a .gguf file, a checkpoint directory, a shard set or a config.json: only headers are read. The machine is this
one's saved profile (measured once if none is), or what --profile, --ram, --vram, --disk-bw and --hosts describe.
--verify K benches the top K rows here and prints projected beside measured.

Examples:
  rocketllm plan ./SmolLM2.gguf
  rocketllm plan ./Llama-70B.gguf --ram 24GiB --hosts 4 --link-bw 1.25GB/s
  rocketllm plan ./model --min-context 32768 --max-memory 16GiB --json
  rocketllm plan ./SmolLM2.gguf --verify 2
"""

TOP = 6  # rows in the table, each with its details
PANEL_MACHINE, PANEL_REQUEST = "What-if hardware", "Constraints"


def run(
    model: ModelArg = None,
    model_option: ModelOpt = None,
    ram: Annotated[
        Optional[str],
        typer.Option(
            "--ram",
            metavar="BYTES",
            rich_help_panel=PANEL_MACHINE,
            show_default=False,
            help="Plan for this much RAM (e.g. 64GiB); free memory keeps today's share.",
        ),
    ] = None,
    vram: Annotated[
        Optional[str],
        typer.Option(
            "--vram",
            metavar="BYTES",
            rich_help_panel=PANEL_MACHINE,
            show_default=False,
            help="Plan for this much VRAM (a GPU machine's profile).",
        ),
    ] = None,
    disk_bw: Annotated[
        Optional[str],
        typer.Option(
            "--disk-bw",
            metavar="RATE",
            rich_help_panel=PANEL_MACHINE,
            show_default=False,
            help="Plan for storage reads this fast, in bytes/s (e.g. 7GB/s).",
        ),
    ] = None,
    hosts: Annotated[
        int,
        typer.Option(
            "--hosts",
            metavar="N",
            min=1,
            rich_help_panel=PANEL_MACHINE,
            help="Also plan pipeline stages over 2, 4 ... this many hosts like this one.",
        ),
    ] = 1,
    link_bw: Annotated[
        Optional[str],
        typer.Option(
            "--link-bw",
            metavar="RATE",
            rich_help_panel=PANEL_MACHINE,
            show_default=False,
            help="With --hosts: the link between hosts, bytes/s (1.25GB/s is 10 Gbit/s).",
        ),
    ] = None,
    link_latency: Annotated[
        float,
        typer.Option(
            "--link-latency",
            metavar="SECONDS",
            min=0.0,
            rich_help_panel=PANEL_MACHINE,
            help="With --hosts: one message's latency over a link.",
        ),
    ] = 0.0,
    profile_file: Annotated[
        Optional[Path],
        typer.Option(
            "--profile",
            metavar="FILE",
            rich_help_panel=PANEL_MACHINE,
            show_default=False,
            help="Plan for the machine `rocketllm doctor --json` described.",
        ),
    ] = None,
    min_context: Annotated[
        Optional[int],
        typer.Option(
            "--min-context",
            metavar="TOKENS",
            min=1,
            rich_help_panel=PANEL_REQUEST,
            show_default=False,
            help="Tokens each sequence must hold.",
        ),
    ] = None,
    max_memory: Annotated[
        Optional[str],
        typer.Option(
            "--max-memory",
            metavar="BYTES",
            rich_help_panel=PANEL_REQUEST,
            show_default=False,
            help="Memory the run may take (RAM, plus VRAM on a GPU).",
        ),
    ] = None,
    batch: Annotated[
        int,
        typer.Option(
            "--batch", metavar="N", min=1, rich_help_panel=PANEL_REQUEST, help="Sequences per pass (generate --batch)."
        ),
    ] = 1,
    quality: Annotated[
        Optional[float],
        typer.Option(
            "--quality",
            metavar="KL",
            min=0.0,
            rich_help_panel=PANEL_REQUEST,
            show_default=False,
            help="Only formats whose measured KL against the unquantised weights is at most KL (nats per token).",
        ),
    ] = None,
    top: Annotated[
        int, typer.Option("--top", metavar="N", min=1, help="Rows shown in the table, each with its details.")
    ] = TOP,
    verify: Annotated[
        Optional[int],
        typer.Option(
            "--verify",
            metavar="K",
            min=1,
            show_default=False,
            help="Bench the top K rows that run here; projected beside measured.",
        ),
    ] = None,
    summary_only: Annotated[
        bool, typer.Option("--summary", help="Print only the one-line summary (for an issue).")
    ] = False,
    json_output: JsonOpt = False,
) -> None:
    from ..planning.request import PlanRequest

    model = pick_model(model, model_option)
    if hosts > 1 and link_bw is None:
        raise UsageError(
            "--hosts needs --link-bw: the link between hosts, e.g. --link-bw 1.25GB/s for 10 Gbit/s Ethernet"
        )
    if hosts == 1 and (link_bw is not None or link_latency):
        raise UsageError("--link-bw and --link-latency go with --hosts N (N at least 2)")
    request = PlanRequest(
        min_context,
        _size("--max-memory", max_memory),
        batch,
        quality,
        hosts,
        _size("--link-bw", link_bw, rate=True) or 0.0,
        link_latency,
    )
    from ..planning.formats import read_source
    from ..planning.planner import make_plan
    from ..planning.report import document, render, summary
    from ..planning.whatif import what_if

    source = read_source(Path(model))
    out = Output(as_json=json_output)
    profile, notes = what_if(
        _profile(profile_file, source, out),
        _size("--ram", ram),
        _size("--vram", vram),
        _size("--disk-bw", disk_bw, rate=True),
    )
    plan = make_plan(source, profile, request, notes)
    measured = None
    if verify:
        from ..bench.planverify import verify_rows

        measured = verify_rows(plan, model, verify, out.log, out.progress)
    if json_output:
        out.json(document(plan, model, measured))
    else:
        out.result(summary(plan) if summary_only else render(plan, model, top, measured))


def _profile(path: Path | None, source, out: Output):
    """--profile FILE, else this machine's saved profile for the filesystem holding MODEL (measured once if none is)."""
    from ..profiles import HardwareProfile

    if path is not None:
        from ..planning.whatif import profile_from_file

        return profile_from_file(path)
    where = source.run_path if source.run_path.is_dir() else source.run_path.parent
    return HardwareProfile.cached(where) or HardwareProfile.load(storage_path=where, log=out.log)


def _size(flag: str, text: str | None, rate: bool = False) -> float | None:
    if text is None:
        return None
    from ..sizes import parse_bytes

    raw = text.strip()
    if rate and raw.lower().endswith("/s"):
        raw = raw[:-2]
    try:
        value = parse_bytes(raw)
    except ValueError as exc:
        raise UsageError(f"{flag}: {exc}{' per second' if rate else ''}") from None
    if value <= 0:
        raise UsageError(f"{flag} must be more than 0 (got {text})")
    return value
