"""The CLI in ordinary shell pipelines: a reader that goes away (`| head -c 5`) ends any command quietly with
exit 0, as `yes | head` does; a closed stderr never stops the work; a prompt byte that is not UTF-8 (on stdin,
in PROMPT, in a --batch stdin) becomes U+FFFD with one warning naming where, never an internal error."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from rocketllm_cli.app import app
from rocketllm_cli.shard.sharder import shard

CLI = [sys.executable, "-m", "rocketllm_cli"]
NEW = "6"
BAD = b"Hel\xfflo"  # \xff is never valid UTF-8: the first bad byte is at offset 3
REPLACED = "Hel\ufffdlo"


@pytest.fixture(scope="module")
def shards(tiny_checkpoint):
    """The tiny model's shards in the session cache, so each run below only loads them."""
    return shard(tiny_checkpoint, log=lambda m: None)[1]


def env() -> dict:
    """Read at each run: the session's isolated cache is set after import. UTF-8 whatever this machine's locale."""
    return {**os.environ, "PYTHONUTF8": "1"}


def quiet(stderr: bytes) -> bool:
    return b"internal error" not in stderr and b"Traceback" not in stderr and b"Exception ignored" not in stderr


def run_with_stdout_closed(*args: str) -> subprocess.CompletedProcess:
    """The reader of stdout is gone before the command writes a byte, so its first result write breaks the pipe."""
    process = subprocess.Popen(
        [*CLI, *args], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env()
    )
    process.stdout.close()
    _, err = process.communicate(timeout=300)
    return subprocess.CompletedProcess(process.args, process.returncode, b"", err)


# -- stdout closed: exit 0, nothing on stderr but the command's own logs -------------------------------------
def test_generate_into_head_ends_quietly_with_exit_0(shards):
    pipeline = 'set -o pipefail; "$@" | head -c 5'  # pipefail: the status is rocketllm's, not head's
    done = subprocess.run(
        ["bash", "-c", pipeline, "sh", *CLI, "generate", str(shards), "Hello", "--raw", "-n", "200"],
        capture_output=True,
        env=env(),
        timeout=300,
    )
    assert done.returncode == 0, done.stderr.decode()
    assert len(done.stdout) == 5 and quiet(done.stderr), done.stderr.decode()


@pytest.mark.parametrize("command", ["generate", "generate --json", "shard", "doctor", "profile", "cache ls", "bench"])
def test_every_command_ends_quietly_when_stdout_is_closed(command, shards, tiny_checkpoint, tmp_path):
    args = {
        "generate": ["generate", str(shards), "Hello", "--raw", "-n", NEW],
        "generate --json": ["generate", str(shards), "Hello", "--raw", "-n", NEW, "--json"],
        "shard": ["shard", str(tiny_checkpoint), "--out", str(tmp_path / "out")],
        "doctor": ["doctor"],
        "profile": ["profile"],
        "cache ls": ["cache", "ls"],
        "bench": ["bench", str(shards), "--regime", "resident", "--tokens", "1", "--prompt-tokens", "2"],
    }[command]
    done = run_with_stdout_closed(*args)
    assert done.returncode == 0 and quiet(done.stderr), (done.returncode, done.stderr.decode())
    if command == "shard":
        assert (tmp_path / "out" / "manifest.json").is_file()  # the work was done; only its report had no reader


def test_help_and_version_end_quietly_when_stdout_is_closed():
    for args in (["generate", "--help"], ["--version"]):
        done = run_with_stdout_closed(*args)
        assert done.returncode == 0 and quiet(done.stderr), (args, done.stderr.decode())


