"""The one generation loop: `generate`, `bench` and `serve` all run their prompts through Generator.

Layered as mlx-lm does: transformers' generate yields tokens; the streamer (streamer.py) turns them into text
pieces, with a timestamp and a read_bytes mark per step; the outcome carries the full text, the ids, why it
ended and the figures stats.py measures. Any transformers-compatible model works: a StreamingModel's ledger
adds bytes per tier, a plain model (bench's baselines) reports times and witnessed reads only.

A lone prompt may be decoded speculatively (speculate.py): transformers' assisted generation drafts tokens and one
pass verifies them, so a step hands the streamer several tokens; the loop counts the positions each pass of the
target computed, which gives the tokens proposed, accepted and made per pass.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
from transformers import LogitsProcessorList, StoppingCriteriaList

from .constraints import Constraint
from .endtokens import eos_token_ids, pad_token_id
from .grammar import Grammars
from .logprobs import LogprobRecorder, prompt_logprobs
from .passhooks import pass_counter, prompt_snapshot
from .processors import HoldEndOfSequence, LogitBias, Penalties
from .sampling import SamplingParams
from .speculate import UNCROPPABLE, Speculation, speculation_for
from .stats import GenerationStats, Record, measure
from .streamer import Row, StopWhen, Streamer


@dataclass
class GenerationRequest:
    prompt_ids: list[int]
    params: SamplingParams
    stop: tuple[str, ...] = ()
    cancel: threading.Event = field(default_factory=threading.Event)
    on_text: Callable[[str], None] | None = None  # called on the generating thread with each safe piece of text
    use_prefix_cache: bool = True
    keep_prefix: bool = True  # store this generation's KV for later prompts (bench times repeats without it)
    # The processor's tensors beside the ids (pixel_values, image_grid_thw ...: text/images.py) for a prompt with
    # pictures.
    # Such a prompt runs alone and never touches the prefix cache: two pictures' placeholder tokens are the same ids.
    model_inputs: dict | None = None
    constraint: Constraint | None = None  # what the output must be (text/grammar.py): a JSON Schema, a grammar ...
    # record each generated token's log-probability, with this many most likely (text/logprobs.py)
    logprobs: int | None = None
    # also each prompt token's, given those before it (an echo), with this many most likely
    prompt_logprobs: int | None = None
    # called on the generating thread with each new token's TokenLogprob
    on_logprobs: Callable[[list], None] | None = None
    score_only: bool = False  # generate nothing: only the prompt's log-probabilities (an echo with max_tokens 0)

    @property
    def has_images(self) -> bool:
        return bool(self.model_inputs)


@dataclass
class GenerationOutcome:
    text: str  # the reply, trimmed at the stop string
    token_ids: list[int]  # every generated id (an end-of-sequence id included)
    prompt_tokens: int
    finish_reason: str  # stop | length | cancelled
    stop_sequence: str | None = None  # the stop string that ended it, if one did
    reused_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    record: Record = field(default_factory=Record)  # what the generation saw, step by step (shared by a batch's rows)
    stats: GenerationStats = field(default_factory=GenerationStats)  # measure(record): every step counted
    logprobs: list | None = None  # TokenLogprob of each of token_ids, when the request asked for them
    prompt_logprobs: list | None = None  # None, then TokenLogprob of each later prompt token, when the request asked

    @property
    def new_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def ledger(self) -> dict:
        """The ledger's summary of this generation (empty for a model without a ledger)."""
        return self.stats.ledger


