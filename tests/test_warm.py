"""A warm model: the first generate of a model starts a background server on a user-only unix socket and says so
once; the next attaches without importing torch and prints what a cold run prints; `ps` lists it, `stop` ends it; it
stops by itself after --keep-alive without a request; a server killed is found stale and replaced; two first calls at
once start one server; another model or other load-time knobs replace it; Ctrl-C of a client leaves the server; a
model that cannot load is the client's one-line error; --batch, --image and --logprobs run in the client's process."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

CLIENT = (
    "import sys\nfrom rocketllm_cli.app import main\ntry:\n    main()\nfinally:\n"
    "    print('imported torch:', 'torch' in sys.modules, file=sys.stderr)\n"
)
PROMPT = "The capital of France is"


def cli(*args: str, keep: str = "60s", timeout: float = 180) -> subprocess.CompletedProcess:
    """`rocketllm ARGS` in a fresh process (the way a shell loop runs it), saying at exit whether it imported torch."""
    return subprocess.run(
        [sys.executable, "-c", CLIENT, *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "ROCKETLLM_KEEP_ALIVE": keep},
        check=False,
    )


def warm_models() -> list[dict]:
    listed = cli("ps", "--json")
    assert listed.returncode == 0, listed.stderr
    return json.loads(listed.stdout)["models"]


@pytest.fixture
def tiny(tiny_factory):
    source = tiny_factory("llama", seed=101)
    yield source
    cli("stop", "--all")  # nothing outlives the test


@pytest.fixture
def cold(tiny) -> str:
    result = cli("generate", tiny, PROMPT, "--raw", "-n", "6", keep="0")
    assert result.returncode == 0 and "stays loaded" not in result.stderr, result.stderr
    return result.stdout


def test_the_second_generate_attaches_and_prints_what_a_cold_run_prints(tiny, cold):
    first = cli("generate", tiny, PROMPT, "--raw", "-n", "6")
    assert first.returncode == 0, first.stderr
    assert first.stdout == cold and "stays loaded for 1m after each request" in first.stderr
    [model] = warm_models()
    assert model["keep_alive_s"] == 60 and model["rss_bytes"] > 0 and 0 < model["expires_in_s"] <= 60
    socket_mode = stat.S_IMODE(os.stat(model["socket"]).st_mode)
    assert socket_mode == 0o600 and stat.S_IMODE(os.stat(Path(model["socket"]).parent).st_mode) == 0o700
    second = cli("generate", tiny, PROMPT, "--raw", "-n", "6")
    assert second.returncode == 0 and second.stdout == cold, second.stderr
    assert "stays loaded" not in second.stderr and second.stderr.strip().splitlines()[-1] == "imported torch: False"
    as_json = cli("generate", tiny, PROMPT, "--raw", "-n", "6", "--json")
    doc = json.loads(as_json.stdout)
    assert doc["text"] + "\n" == cold
    # the figures a cold run reports, measured by the server for this request: bytes per tier, residency, peak RSS
    cold_doc = json.loads(cli("generate", tiny, PROMPT, "--raw", "-n", "6", "--json", keep="0").stdout)
    assert doc["stats"]["bytes_per_token"] == cold_doc["stats"]["bytes_per_token"]
    assert doc["stats"]["residency"] == cold_doc["stats"]["residency"] and doc["stats"]["peak_rss_bytes"] > 0
    assert {"speculation", "compute_dtype", "device", "per_token_ms"} <= set(doc["stats"]) and "load_s" not in doc[
        "stats"
    ]
    with_stats = cli("generate", tiny, PROMPT, "--raw", "-n", "6", "--stats")
    lines = with_stats.stderr.splitlines()
    for start in (
        "tokens: ",
        "time: ",
        "decode: ",
        "bytes per token: device ",
        "speculative decoding",
        "peak RSS: ",
        "residency: ",
    ):
        assert any(line.startswith(start) for line in lines), (start, with_stats.stderr)
    assert "the model already loaded" in with_stats.stderr and "from the server's prefix cache" in with_stats.stderr
    assert [m["pid"] for m in warm_models()] == [model["pid"]]
    stopped = cli("stop", tiny)
    assert stopped.returncode == 0 and f"pid {model['pid']}" in stopped.stderr and warm_models() == []
    assert cli("stop", tiny).returncode == 1  # nothing warm to stop: one line


def test_keep_alive_ends_the_server_and_a_killed_one_is_replaced(tiny, cold):
    assert cli("generate", tiny, PROMPT, "--raw", "-n", "6", keep="2s").returncode == 0
    [model] = warm_models()
    deadline = time.monotonic() + 30
    while warm_models() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert warm_models() == [] and not Path(model["socket"]).exists()
    assert cli("generate", tiny, PROMPT, "--raw", "-n", "6").returncode == 0
    [model] = warm_models()
    os.kill(model["pid"], signal.SIGKILL)  # stale: its entry and socket stay behind
    time.sleep(0.5)
    again = cli("generate", tiny, PROMPT, "--raw", "-n", "6")
    assert again.returncode == 0 and again.stdout == cold and "stays loaded" in again.stderr
    assert [m["pid"] for m in warm_models()] != [model["pid"]] and len(warm_models()) == 1


def test_each_request_sets_the_keep_alive_from_then_on(tiny, cold):
    """As ollama's per-request keep_alive: the same server, its keep-alive what the latest generate asked for."""
    assert cli("generate", tiny, PROMPT, "--raw", "-n", "6", keep="60s").returncode == 0
    [model] = warm_models()
    assert model["keep_alive_s"] == 60
    assert cli("generate", tiny, PROMPT, "--raw", "-n", "6", keep="1h").stdout == cold
    [longer] = warm_models()
    assert longer["pid"] == model["pid"] and longer["keep_alive_s"] == 3600 and longer["expires_in_s"] > 3000
    assert cli("generate", tiny, PROMPT, "--raw", "-n", "6", keep="1s").stdout == cold
    deadline = time.monotonic() + 30
    while warm_models() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert warm_models() == [] and not Path(model["socket"]).exists()


