"""A context that cannot run out of memory: max_context is what the memory left holds of KV, and a request over
it is refused before any work, by the Python API, `generate` and both server APIs, with the numbers."""

from __future__ import annotations

import pytest
import torch
from cli_contract import one_error_line
from serve_helpers import LiveServer
from test_knobs import GiB, synthetic
from typer.testing import CliRunner

from rocketllm_cli.app import app
from rocketllm_cli.auto import AutoModel
from rocketllm_cli.checkpoint.modelfacts import model_facts_from_path
from rocketllm_cli.errors import ParameterError
from rocketllm_cli.profiles import resolve_knobs
from rocketllm_cli.profiles.knobs.expression import evaluate
from rocketllm_cli.profiles.knobs.shape import pass_shape_of

ADMITTED = 300  # tokens the budget below holds


def _budget(facts, shape) -> int:
    """kv_cache_bytes that holds ADMITTED tokens of fp32 K and V (plus the one layer attention reads) and the
    activations of a pass over them, no more."""
    per_token = facts.kv_values_per_token * (4 + 4 / facts.kv_growing_layers) + shape.activation_bytes_per_token
    return int(ADMITTED * per_token) + 1


@pytest.fixture(scope="module")
def tight(tiny_factory):
    """The tiny Llama whose KV budget admits ADMITTED tokens. 16 layers with K and V as wide as the queries: its KV
    cache, which int4 shrinks, is then most of what a token costs beside the activations of a pass (one layer's)."""
    path = tiny_factory("llama", max_position_embeddings=4096, num_key_value_heads=4, num_hidden_layers=16)
    budget = _budget(model_facts_from_path(path), pass_shape_of(path))
    model = AutoModel.from_pretrained(path, kv_cache_bytes=budget, compute_dtype="fp32")
    yield path, budget, model
    model.close()


@pytest.fixture(scope="module")
def int4_admits(tight):
    """What the same budget admits with the KV cache in int4: the max_context of a model loaded so."""
    path, budget, _ = tight
    model = AutoModel.from_pretrained(path, kv_cache_bytes=budget, compute_dtype="fp32", kv_cache_dtype="int4")
    admitted = int(model.knobs.value("max_context"))
    model.close()
    assert admitted > ADMITTED
    return admitted


def _ids(n: int) -> torch.Tensor:
    return torch.arange(5, 5 + n).remainder(200).unsqueeze(0)


def test_max_context_is_what_the_budget_holds_and_the_formula_recomputes(tight):
    _, _, model = tight
    knob = model.knobs["max_context"]
    assert knob.value == ADMITTED and evaluate(knob.formula, knob.inputs) == ADMITTED
    assert (
        "left for KV of kv_cache_bytes, within what the weights, buffers, runtime and reserve leave" in knob.note
        and "per token in fp32" in knob.note
    )


def test_the_python_api_refuses_before_any_pass_and_admits_what_fits(tight, int4_admits):
    _, budget, model = tight
    model.ledger.reset()
    with pytest.raises(ParameterError) as caught:
        model.generate(_ids(ADMITTED - 10), max_new_tokens=20, do_sample=False)
    message = str(caught.value)
    assert f"prompt is {ADMITTED - 10} tokens and max_new_tokens 20, but the context allows {ADMITTED}" in message
    assert "left for KV" in message and "\n" not in message
    assert message.endswith(f"; kv_cache_dtype int4 would admit {int4_admits} tokens in the same memory")
    with pytest.raises(ParameterError) as caught:  # beyond what int4 would admit too: no such suggestion
        model.generate(_ids(int4_admits), max_new_tokens=20, do_sample=False)
    assert "int4" not in str(caught.value)
    assert not model.ledger.steps, "a refused request ran a forward pass"
    out = model.generate(
        _ids(ADMITTED - 20), max_new_tokens=20, min_new_tokens=20, do_sample=False, return_dict_in_generate=True
    )
    assert out.sequences.shape[1] == ADMITTED
    cache = out.past_key_values
    held = sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))
    assert held <= budget  # the accounting: the KV the admitted request left fits the budget it was admitted under


