"""stream/appendcache.py: the default KV cache appends in place and holds exactly what transformers' DynamicLayer
holds, through appends, crops (by slicing and compacting), copies and replaced tensors."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoConfig
from transformers.cache_utils import DynamicLayer

from rocketllm_cli.stream.appendcache import STEP, AppendLayer, appending_cache
from rocketllm_cli.text.cachekinds import crop, nbytes, output_cache, supported


def _kv(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, 3, n, 8, generator=g), torch.randn(2, 3, n, 8, generator=g)


def _same(a, b) -> None:
    assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)


def test_appends_in_place_and_holds_what_dynamic_layer_holds():
    ours, theirs = AppendLayer(), DynamicLayer()
    for i, n in enumerate([5, 1, 1, STEP, 1, 3]):
        k, v = _kv(n, i)
        got, want = ours.update(k, v), theirs.update(k, v)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        _same(ours, theirs)
        if i == 1:
            buffer = ours._kbuf.data_ptr()
        if i == 2:  # a token more fits the buffer: no copy of what is held
            assert ours._kbuf.data_ptr() == buffer
    assert ours.get_seq_length() == theirs.get_seq_length() == 5 + 1 + 1 + STEP + 1 + 3
    assert ours._kbuf.shape[-2] - ours.keys.shape[-2] <= STEP  # at most STEP tokens of room beyond the tokens


def test_crops_copies_and_replaced_tensors_are_seen_on_the_next_append():
    ours, theirs = AppendLayer(), DynamicLayer()
    for layer in (ours, theirs):
        layer.update(*_kv(10, 0))
    for layer in (ours, theirs):  # transformers' own crop slices; the next append writes over the dropped tokens
        layer.crop(-4)  # 10 -> 6 tokens
        layer.update(*_kv(2, 1))
    _same(ours, theirs)
    snapshot = copy.deepcopy(ours)  # a kept prefix: appends to the live layer do not reach it
    ours.update(*_kv(1, 2))
    theirs.update(*_kv(1, 2))
    assert snapshot.get_seq_length() == 8 and torch.equal(snapshot.keys, theirs.keys[..., :8, :])
    assert snapshot._kbuf.data_ptr() != ours._kbuf.data_ptr()
    for layer in (ours, theirs):  # something else replaces the tensors (a reorder): the buffer is made again
        layer.keys, layer.values = layer.keys.flip(0).clone(), layer.values.flip(0).clone()
        layer.update(*_kv(1, 3))
    _same(ours, theirs)


def test_a_compacting_crop_lets_the_buffer_go_and_the_bytes_count_what_is_held():
    config = AutoConfig.for_model("llama", num_hidden_layers=2, hidden_size=32, num_attention_heads=4)
    cache = appending_cache(config)
    assert cache is not None and supported(cache) == (True, "")
    k, v = _kv(20, 0)
    for layer_idx in range(2):
        cache.update(k, v, layer_idx)
    assert {type(layer).__name__ for layer in cache.layers} == {"AppendLayer"}
    held = sum(layer._kbuf.numel() + layer._vbuf.numel() for layer in cache.layers) * 4
    assert nbytes(cache) == held  # the buffers, room included, each once
    crop(cache, 8)
    assert all(layer._kbuf is None for layer in cache.layers) and cache.get_seq_length() == 8
    assert nbytes(cache) == 2 * 2 * k[..., :8, :].numel() * 4


def test_models_with_other_layers_keep_transformers_cache():
    sliding = AutoConfig.for_model("mistral", num_hidden_layers=2, sliding_window=16)
    hybrid = AutoConfig.for_model(
        "gemma3_text", num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"]
    )
    assert appending_cache(sliding) is None and appending_cache(hybrid) is None


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_generate_gives_transformers_tokens_past_a_buffer_step(arch, tiny_factory):
    """A prompt and reply longer than STEP: the streamed model's greedy tokens are plain transformers'."""
    from transformers import AutoModelForCausalLM

    from rocketllm import AutoModel

    path = tiny_factory(arch)
    ids = torch.randint(3, 200, (1, STEP - 4), generator=torch.Generator().manual_seed(1))
    plain = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    want = plain.generate(ids, max_new_tokens=12, do_sample=False, min_new_tokens=12)
    streamed = AutoModel.from_pretrained(path, compute_dtype="fp32")
    try:
        out = streamed.generate(
            ids, max_new_tokens=12, do_sample=False, min_new_tokens=12, return_dict_in_generate=True
        )
    finally:
        streamed.close()
    assert out.sequences.tolist() == want.tolist()
    assert {type(layer).__name__ for layer in output_cache(out).layers} == {"AppendLayer"}  # the engine's default


def test_a_cache_sized_for_a_run_holds_no_room_past_it():
    """generate's prompt and new tokens bound the buffers (the KV the plan sized), until a run goes past them."""
    config = AutoConfig.for_model("llama", num_hidden_layers=1, hidden_size=32, num_attention_heads=4)
    cache = appending_cache(config, tokens=20)
    cache.update(*_kv(5, 0), 0)
    assert cache.layers[0]._kbuf.shape[-2] == 20
    cache.update(*_kv(15, 1), 0)
    assert cache.layers[0]._kbuf.shape[-2] == 20 and cache.get_seq_length() == 20
    cache.update(*_kv(1, 2), 0)  # past the run's tokens (a draft verified at the end): grows as any cache does
    assert cache.layers[0]._kbuf.shape[-2] == STEP and cache.get_seq_length() == 21


def test_a_call_is_handed_a_cache_only_where_it_keeps_one_the_forward_takes_one_and_none_was_given():
    """MPT's config says use_cache=False: generate recomputes the whole sequence each step, and handed a cache anyway
    it attended the cache's keys beside the recomputed ones (its fourth token drifted from transformers'). GPT-1's
    forward takes no cache; xLSTM keeps its own (a DynamicCache lacks its rnn_state)."""
    from types import SimpleNamespace

    from rocketllm_cli.stream.appendcache import needs_cache

    class Plain:
        generation_config = SimpleNamespace(use_cache=True)

        def forward(self, input_ids, cache=None, **kwargs): ...

    class NoCacheArgument(Plain):
        def forward(self, input_ids, attention_mask=None): ...

    class OwnCache(Plain):
        @classmethod
        def _supports_default_dynamic_cache(cls):
            return False

    model = Plain()
    assert needs_cache(model, {})
    assert not needs_cache(model, {"use_cache": False}) and needs_cache(model, {"use_cache": True})
    assert not needs_cache(model, {"cache": object()}) and not needs_cache(model, {"past_key_values": object()})
    assert not needs_cache(model, {"generation_config": SimpleNamespace(use_cache=False)})
    model.generation_config = SimpleNamespace(use_cache=False)  # MPT's
    assert not needs_cache(model, {}) and needs_cache(model, {"use_cache": True})
    assert not needs_cache(NoCacheArgument(), {}) and not needs_cache(OwnCache(), {})
