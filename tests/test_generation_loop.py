"""One generation loop behind generate, bench and serve: a batch equals lone runs token for token (each row cut
where a lone run stops), generate's figures and bench's warm-up-free figures come from one function over one
record, a plain transformers model runs the same loop, the streamer never hands on half a character or the
start of a stop string, and library errors name keywords (the CLI spells flags, the server its fields)."""

from __future__ import annotations

import inspect
import json
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM
from typer.testing import CliRunner

from rocketllm_cli.app import app, flag_of
from rocketllm_cli.auto import AutoModel
from rocketllm_cli.bench.timing import WARMUP, timed_run
from rocketllm_cli.compat import dtype_kwargs
from rocketllm_cli.errors import ParameterError
from rocketllm_cli.replies import DEFAULT_REPLY_TOKENS
from rocketllm_cli.server.refusals import refused
from rocketllm_cli.stream.context import check_context
from rocketllm_cli.text.endtokens import pad_token_id
from rocketllm_cli.text.loop import GenerationRequest, Generator
from rocketllm_cli.text.sampling import SamplingParams
from rocketllm_cli.text.stats import measure
from rocketllm_cli.text.streamer import Row

SEED = 41  # this module's own tiny model
NEW = 10


@pytest.fixture(scope="module")
def source(tiny_factory):
    return tiny_factory("llama", seed=SEED)


@pytest.fixture(scope="module")
def streamed(source):
    """Nothing resident: every token streams every unit from storage, so the bytes per token are known exactly."""
    model = AutoModel.from_pretrained(source, device_cache_bytes=0, host_cache_bytes=0)
    yield model
    model.close()


@pytest.fixture(scope="module")
def prompts(streamed):
    tok = streamed.tokenizer
    return {"long": tok("The quick brown fox jumps").input_ids, "short": tok("Hello").input_ids}


def lone(model, ids, params=SamplingParams(max_new_tokens=NEW)):
    return Generator(model).run(GenerationRequest(list(ids), params))


def test_a_batch_equals_lone_runs_token_for_token(streamed, prompts):
    long, short = prompts["long"], prompts["short"]
    assert len(long) > len(short)  # the short prompt is left-padded in the batch
    config = streamed.generation_config
    original = config.eos_token_id
    try:
        # Make a token the short prompt's lone run emits an end-of-sequence id, so that row ends early while the
        # long one goes on: the batch must cut it where the lone run stopped.
        free = lone(streamed, short).token_ids
        avoid = set(lone(streamed, long).token_ids)
        k = next(i for i in range(2, len(free)) if free[i] not in avoid and free[i] not in free[:i])
        config.eos_token_id = [int(original if not isinstance(original, list) else original[0]), free[k]]
        expected = {name: lone(streamed, ids) for name, ids in prompts.items()}
        assert expected["short"].token_ids == free[: k + 1] and expected["short"].finish_reason == "stop"
        assert expected["long"].new_tokens == NEW and expected["long"].finish_reason == "length"
        order = ["long", "short", "long", "long"]
        params = SamplingParams(max_new_tokens=NEW)
        batch = Generator(streamed).run_batch([GenerationRequest(prompts[name], params) for name in order])
    finally:
        config.eos_token_id = original
    for name, got in zip(order, batch):
        want = expected[name]
        assert (got.token_ids, got.text, got.finish_reason, got.prompt_tokens) == (
            want.token_ids,
            want.text,
            want.finish_reason,
            want.prompt_tokens,
        ), name


def test_cli_batch_of_identical_prompts_equals_single_runs(source):
    def run(*args, input=None):
        result = CliRunner().invoke(
            app, ["generate", str(source), *args, "--raw", "-n", str(NEW), "--json"], input=input
        )
        assert result.exit_code == 0, result.stderr
        return json.loads(result.stdout)

    single = run("Hello")
    many = run("--batch", input="Hello\nHello\nHello\n")
    assert many["results"] == [{k: single[k] for k in ("text", "prompt_tokens", "new_tokens")}] * 3
    assert many["stats"]["batch"] == 3 and set(many["stats"]) == set(single["stats"]) | {"batch"}


def test_generate_and_bench_figures_come_from_one_function_over_one_record(streamed, prompts):
    tokens = 4
    new = 1 + WARMUP + tokens
    bench = timed_run(streamed, prompts["long"], tokens)  # what a bench row reports
    generated = lone(streamed, prompts["long"], SamplingParams(max_new_tokens=new, min_new_tokens=new))
    record = generated.record
    assert generated.new_tokens == new and len(record.times) == new and len(record.marks) == new + 1
    # generate's figures: every step of its record
    gaps = [b - a for a, b in zip(record.times, record.times[1:])]
    figures = generated.stats.to_dict()
    assert generated.stats.gaps_s == gaps and generated.stats.ttft_s == record.times[0] - record.start
    assert figures["per_token_ms"] == round(1000 * sum(gaps) / len(gaps), 2)
    assert figures["decode_tokens_per_s"] == round(len(gaps) / sum(gaps), 2)
    # bench's: the same function over the same kind of record, the warm-up left out
    warm = measure(record, WARMUP)
    assert warm.gaps_s == gaps[WARMUP:] and len(bench.gaps_s) == tokens
    assert set(bench.to_dict()) == set(figures)
    assert bench.ledger["decode_passes"] == warm.ledger["decode_passes"] == tokens
    served = bench.bytes_per_token
    assert served == warm.bytes_per_token == generated.stats.bytes_per_token  # each decode pass streams the same units
    assert served["storage"] > 0 and served["device"] == served["host"] == 0
    assert generated.stats.served_bytes["storage"] == sum(s.served["storage"] for s in record.steps)


