"""rocketllm serve under load, over a long run and through cancellation storms, on loopback, bounded in count and time.

- load: C concurrent clients x R requests, OpenAI and Anthropic, streamed and not, against a queue limit: every reply
  equals `Generator.run`'s text, jobs run in arrival order, each `x-rocketllm-queue-position` is the number of jobs
  still queued or running when it arrived, a full queue is a 429 with retry-after (honoured, counted), and /health
  and /metrics answer within 100 ms throughout (p50/p99 measured);
- soak: sequential requests with prefix-cache hits and misses: RSS and open file descriptors stay flat, the prefix
  cache within its byte limit;
- storms: streams cancelled at random moments free the worker within about one token; clients that send a
  request and never read, or connect and never send, leak nothing.

Each runs short in the default suite and at full size under `-m stress` (docs/RELIABILITY.md has the command and
the figures). Every run prints its figures on one line (`pytest -s` shows them).
"""

from __future__ import annotations

import gc
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import psutil
import pytest
from serve_helpers import LiveServer, Script

from rocketllm_cli.text.loop import GenerationRequest, Generator
from rocketllm_cli.text.promptids import encode_prompt
from rocketllm_cli.text.sampling import SamplingParams

MODEL = "tiny"
N = 6  # tokens per reply
QUESTIONS = ["What is the capital of France?", "Name a prime number.", "Say hello.", "Count to three."]
HEALTH_BUDGET_S = 0.1  # /health and /metrics answer within this (median), whatever the worker does
# their 99th percentile: on a shared 2-core machine a probe's process can wait that long for a core
TAIL_BUDGET_S = 0.25


@pytest.fixture(scope="module")
def model(resident_tiny_llama):
    return resident_tiny_llama


@pytest.fixture(scope="module")
def reference(model):
    """What generate gives for each question, through the chat template (both APIs render one user turn the same
    way)."""
    out = {}
    for q in QUESTIONS:
        ids = encode_prompt(model.tokenizer, q, chat=True)[0].tolist()
        out[q] = Generator(model).run(GenerationRequest(ids, SamplingParams(max_new_tokens=N))).text
    return out


def quantile(values: list[float], q: float) -> float:
    assert values, "no samples"
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


CLIENTS = Path(__file__).parent / "fixtures" / "serve_clients.py"


class Poller:
    """Asks `path` every `every` s from a process of its own while a run goes on; then `latencies` and `failures`."""

    def __init__(self, url: str, path: str, every: float, tmp_path: Path) -> None:
        self.stop_file = tmp_path / f"stop-{path.strip('/')}"
        self.process = subprocess.Popen(
            [sys.executable, str(CLIENTS), "poll", url, path, str(every), str(self.stop_file)],
            stdout=subprocess.PIPE,
            text=True,
        )
        self.latencies: list[float] = []
        self.failures = 0

    def stop(self) -> None:
        self.stop_file.touch()
        out, _ = self.process.communicate(timeout=60)
        result = json.loads(out)
        self.latencies, self.failures = result["latencies"], result["failures"]


class LoopLag:
    """How long the server's event loop takes to run a callback handed to it from another thread, every `every` s:
    what /health waits for inside the server, without the client's process or the network."""

    def __init__(self, server: LiveServer, every: float = 0.01) -> None:
        self.loop = server.server.servers[0].get_loop()
        self.lags: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(every,), daemon=True)
        self._thread.start()

    def _run(self, every: float) -> None:
        while not self._stop.is_set():
            ran = threading.Event()
            start = time.perf_counter()
            self.loop.call_soon_threadsafe(ran.set)
            if ran.wait(10):
                self.lags.append(time.perf_counter() - start)
            self._stop.wait(every)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(15)


