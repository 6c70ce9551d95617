"""`bench --perplexity FILE [--reference REF]`: teacher-forced perplexity of a streamed model on a text, how often
a reference model's greedy choice agrees with it, and how far its distributions are from the reference's (KL).

Windows of `window` tokens start every `stride` tokens. Each window is one forward pass over all its tokens (a prefill:
one streaming pass serves them all) and scores only the tokens no earlier window scored, so every token but the first is
scored exactly once, each with at least window - stride tokens of context once past the first window.
perplexity = exp(mean negative log-likelihood), the log-softmax taken in fp32 whatever the compute dtype.
With a reference, KL(reference || model) is taken at the same scored positions from the same fp32 log-softmaxes
(`Divergence`: one model's distributions wait in a scratch file, never both models' in memory).
"""

from __future__ import annotations

import gc
import math
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from ..errors import UsageError
from .defaults import PERPLEXITY_REGIME, PERPLEXITY_WINDOW
from .divergence import Divergence, divergence

PERPLEXITY_REGIMES = ("resident", "host", "storage")
CHECKED_IDS = 8  # how many differing token ids a tokenizer mismatch names at most
ROWS = 64  # scored positions per fp32 log-softmax (and per KL step): its temporaries are ROWS x vocabulary floats


@dataclass
class PerplexityRequest:
    model: str | None
    text_file: str
    reference: str | None = None
    window: int | None = None  # None: PERPLEXITY_WINDOW, or the model's context if shorter
    stride: int | None = None  # None: half the window
    regime: str = PERPLEXITY_REGIME
    synthetic: str | None = None
    knob_flags: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if (self.model is None) == (self.synthetic is None):
            raise UsageError("give MODEL or --synthetic ARCH:SIZE (one of them)")
        if self.window is not None and self.window < 2:
            raise UsageError(f"--window must be at least 2 tokens (got {self.window})")
        if self.stride is not None and self.stride < 1:
            raise UsageError(f"--stride must be at least 1 token (got {self.stride})")
        if self.stride is not None and self.window is not None and self.stride >= self.window:
            raise UsageError(
                f"--stride ({self.stride}) must be less than --window ({self.window}): a window's first "
                f"token is "
                "predicted from the one before it"
            )
        if self.regime not in PERPLEXITY_REGIMES:
            raise UsageError(
                f"--perplexity runs one regime: pass --regime {', '.join(PERPLEXITY_REGIMES)} (got {self.regime!r})"
            )


def read_text(path: str) -> str:
    """The text to score; a missing, unreadable or empty file is one line."""
    p = Path(path).expanduser()
    if not p.exists():
        raise UsageError(f"--perplexity {path}: no such file")
    if not p.is_file():
        raise UsageError(f"--perplexity {path}: not a file (give a UTF-8 text file)")
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise UsageError(f"--perplexity {path}: not UTF-8 text (byte {exc.start})") from None
    if not text.strip():
        raise UsageError(f"--perplexity {path}: the text is empty")
    return text


def windows(n: int, window: int, stride: int) -> list[tuple[int, int, int]]:
    """(begin, end, first) per pass over n tokens: ids[begin:end] go in, and the tokens at begin + first .. end - 1
    are scored (each predicted from the logits one position before it). stride < window, so first >= 1."""
    spans, scored_to = [], 1  # token 0 has nothing before it to be predicted from
    for begin in range(0, n, stride):
        end = min(begin + window, n)
        spans.append((begin, end, scored_to - begin))
        scored_to = end
        if end == n:
            break
    return spans


@dataclass
class Scored:
    """What one model said about the text: per scored position (1 .. n-1) its negative log-likelihood and argmax."""

    nll: list[float]
    argmax: list[int]
    window_s: list[float]  # forward time of each pass
    window_tokens: list[int]  # tokens that went into each pass

    @property
    def perplexity(self) -> float:
        return math.exp(sum(self.nll) / len(self.nll))


