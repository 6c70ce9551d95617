"""Speculative decoding in the one generation loop: greedy tokens equal plain greedy's token for token (fp32, every
layer
streamed from storage) with prompt lookup and with a draft model; sampling with a seed keeps its finish reasons; stop
strings and end-of-sequence ids inside a pass of several tokens end the reply where plain decoding would; the figures
count what was proposed, accepted and made per pass; the knob's auto turns it on where layers stream and off where
every unit is resident; a stateful model and a batch have it off with the reason; a draft with another vocabulary is
refused naming the parameter (the CLI its flag)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from rocketllm_cli.app import app
from rocketllm_cli.auto import AutoModel
from rocketllm_cli.errors import ParameterError
from rocketllm_cli.text.loop import GenerationRequest, Generator
from rocketllm_cli.text.prefix import PrefixCache
from rocketllm_cli.text.sampling import SamplingParams

SEED = 53  # this module's own tiny model
NEW = 24
EVERYTHING = 1 << 40  # a device budget that holds any tiny model


@pytest.fixture(scope="module")
def source(tiny_factory):
    return tiny_factory("llama", seed=SEED)


@pytest.fixture(scope="module")
def streamed(source):
    model = AutoModel.from_pretrained(source, device_cache_bytes=0, host_cache_bytes=0)
    yield model
    model.close()


@pytest.fixture(scope="module")
def twin(source):
    """The target's own weights, every unit resident: a draft whose tokens are nearly all accepted (passes of several
    tokens)."""
    model = AutoModel.from_pretrained(source, device_cache_bytes=EVERYTHING)
    yield model
    model.close()


@pytest.fixture(scope="module")
def other_draft(tiny_factory):
    """A second random Llama with the same tokenizer: its drafts are mostly rejected."""
    model = AutoModel.from_pretrained(
        tiny_factory("llama", seed=SEED + 1, num_hidden_layers=1), device_cache_bytes=EVERYTHING
    )
    yield model
    model.close()


@pytest.fixture(scope="module")
def prompt(streamed):
    return streamed.tokenizer("the cat sat on the mat and the cat sat on the mat and the cat").input_ids


def run(model, ids, params=SamplingParams(max_new_tokens=NEW), stop=(), **speculation):
    return Generator(model, **speculation).run(GenerationRequest(list(ids), params, stop=stop))


@pytest.fixture(scope="module")
def plain(streamed, prompt):
    out = run(streamed, prompt, speculate="off")
    assert out.new_tokens == NEW and out.stats.speculation["mode"] == "off"
    return out


@pytest.mark.parametrize("mode", ["prompt-lookup", "draft", "twin"])
def test_greedy_tokens_equal_plain_greedy(mode, streamed, twin, other_draft, prompt, plain):
    kwargs = (
        {"speculate": "prompt-lookup"}
        if mode == "prompt-lookup"
        else {"speculate": "draft", "draft_model": twin if mode == "twin" else other_draft}
    )
    got = run(streamed, prompt, **kwargs)
    assert (got.token_ids, got.text, got.finish_reason) == (plain.token_ids, plain.text, plain.finish_reason)
    spec = got.stats.speculation
    assert spec["mode"] == kwargs["speculate"] and spec["proposed"] > 0
    assert spec["tokens"] == got.new_tokens == NEW and spec["accepted"] == NEW - spec["passes"]
    assert spec["tokens_per_pass"] == round(NEW / spec["passes"], 3)
    assert len(got.record.steps) == spec["passes"]  # the ledger counted the same passes
    # the decode passes alone (the prefill's pass made the first tokens): what plan projects a speculating row at
    assert spec["decode_passes"] == spec["passes"] - 1 == len(got.stats.gaps_s)
    assert spec["decode_tokens"] == NEW - got.record.counts[0] == got.stats.decode_tokens
    # the positions each decode pass computed (its last token and the drafts it verified): what plan costs a pass at
    decode_positions = got.record.pass_tokens[1:]
    assert spec["decode_positions_per_pass"] == round(sum(decode_positions) / len(decode_positions), 3)
    assert spec["decode_positions_per_pass"] >= spec["decode_tokens"] / spec["decode_passes"]
    if mode == "twin":
        # several tokens per put: the streamer and the per-token figures divide passes
        assert spec["tokens_per_pass"] > 1.5
        assert got.stats.decode_tokens == sum(got.stats.step_tokens) > len(got.stats.gaps_s)
        per_pass = got.stats.ledger["per_pass_served"]["storage"]
        assert got.stats.bytes_per_token["storage"] < per_pass


def test_stop_strings_and_end_of_sequence_inside_a_pass_end_where_plain_decoding_does(streamed, twin, prompt, plain):
    # A stop string from the middle of the plain reply, and, apart, an end-of-sequence id that plain greedy emits.
    text = plain.text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    want = run(streamed, prompt, stop=(stop,), speculate="off")
    got = run(streamed, prompt, stop=(stop,), speculate="draft", draft_model=twin)
    assert want.finish_reason == "stop" and want.stop_sequence == stop
    assert (got.token_ids, got.text, got.finish_reason, got.stop_sequence) == (want.token_ids, want.text, "stop", stop)
    config = streamed.generation_config
    original = config.eos_token_id
    k = next(i for i in range(3, NEW) if plain.token_ids[i] not in plain.token_ids[:i])
    try:
        config.eos_token_id = plain.token_ids[k]
        twin.generation_config.eos_token_id = plain.token_ids[k]
        got = run(streamed, prompt, speculate="draft", draft_model=twin)
    finally:
        config.eos_token_id = twin.generation_config.eos_token_id = original
    assert got.token_ids == plain.token_ids[: k + 1] and got.finish_reason == "stop"


def test_sampling_with_a_seed_runs_and_keeps_finish_reasons(streamed, other_draft, prompt):
    params = SamplingParams(max_new_tokens=NEW, temperature=0.8, seed=5)
    for kwargs in ({"speculate": "prompt-lookup"}, {"speculate": "draft", "draft_model": other_draft}):
        first, again = run(streamed, prompt, params, **kwargs), run(streamed, prompt, params, **kwargs)
        assert first.token_ids == again.token_ids and first.finish_reason == "length" and first.new_tokens == NEW
        assert first.stats.speculation["tokens"] == NEW


def test_a_speculative_run_beside_a_prefix_cache_computes_its_prompt_and_keeps_it(streamed, prompt, plain):
    # transformers' assisted generation re-feeds the whole prompt over a restored cache: the loop must not hand it one.
    cache = PrefixCache(1 << 30)
    generator = Generator(streamed, cache, speculate="prompt-lookup")
    first = generator.run(GenerationRequest(list(prompt), SamplingParams(max_new_tokens=NEW)))
    again = generator.run(GenerationRequest(list(prompt), SamplingParams(max_new_tokens=NEW)))
    assert first.token_ids == again.token_ids == plain.token_ids and again.reused_tokens == 0
    assert "not looked up" in again.stats.speculation["prefix_cache"] and cache.to_dict()["stored"] >= 1
    reused = Generator(streamed, cache, speculate="off").run(
        GenerationRequest(list(prompt), SamplingParams(max_new_tokens=NEW))
    )
    assert reused.reused_tokens > 0 and reused.token_ids == plain.token_ids  # what the speculative runs kept is sound


def test_auto_is_on_where_layers_stream_and_off_where_every_unit_is_resident(streamed, twin, prompt):
    assert streamed.knobs.value("speculate") == "prompt-lookup"  # derived: nothing resident
    assert Generator(streamed).speculation.mode == "prompt-lookup"
    assert "stream each pass" in Generator(streamed).speculation.reason
    assert twin.knobs.value("speculate") == "off"
    off = Generator(twin).speculation
    assert off.mode == "off" and "every unit is in memory" in off.reason
    knob = streamed.knobs["speculate"]
    # printed with its inputs in `profile`
    assert "device_cache_bytes" in knob.formula and knob.inputs["total_bytes"] > 0
    # A batch is never speculative, whatever the knob says.
    rows = Generator(streamed, speculate="prompt-lookup").run_batch(
        [GenerationRequest(list(prompt), SamplingParams(max_new_tokens=4))] * 2
    )
    assert rows[0].stats.speculation["mode"] == "off" and "batch" in rows[0].stats.speculation["reason"]


def test_a_state_layer_turns_it_off_where_transformers_no_longer_marks_the_model(stateful_factory, monkeypatch):
    """transformers 5.25 dropped `_is_stateful` and calls state layers croppable, yet its assisted generation gave other
    tokens than greedy decoding on Mamba, Mamba2 and Qwen3-Next: without the mark, the cache's own layers decide."""
    from rocketllm_cli.text.speculate import cannot_roll_back

    model = AutoModel.from_pretrained(stateful_factory("mamba"), device_cache_bytes=0, host_cache_bytes=0)
    try:
        for cls in type(model.model).__mro__:
            if "_is_stateful" in vars(cls):
                monkeypatch.delattr(cls, "_is_stateful")
        assert not hasattr(model.model, "_is_stateful")
        reason = cannot_roll_back(model)
        assert "LinearAttentionLayer layers" in reason and "cannot be rolled back" in reason
        assert Generator(model).speculation.mode == "off"
    finally:
        model.close()


