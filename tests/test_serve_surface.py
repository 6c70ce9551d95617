"""The rest of the OpenAI surface, through the openai SDK: logprobs (chat and completions, streamed and not, an echoed
prompt's first token null, max_tokens 0 with echo) equal to the loop's own; n choices as rows of one batch, streamed
under their index; logit_bias; the Responses API (text, streamed events in order, forced function calls, text.format,
what it refuses); /tokenize, /detokenize and /tokenizer_info in llama-server's and vLLM's shapes."""

from __future__ import annotations

import json

import jsonschema
import pytest
from serve_helpers import LiveServer

from rocketllm_cli.auto import AutoModel
from rocketllm_cli.text.loop import GenerationRequest, Generator
from rocketllm_cli.text.sampling import SamplingParams

MODEL = "tiny"
ASK = [{"role": "user", "content": "Say something."}]
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def server(tiny_factory):
    model = AutoModel.from_pretrained(tiny_factory("llama", seed=97), device_cache_bytes="1GB")
    with LiveServer(model, MODEL) as live:
        yield live
    model.close()


def loop(server, ids, **request):
    """What the loop itself gives for these ids (the server's own generator, greedy)."""
    params = SamplingParams(max_new_tokens=request.pop("max_new_tokens", 6))
    return Generator(server.state.model, speculate="off").run(GenerationRequest(list(ids), params, **request))


# -- logprobs -------------------------------------------------------------------------------------------------
def test_chat_logprobs_streamed_and_not_are_the_loops(server):
    client = server.openai()
    reply = client.chat.completions.create(
        model=MODEL, messages=ASK, max_tokens=6, logprobs=True, top_logprobs=3, **GREEDY
    )
    content = reply.choices[0].logprobs.content
    assert len(content) == reply.usage.completion_tokens == 6
    ids = server.state.builder.chat(ASK)
    expected = loop(server, ids, logprobs=3)
    text_of = server.state.token_text
    assert [c.token for c in content] == [text_of(t) for t in expected.token_ids]
    assert all(abs(c.logprob - e.logprob) < 1e-4 for c, e in zip(content, expected.logprobs))
    assert all(len(c.top_logprobs) == 3 and c.top_logprobs[0].logprob >= c.top_logprobs[-1].logprob for c in content)
    assert content[0].bytes == list(content[0].token.encode())
    streamed = [
        t
        for chunk in client.chat.completions.create(
            model=MODEL, messages=ASK, max_tokens=6, logprobs=True, top_logprobs=3, stream=True, **GREEDY
        )
        if chunk.choices and chunk.choices[0].logprobs
        for t in chunk.choices[0].logprobs.content
    ]
    assert [(t.token, round(t.logprob, 4)) for t in streamed] == [(c.token, round(c.logprob, 4)) for c in content]
    plain = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=2, **GREEDY)
    assert plain.choices[0].logprobs is None


def test_completions_echo_with_logprobs_as_lm_evaluation_harness_asks(server):
    """Token-id prompt, echo, logprobs 1, max_tokens 1 (and 0): the prompt's log-probabilities, the first null."""
    client = server.openai()
    ids = server.state.builder.tokenizer("the cat sat on the mat").input_ids
    scored = Generator(server.state.model).score(ids, top=1)
    for max_tokens in (1, 0):
        reply = client.completions.create(
            model=MODEL, prompt=ids, echo=True, logprobs=1, max_tokens=max_tokens, temperature=0, seed=1234
        )
        lp = reply.choices[0].logprobs
        assert (
            len(lp.token_logprobs) == len(ids) + max_tokens
            and lp.token_logprobs[0] is None
            and lp.top_logprobs[0] is None
        )
        assert all(abs(a - b.logprob) < 1e-4 for a, b in zip(lp.token_logprobs[1 : len(ids)], scored[1:]))
        assert all(len(top) == 1 for top in lp.top_logprobs[1:])
        assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
        assert reply.choices[0].text.startswith(server.state.builder.decode(ids))
    streamed = [
        c
        for c in client.completions.create(
            model=MODEL, prompt="the cat", logprobs=2, max_tokens=4, stream=True, **GREEDY
        )
    ]
    tokens = [t for c in streamed if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    assert len(tokens) == 4


# -- n -------------------------------------------------------------------------------------------------------
def test_n_choices_are_rows_of_one_batch_streamed_under_their_index(server):
    client = server.openai()
    ask = dict(model=MODEL, messages=ASK, max_tokens=5, n=3, temperature=1.0, seed=7)
    reply = client.chat.completions.create(**ask)
    # every row's tokens
    assert [c.index for c in reply.choices] == [0, 1, 2] and 3 <= reply.usage.completion_tokens <= 15
    assert len({c.message.content for c in reply.choices}) > 1  # sampled rows differ
    assert [c.message.content for c in client.chat.completions.create(**ask).choices] == [
        c.message.content for c in reply.choices
    ]
    pieces = {0: "", 1: "", 2: ""}
    for chunk in client.chat.completions.create(**ask, stream=True):
        for choice in chunk.choices:
            pieces[choice.index] += choice.delta.content or ""
    assert [pieces[i] for i in range(3)] == [c.message.content for c in reply.choices]
    greedy = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=5, n=2, **GREEDY)
    # rows of one batch, each the lone reply
    assert greedy.choices[0].message.content == greedy.choices[1].message.content
    completions = client.completions.create(model=MODEL, prompt="the cat", max_tokens=3, n=2, **GREEDY)
    assert [c.index for c in completions.choices] == [0, 1]


