"""The one streamer: transformers' put/end protocol for a batch of rows, with a timestamp and a read_bytes
mark per step, incremental text, stop strings and cancellation.

generate() puts the prompt ids [B, S] first (skipped, once), then each step's new token of every row [B]; a speculative
step of a lone row puts every token that pass made, [1, n].
A row's text is handed on (on_text) only once it cannot turn out to be half a multi-byte character or the
start of one of its stop strings. StopWhen, the one StoppingCriteria, ends a row at its first stop string or
once its cancel event is set (checked after every step, so a client that went away frees the model within one).
"""

from __future__ import annotations

import threading
import time
from typing import Callable

import torch
from transformers import StoppingCriteria

from ..iocounts import storage_read_bytes
from .stats import Record


class Row:
    """One sequence's text as its tokens come. Decodes as it goes only when someone reads it (on_text or stop
    strings)."""

    def __init__(
        self,
        tokenizer,
        eos_ids: set[int],
        stop: tuple[str, ...] = (),
        on_text: Callable[[str], None] | None = None,
        cancel: threading.Event | None = None,
        on_logprobs: Callable[[list], None] | None = None,
    ) -> None:
        self.tokenizer, self.eos_ids, self.on_text, self.on_logprobs = tokenizer, eos_ids, on_text, on_logprobs
        self.logprobs: list = []  # TokenLogprob of each of `ids`, when the loop records them (text/logprobs.py)
        self.stop = tuple(s for s in stop if s)
        self.cancel = cancel or threading.Event()
        self.ids: list[int] = []  # this row's tokens until it ended (an end-of-sequence id, or a stop string's step)
        self.text = ""
        self.sent = 0
        self.stop_at: int | None = None  # where the first stop string begins in text
        self.stop_sequence: str | None = None
        self.ended_at: int | None = None  # sequence length when StopWhen first ended this row
        self._ended = False
        self._live = on_text is not None or bool(self.stop)
        self._longest = max((len(s) for s in self.stop), default=0)

    def add(self, token: int, logprob=None) -> None:
        if self._ended:
            return  # a finished row of a batch goes on receiving padding
        self.ids.append(token)
        self._ended = token in self.eos_ids
        if logprob is not None:
            self.logprobs.append(logprob)
            if self.on_logprobs is not None:  # before the text it belongs to is handed on
                self.on_logprobs([logprob])
        if self._live:
            self.text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
            if self.stop:
                self._find_stop()
            self._send(final=False)

    def finish(self, token_ids: list[int]) -> str:
        """The reply once generation returned: the text of `token_ids`, trimmed at the stop string; sends the rest."""
        if self.stop_at is None:
            self.text = self.tokenizer.decode(token_ids, skip_special_tokens=True) if self.tokenizer is not None else ""
        self._send(final=True)
        return self.reply()

    def should_stop(self) -> bool:
        return self.stop_at is not None or self.cancel.is_set()

    def reply(self) -> str:
        return self.text[: self.stop_at] if self.stop_at is not None else self.text

    def _find_stop(self) -> None:
        start = max(0, self.sent - self._longest)
        found = [(i, s) for s in self.stop if (i := self.text.find(s, start)) >= 0]
        if found:
            self.stop_at, self.stop_sequence = min(found)
            self._ended = True  # the ids of later steps are not part of the reply

    def _send(self, final: bool) -> None:
        text = self.reply()
        end = len(text)
        if not final:
            if text.endswith("\ufffd"):  # half of a multi-byte character: wait for the rest
                end = len(text.rstrip("\ufffd"))
            if self.stop_at is None:
                end -= held_back(text[:end], self.stop)
        if end > self.sent:
            piece, self.sent = text[self.sent : end], end
            if self.on_text is not None:
                self.on_text(piece)


def held_back(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest end of `text` that is the beginning of a stop string (it may yet become one)."""
    best = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:n]):
                best = n
                break
    return best


class Streamer:
    """transformers' streamer protocol over a batch: timestamps and read_bytes into `record`, tokens to each row.
    on_step(tokens), when given, hears each plain step's tokens (one a row) before the next forward pass begins: the
    grammar mask (text/grammar.py) computes the next mask meanwhile."""

    def __init__(
        self, rows: list[Row], record: Record, on_step: Callable[[list[int]], None] | None = None, recorder=None
    ) -> None:
        self.rows, self.record, self.on_step = rows, record, on_step
        self.recorder = recorder  # a LogprobRecorder: each plain step's tokens get their log-probabilities from it
        self._prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if not self._prompt_seen:  # the first call carries the prompt
            self._prompt_seen = True
            self.record.marks.append(storage_read_bytes())
            return
        self.record.times.append(time.perf_counter())
        self.record.marks.append(storage_read_bytes())
        if value.dim() == 2 and len(self.rows) == 1:  # a lone row's tokens of one (speculative) pass
            tokens = value[0].tolist()
            self.record.counts.append(len(tokens))
            for token in tokens:
                self.rows[0].add(int(token))
            return
        self.record.counts.append(1)
        tokens = value.reshape(-1).tolist()
        if self.on_step is not None:
            self.on_step(tokens)
        logprobs = self.recorder.chosen(tokens) if self.recorder is not None else [None] * len(tokens)
        for row, token, logprob in zip(self.rows, tokens, logprobs):
            row.add(int(token), logprob)

    def end(self) -> None:
        pass  # the loop finishes each row once generate has returned its ids


class StopWhen(StoppingCriteria):
    """True for each row whose stop string appeared or whose job was cancelled; notes the length it ended at."""

    def __init__(self, rows: list[Row]) -> None:
        self.rows = rows

    def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
        done = [row.should_stop() for row in self.rows]
        for row, stop in zip(self.rows, done):
            if stop and row.ended_at is None:
                row.ended_at = int(input_ids.shape[1])
        return torch.tensor(done, dtype=torch.bool, device=input_ids.device)
