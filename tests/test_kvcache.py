"""The int4 KV cache: its layout is a function of the length, a speculative rollback restores it exactly, it stores
under 0.3x the bytes of bf16, and a streamed model with it generates what plain transformers does with it."""

from __future__ import annotations

import itertools

import pytest
import torch
from cli_contract import one_error_line
from transformers import AutoModelForCausalLM
from typer.testing import CliRunner

from rocketllm_cli.app import app
from rocketllm_cli.auto import AutoModel
from rocketllm_cli.dtypes import int4_kv_value_bytes
from rocketllm_cli.errors import ParameterError
from rocketllm_cli.stream.kvcache import (
    Int4Layer,
    cache_bytes,
    generate_cache_kwarg,
    make_cache,
)
from rocketllm_cli.text.prefix import PrefixCache

pytestmark = pytest.mark.compat
R, G = 16, 64  # residual window and quantization group of these tests


def _kv(tokens: int, heads: int = 2, dim: int = 16, seed: int = 0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, heads, tokens, dim, generator=g, dtype=dtype), torch.randn(
        1, heads, tokens, dim, generator=g, dtype=dtype
    )


def _fed(k, v, chunks: list[int], recording: bool = False) -> Int4Layer:
    layer, at = Int4Layer(R), 0
    if recording:  # as transformers 5.25's generate asks for it (older ones pass nothing)
        layer.activate_past_recording(recurrent_states_to_keep=1)
    for n in chunks:
        layer.update(k[..., at : at + n, :], v[..., at : at + n, :])
        at += n
    return layer


def _state(layer: Int4Layer) -> list[torch.Tensor]:
    return [
        layer.keys,
        layer.values,
        layer.k_codes,
        layer.k_scale,
        layer.k_min,
        layer.v_codes,
        layer.v_scale,
        layer.v_min,
    ]


def _same(a: Int4Layer, b: Int4Layer) -> bool:
    return a.quantized == b.quantized and all(torch.equal(x, y) for x, y in zip(_state(a), _state(b)))