def test_logit_bias_bans_and_forces(server):
    client = server.openai()
    first = loop(server, server.state.builder.chat(ASK), max_new_tokens=1).token_ids[0]
    banned = client.chat.completions.create(
        model=MODEL, messages=ASK, max_tokens=1, logit_bias={str(first): -100}, logprobs=True, **GREEDY
    )
    assert banned.choices[0].logprobs.content[0].token != server.state.token_text(first)
    forced_id = server.state.builder.tokenizer("x", add_special_tokens=False).input_ids[0]
    forced = client.chat.completions.create(
        model=MODEL, messages=ASK, max_tokens=3, logit_bias={str(forced_id): 100}, **GREEDY
    )
    assert forced.choices[0].message.content == "xxx"


# -- Responses ------------------------------------------------------------------------------------------------
def test_responses_text_and_its_stream_events_in_order(server):
    client = server.openai()
    response = client.responses.create(
        model=MODEL, input="Say something.", instructions="Be brief.", max_output_tokens=6, temperature=0
    )
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.output[0].type == "message" and response.output_text and response.usage.output_tokens == 6
    with client.responses.stream(
        model=MODEL, input="Say something.", instructions="Be brief.", max_output_tokens=6, temperature=0
    ) as stream:
        events = [event.type for event in stream]
        final = stream.get_final_response()
    assert events[:2] == ["response.created", "response.in_progress"]
    assert events[2:4] == ["response.output_item.added", "response.content_part.added"]
    assert "response.output_text.delta" in events and events[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert final.output_text == response.output_text and final.status == "incomplete"


def test_responses_forced_function_call_and_json_schema_format(server):
    client = server.openai()
    tool = {
        "type": "function",
        "name": "get_time",
        "description": "time",
        "strict": True,
        "parameters": {
            "type": "object",
            "properties": {"tz": {"enum": ["UTC", "CET"]}},
            "required": ["tz"],
            "additionalProperties": False,
        },
    }
    response = client.responses.create(
        model=MODEL,
        input="What time is it?",
        tools=[tool],
        tool_choice="required",
        max_output_tokens=200,
        temperature=0,
    )
    calls = [item for item in response.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_time" and json.loads(calls[0].arguments)["tz"] in ("UTC", "CET")
    with client.responses.stream(
        model=MODEL,
        input="What time is it?",
        tools=[tool],
        tool_choice={"type": "function", "name": "get_time"},
        max_output_tokens=200,
        temperature=0,
    ) as stream:
        kinds = [event.type for event in stream]
    assert "response.function_call_arguments.delta" in kinds and kinds[-1] == "response.completed"
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}},
        "required": ["ok"],
        "additionalProperties": False,
    }
    formatted = client.responses.create(
        model=MODEL,
        input="Is it?",
        max_output_tokens=200,
        temperature=0,
        text={"format": {"type": "json_schema", "name": "answer", "schema": schema, "strict": True}},
    )
    jsonschema.validate(json.loads(formatted.output_text), schema)


@pytest.mark.parametrize(
    "extra, param, words",
    [
        ({"previous_response_id": "resp_x"}, "previous_response_id", "stores no responses"),
        ({"tools": [{"type": "web_search"}]}, "tools", "function tools only"),
        ({"store": True}, "store", "not supported"),
        (
            {"text": {"format": {"type": "json_schema", "name": "x", "schema": [1]}}},
            "text.format",
            "must be a JSON Schema object",
        ),
        ({"max_output_tokens": 0}, "max_output_tokens", "must be >= 1"),
    ],
)
def test_responses_refuses_what_it_cannot_keep(server, extra, param, words):
    response = server.http().post("/v1/responses", json={"model": MODEL, "input": "hi", **extra})
    error = response.json()["error"]
    assert response.status_code == 400 and error["param"] == param and words in error["message"], error


# -- the tokenizer ----------------------------------------------------------------------------------------------
def test_tokenize_detokenize_and_tokenizer_info_in_both_shapes(server):
    http = server.http()
    tokenizer = server.state.builder.tokenizer
    text = "the cat sat"
    llama = http.post("/tokenize", json={"content": text}).json()
    assert llama["tokens"] == tokenizer(text, add_special_tokens=False).input_ids
    vllm = http.post("/tokenize", json={"prompt": text, "add_special_tokens": False}).json()
    assert vllm["tokens"] == llama["tokens"] and vllm["count"] == len(llama["tokens"])
    pieces = http.post("/tokenize", json={"content": text, "with_pieces": True}).json()["tokens"]
    assert "".join(p["piece"] for p in pieces) == text
    back = http.post("/detokenize", json={"tokens": llama["tokens"]}).json()
    assert back["content"] == back["prompt"] == text
    info = http.get("/tokenizer_info").json()
    assert info["eos_token"] == tokenizer.eos_token and info["chat_template"]
    assert http.post("/detokenize", json={"tokens": [-1]}).status_code == 400
    chat = http.post("/tokenize", json={"messages": ASK}).json()["tokens"]
    assert chat == server.state.builder.chat(ASK)


def test_a_streamed_echo_with_logprobs_sends_the_prompt_first_and_each_token_once(server):
    client = server.openai()
    whole = client.completions.create(model=MODEL, prompt="the cat", echo=True, logprobs=1, max_tokens=4, **GREEDY)
    chunks = [
        c
        for c in client.completions.create(
            model=MODEL, prompt="the cat", echo=True, logprobs=1, max_tokens=4, stream=True, **GREEDY
        )
        if c.choices
    ]
    assert chunks[0].choices[0].text == "the cat" and chunks[0].choices[0].logprobs.token_logprobs[0] is None
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    tokens = [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    assert tokens == whole.choices[0].logprobs.tokens
