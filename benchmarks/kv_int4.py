"""int4 KV cache against the compute dtype's cache on one model: bytes, greedy agreement, perplexity, context admitted.

    python benchmarks/kv_int4.py MODEL [--context 4096] [--new 256] [--budget 48MiB ...]

MODEL: a GGUF or a shard set (docs/HARDWARE.md's rows used SmolLM2's GGUF sharded with `--quantize none`: bf16
weights prefill 3,840 tokens in seconds on AMX, where the int4 weight kernel, not a GEMM, takes minutes).

At `--context` tokens (a prompt of context - new tokens of docs/ARCHITECTURE.md, then `--new` greedy tokens):
- KV bytes: what each cache holds at the end (every tensor: codes, scales, the full-precision window);
- agreement: free-running, the share of the `--new` positions where the int4 run's token equals the reference
  run's, and the first that differs; teacher-forced, prompt and the reference's tokens in one pass through a fresh
  int4 cache, its argmax compared with the reference's next token at each of the `--new` positions (a divergence
  does not shift the rest; one pass reads more int4 than decoding does, so this errs on the pessimistic side);
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
from rocketllm_cli.stream.auto import AutoModel
from rocketllm_cli.stream.kvcache import cache_bytes, generate_cache_kwarg

DTYPES = ("auto", "int4")


def run(model_path: str, context: int, new: int, residual: int) -> dict:
    figures: dict = {}
    text = (ROOT / "docs" / "ARCHITECTURE.md").read_text(encoding="utf-8")
    ppl_text = (ROOT / "tests" / "fixtures" / "perplexity.txt").read_text(encoding="utf-8")
    reference = None
    for dtype in DTYPES:
        model = AutoModel.from_pretrained(model_path, kv_cache_dtype=dtype, kv_residual_tokens=residual)
        try:
            tok = model.tokenizer
            ids = tok(text, return_tensors="pt").input_ids[:, : context - new]
            assert ids.shape[1] == context - new, "the prompt text is too short for this context"
            started = time.perf_counter()
            out = model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False, return_dict_in_generate=True)
            seconds = time.perf_counter() - started
            tokens = out.sequences[0, ids.shape[1]:].tolist()
            cache = getattr(out, "cache", None) or out.past_key_values
            row = {"kv_dtype": str(model.kv_dtype), "kv_bytes": cache_bytes(cache), "cache_tokens": cache.get_seq_length(),
                   "generate_s": round(seconds, 1), "tokens": tokens}
            if reference is None:
                reference = tokens
            else:
                same = [a == b for a, b in zip(tokens, reference)]
                row["free_running_agreement"] = sum(same) / len(same)
                row["first_difference"] = same.index(False) if False in same else None
                row["teacher_forced_agreement"] = teacher_forced(model, ids, reference)
            ppl_ids = tok(ppl_text).input_ids
            row["perplexity"] = score(model, ppl_ids, 512, 256).perplexity
            row["ms_per_token"] = round(1000 * seconds / new, 1)  # prefill included
            figures[dtype] = row
            print(json.dumps({k: v for k, v in row.items() if k != "tokens"}), file=sys.stderr, flush=True)
        finally:
            model.close()
    return figures


def teacher_forced(model, prompt: torch.Tensor, reference: list[int]) -> float:
    """Prompt + reference tokens in one pass through a fresh int4 cache: how often its argmax is the reference's next token."""
    ids = torch.cat([prompt, torch.tensor([reference])], dim=1)
    with torch.inference_mode():
        logits = model(input_ids=ids, use_cache=True, **{generate_cache_kwarg(): model.new_kv_cache()}).logits[0]
    n = prompt.shape[1]
    predicted = logits[n - 1 : n - 1 + len(reference)].argmax(-1).tolist()
    return sum(int(p == t) for p, t in zip(predicted, reference)) / len(reference)


def admitted(model_path: str, budgets: list[int], residual: int) -> dict:
    from transformers import AutoConfig

    from rocketllm_cli.profiles import HardwareProfile
    from rocketllm_cli.shard.modelfacts import facts_from_manifest
    from rocketllm_cli.stream.auto import ensure_shards

    manifest, directory = ensure_shards(model_path)
    facts = facts_from_manifest(manifest, AutoConfig.from_pretrained(directory))
    profile = HardwareProfile.load(storage_path=directory)
    rows = {}
    for budget in budgets:
        rows[budget] = {}
        for dtype in DTYPES:
            knobs = resolve_knobs(profile, facts, kwargs={"kv_cache_bytes": budget, "kv_cache_dtype": dtype,
                                                          "kv_residual_tokens": residual})
            rows[budget][dtype] = knobs.value("max_context")
    return {"max_positions": facts.max_positions, "rows": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--residual", type=int, default=64, help="kv_residual_tokens (the knob's default is 64)")
    ap.add_argument("--budget", nargs="*", default=["32MiB", "48MiB", "56MiB"])
    args = ap.parse_args()
    figures = run(args.model, args.context, args.new, args.residual)
    budgets = admitted(args.model, [parse_bytes(b) for b in args.budget], args.residual)
    ref, q = figures["auto"], figures["int4"]
    print(f"SmolLM2 at {args.context} tokens of context ({args.context - args.new} prompt + {args.new} greedy), "
          f"kv_residual_tokens {args.residual}\n")
    print("| KV dtype | KV bytes at the end | × reference | greedy agreement (free-running / teacher-forced) | perplexity | Δ perplexity |")
    print("|---|---|---|---|---|---|")
    print(f"| {ref['kv_dtype']} (auto) | {format_bytes(ref['kv_bytes'])} | 1.00 | reference | {ref['perplexity']:.4f} | |")
    print(f"| int4 | {format_bytes(q['kv_bytes'])} | {q['kv_bytes'] / ref['kv_bytes']:.3f} | "
          f"{100 * q['free_running_agreement']:.1f}% (first difference at {q['first_difference']}) / "
          f"{100 * q['teacher_forced_agreement']:.1f}% | {q['perplexity']:.4f} | {100 * (q['perplexity'] / ref['perplexity'] - 1):+.2f}% |")
    print(f"\nmax_context admitted (model limit {budgets['max_positions']}):\n")
    print("| kv_cache_bytes | " + " | ".join(f"{figures[d]['kv_dtype']}" for d in DTYPES) + " | int4 / reference |")
    print("|---|---|---|---|")
    for budget, row in budgets["rows"].items():
        print(f"| {format_bytes(budget)} | " + " | ".join(str(row[d]) for d in DTYPES) + f" | {row['int4'] / row['auto']:.2f} |")
    for row in figures.values():
        row.pop("tokens")
    print(json.dumps({"figures": figures, "admitted": budgets}, default=str), file=sys.stderr)


if __name__ == "__main__":
    main()
