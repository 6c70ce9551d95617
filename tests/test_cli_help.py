"""Help a person can read on an 80-column terminal (plain MODEL, TEXT, INTEGER, BYTES metavars; every panel
title whole), and MODEL given as --model wherever it is an argument, as llama-server and vLLM users type it."""

from __future__ import annotations

import json
import re

import pytest
from cli_contract import one_error_line
from typer.testing import CliRunner

from rocketllm_cli.app import app
from rocketllm_cli.commands import cache
from rocketllm_cli.options import KNOB_ENV_HINT, KNOB_PANEL
from rocketllm_cli.shard.sharder import shard

COMMANDS = [
    [],
    *([c.name] for c in app.registered_commands),
    [cache.NAME],
    *([cache.NAME, name] for name in cache.SUBCOMMANDS),
]
PLAIN = {"COLUMNS": "80", "TERM": "dumb", "NO_COLOR": "1"}


def render_help(words: list[str]) -> str:
    result = CliRunner().invoke(app, [*words, "--help"], env=PLAIN)
    assert result.exit_code == 0, result.output
    return result.stdout


@pytest.mark.parametrize("words", COMMANDS, ids=lambda words: " ".join(words) or "rocketllm")
def test_help_fits_80_columns_with_plain_metavars(words):
    text = render_help(words)
    lines = text.splitlines()
    assert max(len(line) for line in lines) <= 80
    assert "{" not in text and not re.search(r"<(str|bool|int|float|path|list)", text), text
    titles = [line for line in lines if line.startswith("╭")]
    # no title cut into its border
    assert titles and all(re.fullmatch(r"╭─ \S.*\S ─+╮", line) for line in titles), titles
    usage = next(line for line in lines if "Usage:" in line)
    after_options = usage.split("[OPTIONS]")[1].split()  # MODEL [PROMPT], [NAME]..., COMMAND [ARGS]...
    assert all(re.fullmatch(r"COMMAND|\[ARGS\]\.\.\.|\[?[A-Z]+\]?(\.\.\.)?", word) for word in after_options), usage


@pytest.mark.parametrize("name", ["generate", "serve", "bench", "profile"])
def test_knob_help_has_the_whole_panel_title_and_the_variables_hint(name):
    text = render_help([name])
    assert f"╭─ {KNOB_PANEL} ─" in text
    assert " ".join(KNOB_ENV_HINT.split()) in " ".join(text.split())
    assert re.search(r"--device-cache-bytes +BYTES ", text) and re.search(r"--io-workers +INTEGER ", text)


def test_arguments_and_options_read_as_words():
    generate = render_help(["generate"])
    assert "generate [OPTIONS] [MODEL] [PROMPT]" in generate
    assert re.search(r"--model +MODEL ", generate) and re.search(r"--max-new-tokens +-n +INTEGER ", generate)
    assert re.search(r"--stats +Print", generate)  # a flag takes no value, so it shows none
    assert "cache rm [OPTIONS] [NAME]..." in render_help(["cache", "rm"])
    assert re.search(r"--model +PATH ", render_help(["doctor"]))


def test_help_text_is_shown_as_written_not_read_as_markup():
    """Typer reads help as rich markup: brackets in our text (an extra's name, a hand-written default) stay."""
    flat = lambda words: " ".join(render_help(words).replace("│", " ").split())  # noqa: E731
    assert "pip install -e '.[vision]'" in flat(["generate"])
    assert "pip install -e '.[server]'" in flat(["serve"])
    assert re.search(
        r"--tokens INTEGER Decode tokens measured \(after one warm-up token\)\. \[default: \d+\]", flat(["bench"])
    )
    live = lambda text: re.sub(r"[\d.]+ [KMGT]?i?B now", "N now", text)  # noqa: E731 - free memory moves between two renders
    assert live(flat(["bench"])) == live(flat(["bench"]))  # a second help in one process is not escaped twice


