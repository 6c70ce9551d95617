"""Structured output through the server, as clients ask for it: response_format json_object and json_schema, forced
tool calls (OpenAI tool_choice required or named, Anthropic any or tool), Anthropic output_config.format, and auto tool
calls whose arguments are constrained once the model opens one.

On a tiny random model the replies are noise the mask shapes, so every reply that ends is valid whatever the model
prefers: forced calls in each family's format (hermes, llama3_json, mistral), through the openai and anthropic clients,
streamed and not; parallel calls only when allowed. Each family's auto grammar accepts the corpus's calls and refuses
a malformed one. Fields that cannot take effect are 400s naming them. The real SmolLM2 then answers the openai SDK's
`.parse()` and the anthropic SDK with a parsed object and forced calls."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
from serve_helpers import LiveServer, with_template

from rocketllm_cli.auto import AutoModel
from rocketllm_cli.server.openai_requests import prepare_chat
from rocketllm_cli.server.structured import for_tools, lark_literal
from rocketllm_cli.server.tools import FAMILIES, parser_for
from rocketllm_cli.synthetic.tokenizer import build_tokenizer
from rocketllm_cli.text.grammar import Grammars

CORPUS = Path(__file__).parent / "fixtures" / "tool_calls"
MODEL = "tiny"
BUDGET = 1000  # tokens: a noise model needs room to close what it opens (prompts here are under 1,048)
CITY = {"type": "string", "maxLength": 8}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": CITY, "unit": {"enum": ["celsius", "fahrenheit"]}},
                "required": ["city", "unit"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "Current time in a timezone",
            "parameters": {
                "type": "object",
                "properties": {"timezone": {"type": "string", "maxLength": 6}},
                "required": ["timezone"],
            },
        },
    },
]
ANTHROPIC_TOOLS = [
    {
        "name": t["function"]["name"],
        "description": t["function"]["description"],
        "input_schema": t["function"]["parameters"],
    }
    for t in TOOLS
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["name", "age"],
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def valid_call(name: str, arguments: dict | str) -> None:
    jsonschema.validate(json.loads(arguments) if isinstance(arguments, str) else arguments, SCHEMAS[name])


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family_server(request, tiny_checkpoint, tmp_path_factory):
    family = request.param
    where = tmp_path_factory.mktemp(f"structured-{family}")
    path = with_template(tiny_checkpoint, (CORPUS / family / "template.jinja").read_text(), where / "model")
    model = AutoModel.from_pretrained(path, out=where / "shards", device_cache_bytes="1GB")
    with LiveServer(model, MODEL) as server:
        assert server.state.family == family
        yield family, server
    model.close()


@pytest.fixture(scope="module")
def server(tiny_factory):
    model = AutoModel.from_pretrained(tiny_factory("llama", seed=73), device_cache_bytes="1GB")
    with LiveServer(model, MODEL) as live:
        yield live
    model.close()


# -- forced calls on a noise model, each family -------------------------------------------------------
@pytest.mark.parametrize("choice", ["named", "required"])
def test_a_forced_openai_tool_choice_is_a_valid_call_in_the_familys_format(family_server, choice):
    family, server = family_server
    client = server.openai()
    tool_choice = {"type": "function", "function": {"name": "get_time"}} if choice == "named" else "required"
    for stream in (False, True):
        ask = dict(
            model=MODEL,
            messages=ASK,
            tools=TOOLS,
            tool_choice=tool_choice,
            max_tokens=BUDGET,
            temperature=0,
            parallel_tool_calls=False,
        )
        if stream:
            calls, finish = {}, None
            for chunk in client.chat.completions.create(**ask, stream=True):
                for delta in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
                    entry = calls.setdefault(delta.index, {"name": "", "arguments": ""})
                    entry["name"] += delta.function.name or ""
                    entry["arguments"] += delta.function.arguments or ""
                finish = (chunk.choices[0].finish_reason if chunk.choices else None) or finish
            got = [(c["name"], c["arguments"]) for _, c in sorted(calls.items())]
        else:
            reply = client.chat.completions.create(**ask).choices[0]
            finish = reply.finish_reason
            got = [(c.function.name, c.function.arguments) for c in reply.message.tool_calls or []]
        assert finish == "tool_calls" and len(got) == 1, (family, stream, got)
        name, arguments = got[0]
        assert name == "get_time" or (choice == "required" and name in SCHEMAS)
        valid_call(name, arguments)


@pytest.mark.parametrize(
    "choice", [{"type": "tool", "name": "get_weather"}, {"type": "any", "disable_parallel_tool_use": True}]
)
def test_a_forced_anthropic_tool_choice_is_one_tool_use_block(family_server, choice):
    family, server = family_server
    client = server.anthropic()
    reply = client.messages.create(
        model=MODEL, max_tokens=BUDGET, messages=ASK, tools=ANTHROPIC_TOOLS, tool_choice=choice
    )
    uses = [b for b in reply.content if b.type == "tool_use"]
    assert reply.stop_reason == "tool_use" and len(uses) == 1, reply.content
    assert choice["type"] == "any" or uses[0].name == "get_weather"
    valid_call(uses[0].name, uses[0].input)
    with client.messages.stream(
        model=MODEL, max_tokens=BUDGET, messages=ASK, tools=ANTHROPIC_TOOLS, tool_choice=choice
    ) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use" and [b.type for b in final.content] == ["tool_use"]
    valid_call(final.content[0].name, final.content[0].input)


def test_a_named_call_generates_only_its_arguments(server):
    """The server writes the call's opening into the prompt itself: the model's tokens are the arguments alone, and the
    server closes the call."""
    body = {
        "model": MODEL,
        "messages": ASK,
        "tools": TOOLS,
        "max_tokens": BUDGET,
        "temperature": 0,
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
    }
    prepared = prepare_chat(body, server.state)
    prefill = server.state.builder.prefill_ids(prepared.structure.prefill)
    assert (
        prepared.structure.prefill == '<tool_call>\n{"name": "get_weather", "arguments": '
        and prepared.request.prompt_ids[-len(prefill) :] == prefill
    )
    outcome = server.state.generator.run(prepared.request)
    valid_call("get_weather", outcome.text)  # what the model generated is the arguments object and nothing else
    content, calls = server.state.builder.parser.parse(prepared.reply_text(outcome))
    assert (
        content == "" and [c.name for c in calls] == ["get_weather"] and calls[0].arguments == json.loads(outcome.text)
    )


def test_parallel_calls_only_when_allowed(server):
    client = server.openai()
    ask = dict(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=BUDGET, temperature=0)
    one = client.chat.completions.create(**ask, parallel_tool_calls=False).choices[0].message.tool_calls
    assert len(one) == 1
    grammar = server.state.generator.grammars
    structure = for_tools(server.state.builder.parser, TOOLS, "required", True, server.state.lark_literal)
    matcher = grammar.matcher(structure.constraint)
    two = (
        '{"name": "get_time", "arguments": {"timezone": "CET"}}\n</tool_call>\n<tool_call>\n{"name": "get_weather", '
        '"arguments": {"city": "Oslo", "unit": "celsius"}}'
    )
    ids = server.state.builder.tokenizer(two, add_special_tokens=False).input_ids
    assert matcher.validate_tokens(ids) == len(ids)  # with parallel calls allowed, the grammar takes a second call
    single = grammar.matcher(
        for_tools(server.state.builder.parser, TOOLS, "required", False, server.state.lark_literal).constraint
    )
    assert single.validate_tokens(ids) < len(ids)


# -- response_format and output_config on a noise model ----------------------------------------------
def test_response_format_json_schema_and_json_object(server):
    client = server.openai()
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    reply = client.chat.completions.create(
        model=MODEL, messages=ASK, response_format=fmt, max_tokens=BUDGET, temperature=0
    )
    jsonschema.validate(json.loads(reply.choices[0].message.content), PERSON)
    pieces = [
        c.choices[0].delta.content or ""
        for c in client.chat.completions.create(
            model=MODEL, messages=ASK, response_format=fmt, max_tokens=BUDGET, temperature=0.9, seed=4, stream=True
        )
        if c.choices
    ]
    jsonschema.validate(json.loads("".join(pieces)), PERSON)
    obj = client.chat.completions.create(
        model=MODEL, messages=ASK, response_format={"type": "json_object"}, max_tokens=BUDGET, temperature=0, seed=1
    )
    if obj.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(obj.choices[0].message.content), dict)
    else:  # a noise model may not close a free-form object in the budget: what it wrote is still an object's beginning
        assert obj.choices[0].message.content.lstrip().startswith("{")


def test_anthropic_output_config_format(server):
    body = {
        "model": MODEL,
        "max_tokens": BUDGET,
        "messages": ASK,
        "output_config": {"format": {"type": "json_schema", "schema": PERSON}},
    }
    reply = server.http().post("/v1/messages", json=body).json()
    jsonschema.validate(json.loads(reply["content"][0]["text"]), PERSON)
    legacy = (
        server.http()
        .post(
            "/v1/messages",
            json={
                **{k: v for k, v in body.items() if k != "output_config"},
                "output_format": {"type": "json_schema", "schema": PERSON},
            },
        )
        .json()
    )
    jsonschema.validate(json.loads(legacy["content"][0]["text"]), PERSON)


def test_a_schema_is_compiled_once_across_requests(server):
    grammars = server.state.generator.grammars
    fmt = {"type": "json_schema", "json_schema": {"name": "p", "schema": {**PERSON, "title": "once"}}}
    before = grammars.compiles
    for _ in range(3):
        server.openai().chat.completions.create(
            model=MODEL, messages=ASK, response_format=fmt, max_tokens=BUDGET, temperature=0
        )
    assert grammars.compiles == before + 1


@pytest.mark.parametrize(
    "path, body, param, words",
    [
        (
            "/v1/chat/completions",
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/nowhere"}}}},
            "response_format",
            "JSON Schema",
        ),
        (
            "/v1/chat/completions",
            {"response_format": {"type": "xml"}},
            "response_format",
            "must be text, json_object or json_schema",
        ),
        (
            "/v1/chat/completions",
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}}},
            "response_format",
            "must be a JSON Schema object",
        ),
        (
            "/v1/chat/completions",
            {"response_format": {"type": "json_object"}, "tools": TOOLS, "tool_choice": "required"},
            "response_format",
            "forces a tool call",
        ),
        ("/v1/chat/completions", {"parallel_tool_calls": "no"}, "parallel_tool_calls", "must be true or false"),
        (
            "/v1/messages",
            {"output_config": {"format": {"type": "json_schema", "schema": PERSON}, "effort": "high"}},
            "output_config",
            "'output_config.effort' is not supported",
        ),
        ("/v1/messages", {"output_config": {"format": {"type": "text"}}}, "output_config.format", "json_schema"),
        (
            "/v1/messages",
            {
                "tools": ANTHROPIC_TOOLS,
                "tool_choice": {"type": "any"},
                "messages": ASK + [{"role": "assistant", "content": "Let me"}],
            },
            "messages",
            "assistant prefill",
        ),
        (
            "/v1/messages",
            {"tools": ANTHROPIC_TOOLS, "tool_choice": {"type": "any", "disable_parallel_tool_use": 1}},
            "tool_choice",
            "must be true or false",
        ),
    ],
)
def test_what_cannot_take_effect_is_a_400_naming_the_field(server, path, body, param, words):
    base = {"model": MODEL, "messages": ASK, "max_tokens": 4}
    response = server.http().post(path, json={**base, **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert words in error["message"], error
    if path.startswith("/v1/chat"):
        assert error["param"] == param


# -- each family's auto grammar -------------------------------------------------------------------------
CORPUS_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "unit": {"type": "string"}},
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "parameters": {"type": "object", "properties": {"timezone": {"type": "string"}}},
        },
    },
]


# The corpus's replies a constrained reply may be, and those it may not: malformed or cut-off calls, and the variants
# the parsers salvage (arguments as a JSON string, the other family's argument key, text after a bare JSON call).
WRITTEN = {
    "hermes": {"no_call", "single", "parallel", "text_then_call"},
    "llama3_json": {"no_call", "single", "two_calls", "python_tag"},
    "mistral": {"no_call", "single", "two_calls"},
}
REFUSED = {
    "hermes": {"malformed", "unclosed", "arguments_as_text", "list_in_block"},
    "llama3_json": {"arguments_key", "call_then_text", "json_that_is_not_a_call"},
    "mistral": set(),
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("special_marker", [False, True])
def test_each_familys_auto_grammar_takes_its_calls_and_text_and_refuses_malformed_ones(family, special_marker):
    """special_marker: the tokenizer holds the family's marker as a special token (Mistral's [TOOL_CALLS], Llama's
    <|python_tag|>, Qwen's <tool_call>), which the grammar must name as that token, inside the separators too."""
    parser = parser_for(family)
    tokenizer = build_tokenizer(added=(parser.MARKER,) if special_marker else ())
    grammars = Grammars(tokenizer, [tokenizer.eos_token_id])
    structure = for_tools(parser, CORPUS_TOOLS, "auto", True, lark_literal(tokenizer))
    assert ("<[" in structure.constraint.source) == special_marker

    def accepted(name: str) -> bool:
        ids = tokenizer((CORPUS / family / f"{name}.txt").read_text(), add_special_tokens=False).input_ids + [
            tokenizer.eos_token_id
        ]
        return grammars.matcher(structure.constraint).validate_tokens(ids) == len(ids)

    assert all(accepted(name) for name in WRITTEN[family]), {name: accepted(name) for name in WRITTEN[family]}
    assert not any(accepted(name) for name in REFUSED[family]), {name: accepted(name) for name in REFUSED[family]}