def test_two_first_calls_start_one_server_and_other_knobs_replace_it(tiny, cold):
    args = [sys.executable, "-c", CLIENT, "generate", str(tiny), PROMPT, "--raw", "-n", "6"]
    env = {**os.environ, "ROCKETLLM_KEEP_ALIVE": "60s"}
    both = [
        subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) for _ in range(2)
    ]
    outs = [p.communicate(timeout=180) for p in both]
    assert [p.returncode for p in both] == [0, 0] and [o for o, _ in outs] == [cold, cold], outs
    assert sum("stays loaded" in err for _, err in outs) == 1 and len(warm_models()) == 1
    other = cli("generate", tiny, PROMPT, "--raw", "-n", "6", "--prefetch-depth", "1")
    assert other.returncode == 0 and "stopping the warm server" in other.stderr, other.stderr
    [model] = warm_models()
    assert model["knobs"] == {"prefetch_depth": "1"}


def test_another_model_loads_beside_when_memory_holds_it(tiny, tiny_factory, cold):
    assert cli("generate", tiny, PROMPT, "--raw", "-n", "6").returncode == 0
    [first] = warm_models()
    other = tiny_factory("llama", seed=102)
    beside = cli("generate", other, PROMPT, "--raw", "-n", "6")
    assert beside.returncode == 0, beside.stderr
    note = next(line for line in beside.stderr.splitlines() if "loads beside" in line)
    assert (
        note.startswith(f"note: {other.name} loads beside 1 warm model ({tiny.name}): ")
        and " free, " in note
        and "needed" in note
    )
    pids = [m["pid"] for m in warm_models()]
    assert len(pids) == 2 and first["pid"] in pids
    assert cli("generate", tiny, PROMPT, "--raw", "-n", "6").stdout == cold  # the first is still warm, and answers


