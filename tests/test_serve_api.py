"""rocketllm serve, over HTTP with the real openai and anthropic clients against a live server on 127.0.0.1:
greedy replies equal `Generator.run` token for token (chat, completions, messages; streamed and not), the
stream formats end as each API specifies, requests queue with their position in a header, a client that
disconnects frees the model at once, and every bad request is a 400/404 in the API's own error shape
after which the server keeps serving."""

from __future__ import annotations

import json
import threading
import time

import anthropic
import openai
import pytest
from serve_helpers import LiveServer, Script

from rocketllm_cli.text.loop import GenerationRequest, Generator
from rocketllm_cli.text.promptids import encode_prompt
from rocketllm_cli.text.sampling import SamplingParams

MODEL = "tiny"
QUESTION = "What is the capital of France?"
N = 12
GREEDY = {"temperature": 0}
QUEUE = "x-rocketllm-queue-position"


@pytest.fixture(scope="module")
def model(resident_tiny_llama):
    return resident_tiny_llama


@pytest.fixture(scope="module")
def reference(model):
    """What `generate` gives for the same prompts, computed before the server owns the model."""
    chat_ids = encode_prompt(model.tokenizer, QUESTION, chat=True)
    raw_ids = encode_prompt(model.tokenizer, QUESTION, chat=False)
    chat = Generator(model).run(GenerationRequest(chat_ids[0].tolist(), SamplingParams(max_new_tokens=N)))
    raw = Generator(model).run(GenerationRequest(raw_ids[0].tolist(), SamplingParams(max_new_tokens=N)))
    return {"chat": chat, "raw": raw, "chat_ids": chat_ids[0].tolist(), "raw_ids": raw_ids[0].tolist()}


@pytest.fixture(scope="module")
def server(model, reference):
    with LiveServer(model, MODEL) as live:
        yield live


@pytest.fixture
def script(model):
    s = Script(model)
    yield s
    s.remove()


def chat(server, content=QUESTION, **kwargs):
    kwargs = {"max_tokens": N, **GREEDY, **kwargs}
    return server.openai().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": content}], **kwargs
    )


def sse_lines(server, path: str, body: dict) -> list[str]:
    with server.http() as http, http.stream("POST", path, json=body) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        return [line for line in response.iter_lines() if line]


# -- replies equal generate's ----------------------------------------------------------------------------
def test_models_lists_the_served_name(server):
    listed = server.openai().models.list().data
    assert [m.id for m in listed] == [MODEL]
    assert listed[0].model_extra["multimodal"] is False
    assert server.anthropic().models.list().data[0].id == MODEL


def test_chat_equals_generate_token_for_token(server, reference):
    reply = chat(server)
    ref = reference["chat"]
    assert reply.choices[0].message.content == ref.text
    assert reply.choices[0].message.role == "assistant"
    assert reply.usage.prompt_tokens == len(reference["chat_ids"]) and reply.usage.completion_tokens == ref.new_tokens
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens
    assert reply.choices[0].finish_reason == ("length" if ref.new_tokens == N else "stop")
    assert reply.model == MODEL and reply.id.startswith("chatcmpl-")


