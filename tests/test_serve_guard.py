"""rocketllm serve at its door: the API key (401 in each API's shape on every endpoint but /health, compared in
constant time, never logged), the queue limit (429 with retry-after, /health and /metrics answering meanwhile),
hostile requests (413, nesting, wrong types, absurd values, unsupported options, bad tool schemas, invalid UTF-8:
each a 4xx in the API's shape, the server serving on), a hypothesis fuzz of both APIs with no 5xx, and a storage
read error while a model streams from disk (a 500 in the API's shape, one log line, /health says so, the next
request is served and equals generate's)."""

from __future__ import annotations

import errno
import json
import os
import threading
import time

import anthropic
import httpx
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from serve_helpers import LiveServer, Script

from rocketllm_cli.auto import AutoModel
from rocketllm_cli.text.loop import GenerationRequest, Generator
from rocketllm_cli.text.promptids import encode_prompt
from rocketllm_cli.text.sampling import SamplingParams

MODEL = "tiny"
KEY = "rk-test-7f3a9c1e5b2d4a60"
QUESTION = "What is the capital of France?"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "temperature": 0}
MESSAGES = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "temperature": 0}
COMPLETION = {"model": MODEL, "prompt": "hi", "max_tokens": 2, "temperature": 0}
# per endpoint; the stress run (docs/RELIABILITY.md) takes 500
FUZZ_EXAMPLES = int(os.environ.get("ROCKETLLM_FUZZ_EXAMPLES", "25"))


@pytest.fixture(scope="module")
def model(resident_tiny_llama):
    return resident_tiny_llama


@pytest.fixture(scope="module")
def server(model):
    with LiveServer(model, MODEL) as live:
        yield live


@pytest.fixture
def script(model):
    s = Script(model)
    yield s
    s.remove()


def openai_error(response, status: int, kind: str = "invalid_request_error") -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == kind, error
    return error


def anthropic_error(response, status: int, kind: str = "invalid_request_error") -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"type", "error"} and body["type"] == "error" and body["error"]["type"] == kind, body
    return body["error"]


def still_serving(server) -> None:
    reply = server.http().post("/v1/chat/completions", json=CHAT)
    assert reply.status_code == 200 and reply.json()["choices"][0]["message"]["content"] is not None


# -- the API key ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def locked(tiny_factory):
    # a model has one worker
    keyed_model = AutoModel.from_pretrained(tiny_factory("llama", seed=21), device_cache_bytes="1GB")
    with LiveServer(keyed_model, MODEL, api_key=KEY) as live:
        yield live
    keyed_model.close()


def test_the_right_key_is_served_by_both_clients(locked):
    reply = locked.openai(api_key=KEY).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2
    )
    assert reply.choices[0].message.content is not None
    message = locked.anthropic(api_key=KEY).messages.create(
        model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "hi"}]
    )
    assert message.content[0].type == "text"
    # Authorization: Bearer works there too
    bearer = anthropic.Anthropic(base_url=locked.url, auth_token=KEY, max_retries=0)
    assert bearer.messages.create(model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "hi"}]).content
    assert [m.id for m in locked.openai(api_key=KEY).models.list().data] == [MODEL]


def test_a_wrong_or_missing_key_is_401_in_each_shape(locked):
    with pytest.raises(openai.AuthenticationError) as caught:
        locked.openai(api_key="wrong").chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )
    assert caught.value.body["code"] == "invalid_api_key" and "wrong API key" in caught.value.body["message"]
    with pytest.raises(anthropic.AuthenticationError) as caught:
        locked.anthropic(api_key="wrong").messages.create(
            model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "hi"}]
        )
    assert caught.value.body["error"]["type"] == "authentication_error"
    http = httpx.Client(base_url=locked.url, timeout=30)
    missing = http.post("/v1/chat/completions", json=CHAT)
    assert (
        "missing API key" in openai_error(missing, 401)["message"] and missing.headers["www-authenticate"] == "Bearer"
    )
    assert (
        "x-api-key" in anthropic_error(http.post("/v1/messages", json=MESSAGES), 401, "authentication_error")["message"]
    )
    for method, path in [
        ("GET", "/metrics"),
        ("GET", "/v1/models"),
        ("GET", f"/v1/models/{MODEL}"),
        ("POST", "/v1/completions"),
        ("POST", "/v1/messages/count_tokens"),
        ("GET", "/v1/nothing"),
        ("GET", "/"),
    ]:
        response = http.request(method, path, headers={"authorization": "Bearer " + KEY[:-1]})
        assert response.status_code == 401, (path, response.text)
        assert KEY not in response.text and KEY[:-1] not in response.text  # the key offered is never echoed
    anthropic_error(
        http.get("/v1/models", headers={"anthropic-version": "2023-06-01", "x-api-key": "nope"}),
        401,
        "authentication_error",
    )
    assert http.get("/health").json()["auth"] == "api key required"  # /health is open
    assert http.get("/metrics", headers={"x-api-key": KEY}).status_code == 200


