"""rocketllm serve as a command: --help shows each knob's derived default without measuring anything, every bad
input (the server extra missing, a taken port, a bad flag) is one `error:` line before any model loads, and the
real process serves, logs its plan, tool parser and prefix-cache decision, and stops cleanly on Ctrl-C — on the
tiny model always, and on SmolLM2 where its file is at hand."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest
from cli_contract import one_error_line
from typer.testing import CliRunner

from rocketllm_cli.app import app
from rocketllm_cli.commands.serve import MISSING_EXTRA

START_TIMEOUT_S = 240  # SmolLM2 is sharded (dequantized) on first use: ~25 s here, longer on a busy machine


def invoke(*args, env: dict | None = None):
    return CliRunner().invoke(app, ["serve", *map(str, args)], env=env)


def flat(text: str) -> str:
    """Rich's help box as one line of words."""
    return " ".join(re.sub(r"[│╭╮╰╯─]", " ", text).split())


@pytest.fixture(scope="module")
def tiny(tiny_factory):
    return tiny_factory("llama", seed=21)


# -- help ------------------------------------------------------------------------------------------------
def test_help_shows_the_derived_defaults_from_the_cached_profile(tiny, tmp_path):
    from rocketllm_cli.stream.auto import AutoModel

    AutoModel.from_pretrained(tiny).close()  # caches this machine's profile in the session cache
    start = time.monotonic()
    result = invoke("--help")
    assert result.exit_code == 0 and time.monotonic() - start < 10
    text = flat(result.stdout)
    for flag in ("--host", "--port", "--served-model-name", "--tool-parser", "--prefix-cache", "--device-cache-bytes", "--max-context"):
        assert flag in text
    assert "Default on this machine:" in text and "Default: auto, which turns it on only when every weight is resident" in text
    assert "pip install 'rocketllm[server]'" in text  # not eaten as markup
    assert re.search(r"--io-workers .*Accepts an integer >= 1\. Default on this machine: \d+\.", text)


def test_help_without_a_cached_profile_measures_nothing(tmp_path):
    result = invoke("--help", env={"ROCKETLLM_CACHE": str(tmp_path)})
    assert result.exit_code == 0
    assert "derived at start from the measured hardware profile (none is cached yet)" in flat(result.stdout)
    assert not (tmp_path / "profiles").exists()


# -- bad input: one line, nothing loaded -----------------------------------------------------------------
def test_without_the_server_extra_it_says_how_to_install_it(tiny, monkeypatch):
    monkeypatch.setitem(sys.modules, "fastapi", None)  # `import fastapi` raises ImportError
    assert one_error_line(invoke(tiny)) == f"error: {MISSING_EXTRA}"


def test_a_port_in_use_is_one_line_naming_it(tiny):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        line = one_error_line(invoke(tiny, "--port", port))
    assert line == (f"error: port {port} on 127.0.0.1 is already in use (another server?); stop that program or pass --port "
                    "with a free port (--port 0 picks one)")


@pytest.mark.parametrize("args, message", [
    (["--port", "70000"], "error: --port must be between 0 and 65535 (got 70000)"),
    (["--tool-parser", "xml"], "error: bad --tool-parser 'xml': expected one of hermes, llama3_json, mistral"),
    (["--served-model-name", " "], "error: --served-model-name is empty; give the name clients should send, or leave it out"),
    (["--prefix-cache", "sometimes"], "error: bad value 'sometimes' for prefix_cache (from --prefix-cache): expected one of auto, on, off"),
    (["--device-cache-bytes", "lots"], "error: bad value 'lots' for device_cache_bytes (from --device-cache-bytes): expected a byte count "
                                       "such as 1073741824, 1e9, 2GB, 1.5GiB or 512MiB"),
    (["--host", "192.0.2.1"], "error: cannot listen on 192.0.2.1: not an address of this machine; pass --host 127.0.0.1 "
                              "(or 0.0.0.0 for every interface)"),
])
def test_bad_flags_are_one_line(tiny, args, message):
    assert one_error_line(invoke(tiny, *args)) == message


def test_a_missing_model_is_one_line(tmp_path):
    missing = tmp_path / "no-such-model"
    assert one_error_line(invoke(missing, "--port", "0")) == (
        f"error: model path not found: {missing} (give a model directory, a .gguf file or a hub id like org/name)")


def test_model_as_an_option_reaches_the_loader(tmp_path):
    """`serve --model M`, as llama-server and vLLM users type it, is `serve M`."""
    missing = tmp_path / "no-such-model"
    assert one_error_line(invoke("--model", missing, "--port", "0")) == one_error_line(invoke(missing, "--port", "0"))


