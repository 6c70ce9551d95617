"""rocketllm bench --conversation N: each turn's prompt grows by the reply and the next user message, reuse covers
the earlier turns (not the first), the reply with reuse equals the one without, and bad input is one error line."""

from __future__ import annotations

import json

import pytest
from cli_contract import one_error_line
from typer.testing import CliRunner

from rocketllm_cli.app import app


def invoke(*args):
    return CliRunner().invoke(app, ["bench", *map(str, args)])


@pytest.fixture(scope="module")
def tiny(tiny_factory):
    return tiny_factory("llama", seed=31)


@pytest.fixture(scope="module")
def doc(tiny) -> dict:
    result = invoke(tiny, "--conversation", 3, "--tokens", 6, "--regime", "resident", "--regime", "storage", "--json")
    assert result.exit_code == 0, result.stderr
    return json.loads(result.stdout)


def test_each_turn_reuses_the_earlier_turns_and_gives_the_same_reply(doc):
    assert doc["turns"] == 3 and doc["reply_tokens"] == 6
    assert [run["regime"] for run in doc["runs"]] == ["resident", "storage"]
    for run in doc["runs"]:
        turns = run["turns"]
        assert [t["turn"] for t in turns] == [1, 2, 3]
        assert turns[0]["reused_tokens"] == 0
        for before, after in zip(turns, turns[1:]):
            # reply and a new message added
            assert after["prompt_tokens"] > before["prompt_tokens"] + before["reply_tokens"] - 2
            assert after["reused_tokens"] > before["reused_tokens"] and after["reused_tokens"] % 16 == 0
            assert after["reused_tokens"] <= before["prompt_tokens"] + before["reply_tokens"]
        for t in turns:
            assert t["same_reply"] is True and t["first_difference"] is None
            assert t["computed_tokens_on"] == t["prompt_tokens"] - t["reused_tokens"]
            assert t["prefill_ms_off"] > 0 and t["prefill_ms_on"] > 0
            assert len(t["prefill_ms_samples"]["off"]) == len(t["prefill_ms_samples"]["on"]) == doc["repeats"]
    assert "[DDDD]" in doc["runs"][0]["residency"] and "[SSSS]" in doc["runs"][1]["residency"]
    assert doc["runs"][0]["compute_dtype"] == "float32"


def test_the_table_has_a_row_per_turn(doc):
    from rocketllm_cli.bench.conversation import render_conversation

    lines = render_conversation(doc).splitlines()
    assert lines[0].startswith("**Hardware:** ")
    header = lines.index(
        "| regime | turn | prompt tokens | reused tokens (on) | prefill ms, reuse off | prefill ms, "
        "reuse on | speed-up | same reply |"
    )
    rows = [line for line in lines[header + 2 :] if line.startswith("| ")]
    assert len(rows) == 6 and rows[0].startswith("| resident | 1 | ") and rows[-1].endswith("| yes |")
    assert lines[-2].startswith("- resident: computing in float32; residency: ")
    doc["runs"][0]["turns"][2].update(same_reply=False, first_difference=4)
    assert render_conversation(doc).splitlines()[header + 4].endswith("| no, from token 5 |")


@pytest.mark.parametrize(
    "args, message",
    [
        (["--conversation", "0"], "error: --conversation must be between 1 and 20 turns (got 0)"),
        (
            ["--conversation", "2", "--baseline", "transformers"],
            "error: --conversation measures RocketLLM alone: drop --baseline and --batch",
        ),
        (
            ["--conversation", "2", "--regime", "fast"],
            "error: bad --regime 'fast': expected resident, host, storage, auto, expert-cache or all",
        ),
    ],
)
def test_bad_input_is_one_error_line(tiny, args, message):
    assert one_error_line(invoke(tiny, *args), 2) == message