def test_what_does_not_fit_stops_the_oldest_first(tmp_path, monkeypatch):
    """The policy alone: a model whose weights (plus a quarter and the reserve) exceed the memory free does not fit;
    one that is small does; a hub id, whose size is unknown before it loads, does not."""
    import psutil

    from rocketllm_cli.warm import launch

    weights = tmp_path / "m.gguf"
    weights.write_bytes(bytes(1 << 20))
    total = 16 << 30
    free = lambda available: type("Memory", (), {"total": total, "available": available})()  # noqa: E731
    monkeypatch.setattr(psutil, "virtual_memory", lambda: free(2 << 30))
    fits, words = launch.room_for(str(weights))
    assert (
        fits and words.startswith("2.00 GiB free, ") and "1.00 MiB of weights" in words and "1.60 GiB reserve" in words
    )
    monkeypatch.setattr(psutil, "virtual_memory", lambda: free(1 << 30))
    assert launch.room_for(str(weights))[0] is False  # 1 GiB free < 1.25 MiB + 1.6 GiB reserve
    assert launch.room_for("org/some-model") == (False, "its size is not known before it loads")


def test_ctrl_c_of_a_client_leaves_the_server(tiny, cold):
    assert cli("generate", tiny, PROMPT, "--raw", "-n", "2").returncode == 0
    [model] = warm_models()
    # The tiny random model samples its end of sequence at any step (12 to 379 tokens in six runs here): a reply that
    # ends before the signal lands exits 0, and is tried again; the Ctrl-C that lands must exit 130, cleanly.
    for _ in range(4):
        client = subprocess.Popen(
            [sys.executable, "-c", CLIENT, "generate", str(tiny), PROMPT, "--raw", "-n", "2000", "--temperature", "1"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "ROCKETLLM_KEEP_ALIVE": "60s"},
            # as from a terminal, even in a background suite
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )
        client.stdout.read(1)  # generating
        client.send_signal(signal.SIGINT)
        _, err = client.communicate(timeout=60)
        assert client.returncode in (0, 130) and "Traceback" not in err, (client.returncode, err)
        if client.returncode == 130:
            break
    assert client.returncode == 130, "every reply ended before its Ctrl-C landed"
    assert [m["pid"] for m in warm_models()] == [model["pid"]]
    after = cli("generate", tiny, PROMPT, "--raw", "-n", "6")
    assert after.returncode == 0 and after.stdout == cold  # the cancelled request left it serving


def test_what_cannot_go_warm_runs_here_and_what_cannot_load_is_one_line(tiny, tmp_path):
    batch = subprocess.run(
        [sys.executable, "-c", CLIENT, "generate", str(tiny), "--raw", "-n", "3", "--batch"],
        input="a\nb\n",
        capture_output=True,
        text=True,
        env={**os.environ, "ROCKETLLM_KEEP_ALIVE": "60s"},
        timeout=180,
        check=False,
    )
    assert (
        batch.returncode == 0
        and "--batch runs its prompts as one batch, so the model loads in this process" in batch.stderr
    )
    assert warm_models() == []
    empty = tmp_path / "not-a-model"
    empty.mkdir()
    failed = cli("generate", empty, PROMPT)
    assert failed.returncode == 1 and failed.stderr.startswith("error: ") and "Traceback" not in failed.stderr, (
        failed.stderr
    )
    assert warm_models() == []
    missing = cli("generate", tmp_path / "nowhere", PROMPT)
    assert missing.returncode == 1 and "model path not found" in missing.stderr and warm_models() == []


def test_an_install_without_the_server_extra_answers_here_and_says_how_to_keep_warm(tiny, cold):
    """`pip install rocketllm` without [server]: the default keep-alive cannot start a server, so generate answers
    in its own process, as a cold run does, with one note naming what to install."""
    without = (
        "import importlib.util\nfind = importlib.util.find_spec\n"
        "importlib.util.find_spec = lambda name, *a: None if name in ('fastapi', 'uvicorn') else find(name, *a)\n"
        + CLIENT
    )
    result = subprocess.run(
        [sys.executable, "-c", without, "generate", str(tiny), PROMPT, "--raw", "-n", "6"],
        capture_output=True,
        text=True,
        env={**os.environ, "ROCKETLLM_KEEP_ALIVE": "60s"},
        timeout=180,
        check=False,
    )
    assert result.returncode == 0 and result.stdout == cold, result.stderr
    notes = [line for line in result.stderr.splitlines() if line.startswith("note: ")]
    assert notes == [
        "note: fastapi and uvicorn are not installed (pip install fastapi uvicorn keeps models warm), so the model "
        "loads in this process (no warm server)"
    ], result.stderr
    assert "error" not in result.stderr and warm_models() == []