# -- stderr closed: the work goes on, the exit code stays ---------------------------------------------------
def run_with_stderr_closed(*args: bytes | str, stdin: bytes | None = None) -> subprocess.CompletedProcess:
    process = subprocess.Popen(
        [*CLI, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env()
    )
    process.stderr.close()
    out, _ = process.communicate(stdin or b"", timeout=300)
    return subprocess.CompletedProcess(process.args, process.returncode, out, b"")


def test_a_closed_stderr_drops_the_warning_and_keeps_the_result(shards):
    expected = CliRunner().invoke(app, ["generate", str(shards), REPLACED, "--raw", "-n", NEW])
    assert expected.exit_code == 0 and expected.stdout.strip(), expected.stderr
    # the warning's write breaks the pipe
    done = run_with_stderr_closed("generate", str(shards), BAD, "--raw", "-n", NEW)
    assert done.returncode == 0 and done.stdout.decode("utf-8") == expected.stdout


def test_a_closed_stderr_keeps_the_exit_code_of_an_error(shards):
    done = run_with_stderr_closed("generate", str(shards), "Hello", "--io-workers", "0")
    assert done.returncode == 1 and done.stdout == b""


def test_stdout_and_stderr_into_one_closed_pipe(shards):
    pipeline = 'set -o pipefail; "$@" 2>&1 | head -c 5'
    done = subprocess.run(
        ["bash", "-c", pipeline, "sh", *CLI, "generate", str(shards), BAD, "--raw", "-n", "200"],
        capture_output=True,
        env=env(),
        timeout=300,
    )
    assert done.returncode == 0 and len(done.stdout) == 5, done.stdout


# -- bytes that are not UTF-8: U+FFFD and one warning -------------------------------------------------------
# where: (arguments after MODEL as bytes, stdin, the same input decoded: arguments and stdin, first bad byte's offset)
NOT_UTF8 = {
    "stdin": ([], BAD + b"\n", ([], REPLACED + "\n"), 3),
    "PROMPT": ([BAD], None, ([REPLACED], None), 3),
    "--batch stdin": (["--batch"], b"Hello\n" + BAD + b"\n", (["--batch"], "Hello\n" + REPLACED + "\n"), 6 + 3),
    "--system": (["Hello", "--system", BAD], None, (["Hello", "--system", REPLACED], None), 3),
}


@pytest.mark.parametrize("where", list(NOT_UTF8))
def test_bytes_that_are_not_utf8_become_u_fffd_with_one_warning(where, shards):
    args, stdin, (decoded_args, decoded_stdin), offset = NOT_UTF8[where]
    chat = ["--chat"] if where == "--system" else ["--raw"]  # a system message needs the chat template
    expected = CliRunner().invoke(app, ["generate", str(shards), *decoded_args, *chat, "-n", NEW], input=decoded_stdin)
    assert expected.exit_code == 0, expected.stderr
    done = subprocess.run(
        [*CLI, "generate", str(shards), *args, *chat, "-n", NEW],
        input=stdin,
        capture_output=True,
        env=env(),
        timeout=300,
    )
    assert done.returncode == 0, done.stderr.decode()
    assert done.stdout.decode("utf-8") == expected.stdout
    where_named = "stdin" if where == "--batch stdin" else where
    assert done.stderr.decode().splitlines() == [
        f"warning: {where_named} is not valid UTF-8 (first bad byte at offset {offset}); undecodable bytes were "
        f"replaced with U+FFFD"
    ]


@pytest.mark.parametrize("terminal", [True, False])
def test_a_message_after_text_cut_mid_line_starts_its_own_line_on_a_terminal(terminal, monkeypatch, capsys):
    """Ctrl-C during a streamed reply: on a terminal `error: interrupted` is not glued to the cut text; a pipe or
    a file gets stdout and stderr exactly as written."""
    from rocketllm_cli import output

    monkeypatch.setattr(output, "_same_terminal", lambda: terminal)
    monkeypatch.setattr(output, "_line_open", [False])
    output.write_stdout("The capital of France is Par")
    output.write_stderr("error: interrupted")
    output.write_stderr("a second line")
    output.write_stdout("whole line\n")
    output.write_stderr("after a whole line")
    captured = capsys.readouterr()
    assert captured.out == "The capital of France is Parwhole line\n"
    assert captured.err == ("\n" if terminal else "") + "error: interrupted\na second line\nafter a whole line\n"