def test_chat_streams_the_same_text_and_ends_with_done(server, reference):
    chunks = list(chat(server, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == reference["chat"].text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length" if reference["chat"].new_tokens == N else "stop"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == reference["chat"].new_tokens
    lines = sse_lines(
        server,
        "/v1/chat/completions",
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": QUESTION}],
            "max_tokens": 3,
            "stream": True,
            **GREEDY,
        },
    )
    assert lines[-1] == "data: [DONE]" and all(line.startswith("data: ") for line in lines)
    last = json.loads(lines[-2][6:])  # without include_usage the finishing chunk carries the usage
    assert last["choices"][0]["finish_reason"] and last["usage"]["completion_tokens"] >= 1


def test_completions_equal_generate_streamed_or_not(server, reference):
    client = server.openai()
    whole = client.completions.create(model=MODEL, prompt=QUESTION, max_tokens=N, **GREEDY)
    assert whole.choices[0].text == reference["raw"].text
    assert (
        whole.usage.prompt_tokens == len(reference["raw_ids"])
        and whole.usage.completion_tokens == reference["raw"].new_tokens
    )
    pieces = list(client.completions.create(model=MODEL, prompt=QUESTION, max_tokens=N, stream=True, **GREEDY))
    assert "".join(p.choices[0].text for p in pieces) == reference["raw"].text
    assert pieces[-1].choices[0].finish_reason in ("stop", "length")
    echoed = client.completions.create(model=MODEL, prompt=QUESTION, max_tokens=N, echo=True, **GREEDY)
    assert echoed.choices[0].text == QUESTION + reference["raw"].text


def test_messages_equal_generate_streamed_or_not(server, reference):
    client = server.anthropic()
    message = client.messages.create(
        model=MODEL, max_tokens=N, messages=[{"role": "user", "content": QUESTION}], extra_body=GREEDY
    )
    assert message.content[0].type == "text" and message.content[0].text == reference["chat"].text
    assert message.stop_reason == ("max_tokens" if reference["chat"].new_tokens == N else "end_turn")
    assert message.usage.output_tokens == reference["chat"].new_tokens
    assert message.usage.input_tokens + message.usage.cache_read_input_tokens == len(reference["chat_ids"])
    with client.messages.stream(
        model=MODEL, max_tokens=N, messages=[{"role": "user", "content": QUESTION}], extra_body=GREEDY
    ) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == reference["chat"].text == final.content[0].text
    assert final.stop_reason == message.stop_reason and final.usage.output_tokens == message.usage.output_tokens


def test_messages_stream_follows_anthropics_event_sequence(server):
    lines = sse_lines(
        server,
        "/v1/messages",
        {
            "model": MODEL,
            "max_tokens": 4,
            "stream": True,
            **GREEDY,
            "messages": [{"role": "user", "content": QUESTION}],
        },
    )
    events = [line.removeprefix("event: ") for line in lines if line.startswith("event: ")]
    data = [json.loads(line[6:]) for line in lines if line.startswith("data: ")]
    assert [d["type"] for d in data] == events  # every event names its own type
    core = [e for e in events if e != "ping"]
    assert core[0] == "message_start" and core[1] == "content_block_start"
    assert set(core[2:-3]) == {"content_block_delta"}
    assert core[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    delta = next(d for d in data if d["type"] == "message_delta")
    assert delta["delta"]["stop_reason"] in ("end_turn", "max_tokens") and delta["usage"]["output_tokens"] >= 1


def test_a_system_prompt_and_an_assistant_prefill_reach_the_template(server, script):
    script.say("ok")
    server.anthropic().messages.create(
        model=MODEL,
        max_tokens=4,
        system="Be brief.",
        extra_body=GREEDY,
        messages=[{"role": "user", "content": QUESTION}, {"role": "assistant", "content": "The answer:"}],
    )
    prompt = script.prompt_text()
    assert prompt.startswith("<|im_start|>system\nBe brief.<|im_end|>")
    assert prompt.endswith("<|im_start|>assistant\nThe answer:")  # continued, not a new turn


# -- sampling --------------------------------------------------------------------------------------------
def test_stop_strings_end_the_reply_and_are_trimmed(server, script):
    script.say("Paris is the capital. It is large.")
    reply = chat(server, stop=[" It is"], max_tokens=40)
    assert reply.choices[0].message.content == "Paris is the capital." and reply.choices[0].finish_reason == "stop"
    script.say("Paris is the capital. It is large.")
    streamed = "".join(
        c.choices[0].delta.content or "" for c in chat(server, stop=" It is", max_tokens=40, stream=True)
    )
    assert streamed == "Paris is the capital."
    script.say("Paris is the capital. It is large.")
    message = server.anthropic().messages.create(
        model=MODEL,
        max_tokens=40,
        stop_sequences=["large", "capital"],
        extra_body=GREEDY,
        messages=[{"role": "user", "content": QUESTION}],
    )
    assert (
        message.content[0].text == "Paris is the "
        and message.stop_reason == "stop_sequence"
        and message.stop_sequence == "capital"
    )


def test_max_tokens_ends_with_length(server, script):
    script.delay = 0.001  # also keeps the model from ending on its own
    reply = chat(server, max_tokens=3)
    assert reply.usage.completion_tokens == 3 and reply.choices[0].finish_reason == "length"
    message = server.anthropic().messages.create(
        model=MODEL, max_tokens=3, messages=[{"role": "user", "content": "hi"}]
    )
    assert message.usage.output_tokens == 3 and message.stop_reason == "max_tokens"


def test_a_seed_makes_sampling_repeatable(server):
    a = chat(server, temperature=1.0, top_p=0.9, seed=5, max_tokens=N).choices[0].message.content
    b = chat(server, temperature=1.0, top_p=0.9, seed=5, max_tokens=N).choices[0].message.content
    c = (
        chat(server, temperature=1.0, seed=6, max_tokens=N, extra_body={"top_k": 5, "repetition_penalty": 1.2})
        .choices[0]
        .message.content
    )
    assert a == b and isinstance(c, str)


def test_presence_and_frequency_penalties_take_effect(server):
    """OpenAI's penalties change the reply as the loop's processor computes them (text/loop.py, Penalties)."""
    client = server.openai()
    ask = dict(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=24, **GREEDY)
    plain = client.chat.completions.with_raw_response.create(**ask)
    assert "x-rocketllm-ignored" not in plain.headers
    text = plain.parse().choices[0].message.content
    assert client.chat.completions.create(**ask, frequency_penalty=0.0).choices[0].message.content == text
    assert (
        client.chat.completions.create(**ask, frequency_penalty=2.0, presence_penalty=2.0).choices[0].message.content
        != text
    )


def test_penalties_match_their_definition():
    import torch

    from rocketllm_cli.text.processors import Penalties

    ids = torch.tensor([[9, 9, 1, 2, 2, 2, 3]])  # prompt 9 9, reply 1 2 2 2 3
    out = Penalties(2, presence=0.5, frequency=0.25)(ids, torch.zeros(1, 6))
    assert out[0].tolist() == [0.0, -0.75, -1.25, -0.75, 0.0, 0.0]


def test_a_repeated_prompt_reuses_its_prefix_and_gives_the_same_text(server, reference):
    assert server.state.prefix_on  # the tiny model is resident: auto turns it on
    first, second = chat(server), chat(server)
    assert first.choices[0].message.content == second.choices[0].message.content == reference["chat"].text
    assert second.usage.prompt_tokens_details.cached_tokens >= 16


# -- one model instance: a queue, cancellation -----------------------------------------------------------
def wait_for(condition, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_two_concurrent_requests_queue_with_positions_0_and_1(server, script):
    script.gate = threading.Event()
    client = server.openai()
    answers: dict[str, tuple] = {}

    def ask(name: str) -> None:
        raw = client.chat.completions.with_raw_response.create(
            model=MODEL, messages=[{"role": "user", "content": name}], max_tokens=4, **GREEDY
        )
        answers[name] = (raw.headers[QUEUE], raw.parse())

    first = threading.Thread(target=ask, args=("first",))
    first.start()
    wait_for(lambda: server.state.worker.busy)
    second = threading.Thread(target=ask, args=("second",))
    second.start()
    wait_for(lambda: server.state.worker.queue_length == 1)
    assert server.http().get("/health").json()["queue_length"] == 1
    script.gate.set()
    first.join(30)
    second.join(30)
    assert answers["first"][0] == "0" and answers["second"][0] == "1"
    assert all(a[1].choices[0].message.content is not None for a in answers.values())


def test_a_client_that_disconnects_mid_stream_frees_the_model(server, script):
    script.delay = 0.05  # each token takes 50 ms: the abandoned reply would take 20 s
    body = {"model": MODEL, "messages": [{"role": "user", "content": QUESTION}], "max_tokens": 400, "stream": True}
    with server.http() as http, http.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.headers[QUEUE] == "0"
        for line in response.iter_lines():
            if line.startswith("data: ") and '"content":"' in line and '"content":""' not in line:
                break  # the first piece of text: now walk away
    script.delay = 0
    start = time.monotonic()
    reply = chat(server, max_tokens=2)
    waited = time.monotonic() - start
    assert reply.choices[0].message.content is not None
    abandoned = [h for h in server.history if h["max_new_tokens"] == 400][-1]
    assert abandoned["state"] == "cancelled" and abandoned["generated_tokens"] < 60, abandoned
    assert waited < 10, waited


def test_a_queued_request_whose_client_left_never_runs(server, script):
    script.gate = threading.Event()
    client = server.openai()
    runner = threading.Thread(target=lambda: chat(server, max_tokens=2))
    runner.start()
    wait_for(lambda: server.state.worker.busy)
    short = server.openai(timeout=0.5)
    with pytest.raises(openai.APITimeoutError):
        short.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "left"}], max_tokens=300)
    wait_for(lambda: server.state.worker.queue_length == 0, timeout=5)
    script.gate.set()
    runner.join(30)
    left = [h for h in server.history if h["max_new_tokens"] == 300][-1]
    assert left["state"] == "cancelled" and left["generated_tokens"] == 0
    assert client.models.list().data  # still serving


