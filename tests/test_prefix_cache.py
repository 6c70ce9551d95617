"""Prefix caching: a reused prefix gives exactly the tokens a fresh prefill gives (greedy, several architectures,
a conversation that grows turn by turn, a sliding window that overflows), a restored checkpoint holds exactly
the KV of its tokens, the store stays within its byte budget, and `auto` is on only when every weight is resident."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from rocketllm_cli.auto import AutoModel
from rocketllm_cli.text.cachekinds import seq_length
from rocketllm_cli.text.loop import GenerationRequest, Generator
from rocketllm_cli.text.prefix import BLOCK_TOKENS, PrefixCache, block_hashes, decide
from rocketllm_cli.text.sampling import SamplingParams

NEW = 10
PROMPT = [1] + list(range(10, 60))  # 51 tokens: three whole blocks of 16, and three tokens after them


def load(path, **knobs):
    return AutoModel.from_pretrained(path, device_cache_bytes="1GB", **knobs)


@pytest.fixture(scope="module")
def llama(tiny_checkpoint):
    model = load(tiny_checkpoint)
    yield model
    model.close()


def run(model, ids, cache=None, n=NEW):
    return Generator(model, cache).run(GenerationRequest(list(ids), SamplingParams(max_new_tokens=n)))


def test_block_hashes_are_cumulative():
    a = block_hashes(list(range(64)), 16)
    b = block_hashes(list(range(48)) + [999] * 16, 16)
    c = block_hashes([7] + list(range(1, 64)), 16)
    assert len(a) == 4 and a[:3] == b[:3] and a[3] != b[3]
    assert all(x != y for x, y in zip(a, c))  # a change in the first block changes every boundary after it


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma2", "gpt2"])
def test_reused_prefix_gives_the_tokens_of_a_fresh_prefill(arch, tiny_factory):
    model = load(tiny_factory(arch))
    try:
        fresh = run(model, PROMPT)
        cache = PrefixCache(1 << 30)
        first = run(model, PROMPT, cache)
        again = run(model, PROMPT, cache)
        assert first.reused_tokens == 0 and again.reused_tokens == 3 * BLOCK_TOKENS
        assert fresh.token_ids == first.token_ids == again.token_ids
        assert again.ledger["prefill"]["tokens"] == len(PROMPT) - 3 * BLOCK_TOKENS  # only the rest was computed
    finally:
        model.close()


def test_a_growing_conversation_reuses_the_earlier_turns(llama):
    cache = PrefixCache(1 << 30)
    history = list(PROMPT)
    for turn in range(3):
        fresh = run(llama, history)
        reused = run(llama, history, cache)
        assert reused.token_ids == fresh.token_ids, turn
        if turn:
            # The previous turn's prompt and reply are cached up to their last whole block.
            assert reused.reused_tokens >= (len(history) - 20 - NEW) // BLOCK_TOKENS * BLOCK_TOKENS > 0
        history += fresh.token_ids + list(range(100 + turn * 20, 120 + turn * 20))  # the reply, then the next user turn


def test_a_restored_checkpoint_holds_exactly_the_kv_of_its_tokens(llama):
    from rocketllm_cli.text.cachekinds import output_cache

    def kv(ids):
        with torch.inference_mode():
            out = llama.generate(
                torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                max_new_tokens=1,
                do_sample=False,
                pad_token_id=3,
                return_dict_in_generate=True,
            )
        return output_cache(out)

    cache = PrefixCache(1 << 30)
    assert cache.store(PROMPT, kv(PROMPT)) == 48
    hit = cache.lookup(PROMPT[:40] + [300] * 20)  # shares two blocks and a half
    assert hit is not None and hit.tokens == 32 and seq_length(hit.cache) == 32
    fresh = kv(PROMPT[:32])
    for restored, computed in zip(hit.cache.layers, fresh.layers):
        assert restored.keys.shape[-2] == 32
        torch.testing.assert_close(restored.keys, computed.keys[..., :32, :])
        torch.testing.assert_close(restored.values, computed.values[..., :32, :])
    # The hit is a private copy: using it does not change what is stored.
    hit.cache.layers[0].keys.zero_()
    assert cache.lookup(PROMPT).cache.layers[0].keys.abs().sum() > 0


def test_a_prompt_of_whole_blocks_leaves_a_token_to_compute(llama):
    cache = PrefixCache(1 << 30)
    run(llama, PROMPT, cache)
    hit = cache.lookup(PROMPT[:33])
    assert hit.tokens == 32  # 33 tokens: two blocks reused, one computed
    assert cache.lookup(PROMPT[:32]).tokens == 16  # 32 tokens: the second block is computed, not restored
    assert cache.lookup(PROMPT[:16]) is None


def test_a_sliding_window_that_overflowed_is_not_stored(tiny_factory):
    model = load(tiny_factory("mistral", sliding_window=40))
    try:
        cache = PrefixCache(1 << 30)
        short = [1] + list(range(10, 30))  # 21 + 10 tokens fit the window of 40
        assert run(model, short, cache).reused_tokens == 0 and len(cache) == 1
        assert run(model, short, cache).reused_tokens == 16
        run(model, PROMPT, cache)  # 51 tokens overflow the window: nothing new is kept
        assert len(cache) == 1 and not cache.disabled_reason
        assert run(model, PROMPT, cache).token_ids == run(model, PROMPT).token_ids
    finally:
        model.close()


def test_the_store_stays_within_its_byte_budget(llama):
    probe = PrefixCache(1 << 30)
    run(llama, PROMPT, probe)
    one = probe.bytes  # one entry of 48 tokens
    cache = PrefixCache(int(2.5 * one))
    for start in (100, 150, 200, 250):  # four unrelated prompts of the same length
        run(llama, [1] + list(range(start, start + 50)), cache)
        assert cache.bytes <= cache.max_bytes
    assert len(cache) == 2 and cache.stats.evicted == 2
    assert cache.lookup([1] + list(range(250, 300))) is not None  # the latest are kept
    assert cache.lookup([1] + list(range(100, 150))) is None  # the oldest went first


def test_a_longer_entry_replaces_its_own_prefix(llama):
    cache = PrefixCache(1 << 30)
    first = run(llama, PROMPT, cache)
    size = cache.bytes
    run(llama, PROMPT + first.token_ids + list(range(100, 140)), cache)
    assert len(cache) == 1 and cache.bytes > size  # the shorter checkpoint is unreachable and dropped


def plan(tiers: dict) -> tuple:
    manifest = SimpleNamespace(units=[SimpleNamespace(name=n) for n in tiers])
    return SimpleNamespace(tier=tiers), manifest


@pytest.mark.parametrize(
    "setting, tiers, on",
    [
        ("auto", {"embed": "device", "layer.000": "device", "layer.001": "device"}, True),
        ("auto", {"embed": "device", "layer.000": "device", "layer.001": "storage"}, False),
        ("auto", {"embed": "device", "layer.000": "host", "layer.001": "host"}, False),
        ("on", {"embed": "device", "layer.000": "storage"}, True),
        ("off", {"embed": "device", "layer.000": "device"}, False),
    ],
)
def test_auto_is_on_only_when_every_weight_is_resident(setting, tiers, on):
    enabled, reason = decide(setting, *plan(tiers))
    assert enabled is on
    assert reason.startswith("on" if on else "off")
    if setting == "auto" and not on:
        assert "one streaming pass whatever its length" in reason
