"""How many tokens a speculative pass of one shard set made, as `bench` measured it.

A pass that streams layers costs the bytes it moves whatever its tokens; speculation turns each pass into
`tokens_per_pass` tokens, a property of the model and the text (prompt lookup drafts from what was already said), not of
the hardware. `bench` measures it with every run that speculates; `plan` projects a speculating row at the
figure measured for the same set and mode, and at one token a pass (a floor, said so) where none was.
One small JSON file in the cache, per set and mode, written atomically: not beside a profile, since the figure is not
the machine's (a bench run under a memory cgroup sees another machine, and its acceptance is the same).
"""

from __future__ import annotations

import time
from pathlib import Path

FILE = "speculation.json"


def _key(directory: Path, manifest, mode: str) -> str:
    from .unitreads import set_key

    return f"{set_key(directory, manifest)}-{mode}"


def _where() -> Path:
    from ...cachehome import cache_dir

    return cache_dir() / FILE


def record(directory: Path, manifest, figures: dict) -> None:
    """Keep a run's speculation FIGURES (text/stats.py: mode, proposed, accepted, passes, tokens, and over the measured
    decode passes alone decode_passes, decode_tokens, decode_positions_per_pass, which are kept where given: the
    prefill's pass makes one token whatever the drafts); a run that did not speculate, or made no pass, is not
    kept."""
    from ...cachehome import read_json, write_json

    mode = str(figures.get("mode") or "off")
    passes, tokens = (
        figures.get("decode_passes", figures.get("passes")),
        figures.get("decode_tokens", figures.get("tokens")),
    )
    if mode == "off" or not isinstance(passes, int) or not isinstance(tokens, int) or passes <= 0 or tokens <= 0:
        return
    where = _where()
    stored = read_json(where) or {}
    stored[_key(directory, manifest, mode)] = {
        "mode": mode,
        "tokens_per_pass": tokens / passes,
        "tokens": tokens,
        "passes": passes,
        "proposed": figures.get("proposed"),
        # what a pass computes: its last token and the drafts it verified (a pass of M positions costs more compute
        # than one of a single token: planning/projection.py)
        "positions_per_pass": figures.get("decode_positions_per_pass"),
        "accepted": figures.get("accepted"),
        "measured_at": time.strftime("%Y-%m-%d %H:%M", time.gmtime()) + " UTC",
    }
    try:
        write_json(where, stored)
    except OSError:
        pass  # a read-only cache: speculating rows project at one token a pass, and say so


def lookup(directory: Path, manifest, modes) -> dict[str, dict]:
    """{mode: the stored figures} for this set, for each of MODES measured."""
    from ...cachehome import read_json

    stored = read_json(_where()) or {}
    found = {}
    for mode in modes:
        entry = stored.get(_key(directory, manifest, mode))
        if (
            isinstance(entry, dict)
            and isinstance(entry.get("tokens_per_pass"), (int, float))
            and entry["tokens_per_pass"] >= 1
        ):
            found[mode] = entry
    return found
