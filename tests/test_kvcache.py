"""The int4 KV cache: its layout is a function of the length, a speculative rollback restores it exactly, it stores
under 0.3x the bytes of bf16, and a streamed model with it generates what plain transformers does with it."""

from __future__ import annotations

import pytest
import torch
from cli_contract import one_error_line
from transformers import AutoModelForCausalLM
from typer.testing import CliRunner

from rocketllm_cli.app import app
from rocketllm_cli.dtypes import int4_kv_value_bytes
from rocketllm_cli.errors import ParameterError
from rocketllm_cli.stream.auto import AutoModel
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
    return torch.randn(1, heads, tokens, dim, generator=g, dtype=dtype), torch.randn(1, heads, tokens, dim, generator=g, dtype=dtype)


def _fed(k, v, chunks: list[int], recording: bool = False) -> Int4Layer:
    layer, at = Int4Layer(R), 0
    if recording:
        layer.activate_past_recording()
    for n in chunks:
        layer.update(k[..., at : at + n, :], v[..., at : at + n, :])
        at += n
    return layer


def _state(layer: Int4Layer) -> list[torch.Tensor]:
    return [layer.keys, layer.values, layer.k_codes, layer.k_scale, layer.k_min, layer.v_codes, layer.v_scale, layer.v_min]


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
        assert keys.shape[-2] == length and torch.equal(keys[..., whole.quantized :, :], k[..., whole.quantized : length, :])
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
    assert int4 == pytest.approx(layer.quantized * 3 * 64 * 2 * int4_kv_value_bytes(64) + window * 3 * 64 * 2 * 2, rel=1e-6)


def _config():
    from transformers import LlamaConfig

    return LlamaConfig(num_hidden_layers=1, hidden_size=192, num_attention_heads=3, num_key_value_heads=3)


@pytest.fixture(scope="module")
def tiny(tiny_factory):
    return tiny_factory("llama")


def test_streamed_int4_generates_what_transformers_generates_with_the_same_cache(tiny):
    ids = torch.arange(5, 120).remainder(250).unsqueeze(0)
    model = AutoModel.from_pretrained(tiny, device_cache_bytes=0, compute_dtype="fp32", kv_cache_dtype="int4", kv_residual_tokens=8)
    try:
        streamed = model.generate(ids, max_new_tokens=40, min_new_tokens=40, do_sample=False)
        assert isinstance(model.new_kv_cache().layers[0], Int4Layer)
    finally:
        model.close()
    plain = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32) if _has_dtype_kwarg() else \
        AutoModelForCausalLM.from_pretrained(tiny, torch_dtype=torch.float32)
    cache = make_cache(plain.config, "int4", torch.float32, 8)
    reference = plain.generate(ids, max_new_tokens=40, min_new_tokens=40, do_sample=False, **{generate_cache_kwarg(): cache})
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


def test_the_prefix_cache_declines_an_int4_cache_and_says_why():
    k, v = _kv(200)
    cache = make_cache(_config(), "int4", torch.float32, R)
    cache.layers[0].update(k, v)
    prefix = PrefixCache(1 << 30)
    assert prefix.store(list(range(200)), cache) == 0
    assert "int4" in prefix.disabled_reason and "exactly its length" in prefix.disabled_reason


def test_the_flags_reach_generate_and_a_bad_value_is_one_line(tiny):
    runner = CliRunner()
    ok = runner.invoke(app, ["generate", str(tiny), "hello there", "--raw", "-n", "4", "--dtype", "fp32",
                             "--kv-cache-dtype", "int4", "--kv-residual-tokens", "2"])
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
    model = AutoModel.from_pretrained(tiny, device_cache_bytes=0, compute_dtype="fp32", kv_cache_dtype="int4", kv_residual_tokens=8)
    try:
        params = SamplingParams(max_new_tokens=40)
        plain = Generator(model, speculate="off").run(GenerationRequest(ids, params))
        fast = Generator(model, speculate="prompt-lookup").run(GenerationRequest(ids, params))
    finally:
        model.close()
    assert fast.token_ids == plain.token_ids and fast.stats.speculation["mode"] == "prompt-lookup"
    assert fast.stats.speculation["proposed"] > 0
