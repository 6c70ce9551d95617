"""rocketllm shard: split a checkpoint once into per-unit shards with a manifest."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from ..errors import ShardError
from ..options import JsonOpt, ModelArg, ModelOpt, pick_model
from ..output import Output
from ..sizes import format_bytes

NAME = "shard"
NO_ARGS_IS_HELP = True
HELP = """Split MODEL into one file per layer (plus embed, norm, lm_head, extras) with a manifest.

MODEL is a Hugging Face model directory, a .gguf file, a hub id, or (with --verify) a shard directory.
Shards go beside the model cache unless --out is given; `generate` finds and reuses them.

A GGUF keeps every quantized tensor as its own blocks, byte for byte (Q4_0
... Q8_0, the K-quants, IQ4_NL/IQ4_XS on the native kernels; the IQ1-3, TQ
and MXFP4 grids decoded when used), and its set indexes the file in place:
no weight is copied (--copy writes them into the set; the set is made
again if the file moves or changes). So does a pre-quantized safetensors
checkpoint, exactly: compressed-tensors (pack-quantized, naive- or
int-quantized; int4 or int8), GPTQ (4 or 8 bits; act-order weights are
stored dequantized), AWQ (4-bit GEMM) and bitsandbytes LLM.int8;
bitsandbytes nf4/fp4 are re-quantized to int4 group 32 (lossy; the error
is printed). --quantize int4|int8 quantizes a float model's linear layers
(lossy); --quantize none stores only floats (nf4/fp4 exactly).

Example: rocketllm shard ./Llama-3.1-8B --dtype bf16 --verify
"""


def run(
    model: ModelArg = None,
    model_option: ModelOpt = None,
    out: Annotated[
        Optional[Path],
        typer.Option("--out", help="Shard directory to write (default: under the cache dir, keyed by the source)."),
    ] = None,
    dtype: Annotated[
        str, typer.Option("--dtype", help="Dtype of the shards: auto (as stored), bf16, fp16 or fp32.")
    ] = "auto",
    verify: Annotated[
        bool, typer.Option("--verify", help="Re-check every shard file against the manifest (sizes and sha256).")
    ] = False,
    quantize: Annotated[
        str,
        typer.Option(
            "--quantize",
            help="Low-bit weights: auto (keep a GGUF's or a GPTQ/AWQ/compressed-tensors/bitsandbytes checkpoint's "
            "packed weights), int4 or int8 (round-to-nearest, lossy), none (all floats).",
        ),
    ] = "auto",
    fuse: Annotated[
        bool,
        typer.Option(
            "--fuse/--no-fuse",
            help="Store the packed Linears of a layer that read the "
            "same input (q/k/v, gate/up: found by tracing the model) as one weight, computed in one call.",
        ),
    ] = True,
    copy: Annotated[
        bool,
        typer.Option(
            "--copy",
            help="Write the weights into the set's own files even where it could index a GGUF in place (a set that "
            "outlives the file, or on a faster disk).",
        ),
    ] = False,
    json: JsonOpt = False,
) -> None:
    from ..dtypes import NAMES as DTYPES
    from ..shard.source import check_locatable

    model = pick_model(model, model_option)
    if dtype != "auto" and dtype not in DTYPES:
        raise ShardError(f"bad --dtype {dtype!r}: expected auto, bf16, fp16 or fp32")
    if quantize not in ("auto", "none", "int4", "int8"):
        raise ShardError(f"bad --quantize {quantize!r}: expected auto, int4, int8 or none")
    check_locatable(model)  # a mistyped path is refused before torch and transformers are imported
    from ..shard.identity import hash_in_background

    hash_in_background(model)  # a GGUF's first content hash runs beside the imports below

    from ..checkpoint.manifest import MANIFEST, Manifest
    from ..shard.checks import verify as verify_dir
    from ..shard.sharder import shard, summarize

    output = Output(as_json=json)

    def from_model(rebuild: bool = False):
        return shard(
            model,
            out=out,
            dtype=dtype,
            progress=output.progress,
            log=output.log,
            rebuild=rebuild,
            packing=quantize,
            fuse=fuse,
            copy=copy,
        )

    path = Path(model).expanduser()
    from_source = not (path.is_dir() and (path / MANIFEST).is_file())
    if not from_source:
        manifest, directory = Manifest.load(path), path
        summary = {"reused": True, **summarize(manifest, 0.0)}  # the same fields as a fresh or reused run from a source
    else:
        manifest, directory, summary = from_model()
    problems = verify_dir(directory) if verify else []
    if problems and from_source:  # the source is at hand: write the set again rather than report a damaged one
        output.log(f"{_count(problems)} not match the manifest ({problems[0]}); sharding again")
        manifest, directory, summary = from_model(rebuild=True)
        problems = verify_dir(directory)
    document = {
        "directory": str(directory),
        **summary,
        "verified": verify and not problems,
        "problems": problems,
        "source": manifest.source,
        "indexes": manifest.indexes.get("path"),
        "model_type": manifest.model_type,
    }
    if json:
        output.json(document)
    else:
        rate = f", {summary['mb_per_s']} MB/s" if summary.get("mb_per_s") and not manifest.indexed else ""
        verb = "indexed in place" if manifest.indexed else "sharded"
        state = "reused existing shards" if summary.get("reused") else f"{verb} in {summary.get('seconds')} s{rate}"
        output.result(
            f"{directory}\n{manifest.model_type}: {summary['units']} units ({summary['layers']} layers"
            f"{', ' + str(summary['experts']) + ' experts' if summary.get('experts') else ''}), "
            f"{format_bytes(summary['bytes'])} {manifest.dtype}{_packed(summary)}; {state}"
        )
        if summary.get("packed_tensors"):
            output.result(f"fused: {manifest.fusion or 'none (a set from before fusion)'}")
        if verify:
            output.result("verify: ok, every file matches the manifest" if not problems else "verify: FAILED")
    if problems:
        raise ShardError(
            f"{_count(problems)} not match the manifest ({problems[0]}); "
            "re-run `rocketllm shard` on the source model with --verify to write them again"
        )


def _packed(summary: dict) -> str:
    count = summary.get("packed_tensors", 0)
    return f" ({count} weights packed: {summary['packing']})" if count else ""


def _count(problems: list[str]) -> str:
    return "1 shard file does" if len(problems) == 1 else f"{len(problems)} shard files do"
