"""rocketllm doctor: a paste-able Markdown report of this machine, its measured speeds and a model's projected cost."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from ..errors import ModelError, UsageError
from ..options import JsonOpt, ModelPathOpt, RefreshOpt
from ..output import Output

NAME = "doctor"
HELP = """Report versions, hardware, capability decisions, measured bandwidths and the projected cost per token, as
Markdown to paste into an issue.

Examples: `rocketllm doctor`, `rocketllm doctor --model ./shards`, `rocketllm doctor --model-size 70B --weight-bits 4
--json`.
"""

ModelSizeOpt = Annotated[
    Optional[str],
    typer.Option(
        "--model-size", help="Project a dense model of this many parameters instead of a path, e.g. 70B, 8B, 135M."
    ),
]
WeightBitsOpt = Annotated[
    Optional[float],
    typer.Option(
        "--weight-bits", help="Bits per weight for --model-size (16 = bf16, 4 = 4-bit quantized). [default: 16]"
    ),
]


def run(
    model: ModelPathOpt = None,
    model_size: ModelSizeOpt = None,
    weight_bits: WeightBitsOpt = None,
    json_output: JsonOpt = False,
    refresh: RefreshOpt = False,
) -> None:
    from ..profiles import (
        HardwareProfile,
        ModelFacts,
        model_facts_from_path,
        parse_param_count,
    )
    from ..profiles.report import document as report
    from ..profiles.report import markdown

    if model is not None and model_size is not None:
        raise UsageError("give either --model PATH or --model-size, not both")
    if weight_bits is not None and model_size is None:
        raise UsageError("--weight-bits goes with --model-size")
    facts, source = None, None
    if model is not None:
        facts, source = model_facts_from_path(model), "path"
    elif model_size is not None:
        bits = 16.0 if weight_bits is None else weight_bits
        if not 1 <= bits <= 32:
            raise ModelError(f"--weight-bits {bits:g} is out of range: expected 1 to 32 (e.g. 4, 8, 16)")
        try:
            facts, source = (
                ModelFacts.from_size(parse_param_count(model_size), bits),
                (f"--model-size {model_size} --weight-bits {bits:g}"),
            )
        except ValueError as exc:
            raise ModelError(f"--model-size: {exc}") from None

    from ..threads import COMPUTE_THREADS

    COMPUTE_THREADS.poll()  # the first sample: the report's own, at its end, says what others used meanwhile
    out = Output(as_json=json_output)
    profile = HardwareProfile.load(storage_path=model, refresh=refresh, log=out.log)
    from ..packed.nativeprobe import stored_row
    from ..packed.probe import report_rows

    # the packed kernels' probe, and once a GGUF set has measured it, from how many rows its blocks multiply densely
    native = stored_row(profile.compute_device)
    kernels = report_rows(profile.compute_device) + ([native] if native else [])
    from ..stream.layerprobe import measure as measure_layers

    document = report.build(
        profile, facts, source, model_path=model, log=out.log, kernels=kernels, measure_layers=measure_layers
    )
    from ..distributed.torchrun import launched

    launch = launched()  # under torchrun: every rank measures itself and its link; rank 0 reports the stage plan
    if launch is not None:
        if facts is None:
            raise UsageError("under torchrun, doctor plans stages for a model: give --model PATH or --model-size")
        from ..distributed.opening import plan_for_doctor
        from ..profiles import resolve_knobs

        document["stages"] = plan_for_doctor(launch, profile, facts, resolve_knobs(profile, facts))
        if not launch.is_first:
            return
    if json_output:
        out.json(document)
    else:
        out.result(markdown.render(document))