def score(model, ids: list[int], window: int, stride: int, rows: Callable | None = None) -> Scored:
    """Teacher-forced scores of `ids` under any transformers-compatible causal LM (streamed or not). `rows`, when given,
    is called with the fp32 log-probabilities [r, vocabulary] of every ROWS scored positions or fewer, in position
    order."""
    import torch

    nll, argmax, seconds, sizes = [], [], [], []
    spans = windows(len(ids), window, stride)
    device = getattr(model, "device", None) or torch.device("cpu")
    with torch.inference_mode():
        for begin, end, first in spans:
            x = torch.tensor([ids[begin:end]], device=device)
            start = time.perf_counter()
            logits = model(input_ids=x, **_kv_kwargs(model)).logits[0]  # [L, V]
            seconds.append(time.perf_counter() - start)
            sizes.append(end - begin)
            # logits at j predict token j + 1: the scored targets first .. L-1 come from rows first-1 .. L-2
            for at in range(first - 1, end - begin - 1, ROWS):
                chunk = logits[at : min(at + ROWS, end - begin - 1)].float()
                targets = x[0, at + 1 : at + 1 + len(chunk)]
                logp = torch.log_softmax(chunk, dim=-1)
                nll += (-logp.gather(1, targets[:, None])[:, 0]).double().tolist()
                argmax += chunk.argmax(dim=-1).tolist()
                if rows is not None:
                    rows(logp)
                del chunk, logp
            del logits
    return Scored(nll, argmax, seconds, sizes)


def check_same_tokenizer(
    tokenizer, reference_tokenizer, ids: list[int], ref_ids: list[int], names: tuple[str, str]
) -> None:
    """Refuse a reference whose tokenizer differs: vocabulary size, then the text's own token ids."""
    a, b = len(tokenizer), len(reference_tokenizer)
    if a != b:
        raise UsageError(
            f"tokenizer mismatch: {names[0]} has {a} tokens, --reference {names[1]} has {b}; "
            "agreement needs the same tokenizer"
        )
    if ids != ref_ids:
        at = next((i for i, (x, y) in enumerate(zip(ids, ref_ids)) if x != y), min(len(ids), len(ref_ids)))
        mine, theirs = ids[at : at + CHECKED_IDS], ref_ids[at : at + CHECKED_IDS]
        raise UsageError(
            f"tokenizer mismatch: the text encodes differently from token {at} on ({names[0]} {mine}, --reference "
            f"{names[1]} {theirs}; {len(ids)} vs {len(ref_ids)} tokens); agreement needs the same tokenizer"
        )


def _text_config(directory: Path):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(directory)
    return getattr(config, "get_text_config", lambda: config)()


def model_vocabulary(directory: Path) -> int | None:
    """How many tokens the model's head scores, as its config says (None when it names none)."""
    value = getattr(_text_config(directory), "vocab_size", None)
    return value if isinstance(value, int) and value > 0 else None


def model_context(directory: Path) -> int | None:
    """The longest sequence the model's config allows (None when it names none)."""
    config = _text_config(directory)
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 1:
            return value
    return None


