"""int4 KV cache against the compute dtype's cache on one model: bytes, greedy agreement, perplexity, context admitted,
beside controls that change the KV's precision otherwise.

    python benchmarks/kv_int4.py MODEL [--context 4096] [--new 256] [--budget 48MiB ...] [--variants auto fp16 int4 ...]
                                       [--text FILE] [--offset TOKENS] [--no-perplexity]

Variants (`--variants`, the first is the reference every other is compared with): `auto` (the compute dtype's cache),
a float KV dtype (`fp16`: stored in fp16, read back in the compute dtype), `fp8` (float8 e4m3, a cast this script
makes: no knob stores it), `int4` (`--residual` full-precision tokens) and `int4@R` (R of them). Defaults: auto, fp16,
fp8, int4, int4@256, int4@512: how much of a free-running divergence any change of the KV's precision brings, and how
much int4's does with a wider full-precision window.

MODEL: a GGUF or a shard set (docs/HARDWARE.md's rows used SmolLM2's GGUF sharded with `--quantize none`: bf16
weights prefill 3,840 tokens in seconds on AMX, where the int4 weight kernel, not a GEMM, takes minutes).

At `--context` tokens (a prompt of context - new tokens of docs/ARCHITECTURE.md, then `--new` greedy tokens):
- KV bytes: what each cache holds at the end (every tensor: codes, scales, the full-precision window);
- agreement: free-running, the share of the `--new` positions where a variant's token equals the reference
  run's, and the first that differs; teacher-forced, prompt and the reference's tokens in one pass through a fresh
  cache of the variant, its argmax compared with the reference's next token at each of the `--new` positions (a
  divergence does not shift the rest; one pass reads more int4 than decoding does, so this errs on the pessimistic
  side; the reference's own row is one pass against its decoding: 16-bit rounding of a pass of many positions);
- perplexity on tests/fixtures/perplexity.txt, scored as `rocketllm bench --perplexity` scores it (windows of 512
  every 256, one forward pass each: attention reads int4 for everything before the full-precision window);
- max_context the knobs admit for a KV budget (`--budget`, kv_cache_bytes) in each dtype, on this machine's profile.
Prints one Markdown table (and the raw figures as JSON on stderr).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from rocketllm_cli.bench.perplexity import score
from rocketllm_cli.profiles import resolve_knobs
from rocketllm_cli.sizes import format_bytes, parse_bytes
from rocketllm_cli.auto import AutoModel
from rocketllm_cli.stream.kvcache import cache_bytes, generate_cache_kwarg

DEFAULT_VARIANTS = ("auto", "fp16", "fp8", "int4", "int4@256", "int4@512")


def parse_variant(spec: str, residual: int) -> tuple[str, int]:
    """'int4@256' -> ('int4', 256); 'fp16' -> ('fp16', residual)."""
    dtype, _, window = spec.partition("@")
    return dtype, int(window) if window else residual


def label(spec: str, model, residual: int) -> str:
    dtype, window = parse_variant(spec, residual)
    if dtype == "auto":
        return (
            f"{str(model.dtype).removeprefix('torch.').replace('bfloat16', 'bf16').replace('float32', 'fp32')} (auto)"
        )
    if dtype == "fp8":
        return "fp8 e4m3 (a cast, no knob)"
    return f"int4, {window} full-precision tokens" if dtype == "int4" else dtype


def fp8_cache(model):
    from rocketllm_cli.stream.kvcache import CastLayer, QuantizedKVCache

    layers = int(model.config.get_text_config().num_hidden_layers)
    return QuantizedKVCache([CastLayer(torch.float8_e4m3fn) for _ in range(layers)])


def run(
    model_path: str,
    context: int,
    new: int,
    residual: int,
    variants: list[str],
    text_path: Path | None = None,
    offset: int = 0,
    perplexity: bool = True,
) -> dict:
    figures: dict = {}
    text = (text_path or ROOT / "docs" / "ARCHITECTURE.md").read_text(encoding="utf-8")
    ppl_text = (ROOT / "tests" / "fixtures" / "perplexity.txt").read_text(encoding="utf-8")
    reference = None
    for spec in variants:
        dtype, window = parse_variant(spec, residual)
        model = AutoModel.from_pretrained(
            model_path, kv_cache_dtype="auto" if dtype == "fp8" else dtype, kv_residual_tokens=window
        )
        if dtype == "fp8":
            # generate, the teacher-forced pass and perplexity take it
            model.new_kv_cache = lambda model=model: fp8_cache(model)
        try:
            tok = model.tokenizer
            ids = tok(text, return_tensors="pt").input_ids[:, offset : offset + context - new]
            assert ids.shape[1] == context - new, "the prompt text is too short for this context and offset"
            started = time.perf_counter()
            out = model.generate(
                ids, max_new_tokens=new, min_new_tokens=new, do_sample=False, return_dict_in_generate=True
            )
            seconds = time.perf_counter() - started
            tokens = out.sequences[0, ids.shape[1] :].tolist()
            cache = getattr(out, "cache", None) or out.past_key_values
            row = {
                "variant": spec,
                "kv_cache": label(spec, model, residual),
                "kv_bytes": cache_bytes(cache),
                "cache_tokens": cache.get_seq_length(),
                "generate_s": round(seconds, 1),
                "tokens": tokens,
            }
            if reference is None:
                reference = tokens
                # its own tokens: one pass's rounding
                row["teacher_forced_agreement"] = teacher_forced(model, ids, reference)
            else:
                same = [a == b for a, b in zip(tokens, reference)]
                row["free_running_agreement"] = sum(same) / len(same)
                row["first_difference"] = same.index(False) if False in same else None
                row["teacher_forced_agreement"] = teacher_forced(model, ids, reference)
            row["perplexity"] = score(model, tok(ppl_text).input_ids, 512, 256).perplexity if perplexity else None
            row["ms_per_token"] = round(1000 * seconds / new, 1)  # prefill included
            figures[spec] = row
            print(json.dumps({k: v for k, v in row.items() if k != "tokens"}), file=sys.stderr, flush=True)
        finally:
            model.close()
    return figures


def teacher_forced(model, prompt: torch.Tensor, reference: list[int]) -> float:
    """Prompt + reference tokens in one pass through a fresh int4 cache: how often its argmax is the reference's next
    token."""
    ids = torch.cat([prompt, torch.tensor([reference])], dim=1)
    with torch.inference_mode():
        logits = model(input_ids=ids, use_cache=True, **{generate_cache_kwarg(): model.new_kv_cache()}).logits[0]
    n = prompt.shape[1]
    predicted = logits[n - 1 : n - 1 + len(reference)].argmax(-1).tolist()
    return sum(int(p == t) for p, t in zip(predicted, reference)) / len(reference)


def admitted(model_path: str, budgets: list[int], residual: int, variants: list[str]) -> dict:
    """max_context per KV budget for each variant a knob can store (fp8 is not one)."""
    from transformers import AutoConfig

    from rocketllm_cli.checkpoint.modelfacts import facts_from_manifest
    from rocketllm_cli.profiles import HardwareProfile
    from rocketllm_cli.auto import ensure_shards

    manifest, directory = ensure_shards(model_path)
    facts = facts_from_manifest(manifest, AutoConfig.from_pretrained(directory))
    profile = HardwareProfile.load(storage_path=directory)
    rows = {}
    for budget in budgets:
        rows[budget] = {}
        for spec in variants:
            dtype, window = parse_variant(spec, residual)
            if dtype == "fp8":
                continue
            knobs = resolve_knobs(
                profile, facts, kwargs={"kv_cache_bytes": budget, "kv_cache_dtype": dtype, "kv_residual_tokens": window}
            )
            rows[budget][spec] = knobs.value("max_context")
    return {"max_positions": facts.max_positions, "rows": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument(
        "--residual", type=int, default=64, help="kv_residual_tokens of a plain `int4` (the knob's default is 64)"
    )
    ap.add_argument("--budget", nargs="*", default=["32MiB", "48MiB", "56MiB"])
    ap.add_argument("--variants", nargs="*", default=list(DEFAULT_VARIANTS), help="the first is the reference")
    ap.add_argument("--text", type=Path, default=None, help="the prompt's text (default docs/ARCHITECTURE.md)")
    ap.add_argument(
        "--offset", type=int, default=0, help="the prompt starts at this token of the text: another prompt, same length"
    )
    ap.add_argument(
        "--no-perplexity",
        dest="perplexity",
        action="store_false",
        help="skip the perplexity column (it does not depend on the prompt)",
    )
    args = ap.parse_args()
    figures = run(
        args.model, args.context, args.new, args.residual, args.variants, args.text, args.offset, args.perplexity
    )
    budgets = admitted(args.model, [parse_bytes(b) for b in args.budget], args.residual, args.variants)
    ref = figures[args.variants[0]]
    print(
        f"{Path(args.model).name} at {args.context} tokens of context ({args.context - args.new} prompt from token "
        f"{args.offset} of {(args.text or Path('docs/ARCHITECTURE.md')).name} + {args.new} greedy)\n"
    )
    print(
        "| KV cache | KV bytes at the end | × reference | free-running agreement (first difference) | teacher-forced "
        "agreement | perplexity | Δ perplexity | max_context, "
        + " / ".join(format_bytes(b) for b in budgets["rows"])
        + " of KV |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for spec in args.variants:
        row = figures[spec]
        contexts = (
            " / ".join(str(budgets["rows"][b][spec]) for b in budgets["rows"])
            if spec in next(iter(budgets["rows"].values()))
            else "n/a"
        )
        ppl = f"{row['perplexity']:.4f}" if row["perplexity"] is not None else "-"
        if row is ref:
            print(
                f"| {row['kv_cache']} | {format_bytes(row['kv_bytes'])} | 1.00 | reference | "
                f"{100 * row['teacher_forced_agreement']:.1f}% (its own tokens) | {ppl} | | {contexts} |"
            )
            continue
        first = "none" if row["first_difference"] is None else f"at {row['first_difference']}"
        delta = f"{100 * (row['perplexity'] / ref['perplexity'] - 1):+.2f}%" if row["perplexity"] is not None else "-"
        print(
            f"| {row['kv_cache']} | {format_bytes(row['kv_bytes'])} | {row['kv_bytes'] / ref['kv_bytes']:.3f} | "
            f"{100 * row['free_running_agreement']:.1f}% ({first}) | {100 * row['teacher_forced_agreement']:.1f}% | "
            f"{ppl} | {delta} | {contexts} |"
        )
    print(f"\n(the model's own limit is {budgets['max_positions']} tokens)")
    for row in figures.values():
        row.pop("tokens")
    print(json.dumps({"figures": figures, "admitted": budgets}, default=str), file=sys.stderr)


if __name__ == "__main__":
    main()