def test_which_tokens_are_int4_depends_on_the_length_alone():
    k, v = _kv(300)
    for length in (10, R + G - 1, R + G, 200, 300):
        whole = _fed(k, v, [length])
        assert whole.quantized == (G * ((length - R) // G) if length >= R + G else 0)
        assert R <= whole.keys.shape[-2] < R + G or length < R + G
        step = _fed(k, v, [7] + [1] * (length - 7))  # a prefill then decode steps reach the same state
        assert _same(whole, step), length
        keys, _ = whole._dequantized()
        assert keys.shape[-2] == length and torch.equal(
            keys[..., whole.quantized :, :], k[..., whole.quantized : length, :]
        )
        assert (keys - k[..., :length, :]).abs().max() < 0.25 * k.abs().max()  # int4 of unit normals: within a step


def test_a_rollback_restores_the_state_of_that_length_exactly():
    k, v = _kv(300)
    for start, added in ((R + G - 3, 5), (143, 6), (100, 3)):  # crossing a block boundary, and within the window
        layer = _fed(k, v, [start], recording=True)  # as speculative decoding runs it
        layer.update(k[..., start : start + added, :], v[..., start : start + added, :])
        layer.crop(-added)
        assert layer.get_seq_length() == start and _same(layer, _fed(k, v, [start])), (start, added)
    unrecorded = _fed(k, v, [R + G + 2])
    unrecorded.crop(-5)  # no full-precision copy kept: the block's int4 values go back into the window
    assert unrecorded.quantized == 0 and unrecorded.get_seq_length() == R + G - 3
    assert not torch.equal(unrecorded.keys, k[..., : R + G - 3, :])
    deep = _fed(k, v, [300], recording=True)
    deep.crop(-150)  # past the kept full-precision block: the layout is that of the length, the values int4
    assert deep.get_seq_length() == 150 and deep.quantized == G * ((150 - R) // G)


def test_int4_stores_under_three_tenths_of_bf16_at_4096_tokens():
    k, v = _kv(4096, heads=3, dim=64, dtype=torch.bfloat16)  # SmolLM2's KV heads and head dimension, one layer
    cache = make_cache(_config(), "int4", torch.bfloat16, 64)
    cache.layers[0].update(k, v)
    int4, bf16 = cache_bytes(cache), k.numel() * 2 * 2
    assert int4 <= 0.3 * bf16, int4 / bf16
    layer = cache.layers[0]
    window = layer.keys.shape[-2]  # no full-precision block kept: nothing asked for past recording
    assert int4 == pytest.approx(
        layer.quantized * 3 * 64 * 2 * int4_kv_value_bytes(64) + window * 3 * 64 * 2 * 2, rel=1e-6
    )


def _config():
    from transformers import LlamaConfig

    return LlamaConfig(num_hidden_layers=1, hidden_size=192, num_attention_heads=3, num_key_value_heads=3)


@pytest.fixture(scope="module")
def tiny(tiny_factory):
    return tiny_factory("llama")


def test_streamed_int4_generates_what_transformers_generates_with_the_same_cache(tiny):
    ids = torch.arange(5, 120).remainder(250).unsqueeze(0)
    model = AutoModel.from_pretrained(
        tiny, device_cache_bytes=0, compute_dtype="fp32", kv_cache_dtype="int4", kv_residual_tokens=8
    )
    try:
        streamed = model.generate(ids, max_new_tokens=40, min_new_tokens=40, do_sample=False)
        assert isinstance(model.new_kv_cache().layers[0], Int4Layer)
    finally:
        model.close()
    plain = (
        AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32)
        if _has_dtype_kwarg()
        else AutoModelForCausalLM.from_pretrained(tiny, torch_dtype=torch.float32)
    )
    cache = make_cache(plain.config, "int4", torch.float32, 8)
    reference = plain.generate(
        ids, max_new_tokens=40, min_new_tokens=40, do_sample=False, **{generate_cache_kwarg(): cache}
    )
    assert torch.equal(streamed, reference)
    assert cache.layers[0].quantized == 64 * ((ids.shape[1] + 39 - 8) // 64)  # the last token's KV is never computed


def _has_dtype_kwarg() -> bool:
    import transformers

    return int(transformers.__version__.split(".")[0]) >= 5


def test_a_model_with_sliding_window_layers_is_refused_with_one_line(tiny_factory):
    with pytest.raises(ParameterError) as caught:
        AutoModel.from_pretrained(tiny_factory("gemma2"), kv_cache_dtype="int4")
    assert "full attention" in str(caught.value) and "sliding_attention" in str(caught.value)
    assert "\n" not in str(caught.value)


def test_a_blocks_prefix_cache_declines_an_int4_cache_and_says_why():
    k, v = _kv(200)
    cache = make_cache(_config(), "int4", torch.float32, R)
    cache.layers[0].update(k, v)
    prefix = PrefixCache(1 << 30)
    assert prefix.store(list(range(200)), cache) == 0
    assert "int4" in prefix.disabled_reason and "exactly their length" in prefix.disabled_reason


@pytest.fixture(scope="module")
def resident_int4(tiny):
    model = AutoModel.from_pretrained(
        tiny, device_cache_bytes="1GB", compute_dtype="fp32", kv_cache_dtype="int4", kv_residual_tokens=8
    )
    yield model
    model.close()


def _run(model, ids, prefix=None, n=6, speculate="off"):
    from rocketllm_cli.text.loop import GenerationRequest, Generator
    from rocketllm_cli.text.sampling import SamplingParams

    return Generator(model, prefix, speculate=speculate).run(
        GenerationRequest(list(ids), SamplingParams(max_new_tokens=n))
    )


def _held_bytes(length: int, layers: int = 4, heads: int = 2, dim: int = 16, residual: int = 8) -> int:
    """What an int4 cache of LENGTH tokens holds (the tiny Llama, fp32): int4 codes and scales, the rest in fp32."""
    quantized = G * ((length - residual) // G) if length >= residual + G else 0
    values = layers * heads * dim * 2  # K and V of one token
    return int(quantized * values * int4_kv_value_bytes(dim) + (length - quantized) * values * 4)


def test_the_prefix_cache_keeps_an_int4_cache_at_exactly_its_length_and_gives_the_same_tokens(resident_int4):
    """With 8 full-precision tokens every length here (80 to 110) holds its first 64 tokens in int4: a prompt that
    extends a kept one gives, token for token, what the prefix cache off gives, and computes only its new tokens."""
    from rocketllm_cli.text.reuse import prefix_cache_for

    prefix = prefix_cache_for(resident_int4, 1 << 30)
    assert prefix.mode == "exact" and not prefix.disabled_reason
    first = list(range(5, 85))  # 80 tokens
    _run(resident_int4, first, prefix)
    # kept: the prompt as prefilled, and prompt + reply as generated (the last token has no KV yet)
    assert sorted(len(e.ids) for e in prefix._entries.values()) == [80, 85]
    for entry in prefix._entries.values():
        assert entry.nbytes == cache_bytes(entry.cache) == _held_bytes(len(entry.ids))
        assert entry.cache.get_seq_length() == len(entry.ids) and all(
            layer.quantized == G for layer in entry.cache.layers
        )
    assert prefix.bytes == _held_bytes(80) + _held_bytes(85) < 0.45 * (80 + 85) * 4 * 2 * 16 * 2 * 4  # fp32 KV would be

    second = first + list(range(100, 120))  # extends the kept prompt
    off, on = _run(resident_int4, second), _run(resident_int4, second, prefix)
    assert on.reused_tokens == 80 and on.token_ids == off.token_ids
    assert on.ledger["prefill"]["tokens"] == len(second) - 80  # only the new tokens were computed
    third = second + on.token_ids + [7, 8, 9]  # the next turn: the second's prompt and reply, then more
    off, on = _run(resident_int4, third), _run(resident_int4, third, prefix)
    assert on.reused_tokens == len(second) + 5 and on.token_ids == off.token_ids


def test_a_kept_int4_prefix_is_what_a_fresh_prefill_holds_and_is_never_cropped(resident_int4):
    from rocketllm_cli.text.reuse import prefix_cache_for

    prefix = prefix_cache_for(resident_int4, 1 << 30)
    ids = list(range(9, 99))  # 90 tokens
    _run(resident_int4, ids, prefix, n=1)  # one new token: the only entry is the prompt as prefilled
    assert [len(e.ids) for e in prefix._entries.values()] == [90]
    # Served only for a prompt that extends all 90 tokens, and then with exactly those 90:
    for shorter_or_other in (ids, ids[:-1], ids[:50] + [1] * 45, [3] + ids[1:] + [4]):
        assert prefix.lookup(shorter_or_other) is None
    hit = prefix.lookup(ids + [1, 2])
    assert hit is not None and hit.tokens == 90 and hit.cache.get_seq_length() == 90
    fresh = make_cache(resident_int4.config, "int4", torch.float32, 8)
    with torch.inference_mode():
        resident_int4.model(torch.tensor([ids]), **{generate_cache_kwarg(): fresh})
    for kept, prefilled in zip(hit.cache.layers, fresh.layers):
        assert _same(kept, prefilled) and kept.shadow is None
    # A cache whose rollback put int4 values back into its window is not kept at all.
    rolled = make_cache(resident_int4.config, "int4", torch.float32, 8)
    with torch.inference_mode():
        resident_int4.model(torch.tensor([list(range(5, 150))]), **{generate_cache_kwarg(): rolled})
    rolled.crop(-80)
    assert not rolled.exact and prefix.keep(list(range(5, 70)), rolled) == 0


def test_speculation_beside_an_int4_prefix_cache_keeps_only_exact_caches(resident_int4):
    """Prompt lookup's rollbacks over an int4 cache: what its runs leave in the prefix cache holds exactly its tokens,
    and a later plain run that reuses it gives the tokens of a run with the prefix cache off."""
    from rocketllm_cli.text.reuse import prefix_cache_for

    prefix = prefix_cache_for(resident_int4, 1 << 30)
    ids = (list(range(5, 25)) * 5)[:84]
    fast = _run(resident_int4, ids, prefix, n=12, speculate="prompt-lookup")
    assert fast.token_ids == _run(resident_int4, ids, n=12).token_ids and fast.stats.speculation["proposed"] > 0
    for entry in prefix._entries.values():
        assert entry.cache.exact and entry.cache.get_seq_length() == len(entry.ids)
        # the rollback's full-precision block is dropped
        assert all(layer.shadow is None for layer in entry.cache.layers)
    longer = ids + fast.token_ids + [3, 4]
    on = _run(resident_int4, longer, prefix)
    assert on.reused_tokens > 0 and on.token_ids == _run(resident_int4, longer).token_ids


def test_the_flags_reach_generate_and_a_bad_value_is_one_line(tiny):
    runner = CliRunner()
    ok = runner.invoke(
        app,
        [
            "generate",
            str(tiny),
            "hello there",
            "--raw",
            "-n",
            "4",
            "--dtype",
            "fp32",
            "--kv-cache-dtype",
            "int4",
            "--kv-residual-tokens",
            "2",
        ],
    )
    assert ok.exit_code == 0, ok.stderr
    line = one_error_line(runner.invoke(app, ["generate", str(tiny), "hi", "--kv-cache-dtype", "int3"]))
    assert "kv_cache_dtype" in line and "int4" in line


def test_speculation_over_an_int4_cache_gives_the_plain_int4_tokens(tiny):
    """Prompt lookup's rollbacks crop an int4 cache: with quantized groups behind the window, the greedy tokens are
    those of plain decoding over the same int4 cache (fp32), and some drafts were accepted.

    The run stays between two group boundaries (lengths 136 and 200 with an 8-token window): a pass that crosses one
    quantizes that group before attention, so its earlier positions read as int4 what one-token decoding still read
    at full precision, a rounding difference like bf16's."""
    from rocketllm_cli.text.loop import GenerationRequest, Generator
    from rocketllm_cli.text.sampling import SamplingParams

    ids = (list(range(5, 45)) * 4)[:140]  # repeats: prompt lookup finds its n-grams; 140 + 40 tokens < 200
    model = AutoModel.from_pretrained(
        tiny, device_cache_bytes=0, compute_dtype="fp32", kv_cache_dtype="int4", kv_residual_tokens=8
    )
    try:
        params = SamplingParams(max_new_tokens=40)
        plain = Generator(model, speculate="off").run(GenerationRequest(ids, params))
        fast = Generator(model, speculate="prompt-lookup").run(GenerationRequest(ids, params))
    finally:
        model.close()
    assert fast.token_ids == plain.token_ids and fast.stats.speculation["mode"] == "prompt-lookup"
    assert fast.stats.speculation["proposed"] > 0


def test_serve_with_int4_keeps_exact_prefixes_and_a_chat_replies_as_without_them(resident_int4):
    """Through the server: /health says mode exact and why; each turn of a chat reuses the last turn's prompt and
    reply and replies as with the prefix cache off. Every prompt here holds its first 64 tokens in int4 (72 to 135)."""
    from serve_helpers import LiveServer
    from test_serve_state import DigitsOnly

    turns = ("Count with me, one digit at a time, from the first to the last: " + "go on " * 4 + "now", "More", "Again")

    def chat(server) -> list[str]:
        client, messages, replies = server.openai(), [], []
        for text in turns:
            messages.append({"role": "user", "content": text})
            reply = client.chat.completions.create(model="tiny", messages=messages, max_tokens=6, temperature=0)
            replies.append(reply.choices[0].message.content)
            messages.append({"role": "assistant", "content": replies[-1]})
        return replies

    with LiveServer(resident_int4) as server:
        health = server.http().get("/health").json()["prefix_cache"]
        assert health["enabled"] is True and health["mode"] == "exact"
        assert "int4" in health["reason"] and "never cropped" in health["reason"]
        digits = DigitsOnly(resident_int4)
        try:
            reused = chat(server)
            history = server.history[-len(turns) :]
            server.state.generator.prefix_cache = None
            fresh = chat(server)
        finally:
            digits.remove()
        lengths = [(h["prompt_tokens"], h["generated_tokens"]) for h in history]
        assert all(8 + G <= p and p + n < 8 + 2 * G for p, n in lengths), lengths
        assert reused == fresh and history[0]["reused_tokens"] == 0
        for before, turn in itertools.pairwise(history):
            assert turn["reused_tokens"] == before["prompt_tokens"] + before["generated_tokens"] - 1


def test_a_float_kv_dtype_beside_the_compute_dtype_reuses_block_prefixes(tiny):
    """bf16 KV beside fp32 compute crops as a DynamicCache does: a repeated prompt reuses its whole blocks and gives
    the tokens of the prefix cache off."""
    from rocketllm_cli.text.reuse import prefix_cache_for

    model = AutoModel.from_pretrained(tiny, device_cache_bytes="1GB", compute_dtype="fp32", kv_cache_dtype="bf16")
    try:
        prefix = prefix_cache_for(model, 1 << 30)
        assert prefix.mode == "blocks" and not prefix.disabled_reason
        ids = list(range(5, 56))  # 51 tokens: three blocks of 16
        off, first, again = _run(model, ids), _run(model, ids, prefix), _run(model, ids, prefix)
        assert again.reused_tokens == 48 and off.token_ids == first.token_ids == again.token_ids
        entry = next(iter(prefix._entries.values()))
        assert entry.cache.layers[0].keys.dtype == torch.bfloat16 and entry.nbytes == cache_bytes(entry.cache)
    finally:
        model.close()