def run_perplexity(req: PerplexityRequest, log, progress=None) -> dict:
    """Shard (or reuse) MODEL and REF, check they share a tokenizer, score the text with each in one regime."""
    from transformers import AutoTokenizer

    from ..auto import ensure_shards
    from ..output import no_progress
    from .report import hardware_line, load_average
    from .sources import synthetic_checkpoint

    text = read_text(req.text_file)
    load = {"before": load_average()}
    source = str(synthetic_checkpoint(req.synthetic, log)) if req.synthetic else req.model
    manifest, shards = ensure_shards(source, log=log, progress=progress)
    tokenizer = AutoTokenizer.from_pretrained(shards)
    ids = _encode(tokenizer, text)
    if len(ids) < 2:
        raise UsageError(
            f"--perplexity {req.text_file}: the text encodes to {len(ids)} token; scoring needs at least 2"
        )
    runs = [("model", req.synthetic or Path(req.model).name, shards, manifest)]
    if req.reference is not None:
        ref_manifest, ref_shards = ensure_shards(req.reference, log=log, progress=progress)
        ref_name = Path(req.reference).name
        ref_tokenizer = AutoTokenizer.from_pretrained(ref_shards)
        check_same_tokenizer(tokenizer, ref_tokenizer, ids, _encode(ref_tokenizer, text), (runs[0][1], ref_name))
        runs.append(("reference", ref_name, ref_shards, ref_manifest))
    window, stride = _window_and_stride(req, [r[2] for r in runs], len(ids))
    spans = windows(len(ids), window, stride)
    rows, scored, profile, kl = [], [], None, None
    phase = progress or no_progress
    with ExitStack() as stack:
        meter = _divergence(stack, runs, len(ids) - 1, len(tokenizer), log)
        for role, name, directory, man in runs:
            log(
                f"{role} {name}: scoring {len(ids)} tokens in {len(spans)} windows of up to {window} ({req.regime} "
                f"regime)"
            )
            sink = None if meter is None else (meter.keep if role == "model" else meter.compare)
            with phase(f"perplexity: {name}", announce=False):
                row, result, profile = _score_one(directory, man, ids, window, stride, req, log, sink, role)
            row.update(role=role, name=name)
            rows.append(row)
            scored.append(result)
        if meter is not None:
            kl = meter.summary()
            if kl is None:
                log(f"KL divergence left out: {meter.why_not}")
    agreement = diff = None
    if len(scored) == 2:
        agreement = sum(a == b for a, b in zip(scored[0].argmax, scored[1].argmax)) / len(scored[0].argmax)
        diff = 100 * (scored[0].perplexity / scored[1].perplexity - 1)
    load["after"], load["cores"] = load_average(), profile.cpu_cores
    return {
        "hardware": hardware_line(profile),
        "text": {"file": Path(req.text_file).name, "bytes": len(text.encode()), "tokens": len(ids)},
        "window": window,
        "stride": stride,
        "windows": len(spans),
        "regime": req.regime,
        "rows": rows,
        "agreement": None if agreement is None else round(agreement, 6),
        "perplexity_diff_pct": None if diff is None else round(diff, 4),
        "kl_divergence": kl,
        "load": load,
    }


def _divergence(stack: ExitStack, runs: list, positions: int, tokens: int, log) -> Divergence | None:
    """With a reference, the Divergence both runs feed (its scratch removed when `stack` closes), unless the configs
    say the two heads score vocabularies of different sizes: then None, and the log says why."""
    if len(runs) < 2:
        return None
    (_, name, directory, _), (_, ref_name, ref_directory, _) = runs
    sizes = model_vocabulary(directory), model_vocabulary(ref_directory)
    if None not in sizes and sizes[0] != sizes[1]:
        log(
            f"KL divergence left out: {name} scores {sizes[0]} tokens, --reference {ref_name} {sizes[1]} (a padded "
            f"vocabulary)"
        )
        return None
    return stack.enter_context(divergence(positions, sizes[0] or tokens, (name, ref_name), log))


def _encode(tokenizer, text: str) -> list[int]:
    # special tokens as the tokenizer adds them to a text (a BOS, if any)
    return [int(t) for t in tokenizer(text).input_ids]