def test_keys_are_compared_as_digests_in_constant_time(model):
    from rocketllm_cli.server.state import ServerState

    state = ServerState.__new__(ServerState)  # only the key check, no worker
    from rocketllm_cli.server import state as state_module

    state._key_digest = state_module._digest(KEY)
    assert (
        state.key_matches(KEY)
        and not state.key_matches(KEY + "x")
        and not state.key_matches("")
        and not state.key_matches(None)
    )
    assert not hasattr(state, "api_key")  # the key itself is not kept
    from pathlib import Path

    assert "hmac.compare_digest" in Path(state_module.__file__).read_text()


def test_binding_beyond_loopback_without_a_key_is_a_warning_in_health(model, server):
    from rocketllm_cli.server.state import ServerState

    open_state = ServerState(model, MODEL, host="0.0.0.0")
    keyed = ServerState(model, MODEL, host="0.0.0.0", api_key=KEY)
    try:
        assert open_state.health()["warnings"] == [
            (
                "listening on 0.0.0.0 without an API key: anyone who can reach this machine can use the model; pass "
                "--api-key or set ROCKETLLM_API_KEY"
            )
        ]
        assert keyed.health()["warnings"] == [] and server.state.health()["warnings"] == []
        assert KEY not in json.dumps(keyed.health()) and KEY not in "\n".join(keyed.startup_lines("http://x"))
    finally:
        open_state.worker.stop()
        keyed.worker.stop()


# -- the queue limit -----------------------------------------------------------------------------------
def wait_for(condition, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_a_full_queue_is_429_with_retry_after_and_health_answers_meanwhile(server, script):
    server.state.worker.max_queue = 2
    script.gate = threading.Event()
    results: list = []
    try:

        def ask(i: int) -> None:
            results.append(
                httpx.post(
                    f"{server.url}/v1/chat/completions",
                    json={**CHAT, "messages": [{"role": "user", "content": f"q{i}"}]},
                    timeout=60,
                )
            )

        threads = [threading.Thread(target=ask, args=(0,))]
        threads[0].start()
        wait_for(lambda: server.state.worker.busy)
        for i in (1, 2):
            threads.append(threading.Thread(target=ask, args=(i,)))
            threads[-1].start()
            wait_for(lambda i=i: server.state.worker.queue_length == i)
        http = server.http()
        full = http.post("/v1/chat/completions", json=CHAT)
        error = openai_error(full, 429, "rate_limit_error")
        assert (
            error["code"] == "queue_full"
            and "2 requests waiting" in error["message"]
            and int(full.headers["retry-after"]) >= 1
        )
        full = http.post("/v1/messages", json=MESSAGES)
        assert anthropic_error(full, 429, "rate_limit_error") and int(full.headers["retry-after"]) >= 1
        with pytest.raises(openai.RateLimitError):
            server.openai().chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2
            )
        for path in ("/health", "/metrics"):  # the worker is held: these never wait behind it
            start = time.monotonic()
            assert http.get(path).status_code == 200 and time.monotonic() - start < 0.5
        assert http.get("/health").json()["queue_length"] == 2
        assert "rocketllm_queue_full_total 3" in http.get("/metrics").text
    finally:
        script.gate.set()
        for t in threads:
            t.join(30)
        server.state.worker.max_queue = server.state.max_queue
    assert sorted(r.status_code for r in results) == [200, 200, 200]


def test_the_queue_limit_is_derived_and_said_at_start(server):
    from rocketllm_cli.server.state import derive_max_queue

    value, formula = derive_max_queue()
    assert 1 <= value <= 256 and formula.startswith("min(256, open-file limit ")
    lines = server.state.startup_lines()
    assert any(line.startswith(f"queue: at most {value} requests waiting (= {formula})") for line in lines)
    assert server.http().get("/health").json()["max_queue"] == value


# -- hostile requests ------------------------------------------------------------------------------------
DEEP = {"a": 1}
for _ in range(70):
    DEEP = {"a": DEEP}


