"""Tool calling: every sample of the corpus (tests/fixtures/tool_calls/<family>/) parses to what it should, whole
or streamed in pieces; each family is detected from its chat template; and a call makes the round trip through
a live server with each family's template (OpenAI and Anthropic clients, streamed and not). Only requests that
offered tools are parsed; tool_choice none withholds them, required and named ones instruct the model and open the
call."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from serve_helpers import LiveServer, Script, with_template

from rocketllm_cli.auto import AutoModel
from rocketllm_cli.server.tools import (
    FAMILIES,
    StreamSplitter,
    choose,
    detect,
    parser_for,
)
from rocketllm_cli.synthetic.tokenizer import CHAT_TEMPLATE

CORPUS = Path(__file__).parent / "fixtures" / "tool_calls"
FAMILY_DIRS = sorted(p.name for p in CORPUS.iterdir() if p.is_dir())
SAMPLES = sorted((p.parent.name, p.stem) for p in CORPUS.glob("*/*.txt"))
MODEL = "tiny"
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city",
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
            "description": "Current time in a timezone",
            "parameters": {"type": "object", "properties": {"timezone": {"type": "string"}}},
        },
    },
]
ANSWER = "It is 18 degrees and sunny in Paris."
RESULT = '{"temperature": 18, "sky": "sunny"}'


def sample(family: str, name: str) -> tuple[str, dict]:
    return (CORPUS / family / f"{name}.txt").read_text(), json.loads((CORPUS / family / f"{name}.json").read_text())


def calls_of(calls) -> list[dict]:
    return [{"name": c.name, "arguments": c.arguments} for c in calls]


# -- the corpus ------------------------------------------------------------------------------------------
def test_every_family_has_a_folder_a_template_and_a_replayable_call():
    assert FAMILY_DIRS == sorted(FAMILIES)
    for family in FAMILY_DIRS:
        assert (CORPUS / family / "template.jinja").is_file()
        assert sample(family, "single")[1]["tool_calls"][0]["name"] == "get_weather"


@pytest.mark.parametrize("family, name", SAMPLES, ids=[f"{f}/{n}" for f, n in SAMPLES])
def test_sample_parses(family, name):
    text, expected = sample(family, name)
    content, calls = parser_for(family).parse(text)
    assert calls_of(calls) == expected["tool_calls"]
    assert content == expected["content"]
    assert len({c.id for c in calls}) == len(calls)


@pytest.mark.parametrize("family, name", SAMPLES, ids=[f"{f}/{n}" for f, n in SAMPLES])
def test_sample_streamed_in_pieces_gives_the_same_content_and_calls(family, name):
    text, expected = sample(family, name)
    rng = random.Random(name)
    for sizes in ([1], [3], [rng.randint(1, 9) for _ in range(len(text))]):
        splitter = StreamSplitter(parser_for(family))
        sent, i, k = "", 0, 0
        while i < len(text):
            size = sizes[k % len(sizes)]
            sent += splitter.feed(text[i : i + size])
            i, k = i + size, k + 1
        rest, calls = splitter.finish()
        assert calls_of(calls) == expected["tool_calls"]
        if calls:
            assert (sent + rest).strip() == expected["content"]
            assert "{" not in sent  # no piece of a call was sent as content
        else:
            assert sent + rest == text


@pytest.mark.parametrize("family", FAMILY_DIRS)
def test_family_is_detected_from_the_chat_template(family):
    assert detect((CORPUS / family / "template.jinja").read_text())[0] == family


def test_a_template_without_tools_gets_the_default_and_an_override_wins():
    class Tok:
        chat_template = CHAT_TEMPLATE

    assert detect(CHAT_TEMPLATE) == (None, "the chat template names no tool-call format")
    assert choose(Tok()) == ("hermes", "the chat template names no tool-call format; hermes by default")
    assert choose(Tok(), "mistral") == ("mistral", "--tool-parser")
    Tok.chat_template = {"default": CHAT_TEMPLATE, "tool_use": (CORPUS / "llama3_json" / "template.jinja").read_text()}
    assert choose(Tok())[0] == "llama3_json"  # named templates are read too


# -- round trips through a live server -------------------------------------------------------------------
@pytest.fixture(scope="module", params=FAMILY_DIRS)
def family_server(request, tiny_checkpoint, tmp_path_factory):
    family = request.param
    where = tmp_path_factory.mktemp(family)
    path = with_template(tiny_checkpoint, (CORPUS / family / "template.jinja").read_text(), where / "model")
    # Shards of their own: the cache keys shards on the weights, and these copies differ only in their tokenizer.
    model = AutoModel.from_pretrained(path, out=where / "shards", device_cache_bytes="1GB")
    with LiveServer(model, MODEL) as server:
        yield family, server, Script(model)
    model.close()


def test_a_tool_call_makes_the_round_trip_with_the_openai_client(family_server):
    family, server, script = family_server
    text, expected = sample(family, "single")
    assert server.state.family == family and server.state.builder.native_tools
    client = server.openai()
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    script.say(text, ANSWER)
    first = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, max_tokens=300, temperature=0)
    # rendered by the template
    assert "get_weather" in script.prompt_text() and "Current time in a timezone" in script.prompt_text()
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    call = choice.message.tool_calls[0]
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    assert json.loads(call.function.arguments) == expected["tool_calls"][0]["arguments"]
    messages += [
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": RESULT},
    ]
    second = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, max_tokens=300, temperature=0)
    assert second.choices[0].message.content == ANSWER and second.choices[0].finish_reason == "stop"
    prompt = script.prompt_text()
    assert RESULT in prompt or json.dumps({"content": RESULT}) in prompt  # the result, as the template writes it
    assert prompt.count("get_weather") >= 1 and '"Paris"' in prompt  # the earlier call, rendered back


def test_a_streamed_tool_call_arrives_whole_with_finish_reason_tool_calls(family_server):
    family, server, script = family_server
    text, expected = sample(family, "single")
    script.say(text)
    chunks = list(
        server.openai().chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Weather in Paris?"}],
            tools=TOOLS,
            max_tokens=300,
            temperature=0,
            stream=True,
        )
    )
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(d.content or "" for d in deltas) == ""
    calls = [tc for d in deltas for tc in (d.tool_calls or [])]
    assert len(calls) == 1 and calls[0].index == 0 and calls[0].function.name == "get_weather"
    assert json.loads(calls[0].function.arguments) == expected["tool_calls"][0]["arguments"]
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["tool_calls"]


def test_a_tool_call_makes_the_round_trip_with_the_anthropic_client(family_server):
    family, server, script = family_server
    text, expected = sample(family, "single")
    client = server.anthropic()
    tools = [
        {
            "name": t["function"]["name"],
            "description": t["function"]["description"],
            "input_schema": t["function"]["parameters"],
        }
        for t in TOOLS
    ]
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    script.say(text, ANSWER)
    first = client.messages.create(model=MODEL, max_tokens=300, messages=messages, tools=tools)
    assert first.stop_reason == "tool_use"
    use = [b for b in first.content if b.type == "tool_use"]
    assert len(use) == 1 and use[0].name == "get_weather" and use[0].id.startswith("toolu_")
    assert use[0].input == expected["tool_calls"][0]["arguments"]
    messages += [
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use[0].id, "content": RESULT}]},
    ]
    with client.messages.stream(model=MODEL, max_tokens=300, messages=messages, tools=tools) as stream:
        final = stream.get_final_message()
    assert final.content[0].text == ANSWER and final.stop_reason == "end_turn"
    assert RESULT in script.prompt_text() or json.dumps({"content": RESULT}) in script.prompt_text()


def test_a_streamed_anthropic_tool_use_sends_input_json_delta(family_server):
    family, server, script = family_server
    text, expected = sample(family, "single")
    script.say(text)
    tools = [{"name": "get_weather", "input_schema": TOOLS[0]["function"]["parameters"]}]
    with server.anthropic().messages.stream(
        model=MODEL, max_tokens=300, tools=tools, messages=[{"role": "user", "content": "Weather in Paris?"}]
    ) as stream:
        events = list(stream)
        final = stream.get_final_message()
    kinds = [e.type for e in events]
    assert "input_json" in kinds or any(
        getattr(getattr(e, "delta", None), "type", "") == "input_json_delta" for e in events
    )
    assert [b.type for b in final.content] == ["tool_use"] and final.content[0].input == expected["tool_calls"][0][
        "arguments"
    ]
    assert final.stop_reason == "tool_use"


# -- a template that knows no tools, and tool_choice -----------------------------------------------------
@pytest.fixture(scope="module")
def plain_server(tiny_factory):
    model = AutoModel.from_pretrained(tiny_factory("llama", seed=21), device_cache_bytes="1GB")
    with LiveServer(model, MODEL) as server:
        yield server, Script(model)
    model.close()


def test_a_template_without_tools_gets_them_in_a_system_message(plain_server):
    server, script = plain_server
    assert server.state.family == "hermes" and not server.state.builder.native_tools
    text, _ = sample("hermes", "single")
    client = server.openai()
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"}]
    script.say(text, ANSWER)
    first = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, max_tokens=300, temperature=0)
    prompt = script.prompt_text()
    assert (
        prompt.startswith("<|im_start|>system\nBe brief.\n\nYou can call functions")
        and "<tools>" in prompt
        and "get_time" in prompt
    )
    call = first.choices[0].message.tool_calls[0]
    messages += [
        first.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": RESULT},
    ]
    second = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, max_tokens=300, temperature=0)
    assert second.choices[0].message.content == ANSWER
    prompt = script.prompt_text()
    assert '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather"' in prompt
    assert f"<|im_start|>user\n<tool_response>\n{RESULT}\n</tool_response>" in prompt


def test_only_requests_that_offered_tools_are_parsed(plain_server):
    server, script = plain_server
    text, _ = sample("hermes", "single")
    script.say(text, text)
    client = server.openai()
    plain = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=300, temperature=0
    )
    assert plain.choices[0].message.content == text and plain.choices[0].finish_reason == "stop"
    withheld = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=300,
        temperature=0,
        tools=TOOLS,
        tool_choice="none",
    )
    assert withheld.choices[0].message.content == text and not withheld.choices[0].message.tool_calls
    assert "<tools>" not in script.prompt_text()  # tool_choice none: the tools are not shown either


def test_required_and_named_tool_choice_instruct_the_model_and_open_the_call(plain_server):
    """Constrained decoding enforces them (tests/test_structured_output.py); the prompt still asks, and ends with the
    call's opening that the server wrote itself."""
    server, script = plain_server
    client = server.openai()
    ask = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 2,
        "temperature": 0,
        "tools": TOOLS,
    }
    required = client.chat.completions.with_raw_response.create(**ask, tool_choice="required")
    assert "x-rocketllm-tool-choice" not in required.headers
    prompt = script.prompt_text()
    assert "Answer by calling one or more of the functions offered." in prompt and prompt.endswith(
        "<|im_start|>assistant\n<tool_call>\n"
    )
    client.chat.completions.with_raw_response.create(
        **ask, tool_choice={"type": "function", "function": {"name": "get_time"}}
    )
    prompt = script.prompt_text()
    assert "Answer by calling the function get_time." in prompt and "get_weather" not in prompt
    assert prompt.endswith('<tool_call>\n{"name": "get_time", "arguments": ')
    client.chat.completions.with_raw_response.create(**ask)
    assert script.prompt_text().endswith("<|im_start|>assistant\n")
    response = server.http().post(
        "/v1/chat/completions", json={**ask, "tool_choice": {"type": "function", "function": {"name": "nope"}}}
    )
    assert response.status_code == 400 and "not among the tools" in response.json()["error"]["message"]