# -- the real model ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def smol_server(smollm2_gguf):
    model = AutoModel.from_pretrained(smollm2_gguf)
    with LiveServer(model, "smol") as live:
        yield live
    model.close()


@pytest.mark.realmodel
def test_the_openai_sdk_parse_returns_a_parsed_object(smol_server):
    from pydantic import BaseModel

    class City(BaseModel):
        name: str
        country: str
        population: int

    reply = smol_server.openai().chat.completions.parse(
        model="smol",
        response_format=City,
        temperature=0,
        max_tokens=80,
        messages=[
            {"role": "user", "content": "What is the capital of France? Answer with its name, country and population."}
        ],
    )
    parsed = reply.choices[0].message.parsed
    assert isinstance(parsed, City) and parsed.name == "Paris" and parsed.country.lower() == "france"


@pytest.mark.realmodel
def test_the_real_model_makes_forced_calls_through_both_sdks(smol_server):
    weather = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "Get the weather in a city",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
            },
        }
    ]
    ask = [{"role": "user", "content": "What's the weather in Paris?"}]
    reply = (
        smol_server.openai()
        .chat.completions.create(
            model="smol", messages=ask, tools=weather, tool_choice="required", temperature=0, max_tokens=60
        )
        .choices[0]
    )
    assert reply.finish_reason == "tool_calls" and reply.message.tool_calls[0].function.name == "get_weather"
    assert json.loads(reply.message.tool_calls[0].function.arguments) == {"city": "Paris"}
    anthropic_tools = [
        {
            "name": "get_weather",
            "description": "Get the weather in a city",
            "input_schema": weather[0]["function"]["parameters"],
        }
    ]
    message = smol_server.anthropic().messages.create(
        model="smol",
        max_tokens=60,
        messages=ask,
        tools=anthropic_tools,
        tool_choice={"type": "tool", "name": "get_weather"},
        # greedy (this SDK has no temperature argument)
        extra_body={"temperature": 0},
    )
    assert message.stop_reason == "tool_use" and message.content[-1].input == {"city": "Paris"}