@pytest.mark.parametrize(
    "name, body, words",
    [
        ("negative max_tokens", {"max_tokens": -1}, "'max_tokens' must be >= 1"),
        ("absurd max_tokens", {"max_tokens": 10**30}, "the context allows 2048"),
        ("float max_tokens", {"max_tokens": 1e308}, "must be an integer"),
        ("string max_tokens", {"max_tokens": "5"}, "must be an integer"),
        ("bool max_tokens", {"max_tokens": True}, "must be an integer"),
        ("wrong model type", {"model": 5}, "'model' must be a string"),
        ("wrong messages type", {"messages": "hi"}, "'messages' must be a non-empty list"),
        ("empty messages", {"messages": []}, "non-empty list"),
        ("message not an object", {"messages": ["hi"]}, "must be an object"),
        ("unknown role", {"messages": [{"role": "wizard", "content": "hi"}]}, "'messages[0].role' must be"),
        ("content a number", {"messages": [{"role": "user", "content": 5}]}, "must be a string or a list"),
        ("n 0", {"n": 0}, "'n' must be >= 1"),
        ("logprobs a string", {"logprobs": "yes"}, "'logprobs' must be true or false"),
        ("top_logprobs without logprobs", {"top_logprobs": 2}, "needs 'logprobs': true"),
        ("top_logprobs too many", {"logprobs": True, "top_logprobs": 21}, "'top_logprobs' must be <= 20"),
        ("logit_bias a list", {"logit_bias": [1]}, "must be an object mapping token ids"),
        ("logit_bias out of range", {"logit_bias": {"5": 101}}, "between -100 and 100"),
        (
            "response_format json_schema a number",
            {"response_format": {"type": "json_schema", "json_schema": {"schema": 5}}},
            "must be a JSON Schema object",
        ),
        ("response_format a string", {"response_format": "json"}, "'response_format' must be an object"),
        ("temperature NaN as a string", {"temperature": "NaN"}, "must be a number"),
        ("stop a number", {"stop": 5}, "'stop' must be a string or a list of strings"),
        ("stream a string", {"stream": "yes"}, "'stream' must be true or false"),
        ("tools not a list", {"tools": {"type": "function"}}, "'tools' must be a list"),
        (
            "tool schema type a number",
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 5}}}]},
            "JSON Schema",
        ),
        (
            "tool schema properties a list",
            {
                "tools": [
                    {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": []}}}
                ]
            },
            "JSON Schema",
        ),
        (
            "tool schema required a string",
            {
                "tools": [
                    {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "required": "x"}}}
                ]
            },
            "JSON Schema",
        ),
        (
            "tool schema a string",
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": "object"}}]},
            "JSON Schema",
        ),
        (
            "tool description a number",
            {"tools": [{"type": "function", "function": {"name": "f", "description": 5}}]},
            "must be a string",
        ),
        ("deep nesting", {"metadata": DEEP}, "nests deeper than 64"),
    ],
)
def test_hostile_openai_requests_are_4xx_in_openais_shape(server, name, body, words):
    error = openai_error(server.http().post("/v1/chat/completions", json={**CHAT, **body}), 400)
    assert words in error["message"], (name, error)


@pytest.mark.parametrize(
    "name, body, words",
    [
        ("negative max_tokens", {"max_tokens": -1}, "'max_tokens' must be >= 1"),
        ("absurd max_tokens", {"max_tokens": 10**30}, "the context allows 2048"),
        ("empty messages", {"messages": []}, "non-empty list"),
        ("unknown role", {"messages": [{"role": "tool", "content": "hi"}]}, "must be user or assistant"),
        ("system a number", {"system": 5}, "'system' must be a string"),
        ("stop_sequences a string", {"stop_sequences": 5}, "'stop_sequences' must be a string or a list of strings"),
        (
            "tool schema not JSON Schema",
            {"tools": [{"name": "f", "input_schema": {"type": "object", "properties": {"a": 5}}}]},
            "JSON Schema",
        ),
        ("tool schema missing", {"tools": [{"name": "f"}]}, "input_schema"),
        ("tool name a list", {"tools": [{"name": ["f"], "input_schema": {"type": "object"}}]}, "must be a string"),
        ("content block unknown", {"messages": [{"role": "user", "content": [{"type": "video"}]}]}, "is not supported"),
        ("deep nesting", {"metadata": DEEP}, "nests deeper than 64"),
    ],
)
def test_hostile_anthropic_requests_are_4xx_in_anthropics_shape(server, name, body, words):
    error = anthropic_error(server.http().post("/v1/messages", json={**MESSAGES, **body}), 400)
    assert words in error["message"], (name, error)