# -- information endpoints -------------------------------------------------------------------------------
def test_health_names_model_plan_parser_and_queue(server):
    health = server.http().get("/health").json()
    assert health["status"] == "ok" and health["model"] == MODEL
    assert health["residency"].startswith("residency: ") and set(health["residency_plan"].values()) == {"device"}
    assert health["tool_parser"] == "hermes" and health["queue_length"] == 0
    assert health["prefix_cache"]["enabled"] is True


def test_metrics_are_prometheus_text(server):
    chat(server, max_tokens=2)
    response = server.http().get("/metrics")
    assert response.headers["content-type"].startswith("text/plain")
    text = response.text
    for name, kind in [
        ("rocketllm_requests_total", "counter"),
        ("rocketllm_tokens_total", "counter"),
        ("rocketllm_token_latency_seconds", "summary"),
        ("rocketllm_bytes_per_token", "gauge"),
        ("rocketllm_queue_length", "gauge"),
    ]:
        assert f"# TYPE {name} {kind}" in text and f"# HELP {name} " in text
    samples = dict(line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#"))
    assert float(samples['rocketllm_requests_total{endpoint="/v1/chat/completions",status="200"}']) >= 1
    assert float(samples['rocketllm_tokens_total{kind="generated"}']) >= 1
    assert float(samples['rocketllm_bytes_per_token{tier="device"}']) > 0
    assert float(samples["rocketllm_token_latency_seconds_count"]) >= 1
    assert samples["rocketllm_queue_length"] == "0"


# -- errors, each in its API's shape ---------------------------------------------------------------------
def openai_error(response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    return error


def anthropic_error(response, status: int, kind: str = "invalid_request_error") -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert body["type"] == "error" and body["error"]["type"] == kind
    return body["error"]


CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
MESSAGES = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.mark.parametrize(
    "path, body, param, words",
    [
        ("/v1/chat/completions", {**CHAT, "messages": []}, "messages", "non-empty list"),
        (
            "/v1/chat/completions",
            {k: v for k, v in CHAT.items() if k != "messages"},
            "messages",
            "missing required field 'messages'",
        ),
        (
            "/v1/chat/completions",
            {k: v for k, v in CHAT.items() if k != "model"},
            "model",
            "missing required field 'model'",
        ),
        (
            "/v1/chat/completions",
            {**CHAT, "messages": [{"content": "hi"}]},
            "messages[0].role",
            "missing required field 'messages[0].role'",
        ),
        ("/v1/chat/completions", {**CHAT, "max_tokens": 100000}, "max_tokens", "but the context allows 2048"),
        ("/v1/chat/completions", {**CHAT, "max_tokens": 0}, "max_tokens", "'max_tokens' must be >= 1"),
        ("/v1/chat/completions", {**CHAT, "temperature": "hot"}, "temperature", "must be a number"),
        ("/v1/chat/completions", {**CHAT, "top_p": 0}, "top_p", "'top_p' must be > 0"),
        ("/v1/chat/completions", {**CHAT, "n": 65}, "n", "'n' must be <= 64"),
        (
            "/v1/chat/completions",
            {**CHAT, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
            "messages[0].content",
            "takes text only",
        ),
        ("/v1/chat/completions", {**CHAT, "tool_choice": "required"}, "tool_choice", "needs 'tools'"),
        (
            "/v1/chat/completions",
            {**CHAT, "response_format": {"type": "xml"}},
            "response_format",
            "must be text, json_object or json_schema",
        ),
        ("/v1/completions", {"model": MODEL, "max_tokens": 2}, "prompt", "missing required field 'prompt'"),
        (
            "/v1/completions",
            {"model": MODEL, "prompt": "hi", "max_tokens": 5000},
            "max_tokens",
            "but the context allows 2048",
        ),
    ],
)
def test_bad_openai_requests_are_400_in_openais_shape(server, path, body, param, words):
    error = openai_error(server.http().post(path, json=body), 400)
    assert error["param"] == param and words in error["message"], error


@pytest.mark.parametrize(
    "body, words",
    [
        ({k: v for k, v in MESSAGES.items() if k != "max_tokens"}, "missing required field 'max_tokens'"),
        ({k: v for k, v in MESSAGES.items() if k != "messages"}, "missing required field 'messages'"),
        ({**MESSAGES, "max_tokens": 100000}, "but the context allows 2048"),
        ({**MESSAGES, "temperature": 1.5}, "'temperature' must be <= 1"),
        ({**MESSAGES, "messages": [{"role": "system", "content": "x"}]}, "put a system prompt in 'system'"),
        (
            {
                **MESSAGES,
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {
                                "type": "image",
                                "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="},
                            }
                        ],
                    }
                ],
            },
            "takes text only",
        ),
    ],
)
def test_bad_anthropic_requests_are_400_in_anthropics_shape(server, body, words):
    error = anthropic_error(server.http().post("/v1/messages", json=body), 400)
    assert words in error["message"], error


