"""`bench --conversation N`: a multi-turn chat replayed with prefix reuse off and on, each turn's prefill timed.

Each turn renders the whole conversation through the chat template (every earlier user message and reply,
then a new user message) and generates a greedy reply twice: once with no prefix cache, once with one kept
across turns. The reply with reuse off continues the conversation; the one with reuse on must be the same.
Prefill is prompt in -> first token out, restoring the cached prefix included: the median of a few
one-token runs per turn and setting, interleaved, so a busy machine skews both sides alike. Speculative decoding
is off in both: it would skip the prefix cache's lookup, and the lookup is what this measures.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass, field

from ..errors import UsageError
from .defaults import CONVERSATION_REGIME, REPLY_TOKENS

USER_TURNS = (
    "Tell me about the history of computing in a few sentences.",
    "Which of those machines was the first to keep its program in memory?",
    "How is that idea still used in the computers we have today?",
    "What limits how fast such a computer can run?",
    "Sum up our conversation in one sentence.",
)
REPEATS = 3  # timed prefills per turn and setting; the median is reported


@dataclass
class ConversationRequest:
    model: str | None
    synthetic: str | None
    turns: int
    reply_tokens: int = REPLY_TOKENS
    regimes: tuple[str, ...] = ()
    knob_flags: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if (self.model is None) == (self.synthetic is None):
            raise UsageError("give MODEL or --synthetic ARCH:SIZE (one of them)")
        if not 1 <= self.turns <= 20:
            raise UsageError(f"--conversation must be between 1 and 20 turns (got {self.turns})")
        if self.reply_tokens < 1:
            raise UsageError(f"--tokens must be at least 1 (got {self.reply_tokens})")
        self.regimes = tuple(self.regimes) or (CONVERSATION_REGIME,)


def run_conversation(req: ConversationRequest, log) -> dict:
    from .frame import over_regimes

    def measure(shards, regime: str, flags: dict):
        log(f"{regime}: replaying a {req.turns}-turn conversation with prefix reuse off and on")
        return _replay(shards, regime, req, flags, log)

    doc = over_regimes(
        req.model, req.synthetic, req.regimes, req.knob_flags, ("prefix_cache",), "conversation", measure, log
    )
    return {**doc, "turns": req.turns, "reply_tokens": req.reply_tokens, "repeats": REPEATS}


def _replay(shards, regime: str, req: ConversationRequest, flags: dict, log) -> tuple[dict, object]:
    from ..auto import AutoModel
    from ..checkpoint.manifest import Manifest
    from ..text.loop import GenerationRequest, Generator
    from ..text.reuse import prefix_cache_for
    from ..text.sampling import SamplingParams
    from .regimes import regime_overrides

    model = AutoModel.from_pretrained(shards, flags=flags, log=log, **regime_overrides(regime, Manifest.load(shards)))
    try:
        if not getattr(model.tokenizer, "chat_template", None):
            raise UsageError("--conversation needs a model whose tokenizer has a chat template")
        cache = prefix_cache_for(model, int(model.knobs.value("kv_cache_bytes")))
        if cache.disabled_reason:
            log(f"{regime}: prefix reuse stays off: {cache.disabled_reason}")
        # Speculation off: a speculative run does not look its prompt up in the prefix cache, and reuse is what this
        # times.
        fresh, reusing = Generator(model, speculate="off"), Generator(model, cache, speculate="off")
        params, one = SamplingParams(max_new_tokens=req.reply_tokens), SamplingParams(max_new_tokens=1)
        messages: list[dict] = []
        turns = []
        for turn in range(req.turns):
            messages.append({"role": "user", "content": USER_TURNS[turn % len(USER_TURNS)]})
            ids = _chat_ids(model.tokenizer, messages)
            if turn == 0:
                fresh.run(GenerationRequest(ids, one))  # warm-up: one-off costs are not a turn's
            # Prefill timed REPEATS times each way, alternating, as one-token generations that keep nothing,
            # so every timed run with reuse on restores what the earlier turns left; then the whole replies.
            times: dict[str, list[float]] = {"off": [], "on": []}
            for _ in range(REPEATS):
                times["off"].append(fresh.run(GenerationRequest(ids, one)).stats.ttft_s)
                times["on"].append(reusing.run(GenerationRequest(ids, one, keep_prefix=False)).stats.ttft_s)
            off = fresh.run(GenerationRequest(ids, params))
            on = reusing.run(GenerationRequest(ids, params))
            ms = {k: round(1000 * sorted(v)[len(v) // 2], 2) for k, v in times.items()}
            turns.append(
                {
                    "turn": turn + 1,
                    "prompt_tokens": len(ids),
                    "reused_tokens": on.reused_tokens,
                    "prefill_ms_off": ms["off"],
                    "prefill_ms_on": ms["on"],
                    "prefill_ms_samples": times,
                    "computed_tokens_on": len(ids) - on.reused_tokens,
                    "reply_tokens": off.new_tokens,
                    "same_reply": on.token_ids == off.token_ids,
                    "first_difference": _first_difference(on.token_ids, off.token_ids),
                }
            )
            log(
                f"turn {turn + 1}: {len(ids)} prompt tokens, {on.reused_tokens} reused; prefill median {ms['off']} ms "
                f"off, {ms['on']} ms on"
            )
            messages.append({"role": "assistant", "content": off.text})
        run = {
            "regime": regime,
            "status": "measured",
            "residency": model.plan.describe(model.manifest),
            "turns": turns,
            "compute_dtype": str(model.dtype).removeprefix("torch."),
            "prefix_cache": cache.to_dict(),
        }
        return run, model.profile
    finally:
        model.close()
        del model
        gc.collect()


def _first_difference(a: list[int], b: list[int]) -> int | None:
    """Index of the first token where two replies differ (None when they are the same)."""
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _chat_ids(tokenizer, messages: list[dict]) -> list[int]:
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)[
        "input_ids"
    ]
    return [int(t) for t in (ids[0] if ids and isinstance(ids[0], list) else ids)]


COLUMNS = (
    "regime",
    "turn",
    "prompt tokens",
    "reused tokens (on)",
    "prefill ms, reuse off",
    "prefill ms, reuse on",
    "speed-up",
    "same reply",
)


def render_conversation(doc: dict) -> str:
    from .report import load_note, table_head

    model = doc["model"]
    lines = [
        f"**Hardware:** {doc['hardware']}",
        "",
        f"**Model:** {model['name']} ({model['dtype']}, {model['num_layers']} layers); a {doc['turns']}-turn "
        f"conversation, greedy replies of up to {doc['reply_tokens']} tokens; prefill is the median of "
        f"{doc['repeats']} runs each way; {load_note(doc['load'])}",
        "",
        *table_head(COLUMNS),
    ]
    for run in doc["runs"]:
        if run["status"] != "measured":
            lines.append(f"| {run['regime']} | skipped: {run['reason']} |" + " - |" * (len(COLUMNS) - 2))
            continue
        for t in run["turns"]:
            speed = t["prefill_ms_off"] / t["prefill_ms_on"] if t["prefill_ms_on"] else float("nan")
            lines.append(
                f"| {run['regime']} | {t['turn']} | {t['prompt_tokens']} | {t['reused_tokens']} | "
                f"{t['prefill_ms_off']:.1f} | {t['prefill_ms_on']:.1f} | {speed:.2f}× | {_same(t)} |"
            )
    notes = [
        f"- {run['regime']}: computing in {run['compute_dtype']}; {run['residency']}"
        for run in doc["runs"]
        if run["status"] == "measured"
    ]
    if any(not t["same_reply"] for run in doc["runs"] for t in run.get("turns", ())):
        notes.append(
            "- a reply that differs with reuse on: a prefill computed in pieces rounds differently from a whole one; "
            "in bf16 that can change a greedy choice after some tokens (--dtype fp32 rounds far less)"
        )
    return "\n".join(lines + ([""] + notes if notes else []))


def _same(turn: dict) -> str:
    return "yes" if turn["same_reply"] else f"no, from token {turn['first_difference'] + 1}"