def test_generate_refuses_with_one_line_and_serve_with_each_apis_400(tight, int4_admits):
    path, budget, model = tight
    long = " ".join(["the quick brown fox jumps over the lazy dog"] * 40)  # ~1200 tokens: over what int4 admits too
    result = CliRunner().invoke(
        app,
        ["generate", str(path), long, "--raw", "-n", "64", "--dtype", "fp32"],
        env={"ROCKETLLM_KV_CACHE_BYTES": str(budget)},
    )
    line = one_error_line(result)
    assert f"but the context allows {ADMITTED}" in line and "--max-new-tokens" in line and "int4" not in line

    with LiveServer(model, "tiny") as server:
        http = server.http()
        openai = http.post(
            "/v1/chat/completions",
            json={"model": "tiny", "messages": [{"role": "user", "content": long}], "max_tokens": 64},
        )
        assert openai.status_code == 400
        error = openai.json()["error"]
        assert error["code"] == "context_length_exceeded" and error["param"] == "max_tokens"
        assert f"but the context allows {ADMITTED} (" in error["message"] and "left for KV" in error["message"]
        anthropic = http.post(
            "/v1/messages", json={"model": "tiny", "messages": [{"role": "user", "content": long}], "max_tokens": 64}
        )
        assert anthropic.status_code == 400 and anthropic.json()["type"] == "error"
        assert anthropic.json()["error"]["type"] == "invalid_request_error"
        assert f"but the context allows {ADMITTED}" in anthropic.json()["error"]["message"]
        admitted = http.post(
            "/v1/chat/completions",
            json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
        )
        assert admitted.status_code == 200, admitted.text


MIDDLE = " ".join(["the quick brown fox jumps over the lazy dog"] * 10)  # ~320 tokens: over ADMITTED, within int4's


def test_a_refusal_int4_would_admit_says_how_many_tokens_it_would(tight, int4_admits):
    """generate: one line, a non-zero exit; serve: each API's 400, the number a server started with int4 would admit."""
    path, budget, model = tight
    result = CliRunner().invoke(
        app,
        ["generate", str(path), MIDDLE, "--raw", "-n", "64", "--dtype", "fp32"],
        env={"ROCKETLLM_KV_CACHE_BYTES": str(budget)},
    )
    line = one_error_line(result)
    assert result.exit_code != 0 and f"but the context allows {ADMITTED}" in line
    assert line.endswith(f"; --kv-cache-dtype int4 would admit {int4_admits} tokens in the same memory")
    already = CliRunner().invoke(
        app,
        [
            "generate",
            str(path),
            " ".join(["the quick brown fox"] * 120),
            "--raw",
            "-n",
            "64",
            "--dtype",
            "fp32",
            "--kv-cache-dtype",
            "int4",
        ],
        env={"ROCKETLLM_KV_CACHE_BYTES": str(budget)},
    )
    assert f"but the context allows {int4_admits}" in one_error_line(already) and "would admit" not in one_error_line(
        already
    )

    with LiveServer(model, "tiny") as server:
        http = server.http()
        said = f"; a server started with --kv-cache-dtype int4 would admit {int4_admits} tokens in the same memory"
        openai = http.post(
            "/v1/chat/completions",
            json={"model": "tiny", "messages": [{"role": "user", "content": MIDDLE}], "max_tokens": 64},
        )
        assert openai.status_code == 400
        error = openai.json()["error"]
        assert (
            error["code"] == "context_length_exceeded"
            and error["param"] == "max_tokens"
            and error["message"].endswith(said)
        )
        assert "\n" not in error["message"]
        anthropic = http.post(
            "/v1/messages", json={"model": "tiny", "messages": [{"role": "user", "content": MIDDLE}], "max_tokens": 64}
        )
        assert anthropic.status_code == 400 and anthropic.json()["type"] == "error"
        assert anthropic.json()["error"]["type"] == "invalid_request_error" and anthropic.json()["error"][
            "message"
        ].endswith(said)
        # no max_tokens: nothing left
        completion = http.post("/v1/completions", json={"model": "tiny", "prompt": MIDDLE + MIDDLE})
        assert completion.status_code == 400 and "int4" not in completion.json()["error"]["message"]


def test_int4_admits_over_three_times_the_bf16_context_in_the_same_memory():
    """SmolLM2-135M's shape (30 layers, 3 KV heads of 64) on a machine whose KV room is fixed."""
    from rocketllm_cli.checkpoint.modelfacts import ModelFacts

    facts = ModelFacts(
        "smol",
        270_000_000,
        30,
        4_000_000,
        57_000_000,
        57_000_000,
        23_040,
        1 << 20,
        "bf16",
        kv_values_per_token=11_520,
        kv_growing_layers=30,
        kv_head_dim=64,
    )
    profile = synthetic(ram_total=8 * GiB, ram_available=4 * GiB)
    contexts = {}
    for dtype in ("bf16", "int4"):
        knobs = resolve_knobs(profile, facts, kwargs={"kv_cache_dtype": dtype, "kv_cache_bytes": "1GiB"}, env={})
        knob = knobs["max_context"]
        assert evaluate(knob.formula, knob.inputs) == knob.value
        contexts[dtype] = knob.value
    assert contexts["int4"] >= 3 * contexts["bf16"], contexts