def test_malformed_json_is_400_in_each_shape(server):
    http = server.http()
    for raw in (b"{bad", b"", b"[1, 2]"):
        openai_error(http.post("/v1/chat/completions", content=raw, headers={"content-type": "application/json"}), 400)
        anthropic_error(http.post("/v1/messages", content=raw, headers={"content-type": "application/json"}), 400)
    assert "not valid JSON" in openai_error(http.post("/v1/completions", content=b"{bad"), 400)["message"]


def test_an_unknown_model_is_404_in_each_shape(server):
    with pytest.raises(openai.NotFoundError) as caught:
        server.openai().chat.completions.create(
            model="gpt-4o", messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )
    assert caught.value.body["code"] == "model_not_found" and "'gpt-4o' does not exist" in caught.value.body["message"]
    with pytest.raises(anthropic.NotFoundError) as caught:
        server.anthropic().messages.create(model="claude-x", max_tokens=2, messages=[{"role": "user", "content": "hi"}])
    assert caught.value.body["error"]["type"] == "not_found_error"
    assert (
        openai_error(server.http().post("/v1/completions", json={"model": "nope", "prompt": "x"}), 404)["param"]
        == "model"
    )
    assert server.http().get("/v1/models/nope").status_code == 404


def test_the_clients_raise_their_own_errors_on_a_400(server):
    with pytest.raises(openai.BadRequestError) as caught:
        chat(server, max_tokens=100000)
    assert caught.value.body["code"] == "context_length_exceeded"
    with pytest.raises(anthropic.BadRequestError):
        server.anthropic().messages.create(model=MODEL, max_tokens=5000, messages=[{"role": "user", "content": "hi"}])