@pytest.mark.parametrize(
    "raw, words",
    [
        (
            b'{"model": "tiny", "messages": [{"role": "user", "content": "\xff\xfe"}], "max_tokens": 2}',
            "not valid UTF-8",
        ),
        (
            b'{"model": "tiny", "messages": [{"role": "user", "content": "\\ud800"}], "max_tokens": 2}',
            "lone UTF-16 surrogate",
        ),
        (
            b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "temperature": NaN}',
            "not valid JSON",
        ),
        (b'{"model": "tiny", "max_tokens": ' + b"9" * 5000 + b"}", "not valid JSON"),
        (b"[" * 100000 + b"]" * 100000, "nests deeper than 64"),
        (b'{"a": ' + b"[" * 100000 + b"]" * 100000 + b"}", "nests deeper than 64"),
    ],
)
def test_bytes_no_json_reader_should_take_are_400_in_each_shape(server, raw, words):
    http = server.http()
    for path, check in (
        ("/v1/chat/completions", openai_error),
        ("/v1/messages", anthropic_error),
        ("/v1/completions", openai_error),
    ):
        error = check(http.post(path, content=raw, headers={"content-type": "application/json"}), 400)
        assert words in error["message"], (path, error)
    still_serving(server)


def test_pythons_urllib_reads_the_413_of_a_large_body(server):
    """The body is drained before the answer: urllib sends all of it before reading, and saw "connection reset" when the
    server answered and closed first."""
    import urllib.error
    import urllib.request

    huge = json.dumps({**CHAT, "messages": [{"role": "user", "content": "x" * (4 * server.state.max_body)}]}).encode()
    request = urllib.request.Request(
        f"{server.url}/v1/chat/completions", data=huge, headers={"content-type": "application/json"}
    )
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(request, timeout=60)
    assert err.value.code == 413 and "at most" in json.loads(err.value.read())["error"]["message"]
    still_serving(server)


def test_a_body_over_the_limit_is_413_declared_or_streamed(server):
    http = server.http()
    limit = server.state.max_body
    huge = json.dumps({**CHAT, "messages": [{"role": "user", "content": "x" * (limit + 10)}]}).encode()
    assert "at most" in openai_error(http.post("/v1/chat/completions", content=huge), 413)["message"]
    anthropic_error(http.post("/v1/messages", content=huge), 413, "request_too_large")

    def chunks():  # no content-length: refused as the bytes arrive
        for i in range(0, len(huge), 65536):
            yield huge[i : i + 65536]

    openai_error(http.post("/v1/completions", content=chunks()), 413)
    # under the limit, over the context
    under = json.dumps({**CHAT, "messages": [{"role": "user", "content": "word " * 50000}]})
    assert (
        len(under) < limit
        and "the context" in openai_error(http.post("/v1/chat/completions", content=under), 400)["message"]
    )
    still_serving(server)


# -- fuzz: both APIs, no 5xx ------------------------------------------------------------------------------
JSON_LEAF = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-3, 40),
    st.sampled_from([-1, 0, 2**31, 2**63, 10**30]),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=20),
    st.sampled_from(["", "user", "assistant", "system", "tool", "function", "text", "auto", "none", "required", MODEL]),
)
JSON = st.recursive(
    JSON_LEAF,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)),
    max_leaves=12,
)

