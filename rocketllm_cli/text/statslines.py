"""The figures of a generation (text/stats.py) as the lines `generate --stats` prints."""

from __future__ import annotations


def format_stats(stats: dict, prompt_tokens: int, new_tokens: int) -> str:
    from ..sizes import format_bytes

    per = stats.get("bytes_per_token") or {}
    tiers = ", ".join(f"{t} {format_bytes(b)}" for t, b in per.items())
    witnessed = stats.get("storage_bytes_per_token_witnessed")
    server = stats.get("server")  # through a warm model or --server: the model was loaded already
    cached = f" ({stats.get('cached_prompt_tokens') or 0} from the server's prefix cache)" if server else ""
    if server:
        when = (
            f"time: {stats.get('total_s')} s through {server}, the model already loaded (nothing to find, write or "
            f"load)"
        )
    else:
        when = (
            f"time: {stats.get('load_s')} s to find or write the shards and load them, then {stats.get('total_s')} "
            f"s to generate"
        )
    if server and "bytes_per_token" not in stats:  # a server that sends no figures of its own (another version)
        return "\n".join(
            [
                f"tokens: {prompt_tokens} prompt{cached}, {new_tokens} generated; time to first token "
                f"{stats.get('time_to_first_token_s')} s",
                when + f"; decode {stats.get('decode_tokens_per_s')} tok/s",
                "bytes per tier: the server's /metrics",
            ]
        )
    return "\n".join(
        [
            f"tokens: {prompt_tokens} prompt{cached}, {new_tokens} generated; time to first token "
            f"{stats.get('time_to_first_token_s')} s",
            when,
            (
                f"decode: {stats.get('per_token_ms')} ms per step of a batch of {stats['batch']} "
                f"({stats['batch'] * (stats.get('decode_tokens_per_s') or 0):.2f} tok/s) on {stats.get('device')} in "
                f"{stats.get('compute_dtype')}"
                if stats.get("batch")
                else f"decode: {stats.get('per_token_ms')} ms/token ({stats.get('decode_tokens_per_s')} tok/s) on "
                f"{stats.get('device')} in {stats.get('compute_dtype')}"
            ),
            f"bytes per token: {tiers or 'n/a'}; storage read witnessed "
            f"{format_bytes(witnessed) if witnessed is not None else 'n/a'}",
            *([_experts_line(stats)] if stats.get("experts_per_token") is not None else []),
            *([speculation_line(stats["speculation"])] if stats.get("speculation") else []),
            *([grammar_line(stats["grammar"])] if stats.get("grammar") else []),
            f"peak RSS: {format_bytes(stats.get('peak_rss_bytes'))}",
            *([stages_line(stats["stages"])] if stats.get("stages") else []),
            stats.get("residency", ""),
        ]
    )


def stages_line(stages: dict) -> str:
    """Under torchrun: the plan, and what the links and the other ranks took per pass (measured; the bytes per token
    above are every rank's)."""
    return (
        f"{stages['plan']}; measured over {stages['passes']} passes: stages: links {stages['link_ms_per_pass']} ms, "
        f"other ranks computing {stages['other_ranks_ms_per_pass']} ms per pass; rank 0's own share below"
    )


def speculation_line(spec: dict) -> str:
    """One line on speculative decoding: what was proposed and accepted and the tokens each pass made, or why it was
    off."""
    if "proposed" not in spec:
        return f"speculative decoding: {spec.get('reason') or spec.get('mode')}"
    rate = f" ({100 * spec['acceptance']:.0f}%)" if spec.get("acceptance") is not None else ""
    return (
        f"speculative decoding ({spec['mode']}, up to {spec['draft_tokens']} drafted per pass): {spec['proposed']} "
        f"tokens proposed, {spec['accepted']} accepted{rate}; {spec['tokens']} tokens in {spec['passes']} passes = "
        f"{spec['tokens_per_pass']} tokens per pass"
    )


def grammar_line(grammar: dict) -> str:
    """One line on constrained decoding: the masks applied and what they cost the generating thread."""
    return (
        f"grammar: {grammar['masks']} masks over {grammar['rows']} constrained row(s); the generating thread waited "
        f"{grammar['blocking_ms_per_mask']} ms per mask (computed while the forward pass ran)"
    )


def _experts_line(stats: dict) -> str:
    cache = stats.get("expert_cache") or {}
    rate = cache.get("hit_rate")
    hits = (
        f"{100 * rate:.1f}% ({cache['hits']} of {cache['lookups']} lookups)"
        if rate is not None
        else "n/a (no expert cache in use)"
    )
    return (
        f"experts: {stats['experts_per_token']:.1f} routed expert uses per token (all layers); expert cache hit "
        f"rate {hits}"
    )