def test_an_unknown_route_is_404_and_the_server_keeps_serving(server, reference):
    openai_error(server.http().get("/v1/nothing"), 404)
    assert anthropic_error(server.http().post("/v1/messages/nothing", json={}), 404, "not_found_error")
    assert server.http().get("/v1/chat/completions").status_code == 405
    assert chat(server).choices[0].message.content == reference["chat"].text


def test_a_generation_that_fails_is_a_500_and_the_server_keeps_serving(server, model, reference):
    def broken(*args, **kwargs):
        raise RuntimeError("the device went away")

    model.generate = broken
    try:
        response = server.http().post("/v1/chat/completions", json=CHAT)
        assert response.status_code == 500 and response.headers[QUEUE] == "0"
        assert (
            response.json()["error"]["type"] == "server_error"
            and "the device went away" in response.json()["error"]["message"]
        )
        response = server.http().post("/v1/messages", json=MESSAGES)
        assert response.status_code == 500 and response.json()["error"]["type"] == "api_error"
        lines = sse_lines(server, "/v1/messages", {**MESSAGES, "stream": True})
        assert "event: error" in lines and "the device went away" in lines[lines.index("event: error") + 1]
        lines = sse_lines(server, "/v1/chat/completions", {**CHAT, "stream": True})
        assert '"error"' in lines[-2] and lines[-1] == "data: [DONE]"
    finally:
        del model.generate
    assert chat(server).choices[0].message.content == reference["chat"].text


