"""The forward hooks the loop puts on the target model for one generation: the positions each pass computes, and
a copy of the cache as it stood holding exactly the prompt."""

from __future__ import annotations

from .stats import Record


def prompt_snapshot(prompt_tokens: int, taken: list):
    """A forward hook on the target model: a copy of its cache after the pass that left it holding exactly the prompt
    (the prefill; none where that never happens, as in a speculative pass that also verifies drafts)."""
    from .cachekinds import output_cache

    def hook(module, args, output):
        cache = output_cache(output)
        if not taken and hasattr(cache, "snapshot") and cache.get_seq_length() == prompt_tokens:
            taken.append(cache.snapshot())

    return hook


def pass_counter(record: Record):
    """A forward pre-hook on the target model: the positions each pass computes (the drafted tokens it verifies among
    them)."""

    def hook(module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        embeds = kwargs.get("inputs_embeds") if ids is None else None
        record.pass_tokens.append(
            int(ids.shape[-1]) if ids is not None else int(embeds.shape[1]) if embeds is not None else 0
        )

    return hook
