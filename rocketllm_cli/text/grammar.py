"""Constrained decoding: a grammar masks each row's logits before sampling, in the one generation loop.

The engine is llguidance (docs/ARCHITECTURE.md, "Constrained decoding", says why: measured against xgrammar on this
project's tokenizers). A Constraint names what the output must be (a JSON Schema, any JSON object, a Lark grammar, a
regular expression); Grammars compiles it once per tokenizer (compiled grammars are cached: agents send the same schema
with every request) and hands each batch row a matcher of its own; GrammarMask is the logits processor that keeps each
row's matcher in step with the ids generate holds and masks the tokens the grammar does not allow.

In step with the ids: the matcher follows `input_ids[row, width:]`, rolling back and consuming as they differ, so the
same processor serves plain decoding, a batch (rows that ended receive padding and are left alone), and speculative
decoding, where transformers calls it once per drafted position (a drafted token the grammar refuses gets probability
0 under the mask, so the verification rejects it, and the next call rolls the matcher back).
While a plain step's forward pass runs, the mask for the token the streamer has just seen is already being computed on
a thread of its own (`advance`); llguidance releases the GIL while it computes.

Import cost: llguidance is imported only when a constraint is used.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

import torch
from transformers import LogitsProcessor

from .constraints import Constraint, EngineUnavailable, GrammarError

COMPILED_CACHE = 64  # compiled grammars kept per tokenizer (an agent's schemas, its tools' argument schemas)


class Grammars:
    """The engine bound to one tokenizer: compiles constraints (cached) and makes matchers for the loop's rows.

    Building llguidance's view of a 49k-token vocabulary takes ~0.4 s, so it happens on the first constraint, once.
    Thread-safe: the server compiles on its request thread (a bad grammar is a 400 before the request queues) while
    the worker generates."""

    def __init__(self, tokenizer, eos_ids: list[int] | set[int] | None = None) -> None:
        self.tokenizer = tokenizer
        self.eos_ids = sorted(eos_ids or ())
        self._engine_tokenizer = None
        self._compiled: OrderedDict[Constraint, object] = OrderedDict()
        self._lock = threading.Lock()
        self.compiles = 0  # grammars compiled (cache misses), for tests and /health
        self.hits = 0

    @property
    def engine_tokenizer(self):
        with self._lock:
            if self._engine_tokenizer is None:
                self._engine_tokenizer = _engine_tokenizer(self.tokenizer, self.eos_ids)
            return self._engine_tokenizer

    @property
    def vocab_size(self) -> int:
        return int(self.engine_tokenizer.vocab_size)

    def compile(self, constraint: Constraint):
        """A matcher for CONSTRAINT at its start, compiled once and kept; raises GrammarError with the engine's
        reason."""
        import llguidance

        tokenizer = self.engine_tokenizer
        with self._lock:
            found = self._compiled.get(constraint)
            if found is not None:
                self._compiled.move_to_end(constraint)
                self.hits += 1
                return found
        try:
            grammar = constraint.engine_grammar()
        except (ValueError, TypeError, RuntimeError) as exc:
            raise GrammarError(f"{constraint.describe()} the engine cannot use: {_one_line(exc)}") from None
        matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise GrammarError(f"{constraint.describe()} the engine cannot use: {_one_line(matcher.get_error())}")
        with self._lock:
            self._compiled[constraint] = matcher
            self.compiles += 1
            while len(self._compiled) > COMPILED_CACHE:
                self._compiled.popitem(last=False)
        return matcher

    def matcher(self, constraint: Constraint):
        """A fresh matcher of its own for one row (a copy of the compiled one, at the grammar's start)."""
        return self.compile(constraint).deep_copy()

    def mask(self, constraints: list[Constraint | None], width: int, vocab: int) -> GrammarMask:
        """The logits processor for one generate call over rows with these constraints (None: that row is free)."""
        return GrammarMask([None if c is None else self.matcher(c) for c in constraints], width, vocab, self.eos_ids)


def constrained_kwargs(model, args: tuple, kwargs: dict, json_schema: dict | None, grammar: str | None) -> None:
    """generate()'s keywords with a GrammarMask added for json_schema or grammar (the Python API's constraint); the
    model keeps one Grammars, so a schema given again is not compiled again."""
    from transformers import LogitsProcessorList

    from ..errors import ParameterError
    from .endtokens import eos_token_ids

    if json_schema is not None and grammar is not None:
        raise ParameterError("give {json_schema} or {grammar}, not both", "json_schema", "grammar")
    constraint = Constraint.json_schema(json_schema) if json_schema is not None else Constraint.lark(grammar)
    grammars = model.__dict__.get("_grammars")
    if grammars is None:
        grammars = model.__dict__["_grammars"] = Grammars(getattr(model, "tokenizer", None), eos_token_ids(model))
    ids = kwargs.get("input_ids", args[0] if args else None)
    if ids is None:
        raise ParameterError("a constrained generate needs input_ids", "input_ids")
    mask = grammars.mask([constraint] * ids.shape[0], ids.shape[1], grammars.vocab_size)
    processors = kwargs.get("logits_processor") or LogitsProcessorList()
    kwargs["logits_processor"] = LogitsProcessorList([*processors, mask])


def _engine_tokenizer(tokenizer, eos_ids: list[int]):
    if tokenizer is None:
        raise EngineUnavailable("constrained decoding needs the model's tokenizer, and this model has none")
    try:
        import llguidance
        import llguidance.hf
    except ImportError:  # a dependency; only a broken install lacks it
        raise EngineUnavailable("constrained decoding needs the llguidance package: pip install llguidance") from None
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise EngineUnavailable(
            f"constrained decoding needs a fast (Rust) tokenizer, and this model's is "
            f"{type(tokenizer).__name__}; "
            "save the model with its tokenizer.json"
        )
    try:
        return llguidance.hf.from_tokenizer(tokenizer, eos_token=list(eos_ids) or None)
    except Exception as exc:  # noqa: BLE001 - the engine's own reasons (an unusual pre-tokenizer, a byte map it cannot read)
        raise EngineUnavailable(f"the constraint engine cannot read this model's tokenizer: {_one_line(exc)}") from None


def _one_line(exc: object) -> str:
    text = " ".join(str(exc).split())
    return text if len(text) <= 300 else text[:299] + "…"


# One thread computes masks while the forward pass runs (llguidance releases the GIL while it works).
_POOL: ThreadPoolExecutor | None = None
_POOL_LOCK = threading.Lock()


def _pool() -> ThreadPoolExecutor:
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = ThreadPoolExecutor(1, thread_name_prefix="rocketllm-grammar")
        return _POOL


class _Row:
    """One row's matcher and the generated ids it has consumed."""

    def __init__(self, matcher, words: int) -> None:
        self.matcher = matcher
        self.consumed: list[int] = []
        self.bits = torch.full((1, words), -1, dtype=torch.int32)  # the engine writes the allowed-token bitmask here
        self.current = False  # the bitmask is the one for what the matcher has consumed now
        self.off = False  # the ids hold a token the grammar refuses (a drafted token being verified): nothing to mask

    def follow(self, ids: list[int]) -> None:
        """Roll back and consume so that the matcher has consumed exactly `ids` (or the longest prefix it accepts)."""
        common = 0
        for a, b in zip(self.consumed, ids):
            if a != b:
                break
            common += 1
        new = ids[common:]
        if common < len(self.consumed) or new:
            self.current = False
        if common < len(self.consumed):
            self.matcher.rollback(len(self.consumed) - common)
            del self.consumed[common:]
        self.off = False
        if new:
            ok = self.matcher.validate_tokens(new) if not self.matcher.is_stopped() else 0
            if ok:
                if not self.matcher.consume_tokens(new[:ok]):
                    raise GrammarError(
                        f"the grammar engine refused tokens it had validated: {self.matcher.get_error()}"
                    )
                self.consumed.extend(new[:ok])
            self.off = ok < len(new)

    def fill(self) -> None:
        """Compute the allowed tokens after what was consumed (once per state)."""
        if self.current:
            return
        row = self.bits[0]
        self.matcher.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * row.element_size())
        self.current = True


