"""A checked request, ready for the worker, and what its response needs."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..text.loop import GenerationRequest
from .structured import FREE, Structure


@dataclass
class Prepared:
    """A checked request, ready for the worker, and what its response needs."""

    request: GenerationRequest
    stream: bool = False
    tools: bool = False  # parse the reply for tool calls
    include_usage: bool = False
    headers: dict = field(default_factory=dict)  # extra response headers (ignored settings, tool_choice not enforced)
    echo: str = ""  # the prompt text a completion echoes before its reply
    structure: Structure = FREE  # what constrained decoding enforces, and the text the server writes around the reply
    n: int = 1  # choices: rows of one batch, one streaming pass for all of them
    echo_ids: list[int] | None = None  # an echoed prompt's ids, whose log-probabilities a completion returns first
    settings: dict = field(default_factory=dict)  # what a response repeats of its request (the Responses API's object)
    stats: bool = False  # the caller asked for the engine's figures (STATS_HEADER): bytes per tier, residency, peak RSS

    def rows(self) -> list[GenerationRequest]:
        """The request as the worker runs it: n rows sharing one cancel event (a client that leaves stops them all)."""
        import dataclasses

        return [self.request] + [dataclasses.replace(self.request) for _ in range(self.n - 1)]

    def reply_text(self, outcome) -> str:
        """The whole reply: the structure's prefill and closing around the generated text."""
        return self.structure.prefill + outcome.text + self.closing(outcome)

    def closing(self, outcome) -> str:
        """The structure's closing, where the grammar ran to its end (not after max_tokens or a stop string cut it)."""
        return self.structure.closing if outcome.finish_reason == "stop" and outcome.stop_sequence is None else ""

    def finish(self, splitter, outcome) -> tuple[str, list]:
        """What a streamed reply's splitter still holds once OUTCOME ended, its closing written: (content not sent,
        calls)."""
        held = splitter.feed(self.closing(outcome))
        rest, calls = splitter.finish()
        return held + rest, calls

    def splitter(self, parser):
        """A StreamSplitter for this reply's tool calls, holding the prefill already (None when tools are not
        parsed)."""
        if not self.tools:
            return None
        from .tools import StreamSplitter

        splitter = StreamSplitter(parser)
        splitter.feed(self.structure.prefill)  # a call's opening: held back with the call
        return splitter
