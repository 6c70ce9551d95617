"""rocketllm serve as a command: --help shows each knob's derived default without measuring anything, every bad
input (the server extra missing, a taken port, a bad flag) is one `error:` line before any model loads, and the
real process serves, logs its plan, tool parser and prefix-cache decision (every log line on stderr), and stops
cleanly and at once on Ctrl-C or SIGTERM, open streams ending as their API says — on the tiny model always, and
on SmolLM2 where its file is at hand."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest
from cli_contract import one_error_line
from serve_helpers import LiveServer, Script
from typer.testing import CliRunner

from rocketllm_cli.app import app
from rocketllm_cli.auto import AutoModel
from rocketllm_cli.commands.serve import MISSING_EXTRA
from rocketllm_cli.server.worker import SHUTTING_DOWN, STOP_WAIT_S

START_TIMEOUT_S = 240  # SmolLM2 is sharded (dequantized) on first use: ~25 s here, longer on a busy machine
STOP_TIMEOUT_S = 60  # the helper's patience after a signal; the server stops within ~5 s even with streams in flight
STOP_BUDGET_S = 15  # what a test accepts for that stop: three times the target, for a loaded CI machine


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
    from rocketllm_cli.auto import AutoModel

    AutoModel.from_pretrained(tiny).close()  # caches this machine's profile in the session cache
    start = time.monotonic()
    result = invoke("--help")
    assert result.exit_code == 0 and time.monotonic() - start < 10
    text = flat(result.stdout)
    for flag in (
        "--host",
        "--port",
        "--served-model-name",
        "--tool-parser",
        "--prefix-cache",
        "--device-cache-bytes",
        "--max-context",
    ):
        assert flag in text
    assert (
        "Default on this machine:" in text
        and "Default: auto, which turns it on only when every weight is resident" in text
    )
    assert "pip install -e '.[server]'" in text  # not eaten as markup
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
    assert line == (
        f"error: port {port} on 127.0.0.1 is already in use (another server?); stop that program or pass "
        f"--port "
        "with a free port (--port 0 picks one)"
    )


@pytest.mark.parametrize(
    "args, message",
    [
        (["--port", "70000"], "error: --port must be between 0 and 65535 (got 70000)"),
        (["--tool-parser", "xml"], "error: bad --tool-parser 'xml': expected one of hermes, llama3_json, mistral"),
        (
            ["--served-model-name", " "],
            "error: --served-model-name is empty; give the name clients should send, or leave it out",
        ),
        (
            ["--prefix-cache", "sometimes"],
            "error: bad value 'sometimes' for prefix_cache (from --prefix-cache): expected one of auto, on, off",
        ),
        (
            ["--device-cache-bytes", "lots"],
            "error: bad value 'lots' for device_cache_bytes (from --device-cache-bytes): expected a byte count such as "
            "1073741824, 1e9, 2GB, 1.5GiB or 512MiB",
        ),
        (["--max-queue", "0"], "error: --max-queue must be at least 1 (got 0)"),
        (
            ["--api-key", " "],
            "error: --api-key is empty (or ROCKETLLM_API_KEY is set but empty); give a key, or leave both out",
        ),
        (
            ["--host", "192.0.2.1"],
            "error: cannot listen on 192.0.2.1: not an address of this machine; pass --host 127.0.0.1 (or 0.0.0.0 for "
            "every interface)",
        ),
    ],
)
def test_bad_flags_are_one_line(tiny, args, message):
    assert one_error_line(invoke(tiny, *args)) == message


def test_a_missing_model_is_one_line(tmp_path):
    missing = tmp_path / "no-such-model"
    assert one_error_line(invoke(missing, "--port", "0")) == (
        f"error: model path not found: {missing} (give a model directory, a .gguf file or a hub id like org/name)"
    )


def test_model_as_an_option_reaches_the_loader(tmp_path):
    """`serve --model M`, as llama-server and vLLM users type it, is `serve M`."""
    missing = tmp_path / "no-such-model"
    assert one_error_line(invoke("--model", missing, "--port", "0")) == one_error_line(invoke(missing, "--port", "0"))


# -- the real process ------------------------------------------------------------------------------------
class ServeProcess:
    """`rocketllm serve MODEL --port 0` (or `serve --model MODEL ...`) as a child process. With --json (`as_json`)
    the JSON document on stdout tells where it listens; without, the `listening on URL` line on stderr does."""

    def __init__(
        self, model, *args: str, as_json: bool = True, model_as_option: bool = False, env: dict | None = None
    ) -> None:
        model_words = ["--model", str(model)] if model_as_option else [str(model)]
        command = [
            sys.executable,
            "-m",
            "rocketllm_cli",
            "serve",
            *model_words,
            "--port",
            "0",
            *(["--json"] if as_json else []),
            *args,
        ]
        self.as_json = as_json
        # Ctrl-C as a terminal sends it: a suite started in the background (SIGINT ignored, inherited) would not deliver
        # it
        self.process = subprocess.Popen(
            command,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )
        announcing = self.process.stdout if as_json else self.process.stderr
        self.head: list[str] = []  # what was read from `announcing` before the server was known to listen
        # A server that never announces itself is killed at the deadline (readline then returns), never left running.
        watchdog = threading.Timer(START_TIMEOUT_S, self.process.kill)
        watchdog.start()
        try:
            while True:  # the document is indented JSON: it ends at a line holding only "}"
                line = announcing.readline()
                if not line and watchdog.finished.is_set() and not watchdog.is_alive():
                    raise AssertionError(f"serve did not start within {START_TIMEOUT_S} s")
                assert line or self.process.poll() is None, (
                    "" if as_json else "".join(self.head)
                ) + self.process.stderr.read()
                self.head.append(line)
                announced = line.rstrip("\n") == "}" if as_json else line.startswith("listening on ")
                if announced:
                    break
        except BaseException:
            self.process.kill()
            self.process.wait()
            raise
        finally:
            watchdog.cancel()
        if as_json:
            self.info = json.loads("".join(self.head))
        else:
            url = line.split()[2]
            self.info = {"url": url, "openai_base_url": f"{url}/v1", "anthropic_base_url": url}
        self.stdout = self.stderr = ""
        self.stop_s = float("nan")

    def openai(self):
        import openai

        return openai.OpenAI(base_url=self.info["openai_base_url"], api_key="unused", max_retries=0)

    def anthropic(self):
        import anthropic

        return anthropic.Anthropic(base_url=self.info["anthropic_base_url"], api_key="unused", max_retries=0)

    def stop(self, signum: int = signal.SIGINT) -> tuple[int, str]:
        """Ctrl-C (or `signum`), as a person or a service manager would send it; returns the exit code and all of
        stderr. Sets stdout (all of it), stderr and stop_s, the seconds from the signal to the exit."""
        self.process.send_signal(signum)
        start = time.monotonic()
        try:
            out, err = self.process.communicate(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.process.kill()
            out, err = self.process.communicate()
        self.stop_s = time.monotonic() - start
        head = "".join(self.head)
        self.stdout, self.stderr = (head + out, err) if self.as_json else (out, head + err)
        return self.process.returncode, self.stderr


def test_serve_runs_logs_its_decisions_and_stops_on_ctrl_c(tiny):
    server = ServeProcess(tiny, "--served-model-name", "tiny-cli", "--device-cache-bytes", "1GB", "--no-access-log")
    try:
        assert server.info["url"].startswith("http://127.0.0.1:") and server.info["model"] == "tiny-cli"
        assert server.info["tool_parser"] == "hermes" and server.info["prefix_cache"]["enabled"] is True
        reply = server.openai().chat.completions.create(
            model="tiny-cli", messages=[{"role": "user", "content": "hi"}], max_tokens=3
        )
        assert reply.usage.completion_tokens >= 1
    finally:
        code, err = server.stop()
    assert code == 0, err
    lines = err.splitlines()
    if lines and lines[0].startswith("sharded "):  # the first test to serve this model shards it first
        lines = lines[1:]
    assert lines[0].startswith("model: tiny-cli (llama, 4 layers, fp32), context ")
    assert lines[1].startswith("residency: ") and "[DDDD]" in lines[1]
    assert lines[2] == (
        "tool parser: hermes (the chat template names no tool-call format; hermes by default); "
        "tools described in a system message (the chat template does not render tools)"
    )
    assert lines[3] == (
        "prefix cache: on: auto, and every weight is resident, so a reused prefix skips its prefill compute"
    )
    assert lines[4] == (
        "speculative decoding: off: auto, and every unit is in memory, so a pass costs its compute, "
        "which grows with its tokens"
    )
    assert re.fullmatch(
        r"default max_tokens: \d+ \(= min\(max_context, max\(min_tokens, min\(max_tokens, floor\(reply_budget_s / "
        r"seconds_per_token\)\)\)\) with reply_budget_s=60, .*\); a request's max_tokens wins",
        lines[5],
    ), lines[5]
    assert re.fullmatch(
        r"queue: at most \d+ requests waiting \(= min\(256, open-file limit \d+ // 4\)\); more get 429 with "
        r"retry-after; request bodies up to 1048576 bytes \(= max\(1 MiB, 64 B x context \d+\)\), larger get 413",
        lines[6],
    ), lines[6]
    assert lines[7] == "api key: none (every client is served)"
    assert lines[8] == (
        f"listening on {server.info['url']} (OpenAI: {server.info['url']}/v1, Anthropic: "
        f"{server.info['url']}); Ctrl-C stops"
    )
    assert lines[-1] == "stopped" and "Traceback" not in err


def test_streaming_layers_turn_the_prefix_cache_off_and_say_why(tiny):
    server = ServeProcess(tiny, "--device-cache-bytes", "0", "--host-cache-bytes", "0", "--no-access-log")
    try:
        assert server.info["prefix_cache"]["enabled"] is False
        assert "one streaming pass whatever its length" in server.info["prefix_cache"]["reason"]
        assert set(server.info["residency_plan"].values()) >= {"storage"}
    finally:
        code, err = server.stop()
    print(f"idle, every layer streamed: stopped {server.stop_s:.2f} s after Ctrl-C")
    assert code == 0, err
    assert server.stop_s < STOP_BUDGET_S and err.splitlines()[-1] == "stopped"


def test_a_model_whose_forward_drops_a_kept_state_says_so_once_at_start(stateful_factory):
    server = ServeProcess(stateful_factory("mamba"), "--device-cache-bytes", "1GB", "--no-access-log")
    try:
        server.openai().chat.completions.create(
            model="mamba", messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )
        health = httpx.get(server.info["url"] + "/health").json()["prefix_cache"]
    finally:
        code, err = server.stop()
    assert code == 0, err
    assert health["enabled"] is False and health["reason"].startswith(
        "off: the model's cache has LinearAttentionLayer layers"
    )
    said = [line for line in err.splitlines() if "prefix cache" in line]
    assert said == [f"prefix cache: {health['reason']}"]


class SSEReader:
    """One streamed POST read on its own thread: its lines as they come, `ready` set at the first line for which
    `is_ready(line)` holds (or when the stream ends), `ended_at` the time it ended, `error` how, if not cleanly."""

    def __init__(self, url: str, path: str, body: dict, is_ready) -> None:
        self.lines: list[str] = []
        self.ready = threading.Event()
        self.ended_at: float | None = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._read, args=(url, path, body, is_ready), daemon=True)
        self.thread.start()

    def _read(self, url: str, path: str, body: dict, is_ready) -> None:
        try:
            with httpx.Client(base_url=url, timeout=60) as client, client.stream("POST", path, json=body) as response:
                for line in response.iter_lines():
                    if line:
                        self.lines.append(line)
                        if is_ready(line):
                            self.ready.set()
        except Exception as exc:  # noqa: BLE001 - the test reports it
            self.error = exc
        finally:
            self.ended_at = time.monotonic()
            self.ready.set()


# Greedy, the tiny model counts on past 300 tokens without an end-of-sequence: the stream is surely in flight.
LONG_REPLY = {
    "model": "tiny",
    "messages": [{"role": "user", "content": "Count to a thousand."}],
    "max_tokens": 1000,
    "temperature": 0,
    "stream": True,
}
PATHS = {"openai": "/v1/chat/completions", "anthropic": "/v1/messages"}
HAS_TEXT = {
    "openai": lambda line: '"content":"' in line and '"content":""' not in line,
    "anthropic": lambda line: '"type":"content_block_delta"' in line,
}


@pytest.mark.parametrize(
    "signum, running, queued",
    [(signal.SIGINT, "openai", "anthropic"), (signal.SIGTERM, "anthropic", "openai")],
    ids=["SIGINT", "SIGTERM"],
)
def test_a_stop_with_streams_in_flight_ends_each_as_its_api_says_and_exits_0_at_once(tiny, signum, running, queued):
    """One stream is generating (every layer streamed from storage), the other waits in the queue behind it, and a
    request that is not streamed waits behind both: it gets a 503 saying why."""
    answers: list = []
    server = ServeProcess(
        tiny, "--served-model-name", "tiny", "--device-cache-bytes", "0", "--host-cache-bytes", "0", "--no-access-log"
    )
    streams: dict[str, SSEReader] = {}
    try:
        streams[running] = SSEReader(server.info["url"], PATHS[running], LONG_REPLY, HAS_TEXT[running])
        assert streams[running].ready.wait(60)
        streams[queued] = SSEReader(server.info["url"], PATHS[queued], LONG_REPLY, lambda line: True)
        assert streams[queued].ready.wait(60)
        plain = threading.Thread(
            target=lambda: answers.append(
                httpx.post(server.info["url"] + PATHS[queued], timeout=60, json={**LONG_REPLY, "stream": False})
            )
        )
        plain.start()  # a request that is not streamed, queued third
        deadline = time.monotonic() + 60
        while httpx.get(server.info["url"] + "/health").json()["queue_length"] < 2:
            assert time.monotonic() < deadline, "the third request never queued"
            time.sleep(0.05)
        assert all(s.ended_at is None for s in streams.values()), {api: s.lines[-3:] for api, s in streams.items()}
        signalled = time.monotonic()
    finally:
        code, err = server.stop(signum)
    print(f"{signal.Signals(signum).name} with two streams in flight: stopped in {server.stop_s:.2f} s")
    for stream in streams.values():
        stream.thread.join(30)
    plain.join(30)
    assert code == 0, err
    assert server.stop_s < STOP_BUDGET_S
    assert err.splitlines()[-1] == "stopped" and "Traceback" not in err and "CancelledError" not in err, err
    for api, stream in streams.items():
        assert stream.error is None and stream.ended_at >= signalled, (api, stream.error, stream.lines[-3:])
    openai_lines, anthropic_lines = streams["openai"].lines, streams["anthropic"].lines
    assert openai_lines[-1] == "data: [DONE]"
    assert json.loads(openai_lines[-2].removeprefix("data: "))["choices"][0]["finish_reason"] == "stop"
    assert [line for line in anthropic_lines if line.startswith("event: ")][-2:] == [
        "event: message_delta",
        "event: message_stop",
    ]
    assert json.loads(anthropic_lines[-3].removeprefix("data: "))["delta"]["stop_reason"] == "end_turn"
    assert any(HAS_TEXT[running](line) for line in streams[running].lines)
    assert answers[0].status_code == 503 and answers[0].json()["error"]["message"] == SHUTTING_DOWN


def test_a_stop_does_not_wait_out_a_step_that_does_not_end(tiny):
    """The running step held at a gate, as a layer read from a slow disk would hold it: the stop still ends the
    stream, with its final events, STOP_WAIT_S after it began (in process: the CLI's uvicorn server, told to exit
    as a signal tells it)."""
    model = AutoModel.from_pretrained(tiny, device_cache_bytes="1GB")
    script = Script(model)
    script.gate = threading.Event()
    server = LiveServer(model, "tiny")
    try:
        stream = SSEReader(server.url, PATHS["openai"], LONG_REPLY, lambda line: True)
        assert stream.ready.wait(30) and stream.ended_at is None
        deadline = time.monotonic() + 30
        while not server.state.worker.busy:
            assert time.monotonic() < deadline, "the job never started"
            time.sleep(0.01)
        stopped_at = time.monotonic()
        server.server.should_exit = True
        stream.thread.join(30)
        waited = stream.ended_at - stopped_at
        assert STOP_WAIT_S <= waited < STOP_BUDGET_S, waited
        assert stream.error is None and stream.lines[-1] == "data: [DONE]"
        assert json.loads(stream.lines[-2].removeprefix("data: "))["choices"][0]["finish_reason"] == "stop"
    finally:
        script.gate.set()
        server.close()
        script.remove()
        model.close()


@pytest.mark.parametrize("as_json", [True, False], ids=["json", "plain"])
def test_every_log_line_is_on_stderr_and_stdout_carries_only_the_json_document(tiny, as_json):
    server = ServeProcess(tiny, "--served-model-name", "tiny", as_json=as_json)  # the access log is on by default
    try:
        server.openai().chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )
    finally:
        code, err = server.stop()
    assert code == 0, err
    assert re.search(r'^INFO: +127\.0\.0\.1:\d+ - "POST /v1/chat/completions HTTP/1\.1" 200', err, re.MULTILINE), err
    assert "listening on " in err and err.splitlines()[-1] == "stopped"
    if as_json:
        assert json.loads(server.stdout) == server.info  # one document, and nothing after it
    else:
        assert server.stdout == ""


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
        streamed = "".join(
            c.choices[0].delta.content or ""
            for c in client.chat.completions.create(
                model=name, messages=question, max_tokens=12, temperature=0, stream=True
            )
        )
        assert streamed == reply.choices[0].message.content
        completion = client.completions.create(
            model=name, prompt="The capital of France is", max_tokens=3, temperature=0
        )
        assert completion.choices[0].text.startswith(" Paris")
        message = server.anthropic().messages.create(
            model=name, max_tokens=12, messages=question, extra_body={"temperature": 0}
        )
        assert message.content[0].text == reply.choices[0].message.content
    finally:
        code, err = server.stop()
    assert code == 0, err


# -- generate --server -----------------------------------------------------------------------------------
REMOTE_CLI = (
    "import sys\nfrom rocketllm_cli.app import main\ntry:\n    main()\nfinally:\n"
    "    print('imported torch:', 'torch' in sys.modules, file=sys.stderr)\n"
)


def remote_generate(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """`rocketllm generate ARGS` in a fresh process that says at exit whether it imported torch."""
    return subprocess.run(
        [sys.executable, "-c", REMOTE_CLI, "generate", *args],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
        timeout=120,
        check=False,
    )


def test_generate_through_a_running_server_prints_what_a_local_run_prints(tiny, tmp_path):
    """generate --server sends the prompt to the server and loads nothing: no torch import, the same greedy text,
    the same --json fields; a wrong model, a bad URL, a knob flag and --batch each get one line."""
    local = CliRunner().invoke(app, ["generate", str(tiny), "The capital of France is", "--raw", "-n", "8"])
    assert local.exit_code == 0, local.stderr
    server = ServeProcess(tiny, "--device-cache-bytes", "1GB", "--no-access-log")
    try:
        url = server.info["url"]
        remote = remote_generate("--server", url, "The capital of France is", "--raw", "-n", "8")
        assert remote.returncode == 0, remote.stderr
        assert remote.stdout == local.stdout
        assert remote.stderr.strip().splitlines()[-1] == "imported torch: False"
        by_env = subprocess.run(
            [sys.executable, "-m", "rocketllm_cli", "generate", str(tiny), "--raw", "-n", "8", "--json"],
            input="The capital of France is",
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, "ROCKETLLM_SERVER": url},
            check=False,
        )
        assert by_env.returncode == 0, by_env.stderr
        doc = json.loads(by_env.stdout)
        assert doc["text"] + "\n" == local.stdout and doc["new_tokens"] == 8 and doc["stats"]["server"] == url
        assert doc["stats"]["time_to_first_token_s"] is not None and doc["model"] == server.info["model"]
        alone = remote_generate("--server", url, "--raw", "-n", "8", server.info["model"], "The capital of France is")
        assert alone.returncode == 0 and alone.stdout == local.stdout, alone.stderr
        wrong = remote_generate(str(tmp_path / "other-model"), "hi", "--server", url)
        assert wrong.returncode == 1 and wrong.stderr.splitlines()[0] == (
            f"error: the server at {url} serves '{server.info['model']}', not '{tmp_path / 'other-model'}'; "
            "start a server for that model, or drop MODEL to use the one it serves"
        )
        knob = remote_generate("--server", url, "hi", "--prefetch-depth", "2")
        assert knob.returncode == 1 and knob.stderr.splitlines()[0] == (
            "error: --prefetch-depth tunes the engine of this process, but --server uses the server's; "
            "set it on `rocketllm serve`, or drop --server"
        )
    finally:
        code, err = server.stop()
    assert code == 0, err
    with socket.socket() as s:  # a port nothing listens on once closed
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    gone = remote_generate("--server", f"http://127.0.0.1:{port}", "hi")
    assert gone.returncode == 1 and gone.stderr.splitlines()[0].startswith(
        f"error: no server answers at http://127.0.0.1:{port} ("
    )
    assert "Traceback" not in gone.stderr and gone.stdout == ""


# -- the key for the door --------------------------------------------------------------------------------
KEY = "rk-cli-3b8e51d07a9f4c26"
PROMPT = "the secret plans of the lighthouse keeper"


def test_beyond_loopback_without_a_key_it_warns_at_start_and_in_health(tiny):
    server = ServeProcess(tiny, "--host", "0.0.0.0", "--device-cache-bytes", "1GB", "--no-access-log")
    try:
        warning = (
            "listening on 0.0.0.0 without an API key: anyone who can reach this machine can use the model; "
            "pass --api-key or set ROCKETLLM_API_KEY"
        )
        assert server.info["warnings"] == [warning] and server.info["auth"] == "none"
        assert httpx.get(server.info["url"] + "/health", timeout=30).json()["warnings"] == [warning]
    finally:
        code, err = server.stop()
    assert code == 0 and f"warning: {warning}" in err.splitlines()


def test_the_key_guards_every_endpoint_and_no_key_or_prompt_reaches_a_log_line_or_metrics(tiny):
    """ROCKETLLM_API_KEY, the access log on: the right key is served, a wrong one is 401 in each API's shape; neither
    key
    nor any prompt appears on stderr (uvicorn's log, the server's own), on stdout or in /metrics."""
    import anthropic
    import openai

    wrong = "rk-wrong-9d2c7e41f0b3a8"
    server = ServeProcess(tiny, "--host", "0.0.0.0", "--device-cache-bytes", "1GB", env={"ROCKETLLM_API_KEY": KEY})
    url = server.info["url"]
    try:
        assert server.info["warnings"] == [] and server.info["auth"] == "api key required"
        client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)
        assert client.chat.completions.create(
            model=server.info["model"], messages=[{"role": "user", "content": PROMPT}], max_tokens=3
        ).choices
        assert (
            "".join(
                c.choices[0].delta.content or ""
                for c in client.chat.completions.create(
                    model=server.info["model"],
                    messages=[{"role": "user", "content": PROMPT}],
                    max_tokens=3,
                    stream=True,
                )
                if c.choices
            )
            is not None
        )
        keyed = anthropic.Anthropic(base_url=url, api_key=KEY, max_retries=0)
        assert keyed.messages.create(
            model=server.info["model"], max_tokens=3, messages=[{"role": "user", "content": PROMPT}]
        ).content
        with pytest.raises(openai.AuthenticationError) as refused:
            openai.OpenAI(base_url=url + "/v1", api_key=wrong, max_retries=0).chat.completions.create(
                model=server.info["model"], messages=[{"role": "user", "content": PROMPT}], max_tokens=3
            )
        assert refused.value.status_code == 401
        with pytest.raises(anthropic.AuthenticationError):
            anthropic.Anthropic(base_url=url, api_key=wrong, max_retries=0).messages.create(
                model=server.info["model"], max_tokens=3, messages=[{"role": "user", "content": PROMPT}]
            )
        bad = httpx.post(
            url + "/v1/chat/completions",
            headers={"authorization": f"Bearer {KEY}"},
            timeout=30,
            json={
                "model": server.info["model"],
                "messages": [{"role": "user", "content": PROMPT}],
                "max_tokens": 10**6,
            },
        )
        assert bad.status_code == 400
        assert httpx.get(url + "/metrics", timeout=30).status_code == 401
        metrics = httpx.get(url + "/metrics", headers={"authorization": f"Bearer {KEY}"}, timeout=30).text
        # one 401 there
        assert 'rocketllm_requests_total{endpoint="/v1/chat/completions",status="401"} 2' not in metrics
        assert 'rocketllm_requests_total{endpoint="/v1/chat/completions",status="401"} 1' in metrics
        # generate --server sends the key from ROCKETLLM_API_KEY or --api-key; without one it says how to give it
        keyed_cli = remote_generate("--server", url, PROMPT, "-n", "3", "--raw", env={"ROCKETLLM_API_KEY": KEY})
        assert keyed_cli.returncode == 0, keyed_cli.stderr
        flagged = remote_generate(
            "--server", url, PROMPT, "-n", "3", "--raw", "--api-key", KEY, env={"ROCKETLLM_API_KEY": ""}
        )
        assert flagged.returncode == 0 and flagged.stdout == keyed_cli.stdout, flagged.stderr
        keyless = remote_generate("--server", url, PROMPT, "-n", "3", env={"ROCKETLLM_API_KEY": ""})
        assert keyless.returncode == 1 and "--api-key or ROCKETLLM_API_KEY" in keyless.stderr.splitlines()[0]
    finally:
        code, err = server.stop()
    assert code == 0, err
    assert "POST /v1/chat/completions" in err and "401" in err  # the access log ran
    for secret in (KEY, wrong, PROMPT, "lighthouse"):
        assert secret not in err and secret not in server.stdout and secret not in metrics, secret
