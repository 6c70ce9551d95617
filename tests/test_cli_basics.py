"""Every registered command answers --help; the root answers --version."""

from __future__ import annotations

import subprocess
import sys

import pytest
from typer.testing import CliRunner

from rocketllm_cli import __version__
from rocketllm_cli.app import app

COMMANDS = [command.name for command in app.registered_commands]


def test_the_first_commands_are_registered():
    assert {"doctor", "profile", "shard", "generate"} <= set(COMMANDS)


@pytest.mark.parametrize("name", COMMANDS)
def test_help_of_every_command_exits_0(name):
    result = CliRunner().invoke(app, [name, "--help"])
    assert result.exit_code == 0, result.output
    assert "Usage:" in result.stdout


@pytest.mark.parametrize("name", ["doctor", "profile"])
def test_help_has_a_usage_example_and_the_shared_options(name):
    text = CliRunner().invoke(app, [name, "--help"]).stdout
    assert f"rocketllm {name}" in text and "--json" in text and "--refresh" in text and "--model" in text


def test_profile_help_lists_every_knob_flag():
    from rocketllm_cli.profiles.knobs.table import KNOB_SPECS

    text = CliRunner().invoke(app, ["profile", "--help"], terminal_width=200).stdout
    for spec in KNOB_SPECS:
        assert spec.flag in text


def test_version():
    result = CliRunner().invoke(app, ["--version"])
    assert result.exit_code == 0 and result.stdout.strip() == f"rocketllm {__version__}"
    done = subprocess.run(
        [sys.executable, "-m", "rocketllm_cli", "--version"], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0 and done.stdout.strip() == f"rocketllm {__version__}"


def test_usage_errors_are_one_line_with_exit_2():
    """The console script (not only CliRunner) turns Typer's usage errors into one `error:` line."""
    import subprocess
    import sys

    for args in (["generate", "x", "-n", "abc"], ["bogus"], ["generate", "x", "--bogus"]):
        done = subprocess.run(
            [sys.executable, "-m", "rocketllm_cli", *args], capture_output=True, text=True, timeout=60
        )
        lines = done.stderr.strip().splitlines()
        assert done.returncode == 2, (args, done.stderr)
        assert len(lines) == 1 and lines[0].startswith("error: ") and "--help" in lines[0], (args, done.stderr)
        assert "Traceback" not in done.stderr and done.stdout == ""


def test_knob_help_keeps_its_accepted_values_and_shows_the_derived_default(tmp_path):
    """Every command with knob flags: the accepted forms survive rich markup, and the derived value is shown."""
    from typer.testing import CliRunner

    from rocketllm_cli.app import app

    for command in ("generate", "bench", "serve"):
        result = CliRunner().invoke(
            app, [command, "--help"], env={"ROCKETLLM_CACHE": str(tmp_path / "empty"), "COLUMNS": "400"}
        )
        assert result.exit_code == 0, result.output
        line = next(l for l in result.output.splitlines() if "--expert-cache-policy" in l)
        assert "Accepts one of lfu, lru" in line and "derived at start" in line, line