OPENAI_FIELDS = [
    "model",
    "messages",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "n",
    "stream",
    "stream_options",
    "stop",
    "tools",
    "tool_choice",
    "response_format",
    "logprobs",
    "top_logprobs",
    "logit_bias",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "user",
    "parallel_tool_calls",
]
COMPLETION_FIELDS = [
    "model",
    "prompt",
    "max_tokens",
    "temperature",
    "top_p",
    "stream",
    "stop",
    "echo",
    "suffix",
    "best_of",
    "n",
    "logprobs",
    "seed",
]
ANTHROPIC_FIELDS = [
    "model",
    "messages",
    "max_tokens",
    "system",
    "stop_sequences",
    "stream",
    "temperature",
    "top_p",
    "top_k",
    "tools",
    "tool_choice",
    "metadata",
    "thinking",
    "output_config",
    "output_format",
]
TOOL_OPENAI = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
TOOL_ANTHROPIC = {
    "name": "get_weather",
    "description": "Weather.",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
MESSAGE_FIELDS = ["role", "content", "tool_calls", "tool_call_id", "name"]


@st.composite
def mutated(draw, base: dict, fields: list[str], tool: dict):
    """A valid body with some fields replaced by any JSON value, removed, or nested fields of its message or tool
    changed."""
    body = json.loads(json.dumps(base))
    if draw(st.booleans()):
        body["tools"] = [json.loads(json.dumps(tool))]
    for name in draw(st.lists(st.sampled_from(fields), max_size=3, unique=True)):
        if draw(st.integers(0, 4)) == 0:
            body.pop(name, None)
        else:
            body[name] = draw(JSON)
    if (
        "messages" in body
        and isinstance(body["messages"], list)
        and body["messages"]
        and isinstance(body["messages"][0], dict)
        and draw(st.booleans())
    ):
        body["messages"][0][draw(st.sampled_from(MESSAGE_FIELDS))] = draw(JSON)
    if (
        body.get("tools")
        and isinstance(body["tools"], list)
        and isinstance(body["tools"][0], dict)
        and draw(st.booleans())
    ):
        target = body["tools"][0].get("function", body["tools"][0])
        if isinstance(target, dict):
            target[draw(st.sampled_from(["name", "description", "parameters", "input_schema", "type"]))] = draw(JSON)
    if draw(st.integers(0, 9)) == 0:
        body = draw(JSON)  # sometimes not an object at all
    return body


FUZZ_COUNTS: dict[str, dict] = {}


def _fuzz_one(server, path: str, body, check) -> None:
    counts = FUZZ_COUNTS.setdefault(path, {"examples": 0, "2xx": 0, "4xx": 0, "5xx": 0})
    counts["examples"] += 1
    if not hasattr(server, "fuzz_client"):
        server.fuzz_client = server.http()
    response = server.fuzz_client.post(path, content=json.dumps(body), headers={"content-type": "application/json"})
    status = response.status_code
    counts[f"{status // 100}xx"] = counts.get(f"{status // 100}xx", 0) + 1
    assert status < 500, (body, response.text)
    if status >= 400:
        check(response, status, response.json()["error"]["type"])
    elif response.headers["content-type"].startswith("text/event-stream"):
        assert '"error"' not in response.text and "event: error" not in response.text, (body, response.text[-400:])
    else:
        assert response.json()["model"] == MODEL


FUZZ = settings(
    max_examples=FUZZ_EXAMPLES,
    derandomize=True,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture, HealthCheck.data_too_large],
)


@FUZZ
@given(body=mutated(CHAT, OPENAI_FIELDS, TOOL_OPENAI))
def test_fuzzed_chat_completions_never_5xx(server, body):
    _fuzz_one(server, "/v1/chat/completions", body, openai_error)


@FUZZ
@given(body=mutated(COMPLETION, COMPLETION_FIELDS, TOOL_OPENAI))
def test_fuzzed_completions_never_5xx(server, body):
    body.pop("tools", None) if isinstance(body, dict) else None
    _fuzz_one(server, "/v1/completions", body, openai_error)


@FUZZ
@given(body=mutated(MESSAGES, ANTHROPIC_FIELDS, TOOL_ANTHROPIC))
def test_fuzzed_messages_never_5xx(server, body):
    _fuzz_one(server, "/v1/messages", body, anthropic_error)


def test_the_fuzz_ran_and_the_server_serves(server):
    still_serving(server)
    totals = {k: sum(c.get(k, 0) for c in FUZZ_COUNTS.values()) for k in ("examples", "2xx", "4xx", "5xx")}
    print(f"fuzz: {json.dumps(FUZZ_COUNTS)} totals {totals}")
    if FUZZ_COUNTS:  # when the fuzz tests ran in this session
        assert totals["5xx"] == 0 and totals["2xx"] > 0 and totals["4xx"] > 0


def test_a_bug_is_a_500_in_the_apis_shape_and_one_log_line(server, monkeypatch):
    from rocketllm_cli.server import anthropic_requests, openai_requests

    def broken(body, state):
        raise RuntimeError(f"a bug that quotes {body['messages'][0]['content']}")

    monkeypatch.setattr(openai_requests, "prepare_chat", broken)
    monkeypatch.setattr(anthropic_requests, "prepare_messages", broken)
    before = len(server.logs)
    secret = "the prompt nobody may log"
    body = {**CHAT, "messages": [{"role": "user", "content": secret}]}
    assert (
        openai_error(server.http().post("/v1/chat/completions", json=body), 500, "server_error")["message"]
        == "internal error (RuntimeError)"
    )
    anthropic_error(server.http().post("/v1/messages", json=body), 500, "api_error")
    logged = server.logs[before:]
    assert logged == [
        "error: POST /v1/chat/completions: internal error (RuntimeError); the server goes on serving",
        "error: POST /v1/messages: internal error (RuntimeError); the server goes on serving",
    ]
    monkeypatch.undo()
    still_serving(server)


