"""Prefix reuse on models whose cache keeps a recurrent or convolution state: such a cache cannot be cropped, so a
kept one is reused only by a prompt that extends its tokens exactly, and a conversation through it gives exactly the
tokens of fresh runs (linear attention beside attention, short convolutions beside attention, Mamba-2 alone); a
model whose forward drops a kept state has reuse off with the reason; KV-only models keep block reuse, unprobed."""

from __future__ import annotations

import pytest
import torch

from rocketllm_cli.auto import AutoModel
from rocketllm_cli.text import reuse
from rocketllm_cli.text.loop import GenerationRequest, Generator
from rocketllm_cli.text.prefix import PrefixCache
from rocketllm_cli.text.reuse import prefix_cache_for, reuse_for
from rocketllm_cli.text.sampling import SamplingParams

NEW = 8
PROMPT = [1] + list(range(10, 40))


def load(path):
    return AutoModel.from_pretrained(path, device_cache_bytes="1GB")


def run(model, ids, cache=None, n=NEW):
    return Generator(model, cache).run(GenerationRequest(list(ids), SamplingParams(max_new_tokens=n)))


@pytest.fixture(scope="module")
def lfm2(stateful_factory):
    model = load(stateful_factory("lfm2"))
    yield model
    model.close()


@pytest.mark.parametrize(
    "model_type, kind",
    [("qwen3_next", "LinearAttentionLayer"), ("lfm2", "LinearAttentionLayer"), ("mamba2", "LinearAttentionLayer")],
)
def test_a_conversation_through_the_prefix_cache_gives_the_tokens_of_fresh_runs(model_type, kind, stateful_factory):
    model = load(stateful_factory(model_type))
    try:
        found = reuse_for(model)
        assert found.mode == "extend" and kind in found.reason and "extends it exactly" in found.reason
        cache = prefix_cache_for(model, 1 << 30)
        assert cache.mode == "extend" and not cache.disabled_reason
        history, kept = list(PROMPT), 0
        for turn in range(3):
            fresh = run(model, history)
            reused = run(model, history, cache)
            assert reused.token_ids == fresh.token_ids, turn
            assert reused.reused_tokens == kept  # the whole previous turn: its prompt and its reply but the last token
            assert reused.ledger["prefill"]["tokens"] == len(history) - kept  # only the rest was computed
            kept = len(history) + len(fresh.token_ids) - 1
            # the reply, then the next user turn
            history += fresh.token_ids + list(range(100 + turn * 20, 110 + turn * 20))
    finally:
        model.close()


def test_a_kept_state_serves_only_a_prompt_that_extends_it(lfm2):
    cache = PrefixCache(1 << 30, mode="extend")
    first = run(lfm2, PROMPT, cache)
    kept = PROMPT + first.token_ids[:-1]
    assert len(cache) == 1 and cache.bytes > 0
    assert cache.lookup(PROMPT) is None  # the state is the one after the reply: the same prompt again cannot use it
    assert cache.lookup(kept) is None  # nothing would be left to compute
    assert cache.lookup(kept[:-1] + [7, 8]) is None  # diverges inside the kept tokens
    hit = cache.lookup(kept + [7])
    # attention layers: generate slices itself
    assert hit is not None and hit.tokens == len(kept) and hit.feed_from == 0
    assert run(lfm2, PROMPT, cache).token_ids == first.token_ids  # a repeat is computed afresh, and kept once
    assert len(cache) == 1


def test_a_cache_of_state_layers_only_is_given_the_tokens_generate_cannot_count(stateful_factory):
    """Where a cache of state layers alone cannot say how many tokens it has seen (transformers up to 5.24), generate
    is given only the new ones; where it counts them (5.25), the whole prompt, which generate slices itself."""
    model = load(stateful_factory("mamba2"))
    try:
        cache = prefix_cache_for(model, 1 << 30)
        first = run(model, PROMPT, cache)
        hit = cache.lookup(PROMPT + first.token_ids + [7])
        assert hit.tokens == len(PROMPT) + len(first.token_ids) - 1
        try:
            counted = int(hit.cache.get_seq_length())
        except ValueError:  # 'can only be called on Attention layers'
            counted = None
        assert hit.feed_from == (hit.tokens if counted is None else 0)
        assert counted in (None, hit.tokens)
    finally:
        model.close()


def test_a_model_whose_forward_drops_a_kept_state_has_reuse_off_with_the_reason(stateful_factory):
    model = load(stateful_factory("mamba"))
    try:
        found = reuse_for(model)
        assert found.mode is None
        assert found.reason.startswith(
            "the model's cache has LinearAttentionLayer layers, whose state cannot be cropped"
        )
        assert "gives other logits than a fresh prefill" in found.reason and "\n" not in found.reason
        cache = prefix_cache_for(model, 1 << 30)
        assert cache.disabled_reason == found.reason
        run(model, PROMPT, cache)
        assert len(cache) == 0 and cache.lookup(PROMPT + [7] * 20) is None
    finally:
        model.close()


def test_a_forward_that_does_not_read_a_kept_state_is_caught(monkeypatch, lfm2):
    """A forward that would give close logits but ignores a kept state (as transformers' Jamba does with its
    recurrent state): the probe changes each kind of state and sees no change."""
    extended = torch.zeros(4)
    monkeypatch.setattr(reuse, "_logits", lambda model, ids, cache=None: extended)
    found = reuse_for(lfm2)
    assert found.mode is None and "does not read its kept conv_states when several new tokens follow" in found.reason


def test_kv_only_models_keep_block_reuse_without_a_probe(monkeypatch, tiny_factory):
    model = load(tiny_factory("gemma2"))  # full attention and sliding windows
    try:
        monkeypatch.setattr(reuse, "_probe", lambda model: pytest.fail("a KV-only model is probed"))
        assert reuse_for(model) == reuse.Reuse("blocks")
        assert prefix_cache_for(model, 1 << 30).mode == "blocks"
    finally:
        model.close()


def test_a_model_that_keeps_its_state_outside_a_cache_object_has_reuse_off(monkeypatch, lfm2):
    class Output:
        def __init__(self) -> None:
            self.cache = [torch.zeros(1)]  # what RWKV hands back: a list of tensors

    monkeypatch.setattr(reuse, "declared_kinds", lambda model: None)
    monkeypatch.setattr(reuse, "_output", lambda model, ids, cache=None: Output())
    found = reuse_for(lfm2)
    assert found.mode is None and found.reason == (
        "the model keeps its cache in a list, not a transformers cache of layers, so it cannot be kept and restored"
    )