def test_a_device_cache_larger_than_the_model_takes_only_the_models_bytes_from_the_context():
    """`--device-cache-bytes 1TB` says "keep everything resident": the KV room is what the model leaves, not 0."""
    from rocketllm_cli.checkpoint.modelfacts import ModelFacts

    facts = ModelFacts(
        "smol",
        270_000_000,
        30,
        4_000_000,
        57_000_000,
        57_000_000,
        23_040,
        1 << 20,
        "bf16",
        kv_values_per_token=11_520,
        kv_growing_layers=30,
        kv_head_dim=64,
    )
    profile = synthetic(ram_total=8 * GiB, ram_available=4 * GiB)
    contexts = {}
    for cap in ("1TB", str(facts.total_bytes)):
        knob = resolve_knobs(profile, facts, kwargs={"device_cache_bytes": cap}, env={})["max_context"]
        assert evaluate(knob.formula, knob.inputs) == knob.value
        contexts[cap] = knob.value
    assert contexts["1TB"] == contexts[str(facts.total_bytes)] > 0, contexts


def test_streaming_buffers_sized_for_a_layer_leave_the_context_its_room():
    """A 2.8 B Llama under a 1.2 GiB limit: the 144 MiB tied embedding fits resident, so the buffers hold 60 MiB
    layers, as device_cache_bytes sized them. Counting three embedding-sized buffers left the context 0 tokens and
    every prompt was refused."""
    from rocketllm_cli.checkpoint.modelfacts import ModelFacts

    MiB = 1 << 20
    facts = ModelFacts(
        "big",
        1_787_295_744,
        26,
        62_926_848,
        151_191_552,
        151_191_552 + 2 * MiB,
        106_496,
        2048,
        "bf16",
        kv_values_per_token=53_248,
        kv_growing_layers=26,
        kv_head_dim=128,
    )
    profile = synthetic(ram_total=1200 * MiB, ram_available=1_239_531_520)
    knobs = resolve_knobs(profile, facts, env={})
    context, cache = knobs["max_context"], knobs["device_cache_bytes"]
    assert cache.value >= facts.non_layer_bytes and "layer" in cache.note  # the embedding resident, buffers for layers
    assert evaluate(context.formula, context.inputs) == context.value
    buffers = (knobs.value("prefetch_depth") + 2) * facts.layer_bytes
    room = profile.ram_available - knobs.value("reserve_bytes") - cache.value - buffers
    assert context.value == min(facts.max_positions, room // (53_248 * (2 + 2 / 26))) > 0


def test_a_one_shot_run_is_sized_through_the_sets_tokenizer_and_generates_the_same(tiny_factory):
    """run_tokens as a function of the tokenizer (what `generate` with no server passes): called with the set's
    tokenizer, which the model then keeps (loaded once); the KV cache is sized for its answer, and the tokens are
    those of the model loaded for any request."""
    path = tiny_factory("llama", max_position_embeddings=4096)
    seen = []

    def tokens(tokenizer):
        seen.append(tokenizer)
        return 7 + 5

    sized = AutoModel.from_pretrained(path, run_tokens=tokens, compute_dtype="fp32")
    anyone = AutoModel.from_pretrained(path, compute_dtype="fp32")
    try:
        assert len(seen) == 1 and seen[0] is sized.tokenizer and seen[0] is not None
        assert (
            sized.knobs["kv_cache_bytes"].inputs["run_tokens"] == 12
            and "run_tokens" not in anyone.knobs["kv_cache_bytes"].inputs
        )
        assert 12 <= sized.knobs.value("max_context") and sized.knobs.value("kv_cache_bytes") < anyone.knobs.value(
            "kv_cache_bytes"
        )
        outs = [m.generate(_ids(7), max_new_tokens=5, min_new_tokens=5, do_sample=False) for m in (sized, anyone)]
        assert outs[0].tolist() == outs[1].tolist()
    finally:
        sized.close()
        anyone.close()