def test_a_plain_transformers_model_runs_the_same_loop(source, streamed, prompts):
    plain = AutoModelForCausalLM.from_pretrained(source, **dtype_kwargs(torch.float32)).eval()
    ours = lone(streamed, prompts["long"])
    theirs = Generator(plain, tokenizer=streamed.tokenizer).run(
        GenerationRequest(prompts["long"], SamplingParams(max_new_tokens=NEW))
    )
    assert (theirs.token_ids, theirs.text) == (ours.token_ids, ours.text)
    stats = timed_run(plain, prompts["long"], 3)  # a bench baseline: no ledger, no tokenizer
    assert len(stats.gaps_s) == 3 and stats.ttft_s > 0
    assert stats.ledger == {} and stats.bytes_per_token is None and stats.served_bytes == {}
    assert set(stats.to_dict()) == set(ours.stats.to_dict())


class _Bytes:
    """A tokenizer whose ids are the bytes of UTF-8 text."""

    def decode(self, ids, skip_special_tokens=True):
        return bytes(ids).decode("utf-8", errors="replace")


def test_the_streamer_holds_back_half_characters_and_stop_prefixes():
    pieces: list[str] = []
    row = Row(_Bytes(), eos_ids=set(), stop=("STOP",), on_text=pieces.append)

    def feed(text: str) -> str:
        for b in text.encode():
            row.add(b)
        return "".join(pieces)

    assert feed("n") == "n"
    row.add(0xC3)  # the first byte of é
    assert "".join(pieces) == "n"
    row.add(0xA9)
    assert "".join(pieces) == "né"
    assert feed(" ST") == "né "  # "ST" may begin "STOP"
    assert feed("AR") == "né STAR"
    assert feed(" STO") == "né STAR "
    assert not row.should_stop()
    assert feed("P after") == "né STAR " and row.should_stop() and row.stop_sequence == "STOP"
    assert row.finish(list("né STAR STOP".encode())) == "né STAR " and "".join(pieces) == "né STAR "


def test_a_stop_prefix_that_does_not_become_the_stop_is_sent_at_the_end():
    pieces: list[str] = []
    row = Row(_Bytes(), eos_ids=set(), stop=("STOP",), on_text=pieces.append)
    for b in "go ST".encode():
        row.add(b)
    assert "".join(pieces) == "go "
    assert row.finish(list("go ST".encode())) == "go ST" and "".join(pieces) == "go ST"


def test_library_errors_name_keywords_and_each_caller_spells_them():
    with pytest.raises(ParameterError) as caught:
        SamplingParams(max_new_tokens=0)
    assert str(caught.value) == "max_new_tokens must be at least 1 (got 0)"
    assert caught.value.spelled(flag_of) == "--max-new-tokens must be at least 1 (got 0)"
    err = refused(caught.value)
    assert (err.status, err.message, err.param) == (400, "'max_tokens' must be at least 1 (got 0)", "max_tokens")
    with pytest.raises(ParameterError) as caught:
        check_context(10, 8, 16)
    assert caught.value.params == ("max_new_tokens",)
    assert str(caught.value) == (
        "prompt is 10 tokens and max_new_tokens 8, but the context allows 16; "
        "shorten the prompt or lower max_new_tokens"
    )


def test_the_cli_default_token_count_is_the_library_default():
    from rocketllm_cli.commands import generate

    assert inspect.signature(generate.run).parameters["max_new_tokens"].default == DEFAULT_REPLY_TOKENS
    assert SamplingParams().max_new_tokens == DEFAULT_REPLY_TOKENS


@pytest.mark.parametrize(
    "config, pad",
    [
        (SimpleNamespace(pad_token_id=7, eos_token_id=[5, 2]), 7),
        (SimpleNamespace(pad_token_id=None, eos_token_id=[5, 2]), 5),
        (SimpleNamespace(pad_token_id=None, eos_token_id=2), 2),
        (SimpleNamespace(pad_token_id=None, eos_token_id=None), 0),
        (None, 0),
    ],
)
def test_one_pad_rule(config, pad):
    assert pad_token_id(SimpleNamespace(generation_config=config)) == pad


def test_min_new_tokens_holds_end_of_sequence_off_as_transformers_own_does(source, streamed, prompts):
    """The loop's in-place processor against generate's min_new_tokens, with end-of-sequence set to the token a
    greedy run makes third: both hold it off for exactly the count, then stop at it."""
    plain = AutoModelForCausalLM.from_pretrained(source, **dtype_kwargs(torch.float32)).eval()
    ids = torch.tensor([prompts["long"]])
    free = plain.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, do_sample=False, eos_token_id=None, pad_token_id=0
    )[0, ids.shape[1] :].tolist()
    eos = free[2]
    original = (plain.generation_config.eos_token_id, streamed.generation_config.eos_token_id)
    plain.generation_config.eos_token_id = streamed.generation_config.eos_token_id = eos
    try:
        for held in (0, 2, 5):
            theirs = plain.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=NEW,
                min_new_tokens=held or None,
                do_sample=False,
                pad_token_id=0,
            )[0, ids.shape[1] :].tolist()
            theirs = theirs[: theirs.index(eos) + 1] if eos in theirs else theirs
            ours = lone(streamed, prompts["long"], SamplingParams(max_new_tokens=NEW, min_new_tokens=held))
            assert ours.token_ids == theirs, held
            assert ours.token_ids.index(eos) >= held if eos in ours.token_ids else len(ours.token_ids) == NEW
    finally:
        plain.generation_config.eos_token_id, streamed.generation_config.eos_token_id = original
