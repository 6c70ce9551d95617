"""Speculative decoding: which mode a generation runs in, and why, and the keywords transformers' generate takes for it.

transformers' own assisted generation does the work: a candidate generator drafts tokens (prompt lookup: an n-gram of
the prompt and the text so far; a draft model: a small resident model with the same vocabulary), and one forward pass
of the target verifies them all, keeping the drafted tokens up to the first the target would not have picked, plus the
target's own next token. Greedy, that gives the target's greedy tokens exactly (the logits of a position depend only on
the tokens before it); sampling keeps the target's distribution (standard speculative sampling with a draft model's
probabilities; with prompt lookup each position is sampled from the target and a drafted token kept where they agree).

It pays where a pass costs the bytes it moves rather than the tokens it computes: when layers stream (the speculate
knob's auto). It is off, with the reason, for a model whose cache keeps a recurrent state that cannot be rolled back to
before a rejected token (Mamba, linear attention), and for a batch of several prompts (transformers verifies the drafts
of one sequence).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import ParameterError
from ..profiles.knobs.derivation import DEFAULT_DRAFT_TOKENS
from ..profiles.knobs.table import SPECULATION_MODES

# transformers' words when it finds, after the first pass, that the cache cannot be cropped back
UNCROPPABLE = "requires a cache that can be cropped"


@dataclass(frozen=True)
class Speculation:
    mode: str = "off"  # off | prompt-lookup | draft
    reason: str = ""  # why it is on or off, in words
    tokens: int = DEFAULT_DRAFT_TOKENS  # drafted per pass
    # the draft model (a transformers model, every weight resident) for mode "draft"
    draft: object = field(default=None, repr=False)

    @property
    def on(self) -> bool:
        return self.mode != "off"

    def off(self, reason: str) -> Speculation:
        return Speculation("off", reason, self.tokens)

    def generate_kwargs(self) -> dict:
        """The keywords transformers' generate takes for this mode (none when off)."""
        if self.mode == "prompt-lookup":
            return {"prompt_lookup_num_tokens": self.tokens}
        if self.mode == "draft":
            config = self.draft.generation_config  # the candidate generator reads the draft's own config
            config.num_assistant_tokens = self.tokens
            config.num_assistant_tokens_schedule = "constant"
            return {"assistant_model": self.draft}
        return {}


def speculation_for(
    model, speculate: str | None = None, draft_model=None, draft_tokens: int | None = None
) -> Speculation:
    """The speculation a Generator runs MODEL with. Each argument left None comes from the model's knobs (a model
    AutoModel opened), else: off, the model's own draft (AutoModel loads --draft-model), DEFAULT_DRAFT_TOKENS."""
    knobs = getattr(model, "knobs", None)
    if speculate is not None:
        setting = speculate
    elif knobs is None:
        setting = "off"
    else:  # a derived value is auto's decision; say so
        setting = str(knobs.value("speculate")) if knobs["speculate"].overridden else "auto"
    if setting not in SPECULATION_MODES:
        raise ParameterError(
            f"{{speculate}} must be one of {', '.join(SPECULATION_MODES)} (got {setting!r})", "speculate"
        )
    tokens = (
        draft_tokens
        if draft_tokens is not None
        else int(knobs.value("draft_tokens"))
        if knobs is not None
        else DEFAULT_DRAFT_TOKENS
    )
    if tokens < 1:
        raise ParameterError(f"{{draft_tokens}} must be at least 1 (got {tokens})", "draft_tokens")
    draft = draft_model if draft_model is not None else getattr(model, "draft", None)
    # its transformers model
    draft = getattr(draft, "model", draft) if type(draft).__name__ == "StreamingModel" else draft
    mode, reason = _mode(setting, knobs, draft, explicit=speculate is not None)
    if mode == "draft" and draft is None:
        raise ParameterError("{speculate} draft needs a draft model: give {draft_model}", "speculate", "draft_model")
    spec = Speculation(mode, reason, tokens, draft if mode == "draft" else None)
    if spec.on:
        refusal = cannot_roll_back(model)
        if refusal:
            return spec.off(f"off: {refusal}")
    return spec


def _mode(setting: str, knobs, draft, explicit: bool) -> tuple[str, str]:
    """(mode, reason) for the knob's value; auto is the knob's derivation (on where layers stream)."""
    if setting != "auto":
        where = "speculate parameter" if explicit else "speculate knob"
        return setting, f"{'off' if setting == 'off' else 'on'} ({where}: {setting})"
    knob = knobs["speculate"] if knobs is not None else None
    derived = None if knob is None else (knob.derived_value if knob.overridden else knob.value)
    # no knobs (a plain transformers model), or no model facts: nothing says a pass streams
    if derived in (None, "auto"):
        return "off", "off: auto, and nothing says this model streams its layers"
    if derived == "prompt-lookup" and draft is not None:
        derived = "draft"  # a draft given as a parameter rather than a knob
    inputs = knob.inputs if not knob.overridden else {}
    if {"total_bytes", "device_cache_bytes", "host_cache_bytes", "host_tier_is_memory"} <= set(inputs):
        from ..sizes import format_bytes

        total = inputs["total_bytes"]
        streamed = max(
            0, total - inputs["device_cache_bytes"] - inputs["host_tier_is_memory"] * inputs["host_cache_bytes"]
        )
        where = f"{format_bytes(streamed)} of the model's {format_bytes(total)} stream each pass"
    else:
        where = knob.note.split(" = ", 1)[-1]  # an explicit auto: the derivation the override replaced
    if derived == "off":
        return "off", "off: auto, and every unit is in memory, so a pass costs its compute, which grows with its tokens"
    return derived, f"on ({derived}): auto, and {where}; a streaming pass costs the bytes it moves whatever its tokens"


def cannot_roll_back(model) -> str:
    """Why MODEL's cache cannot be cropped back past rejected drafted tokens, or "" when it can."""
    from .cachekinds import CROPPABLE, declared_kinds

    inner = getattr(model, "model", model) if type(model).__name__ == "StreamingModel" else model
    stateful = getattr(inner, "_is_stateful", None)  # transformers up to 5.24 marks such models; 5.25 dropped the mark
    kinds = sorted((declared_kinds(inner) or set()) - CROPPABLE) if stateful is not False else []
    # Without the mark, a cache layer that keeps a state decides: 5.25 calls such layers croppable, yet its assisted
    # generation gave other tokens than plain greedy decoding on Mamba, Mamba2 and Qwen3-Next.
    if stateful or (stateful is None and kinds):
        what = f"{', '.join(kinds)} layers" if kinds else "a recurrent state"
        return (
            f"{type(inner).__name__} keeps {what} in its cache, a state after every token that cannot be rolled "
            f"back to "
            "before a rejected drafted token"
        )
    return ""
