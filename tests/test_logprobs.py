"""Log-probabilities from the one generation loop: each generated token's equals transformers' own log-softmax of that
step's logits (fp32, every layer streamed and every unit resident), the top ones are the most likely in order, a greedy
token is the top one; a prompt's (an echo) equal a plain forward pass's; a batch records each row's own; and asking for
them turns speculative decoding off with the reason."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from rocketllm_cli.auto import AutoModel
from rocketllm_cli.compat import dtype_kwargs
from rocketllm_cli.text.loop import GenerationRequest, Generator
from rocketllm_cli.text.sampling import SamplingParams

SEED = 83
NEW = 8
EVERYTHING = 1 << 40


@pytest.fixture(scope="module")
def source(tiny_factory):
    return tiny_factory("llama", seed=SEED)


@pytest.fixture(scope="module")
def reference(source):
    model = AutoModelForCausalLM.from_pretrained(source, **dtype_kwargs(torch.float32))
    model.eval()
    return model


@pytest.fixture(scope="module", params=["streamed", "resident"])
def model(request, source):
    budget = (
        {"device_cache_bytes": 0, "host_cache_bytes": 0}
        if request.param == "streamed"
        else {"device_cache_bytes": EVERYTHING}
    )
    streamed = AutoModel.from_pretrained(source, **budget)
    yield streamed
    streamed.close()


@pytest.fixture(scope="module")
def prompt(model):
    return model.tokenizer("the cat sat on the mat and").input_ids


def test_generated_logprobs_equal_transformers_log_softmax(model, reference, prompt):
    out = Generator(model, speculate="off").run(
        GenerationRequest(list(prompt), SamplingParams(max_new_tokens=NEW), logprobs=5)
    )
    with torch.inference_mode():
        ref = reference.generate(
            torch.tensor([prompt]),
            max_new_tokens=NEW,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=0,
        )
    assert ref.sequences[0, len(prompt) :].tolist() == out.token_ids
    assert len(out.logprobs) == out.new_tokens
    for step, (entry, logits) in enumerate(zip(out.logprobs, ref.logits)):
        expected = torch.log_softmax(logits[0].float(), -1)
        assert entry.token == out.token_ids[step]
        assert abs(entry.logprob - expected[entry.token].item()) < 1e-4
        values, ids = expected.topk(5)
        assert [t for t, _ in entry.top] == ids.tolist() and max(
            abs(a - b) for (_, a), b in zip(entry.top, values.tolist())
        ) < 1e-4
        assert entry.top[0][0] == entry.token  # greedy: the chosen token is the most likely one


def test_prompt_logprobs_equal_a_plain_forward_pass(model, reference, prompt):
    generator = Generator(model, speculate="off")
    scored = generator.score(prompt, top=2)
    with torch.inference_mode():
        expected = torch.log_softmax(reference(torch.tensor([prompt])).logits[0].float(), -1)
    assert scored[0] is None and len(scored) == len(prompt)
    for position, entry in enumerate(scored[1:], start=1):
        assert (
            entry.token == prompt[position]
            and abs(entry.logprob - expected[position - 1, prompt[position]].item()) < 1e-4
        )
        assert len(entry.top) == 2 and entry.top[0][1] >= entry.top[1][1]
    both = generator.run(
        GenerationRequest(list(prompt), SamplingParams(max_new_tokens=2), logprobs=0, prompt_logprobs=2)
    )
    assert [e and e.logprob for e in both.prompt_logprobs] == [e and e.logprob for e in scored] and both.logprobs[
        0
    ].top == []


def test_a_batch_records_each_rows_own_and_logprobs_turn_speculation_off(model, prompt):
    short = model.tokenizer("hello").input_ids
    generator = Generator(model, speculate="prompt-lookup")
    rows = generator.run_batch(
        [
            GenerationRequest(list(prompt), SamplingParams(max_new_tokens=NEW), logprobs=1),
            GenerationRequest(list(short), SamplingParams(max_new_tokens=NEW), logprobs=3),
        ]
    )
    alone = Generator(model, speculate="off").run(
        GenerationRequest(list(short), SamplingParams(max_new_tokens=NEW), logprobs=3)
    )
    assert [len(e.top) for e in rows[0].logprobs] == [1] * NEW and [len(e.top) for e in rows[1].logprobs] == [3] * NEW
    assert rows[1].token_ids == alone.token_ids
    assert max(abs(a.logprob - b.logprob) for a, b in zip(rows[1].logprobs, alone.logprobs)) < 1e-4
    one = generator.run(GenerationRequest(list(prompt), SamplingParams(max_new_tokens=NEW), logprobs=0))
    assert one.stats.speculation["mode"] == "off" and "log-probabilities" in one.stats.speculation["reason"]


def test_streamed_logprobs_come_before_their_text(model, prompt):
    events = []
    request = GenerationRequest(
        list(prompt),
        SamplingParams(max_new_tokens=NEW),
        logprobs=0,
        on_text=lambda piece: events.append(("text", piece)),
        on_logprobs=lambda entries: events.append(("logprobs", entries)),
    )
    out = Generator(model, speculate="off").run(request)
    sent = [e for kind, entries in events if kind == "logprobs" for e in entries]
    assert [e.token for e in sent][: out.new_tokens] == out.token_ids
    first_text = next(i for i, (kind, _) in enumerate(events) if kind == "text")
    assert events[0][0] == "logprobs" and first_text > 0


def test_generate_logprobs_in_its_json(source, model, prompt):
    from typer.testing import CliRunner

    from rocketllm_cli.app import app

    result = CliRunner().invoke(
        app,
        [
            "generate",
            str(source),
            "the cat sat on the mat and",
            "--raw",
            "-n",
            "4",
            "--json",
            "--logprobs",
            "2",
            "--speculate",
            "off",
        ],
    )
    assert result.exit_code == 0, result.stderr
    import json

    doc = json.loads(result.stdout)
    expected = Generator(model, speculate="off").run(
        GenerationRequest(list(prompt), SamplingParams(max_new_tokens=4), logprobs=2)
    )
    assert [e["token"] for e in doc["logprobs"]] == expected.token_ids and all(
        len(e["top"]) == 2 for e in doc["logprobs"]
    )
    assert max(abs(e["logprob"] - x.logprob) for e, x in zip(doc["logprobs"], expected.logprobs)) < 1e-4
    refused = CliRunner().invoke(app, ["generate", str(source), "hi", "--logprobs", "2"])
    assert refused.exit_code == 1 and "add --json" in refused.stderr