def test_a_keyword_the_engine_lacks_is_a_400_when_strict_and_named_in_a_header_when_not(server):
    """uniqueItems (like not, dependencies, an unknown format) is not implemented by the engine: a strict request is
    refused
    naming it; a request that did not ask for strictness gets the rest of the schema enforced and is told what was
    not."""
    schema = {
        "type": "object",
        "properties": {"tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2, "uniqueItems": True}},
        "required": ["tags"],
    }
    body = {"model": MODEL, "messages": ASK, "max_tokens": BUDGET, "temperature": 0}
    strict = server.http().post(
        "/v1/chat/completions",
        json={
            **body,
            "response_format": {"type": "json_schema", "json_schema": {"name": "t", "schema": schema, "strict": True}},
        },
    )
    assert strict.status_code == 400 and "uniqueItems" in strict.json()["error"]["message"]
    loose = server.http().post(
        "/v1/chat/completions",
        json={**body, "response_format": {"type": "json_schema", "json_schema": {"name": "t", "schema": schema}}},
    )
    assert loose.status_code == 200 and "uniqueItems" in loose.headers["x-rocketllm-schema-relaxed"]
    value = json.loads(loose.json()["choices"][0]["message"]["content"])
    jsonschema.validate(
        value, {**schema, "properties": {"tags": {**schema["properties"]["tags"], "uniqueItems": False}}}
    )  # the rest held
    anthropic = server.http().post(
        "/v1/messages", json={**body, "output_config": {"format": {"type": "json_schema", "schema": schema}}}
    )
    assert anthropic.status_code == 400 and "uniqueItems" in anthropic.json()["error"]["message"]
    tool = {"type": "function", "function": {"name": "tag", "parameters": schema}}
    forced = {**body, "tools": [tool], "tool_choice": "required"}
    assert server.http().post("/v1/chat/completions", json=forced).headers.get("x-rocketllm-schema-relaxed")
    strict_tool = {**forced, "tools": [{"type": "function", "function": {**tool["function"], "strict": True}}]}
    assert server.http().post("/v1/chat/completions", json=strict_tool).status_code == 400