def test_byte_defaults_that_follow_free_memory_say_so():
    """The caches' sizes come from the memory free when a command starts: help says so rather than print a figure
    as if it were fixed (it differs between two runs of --help)."""
    from rocketllm_cli.profiles import HardwareProfile

    HardwareProfile.load()  # help shows derived values only from a cached profile (the session's)
    text = " ".join(render_help(["generate"]).replace("│", " ").split())
    for flag in ("--device-cache-bytes", "--kv-cache-bytes"):
        described = text.split(flag, 1)[1].split(" --", 1)[0]
        assert "Default on this machine" not in described, described
        assert "Default: derived at start from the memory free then" in described and " now" in described, described
    reserve = text.split("--reserve-bytes", 1)[1].split(" --", 1)[0]  # from the total memory: the same every run
    assert re.search(r"Default on this machine: [\d.]+ [KMG]iB\.", reserve), reserve


# -- MODEL as --model ----------------------------------------------------------------------------------------
def invoke(*args):
    return CliRunner().invoke(app, [*map(str, args)])


@pytest.fixture(scope="module")
def shards(tiny_checkpoint):
    return shard(tiny_checkpoint, log=lambda m: None)[1]


def test_generate_takes_model_as_an_option(shards):
    positional = invoke("generate", shards, "Hello", "--raw", "-n", 6)
    assert positional.exit_code == 0, positional.stderr
    for args in (["--model", shards, "Hello"], ["Hello", "--model", shards]):
        result = invoke("generate", *args, "--raw", "-n", 6)
        assert result.exit_code == 0 and result.stdout == positional.stdout, result.stderr
    piped = CliRunner().invoke(app, ["generate", "--model", str(shards), "--raw", "-n", "6"], input="Hello\n")
    assert piped.exit_code == 0 and piped.stdout == positional.stdout, piped.stderr


def test_shard_takes_model_as_an_option(tiny_checkpoint, shards):
    result = invoke("shard", "--model", tiny_checkpoint, "--json")
    assert result.exit_code == 0, result.stderr
    document = json.loads(result.stdout)
    assert document["directory"] == str(shards) and document["reused"] is True


def test_bench_takes_model_as_an_option(shards):
    result = invoke("bench", "--model", shards, "--regime", "resident", "--tokens", 1, "--prompt-tokens", 2, "--json")
    assert result.exit_code == 0, result.stderr
    document = json.loads(result.stdout)
    assert [row["regime"] for row in document["rows"] if row["name"] == "rocketllm"] == ["resident"]
    assert document["model"]["num_layers"] == 4  # the tiny model's, from the path given to --model


@pytest.mark.parametrize(
    "args",
    [
        ["generate", "./a", "Hello", "--model", "./b"],
        ["shard", "./a", "--model", "./b"],
        ["serve", "./a", "--model", "./b"],
        ["bench", "./a", "--model", "./b"],
    ],
)
def test_model_given_twice_is_a_usage_error(args, tmp_path):
    line = one_error_line(invoke(*args), code=2)
    assert line == "error: MODEL given twice (./a and --model ./b); give it once, as the argument or as --model"


@pytest.mark.parametrize("command", ["generate", "shard", "serve"])
def test_no_model_at_all_is_a_usage_error(command):
    line = one_error_line(invoke(command, "--json"), code=2)
    assert line == "error: no MODEL: give it as the first argument or as --model"


def test_every_declared_argument_is_positional_on_every_python():
    """Typer reads each parameter's Annotated metadata; Python 3.10's typing.get_type_hints wraps parameters that
    default to None in Optional[...], which hid it (MODEL became an option --model and --chat/--raw was lost)."""
    import typer
    from typer.core import TyperArgument

    group = typer.main.get_command(app)
    positional = {
        name: sorted(p.name for p in command.params if isinstance(p, TyperArgument))
        for name, command in group.commands.items()
    }
    assert positional["generate"] == ["model", "prompt"]
    assert positional["serve"] == ["model"] and positional["shard"][0] == "model"
    chat = next(p for p in group.commands["generate"].params if p.name == "chat")
    assert (chat.opts, chat.secondary_opts) == (["--chat"], ["--raw"])