def test_a_model_whose_state_cannot_roll_back_has_it_off_with_the_reason(stateful_factory):
    model = AutoModel.from_pretrained(stateful_factory("mamba"), device_cache_bytes=0, host_cache_bytes=0)
    try:
        assert model.knobs.value("speculate") == "prompt-lookup"  # the knob alone would turn it on
        generator = Generator(model)
        assert generator.speculation.mode == "off" and "rolled back" in generator.speculation.reason
        out = generator.run(GenerationRequest([5, 6, 7, 5, 6, 7], SamplingParams(max_new_tokens=3)))
        assert out.new_tokens == 3 and out.stats.speculation["mode"] == "off"
    finally:
        model.close()


def test_a_draft_with_another_vocabulary_is_refused_naming_the_parameter(source, tiny_factory):
    wider = tiny_factory("llama", seed=SEED, vocab_size=384)
    with pytest.raises(ParameterError) as caught:
        AutoModel.from_pretrained(source, device_cache_bytes=0, host_cache_bytes=0, draft_model=str(wider))
    assert str(caught.value).startswith("draft_model ") and "vocabulary has 384 entries against 320" in str(
        caught.value
    )
    with pytest.raises(ParameterError, match="give draft_model"):
        Generator(object(), speculate="draft")  # no draft at all
    result = CliRunner().invoke(
        app,
        [
            "generate",
            str(source),
            "hi",
            "-n",
            "2",
            "--device-cache-bytes",
            "0",
            "--host-cache-bytes",
            "0",
            "--draft-model",
            str(wider),
        ],
    )
    assert result.exit_code != 0 and result.stderr.count("\n") == 1 and "--draft-model" in result.stderr


def test_generate_reports_proposed_accepted_and_tokens_per_pass(source):
    args = [
        "generate",
        str(source),
        "the cat sat on the mat and the cat sat on the",
        "--raw",
        "-n",
        "12",
        "--device-cache-bytes",
        "0",
        "--host-cache-bytes",
        "0",
        "--speculate",
        "prompt-lookup",
        "--draft-tokens",
        "4",
    ]
    doc = json.loads(CliRunner().invoke(app, [*args, "--json"]).stdout)
    spec = doc["stats"]["speculation"]
    assert spec["mode"] == "prompt-lookup" and spec["draft_tokens"] == 4 and spec["tokens"] == doc["new_tokens"] == 12
    stats = CliRunner().invoke(app, [*args, "--stats"]).stderr
    assert "tokens proposed" in stats and "tokens per pass" in stats