class Generator:
    """Runs requests on one model, one generate call at a time (the server's worker thread is its only caller there).

    speculate (auto | off | prompt-lookup | draft), draft_model (a model with the same vocabulary, every weight
    resident) and draft_tokens default to the model's knobs (AutoModel loads the knob's draft model); see speculate.py.
    """

    def __init__(
        self,
        model,
        prefix_cache=None,
        tokenizer=None,
        speculate: str | None = None,
        draft_model=None,
        draft_tokens: int | None = None,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer if tokenizer is not None else getattr(model, "tokenizer", None)
        self.prefix_cache = prefix_cache
        self.pad_id = pad_token_id(model)
        self.eos_ids = set(eos_token_ids(model))
        self.device = getattr(model, "device", None) or torch.device("cpu")
        self.speculation: Speculation = speculation_for(model, speculate, draft_model, draft_tokens)
        self._grammars: Grammars | None = None

    @property
    def grammars(self) -> Grammars:
        """The constraint engine over this model's tokenizer (built on first use: ~0.4 s for a 49k vocabulary)."""
        if self._grammars is None:
            if self.tokenizer is None:
                raise ValueError("constrained decoding needs a tokenizer")
            self._grammars = Grammars(self.tokenizer, self.eos_ids)
        return self._grammars

    def run(self, request: GenerationRequest) -> GenerationOutcome:
        """Generate for one prompt; the prefix cache (if any) is looked up and, unless keep_prefix is off, extended."""
        return self.run_batch([request])[0]

    def run_batch(self, requests: list[GenerationRequest]) -> list[GenerationOutcome]:
        """Generate for several prompts in one batch: every forward pass serves all of them.

        Prompts are left-padded so new tokens line up; outcomes come back in input order, each row cut at its
        first end-of-sequence id as a lone run would have stopped there. All rows share one SamplingParams.
        """
        if not requests:
            raise ValueError("no prompts to generate for")
        params = requests[0].params
        if any(r.params != params for r in requests):
            raise ValueError("the prompts of one batch share one SamplingParams")
        if self.tokenizer is None and any(r.on_text is not None or r.stop for r in requests):
            raise ValueError("streamed text and stop strings need a tokenizer")
        if len(requests) > 1 and any(r.has_images for r in requests):
            raise ValueError("a prompt with images runs alone, not in a batch")
        if params.min_new_tokens and any(r.constraint is not None for r in requests):
            raise ValueError(
                "min_new_tokens holds end-of-sequence off, which a grammar may need: give one or the other"
            )
        if all(r.cancel.is_set() for r in requests):
            return [GenerationOutcome("", [], len(r.prompt_ids), "cancelled") for r in requests]
        if all(r.score_only for r in requests):
            return [
                GenerationOutcome(
                    "",
                    [],
                    len(r.prompt_ids),
                    "length",
                    logprobs=[],
                    prompt_logprobs=self.score(r.prompt_ids, r.prompt_logprobs or 0),
                )
                for r in requests
            ]
        single = requests[0] if len(requests) == 1 else None
        record = Record(start=time.perf_counter())  # the prefill time includes restoring a cached prefix
        spec = (
            self.speculation
            if single is not None
            else self.speculation.off(
                "off: a batch of several prompts (transformers verifies the drafts of one sequence at a time)"
            )
        )
        if single is not None and single.has_images and spec.on:
            spec = spec.off(
                "off: the prompt carries images (a draft cannot see them, and their placeholder tokens "
                "of two different pictures are identical)"
            )
        if spec.on and any(r.logprobs is not None for r in requests):
            spec = spec.off("off: log-probabilities are read from each plain step's scores")
        scored = [
            self.score(r.prompt_ids, r.prompt_logprobs) if r.prompt_logprobs is not None else None for r in requests
        ]
        # transformers' assisted generation feeds its first pass the whole prompt even over a restored cache, so a
        # speculative run computes its prompt afresh (where layers stream, a prefill is one pass whatever its length).
        hit = self.prefix_cache.lookup(list(single.prompt_ids)) if self._caching(single) and not spec.on else None
        extra = self._model_inputs(single)  # a picture's tensors (pixel values, ...), as the processor made them
        if hit is not None:
            from ..stream.kvcache import generate_cache_kwarg

            extra[generate_cache_kwarg()] = hit.cache
        keep = self._caching(single) and single.keep_prefix
        if keep:
            extra["return_dict_in_generate"] = True  # the output then carries the cache to store
        # a cache generate cannot count is given only the new tokens
        feed_from = hit.feed_from if hit is not None else 0
        ids, mask = self._left_padded([r.prompt_ids[feed_from:] for r in requests])
        rows = [Row(self.tokenizer, self.eos_ids, r.stop, r.on_text, r.cancel, r.on_logprobs) for r in requests]
        record.prompt_new = len(single.prompt_ids) - (hit.tokens if hit is not None else 0) if single is not None else 0
        record.speculation = {
            "mode": spec.mode,
            "reason": spec.reason,
            **({"draft_tokens": spec.tokens} if spec.on else {}),
        }
        if spec.on and self._caching(single):
            record.speculation["prefix_cache"] = (
                "not looked up: a speculative run computes its whole prompt (kept for later runs)"
            )
        ledger = getattr(self.model, "ledger", None)
        # StreamingModel: its module
        inner = getattr(self.model, "model", self.model) if ledger is not None else self.model
        counting = (
            inner.register_forward_pre_hook(pass_counter(record), with_kwargs=True)
            if spec.on and isinstance(inner, torch.nn.Module)
            else None
        )
        # An int4 cache is kept as it stood at exactly its length: a copy once the prompt is in, before decoding goes
        # on.
        snapshots: list = []
        taking = (
            inner.register_forward_hook(prompt_snapshot(len(single.prompt_ids), snapshots))
            if keep and self.prefix_cache.takes_snapshots and isinstance(inner, torch.nn.Module)
            else None
        )
        try:
            out = self._generate(ids, mask, params, rows, record, ledger, spec, extra, requests)
            if out is None:  # the cache turned out not to crop back after the first pass: once more without speculation
                self.speculation = spec = spec.off(
                    f"off: {type(self.model).__name__}'s cache cannot be cropped back "
                    f"to before a "
                    "rejected drafted token (found on its first pass)"
                )
                record.speculation = {"mode": "off", "reason": spec.reason}
                rows = [Row(self.tokenizer, self.eos_ids, r.stop, r.on_text, r.cancel, r.on_logprobs) for r in requests]
                out = self._generate(ids, mask, params, rows, record, ledger, spec, extra, requests)
        finally:
            for hook in (counting, taking):
                if hook is not None:
                    hook.remove()
        record.end = time.perf_counter()
        record.steps = list(ledger.steps) if ledger is not None else []
        sequences = getattr(out, "sequences", out)
        width = ids.shape[1]
        if keep:
            from .cachekinds import output_cache

            for snapshot in snapshots:
                self.prefix_cache.keep(list(single.prompt_ids), snapshot)
            cache = output_cache(out)
            if cache is not None:  # the last id has no KV yet: store() crops to what the cache holds
                self.prefix_cache.store(list(single.prompt_ids) + sequences[0, width:].tolist(), cache)
        stats = measure(record)
        outcomes = []
        for i, (request, row) in enumerate(zip(requests, rows)):
            new = self._cut(sequences[i, width : row.ended_at].tolist())
            # a pass of several tokens may go on past the one that completed the stop string
            if row.stop_at is not None:
                new = new[: len(row.ids)]
            outcomes.append(
                GenerationOutcome(
                    text=row.finish(new),
                    token_ids=new,
                    prompt_tokens=len(request.prompt_ids),
                    finish_reason=self._finish_reason(row, request, new),
                    stop_sequence=row.stop_sequence,
                    reused_tokens=hit.tokens if hit is not None else 0,
                    record=record,
                    stats=stats,
                    logprobs=[e.trimmed(request.logprobs) for e in row.logprobs[: len(new)]]
                    if request.logprobs is not None
                    else None,
                    prompt_logprobs=scored[i],
                )
            )
        del out
        return outcomes

    def _generate(
        self,
        ids,
        mask,
        params: SamplingParams,
        rows: list[Row],
        record: Record,
        ledger,
        spec: Speculation,
        extra: dict,
        requests: list[GenerationRequest],
    ):
        """One generate call (None: speculation found the cache cannot be cropped before any token was handed on)."""
        if params.seed is not None:
            torch.manual_seed(params.seed)
        if ledger is not None:
            ledger.reset()
        record.times, record.marks, record.counts, record.pass_tokens = [], [], [], []
        processors = LogitsProcessorList()
        wanted = [r.logprobs for r in requests if r.logprobs is not None]
        recorder = LogprobRecorder(max(wanted)) if wanted else None
        if recorder is not None:  # first: it reads the scores before penalties, grammar and warpers change them
            processors.append(recorder)
        if params.min_new_tokens and self.eos_ids:
            processors.append(HoldEndOfSequence(ids.shape[1], params.min_new_tokens, self.eos_ids))
        if params.presence_penalty or params.frequency_penalty:
            processors.append(Penalties(ids.shape[1], params.presence_penalty, params.frequency_penalty))
        if params.logit_bias:
            processors.append(LogitBias(params.logit_bias))
        # transformers runs these before its temperature, top-k and top-p warpers, so those only see allowed tokens
        grammar = self._grammar_mask(requests, ids.shape[1])
        if grammar is not None:
            processors.append(grammar)
        try:
            with torch.inference_mode():
                return self.model.generate(
                    ids.to(self.device),
                    attention_mask=mask.to(self.device),
                    max_new_tokens=params.max_new_tokens,
                    streamer=Streamer(rows, record, grammar.advance if grammar is not None else None, recorder),
                    stopping_criteria=StoppingCriteriaList([StopWhen(rows)]),
                    pad_token_id=self.pad_id,
                    **params.generate_kwargs(),
                    **spec.generate_kwargs(),
                    **({"logits_processor": processors} if processors else {}),
                    **extra,
                )
        except ValueError as exc:
            if spec.on and UNCROPPABLE in str(exc) and not any(row.ids for row in rows):
                return None
            raise
        finally:
            if grammar is not None:
                grammar.close()
                record.grammar = grammar.figures()

    def score(self, prompt_ids: list[int], top: int = 0) -> list:
        """Each prompt token's log-probability given the ones before it (None for the first), with the TOP most likely:
        one forward pass over the prompt, nothing generated (an echo with max_tokens 0, or before generating)."""
        return prompt_logprobs(self.model, list(prompt_ids), top)

    def _grammar_mask(self, requests: list[GenerationRequest], width: int):
        """The logits processor for the rows' constraints (a matcher per row), or None when no row has one."""
        if all(r.constraint is None for r in requests):
            return None
        return self.grammars.mask([r.constraint for r in requests], width, self.grammars.vocab_size)

    def _caching(self, request: GenerationRequest | None) -> bool:
        return (
            request is not None
            and self.prefix_cache is not None
            and request.use_prefix_cache
            and not request.has_images
        )

    def _model_inputs(self, request: GenerationRequest | None) -> dict:
        """A prompt's processor tensors on the compute device, floating ones in the model's dtype (pixel values)."""
        if request is None or not request.model_inputs:
            return {}
        dtype = getattr(self.model, "dtype", None)
        return {
            k: v.to(self.device, dtype=dtype if v.is_floating_point() and dtype is not None else v.dtype)
            if isinstance(v, torch.Tensor)
            else v
            for k, v in request.model_inputs.items()
        }

    def _left_padded(self, prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, prompt in enumerate(prompts):
            ids[row, width - len(prompt) :] = torch.tensor(list(prompt), dtype=torch.long)
            mask[row, width - len(prompt) :] = 1
        return ids, mask

    def _cut(self, new: list[int]) -> list[int]:
        """A row's ids up to its first end-of-sequence id: what a lone run would have stopped at."""
        cut = next((i for i, t in enumerate(new) if t in self.eos_ids), None)
        return new[: cut + 1] if cut is not None else new

    def _finish_reason(self, row: Row, request: GenerationRequest, new: list[int]) -> str:
        if row.stop_at is not None:
            return "stop"
        if request.cancel.is_set():
            return "cancelled"
        if new and new[-1] in self.eos_ids:
            return "stop"
        return "length" if len(new) >= request.params.max_new_tokens else "stop"
