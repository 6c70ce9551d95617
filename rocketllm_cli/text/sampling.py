"""Sampling settings of one generation (torch-free: the CLI imports it for its flags)."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ParameterError
from ..replies import DEFAULT_REPLY_TOKENS


@dataclass
class SamplingParams:
    """Per-request settings; temperature 0 means greedy.

    min_new_tokens holds end-of-sequence off until that many tokens exist (bench: every run generates the same count);
    the generation loop applies it (text/loop.py, HoldEndOfSequence), not generate's own processors.
    """

    max_new_tokens: int = DEFAULT_REPLY_TOKENS
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    repetition_penalty: float = 1.0
    min_new_tokens: int = 0
    presence_penalty: float = 0.0  # OpenAI's: subtracted from the logit of every token the reply has used
    frequency_penalty: float = 0.0  # OpenAI's: subtracted once per use of a token in the reply
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) added to that token's logit at every step

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ParameterError(f"{{max_new_tokens}} must be at least 1 (got {self.max_new_tokens})", "max_new_tokens")
        if self.temperature < 0:
            raise ParameterError(
                f"{{temperature}} must be >= 0 (got {self.temperature}); use 0 for greedy", "temperature"
            )
        if not 0 < self.top_p <= 1:
            raise ParameterError(f"{{top_p}} must be in (0, 1] (got {self.top_p})", "top_p")
        if self.top_k < 0:
            raise ParameterError(f"{{top_k}} must be >= 0 (got {self.top_k}); 0 disables it", "top_k")
        if self.repetition_penalty <= 0:
            raise ParameterError(
                f"{{repetition_penalty}} must be > 0 (got {self.repetition_penalty})", "repetition_penalty"
            )
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise ParameterError(f"{{{name}}} must be between -2 and 2 (got {getattr(self, name)})", name)
        if not 0 <= self.min_new_tokens <= self.max_new_tokens:
            raise ParameterError(
                f"{{min_new_tokens}} must be between 0 and {{max_new_tokens}} ({self.max_new_tokens}) "
                f"(got {self.min_new_tokens})",
                "min_new_tokens",
                "max_new_tokens",
            )

    def generate_kwargs(self) -> dict:
        """The keywords transformers' generate takes for these settings (min_new_tokens and the presence and frequency
        penalties aside: the loop applies them, text/loop.py)."""
        if self.temperature == 0:
            return {
                "do_sample": False,
                "temperature": None,
                "top_p": None,
                "top_k": None,
                "repetition_penalty": self.repetition_penalty,
            }
        return {
            "do_sample": True,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k or None,
            "repetition_penalty": self.repetition_penalty,
        }