def test_a_completion_prompt_may_be_token_ids(server, reference):
    whole = server.openai().completions.create(model=MODEL, prompt=reference["raw_ids"], max_tokens=N, **GREEDY)
    assert whole.choices[0].text == reference["raw"].text
    error = openai_error(server.http().post("/v1/completions", json={"model": MODEL, "prompt": [1, 99999]}), 400)
    assert "outside the vocabulary" in error["message"]


@pytest.mark.parametrize(
    "path, body, param, words",
    [
        (
            "/v1/chat/completions",
            {**CHAT, "guided_json": {"type": "object"}},
            "guided_json",
            "unknown field 'guided_json'",
        ),
        ("/v1/chat/completions", {**CHAT, "modalities": ["text", "audio"]}, "modalities", "text only"),
        ("/v1/chat/completions", {**CHAT, "functions": [{"name": "f"}]}, "functions", "legacy functions API"),
        ("/v1/chat/completions", {**CHAT, "store": True}, "store", "keeps no completions"),
        (
            "/v1/chat/completions",
            {**CHAT, "stream_options": {"include_usage": True, "x": 1}},
            "stream_options",
            "include_usage",
        ),
        (
            "/v1/completions",
            {"model": MODEL, "prompt": "hi", "max_tokens": 2, "messages": []},
            "messages",
            "unknown field 'messages'",
        ),
    ],
)
def test_a_field_that_would_be_dropped_is_a_400_naming_it(server, path, body, param, words):
    error = openai_error(server.http().post(path, json=body), 400)
    assert error["param"] == param and words in error["message"], error


def test_informational_fields_are_accepted_as_they_do_not_change_the_reply(server):
    body = {
        **CHAT,
        "user": "u1",
        "metadata": {"k": "v"},
        "service_tier": "auto",
        "store": False,
        "modalities": ["text"],
        "safety_identifier": "s",
        "prompt_cache_key": "p",
        "stream_options": None,
    }
    assert server.http().post("/v1/chat/completions", json=body).status_code == 200
    anthropic = {**MESSAGES, "metadata": {"user_id": "u"}, "thinking": {"type": "disabled"}}
    assert server.http().post("/v1/messages", json=anthropic).status_code == 200
    for extra, words in (
        ({"mcp_servers": [{}]}, "MCP"),
        ({"top_n": 3}, "unknown field 'top_n'"),
        ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking is not supported"),
    ):
        error = anthropic_error(server.http().post("/v1/messages", json={**MESSAGES, **extra}), 400)
        assert words in error["message"], error