# -- load -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "clients, per_client, max_queue",
    [
        (8, 2, 4),
        pytest.param(32, 4, 8, marks=pytest.mark.stress),
    ],
)
def test_load_is_served_right_in_arrival_order_and_health_stays_fast(
    model, reference, clients, per_client, max_queue, tmp_path
):
    with LiveServer(model, MODEL, max_queue=max_queue) as server:
        health, metrics = Poller(server.url, "/health", 0.01, tmp_path), Poller(server.url, "/metrics", 0.05, tmp_path)
        assert gc.get_freeze_count() > 0  # as `serve` does: what was loaded is out of the collector's way
        time.sleep(1.0)  # the pollers are running before the load begins: their first second is the idle baseline
        lag = LoopLag(server)
        spec = {"clients": clients, "per_client": per_client, "tokens": N, "questions": QUESTIONS, "model": MODEL}
        began = time.monotonic()
        run = subprocess.run(
            [sys.executable, str(CLIENTS), "load", server.url, json.dumps(spec)],  # noqa: PLW1510 - its code is asserted below
            capture_output=True,
            text=True,
            timeout=900,
        )
        took = time.monotonic() - began
        lag.stop()
        health.stop()
        metrics.stop()
        assert run.returncode == 0, run.stderr[-2000:]
        result = json.loads(run.stdout)
        history = {h["id"]: h for h in server.history}
        metrics_text = server.http().get("/metrics").text
    served, refused = result["served"], result["refused"]
    assert not result["errors"], result["errors"][:3]
    assert len(served) == clients * per_client
    wrong = [s for s in served if s["text"] != reference[s["question"]]]
    assert not wrong, wrong[:3]
    jobs = [history[s["job"]] for s in sorted(served, key=lambda s: s["job"])]
    assert [j["started_at"] for j in jobs] == sorted(j["started_at"] for j in jobs)  # first in, first out
    for s in served:  # the position header: jobs still queued or running when this one arrived
        job = history[s["job"]]
        ahead = sum(
            1 for other in history.values() if other["id"] < job["id"] and other["finished_at"] > job["enqueued_at"]
        )
        assert s["position"] == job["position"] == ahead, (s, job)
    assert all(r["type"] == "rate_limit_error" and r["retry_after"] >= 1 for r in refused)
    assert f"rocketllm_queue_full_total {len(refused)}" in metrics_text
    idle = health.latencies[:50]  # polled every 10 ms: about the first half second, before any request
    p50, p99 = quantile(health.latencies, 0.5), quantile(health.latencies, 0.99)
    l50, l99 = quantile(lag.lags, 0.5), quantile(lag.lags, 0.99)
    m50, m99 = quantile(metrics.latencies, 0.5), quantile(metrics.latencies, 0.99)
    by_api = {api: sum(1 for r in refused if r["api"] == api) for api in ("openai", "anthropic")}
    print(
        f"\nload: {clients} clients x {per_client} requests (OpenAI and Anthropic, streamed and not), queue limit "
        f"{max_queue}: {len(served)} served right in {took:.1f} s, 429s {len(refused)} ({by_api}), max position "
        f"{max(s['position'] for s in served)}; /health p50 {p50 * 1000:.1f} ms p99 {p99 * 1000:.1f} ms max "
        f"{max(health.latencies) * 1000:.1f} ms over {len(health.latencies)} probes (idle before the load: p50 "
        f"{quantile(idle, 0.5) * 1000:.1f} ms, max {max(idle) * 1000:.1f} ms); /metrics p50 {m50 * 1000:.1f} ms p99 "
        f"{m99 * 1000:.1f} ms over {len(metrics.latencies)}; event loop lag p50 {l50 * 1000:.1f} ms p99 "
        f"{l99 * 1000:.1f} ms over {len(lag.lags)}; load average {os.getloadavg()[0]:.1f}"
    )
    assert health.failures == metrics.failures == 0
    assert p50 < HEALTH_BUDGET_S and m50 < HEALTH_BUDGET_S and p99 < TAIL_BUDGET_S and m99 < TAIL_BUDGET_S, (
        p50,
        p99,
        m50,
        m99,
    )
    if clients > max_queue + 1:
        assert refused  # the limit was reached


# -- soak -------------------------------------------------------------------------------------------------
SYSTEM = (
    "You are a careful assistant who answers questions about geography, arithmetic and the weather in one short "
    "sentence, never more, and who says so when a question has no answer."
)


@pytest.mark.parametrize("requests", [40, pytest.param(500, marks=pytest.mark.stress)])
def test_a_long_run_keeps_memory_descriptors_and_the_prefix_cache_flat(model, requests):
    rng = random.Random(7)
    process = psutil.Process()
    with LiveServer(model, MODEL) as server, server.http() as http:
        cache = server.state.prefix_cache
        assert cache is not None
        warm = max(10, requests // 10)
        samples = []
        for i in range(requests):
            if rng.random() < 0.5:  # a hit: the shared system prompt's blocks are cached
                messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": rng.choice(QUESTIONS)}]
            else:  # a miss: words never seen before
                messages = [
                    {"role": "user", "content": " ".join(f"w{rng.randrange(10**6)}" for _ in range(rng.randint(5, 40)))}
                ]
            stream = i % 3 == 0
            response = http.post(
                "/v1/chat/completions",
                json={"model": MODEL, "messages": messages, "max_tokens": 4, "temperature": 0, "stream": stream},
            )
            assert response.status_code == 200, response.text
            assert cache.bytes <= cache.max_bytes
            if i + 1 == warm or i + 1 == requests:
                samples.append((process.memory_info().rss, open_fds()))
        stats = cache.to_dict()
    (rss0, fds0), (rss1, fds1) = samples
    print(
        f"\nsoak: {requests} requests, prefix cache {stats['hits']} hits / {stats['lookups']} lookups, "
        f"{stats['entries']} entries, {stats['bytes']} of {stats['max_bytes']} bytes, {stats['evicted']} evicted; "
        f"after the first {warm}: RSS {(rss1 - rss0) / 2**20:+.1f} MiB ({rss0 / 2**20:.0f} -> {rss1 / 2**20:.0f} MiB), "
        f"open files {fds1 - fds0:+d} ({fds0} -> {fds1})"
    )
    assert 0 < stats["hits"] < stats["lookups"]
    assert fds1 - fds0 <= 2
    assert rss1 - rss0 < 64 * 2**20


# -- cancellation storms ----------------------------------------------------------------------------------
def _raw_stream_request(port: int, body: dict) -> socket.socket:
    """A client that sends a streaming request and never reads the reply."""
    payload = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        + f"content-length: {len(payload)}\r\n\r\n".encode()
        + payload
    )
    return sock