# -- the real process ------------------------------------------------------------------------------------
class ServeProcess:
    """`rocketllm serve MODEL --port 0 --json` (or `serve --model MODEL ...`) as a child process; the JSON document
    tells where it listens."""

    def __init__(self, model, *args: str, model_as_option: bool = False) -> None:
        model_words = ["--model", str(model)] if model_as_option else [str(model)]
        command = [sys.executable, "-m", "rocketllm_cli", "serve", *model_words, "--port", "0", "--json", *args]
        self.process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                        env={**os.environ, "PYTHONUNBUFFERED": "1"})
        lines = []
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:  # the document is indented JSON: it ends at a line holding only "}"
            line = self.process.stdout.readline()
            assert line or self.process.poll() is None, self.process.stderr.read()
            lines.append(line)
            if line.rstrip("\n") == "}":
                break
            assert time.monotonic() < deadline, "serve did not start"
        self.info = json.loads("".join(lines))

    def openai(self):
        import openai

        return openai.OpenAI(base_url=self.info["openai_base_url"], api_key="unused", max_retries=0)

    def anthropic(self):
        import anthropic

        return anthropic.Anthropic(base_url=self.info["anthropic_base_url"], api_key="unused", max_retries=0)

    def stop(self) -> tuple[int, str]:
        """Ctrl-C, as a person would press it; returns the exit code and everything it logged."""
        self.process.send_signal(signal.SIGINT)
        try:
            _, err = self.process.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            _, err = self.process.communicate()
        return self.process.returncode, err


def test_serve_runs_logs_its_decisions_and_stops_on_ctrl_c(tiny):
    server = ServeProcess(tiny, "--served-model-name", "tiny-cli", "--device-cache-bytes", "1GB", "--no-access-log")
    try:
        assert server.info["url"].startswith("http://127.0.0.1:") and server.info["model"] == "tiny-cli"
        assert server.info["tool_parser"] == "hermes" and server.info["prefix_cache"]["enabled"] is True
        reply = server.openai().chat.completions.create(model="tiny-cli", messages=[{"role": "user", "content": "hi"}], max_tokens=3)
        assert reply.usage.completion_tokens >= 1
    finally:
        code, err = server.stop()
    assert code == 0, err
    lines = err.splitlines()
    assert lines[0].startswith("model: tiny-cli (llama, 4 layers, fp32), context ")
    assert lines[1].startswith("residency: ") and "[DDDD]" in lines[1]
    assert lines[2] == ("tool parser: hermes (the chat template names no tool-call format; hermes by default); "
                        "tools described in a system message (the chat template does not render tools)")
    assert lines[3] == "prefix cache: on: auto, and every weight is resident, so a reused prefix skips its prefill compute"
    assert lines[4] == f"listening on {server.info['url']} (OpenAI: {server.info['url']}/v1, Anthropic: {server.info['url']}); Ctrl-C stops"
    assert lines[-1] == "stopped" and "Traceback" not in err


def test_streaming_layers_turn_the_prefix_cache_off_and_say_why(tiny):
    server = ServeProcess(tiny, "--device-cache-bytes", "0", "--host-cache-bytes", "0", "--no-access-log")
    try:
        assert server.info["prefix_cache"]["enabled"] is False
        assert "one streaming pass whatever its length" in server.info["prefix_cache"]["reason"]
        assert set(server.info["residency_plan"].values()) >= {"storage"}
    finally:
        code, err = server.stop()
    assert code == 0, err


def test_serve_dash_dash_model_serves_the_model(tiny):
    server = ServeProcess(tiny, "--no-access-log", model_as_option=True)
    try:
        assert server.info["model"] == tiny.name
        assert server.openai().models.list().data[0].id == tiny.name
    finally:
        code, err = server.stop()
    assert code == 0, err


@pytest.mark.realmodel
def test_smollm2_answers_paris_through_both_apis(smollm2_gguf):
    server = ServeProcess(smollm2_gguf, "--no-access-log")
    try:
        name = server.info["model"]
        assert name == "SmolLM2-135M-Instruct.Q4_1"
        client = server.openai()
        question = [{"role": "user", "content": "What is the capital of France?"}]
        reply = client.chat.completions.create(model=name, messages=question, max_tokens=12, temperature=0)
        assert "Paris" in reply.choices[0].message.content
        streamed = "".join(c.choices[0].delta.content or "" for c in
                           client.chat.completions.create(model=name, messages=question, max_tokens=12, temperature=0, stream=True))
        assert streamed == reply.choices[0].message.content
        completion = client.completions.create(model=name, prompt="The capital of France is", max_tokens=3, temperature=0)
        assert completion.choices[0].text.startswith(" Paris")
        message = server.anthropic().messages.create(model=name, max_tokens=12, messages=question, extra_body={"temperature": 0})
        assert message.content[0].text == reply.choices[0].message.content
    finally:
        code, err = server.stop()
    assert code == 0, err