class GrammarMask(LogitsProcessor):
    """transformers' logits processor for a batch: each constrained row's disallowed tokens get -inf.

    width: the ids generate was given (left-padded prompts); what follows them is generated. vocab: the engine's
    vocabulary; ids past it (a model's padded embedding rows) are never allowed in a constrained row."""

    def __init__(self, matchers: list, width: int, vocab: int, eos_ids: list[int]) -> None:
        words = (vocab + 31) // 32
        self.rows = [None if m is None else _Row(m, words) for m in matchers]
        self.width, self.vocab = width, vocab
        self.eos_ids = list(eos_ids)
        self._pending: Future | None = None
        self.mask_calls = 0
        self.blocking_s = 0.0  # time generate's thread spent here: waiting for a mask computed ahead, or computing it

    @property
    def matchers(self) -> list:
        return [None if r is None else r.matcher for r in self.rows]

    def advance(self, tokens: list[int]) -> None:
        """The streamer saw each row's next token (a plain step): consume it and compute the next mask now, on the
        grammar thread, while generate runs the next forward pass."""
        self._wait()
        self._pending = _pool().submit(self._advance, list(tokens))

    def _advance(self, tokens: list[int]) -> None:
        for row, token in zip(self.rows, tokens):
            if row is None or row.off or row.matcher.is_stopped():
                continue
            row.follow(row.consumed + [token])
            if not row.off:
                row.fill()

    def _wait(self) -> None:
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        started = time.perf_counter()
        self._wait()
        self.mask_calls += 1
        generated = input_ids[:, self.width :]
        for b, row in enumerate(self.rows):
            if row is None:
                continue
            ids = generated[b].tolist()
            if ids != row.consumed:
                row.follow(ids)
            if row.off:
                continue  # a refused drafted token, or padding after the row ended: this position is never kept
            if row.matcher.is_stopped():
                self._only_eos(scores[b])
                continue
            row.fill()
            _apply(scores[b], row.bits[0], self.vocab)
        self.blocking_s += time.perf_counter() - started
        return scores

    def figures(self) -> dict:
        """What Record.grammar reports: rows constrained, masks applied, the generating thread's time on them."""
        return {
            "rows": sum(r is not None for r in self.rows),
            "masks": self.mask_calls,
            "blocking_ms_per_mask": round(1000 * self.blocking_s / self.mask_calls, 4) if self.mask_calls else None,
        }

    def _only_eos(self, scores: torch.Tensor) -> None:
        keep = scores[self.eos_ids].clone()
        scores.fill_(-float("inf"))
        scores[self.eos_ids] = keep

    def close(self) -> None:
        self._wait()


def _apply(scores: torch.Tensor, bits: torch.Tensor, vocab: int) -> None:
    """scores[i] = -inf where bit i of the bitmask is 0 (and for every id past the engine's vocabulary)."""
    import numpy as np

    allowed = np.unpackbits(bits.numpy().view(np.uint8), bitorder="little")[:vocab].view(np.bool_)
    width = scores.shape[-1]
    if width > vocab:
        scores[vocab:] = -float("inf")
    scores[: min(width, vocab)].masked_fill_(torch.from_numpy(~allowed[:width]), -float("inf"))