@pytest.mark.parametrize("streams, silent", [(8, 4), pytest.param(50, 16, marks=pytest.mark.stress)])
def test_cancelled_streams_free_the_worker_within_a_token_and_nothing_leaks(model, streams, silent, tmp_path):
    step_s = 0.02  # each token takes this long: a stream left running would hold the worker for seconds
    script = Script(model)
    script.delay = step_s
    rng = random.Random(11)
    body = {"model": MODEL, "messages": [{"role": "user", "content": QUESTIONS[0]}], "max_tokens": 300, "stream": True}
    try:
        with LiveServer(model, MODEL) as server:
            health = Poller(server.url, "/health", 0.02, tmp_path)
            fds0 = open_fds()
            freed: list[float] = []
            for i in range(streams):
                read = rng.randint(0, 12)  # events to read before walking away (0: right after the headers)
                with (
                    httpx.Client(base_url=server.url, timeout=60) as http,
                    http.stream("POST", "/v1/chat/completions", json=body) as response,
                ):
                    assert response.status_code == 200
                    job = int(response.headers["x-rocketllm-job"])
                    for n, _line in enumerate(response.iter_lines()):
                        if n >= read:
                            break
                    if rng.random() < 0.5:
                        time.sleep(rng.uniform(0, 3 * step_s))  # cancel between tokens as well as right after one
                    left = time.monotonic()
                # the connection is closed here: the job must end within about a step
                deadline = left + 10
                while not any(h["id"] == job for h in server.history):
                    assert time.monotonic() < deadline, f"stream {i} still runs 10 s after its client left"
                    time.sleep(0.002)
                record = next(h for h in server.history if h["id"] == job)
                assert record["state"] == "cancelled" and record["generated_tokens"] < 300, record
                freed.append(time.monotonic() - left)
            # clients that send a request and never read it, and clients that connect and never send
            silent_socks = [_raw_stream_request(server.port, {**body, "max_tokens": 40}) for _ in range(silent)]
            idle_socks = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(silent)]
            script.delay = 0
            with server.http() as http:  # meanwhile the server serves, after the silent clients' jobs
                reply = http.post("/v1/chat/completions", json={**body, "stream": False, "max_tokens": 2}, timeout=120)
                assert reply.status_code == 200 and reply.json()["choices"][0]["message"]["content"] is not None
            for sock in silent_socks + idle_socks:
                sock.close()
            deadline = time.monotonic() + 20
            while server.state.worker.busy or server.state.worker.queue_length:
                assert time.monotonic() < deadline
                time.sleep(0.01)
            time.sleep(0.3)  # uvicorn closes its side of the dropped connections
            health.stop()
            fds1 = open_fds()
            states = [h["state"] for h in server.history]
    finally:
        script.remove()
    p99 = quantile(health.latencies, 0.99)
    print(
        f"\nstorm: {streams} streams cancelled at random, {silent} never read, {silent} never sent: worker free after "
        f"median {statistics.median(freed) * 1000:.0f} ms, max {max(freed) * 1000:.0f} ms (a token takes "
        f"{step_s * 1000:.0f} ms); open files {fds1 - fds0:+d}; /health p99 {p99 * 1000:.1f} ms; jobs "
        f"{ {s: states.count(s) for s in set(states)} }"
    )
    assert statistics.median(freed) < step_s + 0.25 and max(freed) < 2.0
    assert fds1 - fds0 <= 2
    assert quantile(health.latencies, 0.5) < HEALTH_BUDGET_S and p99 < TAIL_BUDGET_S
    assert "running" not in states and "queued" not in states