def _window_and_stride(req: PerplexityRequest, directories: list[Path], n: int) -> tuple[int, int]:
    contexts = [c for c in (model_context(d) for d in directories) if c is not None]
    context = min(contexts) if contexts else None
    if req.window is not None and context is not None and req.window > context:
        raise UsageError(f"--window {req.window} exceeds the model's context of {context} tokens")
    window = req.window or min(PERPLEXITY_WINDOW, context or PERPLEXITY_WINDOW)
    window = min(window, n)
    stride = req.stride or max(1, window // 2)
    if stride >= window:
        raise UsageError(f"--stride ({stride}) must be less than the window ({window} tokens: the text's length)")
    return window, stride


def _score_one(
    directory: Path,
    manifest,
    ids: list[int],
    window: int,
    stride: int,
    req: PerplexityRequest,
    log,
    sink=None,
    role: str = "model",
):
    from ..auto import AutoModel
    from ..packed.dense import kernel_passes
    from .regimes import REGIME_KNOBS, regime_overrides
    from .timing import ms_summary

    flags = {k: v for k, v in req.knob_flags.items() if k not in REGIME_KNOBS}
    if role == "reference":  # the truth the model is measured against: GGUF blocks times x in fp32, never int8
        flags["kernel"] = "exact"
    streamed = AutoModel.from_pretrained(directory, flags=flags, log=log, **regime_overrides(req.regime, manifest))
    try:
        # A window is one pass of many rows, which GGUF blocks would multiply densely (exact): every row keeps its
        # kernel mode instead, so that what a mode costs is what is measured, against exact mode's own products.
        with kernel_passes():
            result = score(streamed, ids, window, stride, sink)
        row = {
            "status": "measured",
            "perplexity": round(result.perplexity, 4),
            "nll_mean": round(sum(result.nll) / len(result.nll), 6),
            "tokens_scored": len(result.nll),
            "ms_per_window": ms_summary(result.window_s),
            "tokens_per_s": round(sum(result.window_tokens) / sum(result.window_s), 2),
            "compute_dtype": str(streamed.dtype).removeprefix("torch."),
            "shard_dtype": manifest.dtype,
            "residency": streamed.plan.describe(streamed.manifest),
        }
        return row, result, streamed.profile
    finally:
        streamed.close()
        del streamed
        gc.collect()


COLUMNS = (
    "run",
    "model",
    "perplexity",
    "tokens scored",
    "top-1 agreement",
    "perplexity vs reference",
    "KL(ref ‖ model) mean [p99, max]",
    "ms/window median [p10–p90]",
    "tokens/s (windows)",
    "compute dtype",
)


def render_perplexity(doc: dict) -> str:
    from .report import load_note, table_head

    t = doc["text"]
    lines = [
        f"**Hardware:** {doc['hardware']}",
        "",
        (
            f"**Text:** {t['file']} ({t['bytes']} bytes, {t['tokens']} tokens); windows of {doc['window']} tokens "
            f"every {doc['stride']} ({doc['windows']} passes per model, one streaming pass each, {doc['regime']} "
            f"regime); {load_note(doc['load'])}"
        ),
        "",
        *table_head(COLUMNS),
    ]
    for row in doc["rows"]:
        ms = row["ms_per_window"]
        reference = row["role"] == "reference"
        agree = "-" if doc["agreement"] is None or reference else f"{doc['agreement']:.4f}"
        diff = "-" if doc["perplexity_diff_pct"] is None or reference else f"{doc['perplexity_diff_pct']:+.2f}%"
        kl = doc.get("kl_divergence")
        kl = "-" if kl is None or reference else f"{kl['mean']:.3g} [{kl['p99']:.3g}, {kl['max']:.3g}]"
        lines.append(
            f"| {row['role']} | {row['name']} | {row['perplexity']:.4f} | {row['tokens_scored']} | {agree} | {diff} | "
            f"{kl} | {ms['median']:.1f} [{ms['p10']:.1f}–{ms['p90']:.1f}] | {row['tokens_per_s']:.1f} | "
            f"{row['compute_dtype']} |"
        )
    lines.append("")
    lines += [
        f"- {row['role']}: shards {row['shard_dtype']}, computing in {row['compute_dtype']}; {row['residency']}"
        for row in doc["rows"]
    ]
    if doc.get("kl_divergence") is not None:
        lines.append(
            "- KL(ref ‖ model): nats per scored token, the reference's fp32 distribution against the model's at each "
            "scored position"
        )
    return "\n".join(lines)


def _kv_kwargs(model) -> dict:
    """No cache, unless the KV cache stores another dtype (int4): then a fresh one, so attention reads keys and
    values as that cache holds them (int4 before its full-precision window), as it does while generating."""
    cache = model.new_kv_cache() if hasattr(model, "new_kv_cache") else None
    if cache is None:
        return {"use_cache": False}
    from ..stream.kvcache import generate_cache_kwarg

    return {generate_cache_kwarg(): cache, "use_cache": True}
