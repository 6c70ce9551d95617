"""How long a reply is when nobody says: `generate`'s --max-new-tokens default, SamplingParams' own, and the server's
default_max_tokens knob where no speed can be projected to derive it from (profiles/knobs/running.py)."""

DEFAULT_REPLY_TOKENS = 256