# -- a storage read error while the model streams -------------------------------------------------------
@pytest.fixture(scope="module")
def streamed_model(tiny_factory):
    """The tiny model with every layer in the storage tier: each token reads the shard files."""
    m = AutoModel.from_pretrained(tiny_factory("llama", seed=21), device_cache_bytes=0, host_cache_bytes=0)
    assert "[SSSS]" in m.plan.describe(m.manifest)
    yield m
    m.close()


class ReadFault:
    """os.preadv as the store calls it, failing with EIO from the `after`-th call on while armed."""

    def __init__(self, monkeypatch) -> None:
        from rocketllm_cli.stream import store

        self.real, self.armed, self.after, self.calls = os.preadv, False, 0, 0
        monkeypatch.setattr(store.os, "preadv", self)

    def arm(self, after: int = 0) -> None:
        self.calls, self.after, self.armed = 0, after, True

    def __call__(self, fd, buffers, offset, *rest):
        if self.armed:
            self.calls += 1
            if self.calls > self.after:
                raise OSError(errno.EIO, os.strerror(errno.EIO))
        return self.real(fd, buffers, offset, *rest)


def test_a_storage_read_error_is_a_500_one_log_line_and_health_says_so(streamed_model, server, monkeypatch):
    ids = encode_prompt(streamed_model.tokenizer, QUESTION, chat=True)[0].tolist()
    expected = Generator(streamed_model).run(GenerationRequest(ids, SamplingParams(max_new_tokens=6))).text
    fault = ReadFault(monkeypatch)
    body = {**CHAT, "messages": [{"role": "user", "content": QUESTION}], "max_tokens": 6}
    try:
        with LiveServer(streamed_model, MODEL) as live:
            http = live.http()
            fault.arm()
            failed = http.post("/v1/chat/completions", json=body)
            error = openai_error(failed, 500, "server_error")
            assert "cannot read shard file" in error["message"] and "Input/output error" in error["message"]
            anthropic_error(http.post("/v1/messages", json={**MESSAGES, "max_tokens": 6}), 500, "api_error")
            errors = [line for line in live.logs if line.startswith("error:")]
            assert len(errors) == 2 and all("\n" not in line and "cannot read shard file" in line for line in errors)
            assert QUESTION not in "\n".join(live.logs)
            health = http.get("/health").json()
            assert health["status"] == "degraded" and "Input/output error" in health["error"]
            fault.arm(after=8)  # mid-stream: the first tokens go out, then the disk fails
            with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as stream:
                lines = [line for line in stream.iter_lines() if line]
            assert '"error"' in lines[-2] and "Input/output error" in lines[-2] and lines[-1] == "data: [DONE]"
            fault.armed = False  # the fault clears: the next request is served, and right
            reply = http.post("/v1/chat/completions", json=body)
            assert reply.status_code == 200 and reply.json()["choices"][0]["message"]["content"] == expected
            health = http.get("/health").json()
            assert (
                health["status"] == "ok"
                and health["error"] is None
                and "Input/output error" in health["last_error"]["message"]
            )
            print(
                "fault run:", json.dumps({"500": failed.json(), "log": errors[0], "health_after": health["last_error"]})
            )
    finally:
        fault.armed = False
    still_serving(server)


def test_the_listening_socket_says_tcp_so_replies_are_not_held_by_nagle(server):
    """asyncio sets TCP_NODELAY on accepted connections only when the listening socket's proto is IPPROTO_TCP; with
    proto 0 every reply written as headers then body waited ~40 ms for the client's delayed ACK."""
    import socket

    from rocketllm_cli.server.sockets import bind

    sock = bind("127.0.0.1", 0)
    try:
        assert sock.proto == socket.IPPROTO_TCP
    finally:
        sock.close()
    with socket.create_connection(("127.0.0.1", server.port)) as client:
        times = []
        for _ in range(10):
            start = time.perf_counter()
            client.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
            data = b""
            while not data.rstrip().endswith(b"}"):
                data += client.recv(65536)
            times.append(time.perf_counter() - start)
    assert sorted(times)[5] < 0.035, times  # the delayed ACK alone was 40 ms
