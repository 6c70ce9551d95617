"""Pipeline stages over torch.distributed (gloo on loopback): greedy tokens equal to one process and to transformers,
`generate` and `serve` under torchrun, a rank that crashes or hangs, sets that differ, rendezvous that cannot form.

Ranks are launched as torchrun launches them (its variables: RANK, WORLD_SIZE, MASTER_ADDR ...), by torchrun itself for
the CLI and by hand where a test must kill or stop one rank without the launcher ending the others.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from rocketllm_cli.distributed.stageplan import RankFacts, parse_counts, plan_stages
from rocketllm_cli.errors import KnobError

pytestmark = pytest.mark.compat

FIXTURES = Path(__file__).parent / "fixtures"
PROMPT = [1, 40, 57, 60, 71, 85, 90, 44]
NEW = 12
FP32 = {"compute_dtype": "fp32", "speculate": "off"}


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(rank: int, world: int, port: int, extra: dict | None = None) -> dict:
    env = {
        **os.environ,
        "RANK": str(rank),
        "WORLD_SIZE": str(world),
        "LOCAL_RANK": str(rank),
        "LOCAL_WORLD_SIZE": str(world),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "OMP_NUM_THREADS": "1",
        **(extra or {}),
    }
    env.pop("ROCKETLLM_DEBUG", None)
    return env


def launch(world: int, argv_of, extra: dict | None = None, **popen) -> list[subprocess.Popen]:
    """WORLD processes, rank r running argv_of(r), with torchrun's variables for a rendezvous on loopback."""
    port = _port()
    return [
        subprocess.Popen(
            argv_of(r),
            env=_env(r, world, port, extra),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            **popen,
        )
        for r in range(world)
    ]


def finish(procs: list[subprocess.Popen], timeout: float = 240) -> list[tuple[int, str, str]]:
    out = []
    for p in procs:
        try:
            stdout, stderr = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        out.append((p.returncode, stdout, stderr))
    return out


def library(model: Path, world: int, knobs: dict, fault: str = "", new: int = NEW) -> list[tuple[int, str, str]]:
    script = [
        sys.executable,
        str(FIXTURES / "stage_generate.py"),
        str(model),
        json.dumps(PROMPT),
        str(new),
        json.dumps(knobs),
    ]
    if world == 1:
        env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK")}
        done = subprocess.run(script, env={**env, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=240)
        return [(done.returncode, done.stdout, done.stderr)]
    procs = launch(world, lambda r: script + ([fault] if fault else []))
    if fault:  # rank 0 reports; the faulty rank is stopped or gone, and is then ended as its host would be
        try:
            first = finish(procs[:1])
        finally:
            _kill(procs[1:])
        return first
    return finish(procs)


def ids_of(result) -> list[int]:
    code, out, err = result
    assert code == 0, err[-2000:]
    return json.loads(out.strip().splitlines()[-1])["ids"]


def transformers_ids(model: Path) -> list[int]:
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    ids = torch.tensor([PROMPT])
    with torch.inference_mode():
        out = ref.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=NEW,
            min_new_tokens=NEW,
            do_sample=False,
            pad_token_id=0,
        )
    return out[0, len(PROMPT) :].tolist()


@pytest.fixture(scope="module")
def dense(tiny_factory) -> Path:
    return tiny_factory("llama", num_hidden_layers=6)


def test_two_and_three_ranks_equal_one_process_and_transformers(dense):
    expected = transformers_ids(dense)
    assert ids_of(library(dense, 1, FP32)[0]) == expected
    two = library(dense, 2, FP32)
    assert ids_of(two[0]) == expected
    assert all(code == 0 and not out for code, out, _ in two[1:])  # only rank 0 prints
    plan = json.loads(two[0][1].strip().splitlines()[-1])["plan"]
    assert [b - a for a, b in plan["ranges"]] and sum(b - a for a, b in plan["ranges"]) == 6
    three = library(dense, 3, {**FP32, "stages": "1,2,3"})
    result = json.loads(three[0][1].strip().splitlines()[-1])
    assert result["ids"] == expected
    assert result["plan"]["ranges"] == [[0, 1], [1, 3], [3, 6]] and result["plan"]["source"] == "--stages"
    # the other ranks' bytes count in rank 0's ledger: every layer served each decode pass
    served = result["stats"]["per_token_served"]
    assert sum(served.values()) > 0


def test_speculation_crops_every_rank(dense):
    """Prompt lookup verifies several tokens a pass and rolls the cache back: every rank crops its own to rank 0's
    length."""
    knobs = {"compute_dtype": "fp32", "speculate": "prompt-lookup"}
    assert ids_of(library(dense, 2, knobs)[0]) == ids_of(library(dense, 1, {**FP32})[0])


def test_int4_kv_cache_on_every_rank(dense):
    """An int4 KV cache is each rank's own, for its own layers: the tokens are one process's with the same cache."""
    knobs = {**FP32, "kv_cache_dtype": "int4", "kv_residual_tokens": "4"}
    assert ids_of(library(dense, 2, knobs, new=20)[0]) == ids_of(library(dense, 1, knobs, new=20)[0])


def test_moe_three_ranks(tiny_factory):
    from rocketllm_cli.synthetic import MOE_ARCHS

    arch = "qwen2_moe" if "qwen2_moe" in MOE_ARCHS else MOE_ARCHS[0]
    model = tiny_factory(arch)
    expected = transformers_ids(model)
    assert ids_of(library(model, 3, {**FP32, "stages": "1,2,1"})[0]) == expected
    # experts streamed from storage on every rank (nothing resident) give the same tokens
    streamed = {**FP32, "device_cache_bytes": "0", "host_cache_bytes": "0"}
    assert ids_of(library(model, 2, streamed)[0]) == expected


def test_packed_gguf_two_ranks(smollm2_gguf):
    """The real model as a packed set: its greedy tokens over two ranks are the single-process engine's."""
    knobs = {"speculate": "off"}
    one = ids_of(library(smollm2_gguf, 1, knobs, new=8)[0])
    two = library(smollm2_gguf, 2, knobs, new=8)
    assert ids_of(two[0]) == one


def torchrun(*argv: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(_port()),
        "-m",
        "rocketllm_cli",
        *argv,
    ]


def test_generate_under_torchrun_prints_what_one_process_prints(dense):
    argv = ["generate", str(dense), "hello there", "--raw", "-n", "12", "--dtype", "fp32", "--speculate", "off"]
    env = {**os.environ, "ROCKETLLM_KEEP_ALIVE": "0", "OMP_NUM_THREADS": "1"}
    alone = subprocess.run(
        [sys.executable, "-m", "rocketllm_cli", *argv], capture_output=True, text=True, env=env, timeout=240
    )
    staged = subprocess.run(torchrun(*argv, "--stats"), capture_output=True, text=True, env=env, timeout=240)
    assert alone.returncode == 0 and staged.returncode == 0, staged.stderr[-2000:]
    assert staged.stdout == alone.stdout
    assert "stages (derived, --stages" in staged.stderr and "Traceback" not in staged.stderr
    assert "stages: links" in staged.stderr  # --stats shows the time the links took per token


def test_bench_and_doctor_under_torchrun(dense):
    """bench follows rank 0's loads on every rank (one per regime); doctor prints every rank's measurements and the
    plan."""
    env = {**os.environ, "ROCKETLLM_KEEP_ALIVE": "0", "OMP_NUM_THREADS": "1"}
    bench = subprocess.run(
        torchrun(
            "bench", str(dense), "--regime", "resident", "storage", "--tokens", "4", "--prompt-tokens", "8", "--json"
        ),
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert bench.returncode == 0, bench.stderr[-3000:]
    rows = [r for r in json.loads(bench.stdout)["rows"] if r["name"] == "rocketllm"]
    assert [r["regime"] for r in rows] == ["resident", "storage"] and all(r["status"] == "measured" for r in rows)
    for row in rows:
        assert row["stages"]["passes"] >= 5 and row["stages"]["ranges"][-1][1] == 6
    # every rank's bytes: the storage regime serves the whole model from storage each decode token
    assert rows[1]["bytes_per_token"]["storage"] > rows[1]["bytes_per_token"]["device"]
    doctor = subprocess.run(
        torchrun("doctor", "--model", str(dense)), capture_output=True, text=True, env=env, timeout=300
    )
    assert doctor.returncode == 0, doctor.stderr[-3000:]
    section = doctor.stdout.split("## Pipeline stages", 1)[1]
    assert "rank 0 (" in section and "rank 1 (" in section and "plan: stages (derived, --stages" in section
    assert doctor.stdout.count("# RocketLLM doctor report") == 1  # rank 0 alone prints


def _serve(dense, extra_args=(), extra_env=None):
    procs = launch(
        2,
        lambda r: [
            sys.executable,
            "-m",
            "rocketllm_cli",
            "serve",
            str(dense),
            "--port",
            "0",
            "--dtype",
            "fp32",
            "--stage-timeout-s",
            "3",
            *extra_args,
        ],
        extra_env,
    )
    deadline = time.monotonic() + 180
    url = None
    lines = []
    while time.monotonic() < deadline and url is None:
        line = procs[0].stderr.readline()
        if not line:
            break
        lines.append(line)
        if "listening on http://" in line:
            url = line.split("listening on ", 1)[1].split(" ", 1)[0]
    assert url, "".join(lines)[-3000:]
    return procs, url, lines


def _kill(procs):
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGCONT)
            p.kill()
    for p in procs:
        p.wait(timeout=30)


def test_serve_answers_the_openai_client_then_503_when_a_rank_hangs(dense):
    import httpx
    import openai

    procs, url, lines = _serve(dense)
    try:
        assert any(line.startswith("stages (derived") for line in lines)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        reply = client.completions.create(model=dense.name, prompt="hello there", max_tokens=12, temperature=0)
        assert reply.usage.completion_tokens == 12
        health = httpx.get(f"{url}/health").json()
        assert health["status"] == "ok" and health["stages"]["ranges"][-1][1] == 6
        import anthropic

        message = anthropic.Anthropic(base_url=url, api_key="none", max_retries=0).messages.create(
            model=dense.name, max_tokens=6, messages=[{"role": "user", "content": "hello"}]
        )
        assert message.usage.output_tokens >= 1 and message.stop_reason in ("max_tokens", "end_turn")
        procs[1].send_signal(signal.SIGSTOP)  # a host that hangs: no heartbeat, its socket still open
        started = time.monotonic()
        with pytest.raises(openai.InternalServerError) as hung:
            client.completions.create(model=dense.name, prompt="hello there", max_tokens=12, temperature=0, timeout=60)
        waited = time.monotonic() - started
        assert hung.value.status_code == 503 and "rank 1" in str(hung.value) and "no heartbeat" in str(hung.value)
        assert waited < 3 + 10, waited  # the stage timeout, plus the watchdog's period
        again = httpx.post(f"{url}/v1/completions", json={"model": dense.name, "prompt": "x", "max_tokens": 2})
        assert again.status_code == 503
        down = httpx.get(f"{url}/health")
        assert down.status_code == 503 and down.json()["status"] == "failed"
    finally:
        _kill(procs)


def test_serve_answers_503_when_a_rank_dies(dense):
    import httpx

    procs, url, _ = _serve(dense)
    try:
        procs[1].kill()
        procs[1].wait(timeout=30)
        reply = httpx.post(
            f"{url}/v1/completions", json={"model": dense.name, "prompt": "hello", "max_tokens": 4}, timeout=60
        )
        assert reply.status_code == 503 and "rank 1" in reply.text, reply.text
        assert httpx.get(f"{url}/health").status_code == 503
    finally:
        _kill(procs)


@pytest.mark.parametrize("fault,says", [("crash", "stopped answering"), ("hang", "no heartbeat")])
def test_a_rank_that_crashes_or_hangs_is_one_line(dense, fault, says):
    results = library(dense, 2, {**FP32, "stage_timeout_s": "3"}, fault=fault)
    code, out, err = results[0]
    assert code == 1 and not out
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "rank 1" in lines[0] and says in lines[0], err[-2000:]
    assert "Traceback" not in err


def test_sets_that_differ_are_refused_naming_the_rank(tiny_factory, dense):
    other = tiny_factory("llama", num_hidden_layers=6, seed=1)
    script = lambda model: [
        sys.executable,
        str(FIXTURES / "stage_generate.py"),
        str(model),
        json.dumps(PROMPT),
        "4",
        json.dumps(FP32),
    ]
    results = finish(launch(2, lambda r: script(dense if r == 0 else other)))
    (code0, _, err0), (code1, _, err1) = results
    assert code0 == 1 and code1 == 1
    assert [line for line in err0.splitlines() if line.startswith("error:")] == [
        line for line in err0.splitlines() if "has another shard set than rank 0" in line
    ]
    assert "rank 1 (" in err0 and "error:" not in err1  # rank 0 says it once for all


def test_a_rendezvous_that_cannot_form_is_one_line(dense):
    """Rank 1 never comes: rank 0 waits the stage timeout, then one line."""
    port = _port()
    env = _env(0, 2, port, {"ROCKETLLM_KEEP_ALIVE": "0"})
    done = subprocess.run(
        [sys.executable, "-m", "rocketllm_cli", "generate", str(dense), "hi", "-n", "2", "--stage-timeout-s", "2"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert "could not join the stages at 127.0.0.1" in done.stderr and done.stderr.count("error:") == 1, done.stderr


def test_a_wildcard_rendezvous_is_refused(dense):
    env = _env(0, 2, _port(), {"MASTER_ADDR": "0.0.0.0", "ROCKETLLM_KEEP_ALIVE": "0"})
    done = subprocess.run(
        [sys.executable, "-m", "rocketllm_cli", "generate", str(dense), "hi", "-n", "2"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1 and "is a wildcard" in done.stderr and "ROCKETLLM_STAGE_ALLOW_ANY" in done.stderr


# -- the plan, torch-free ----------------------------------------------------------------------------------------------
def _rank(r: int, device: int, storage_bps: float = 1e9, compute_bps: float = 10e9) -> RankFacts:
    return RankFacts(r, f"host{r}", device, 0, compute_bps, None, storage_bps, link_latency_s=1e-4, link_bps=1e8)


def test_plan_balances_equal_ranks_and_spares_a_small_one():
    layers = [100] * 8
    even = plan_stages(
        [_rank(0, 10_000), _rank(1, 10_000)], layers, layers, first_bytes=40, other_bytes=0, hidden_bytes=1000
    )
    assert even.ranges == [(0, 4), (4, 8)]
    assert even.link_seconds == pytest.approx(2 * (1e-4 + 1000 / 1e8))
    # rank 1 holds 200 bytes in memory, the rest streams at 1 GB/s: it gets fewer layers than the one holding everything
    small = plan_stages(
        [_rank(0, 10_000), _rank(1, 200)], layers, layers, first_bytes=40, other_bytes=0, hidden_bytes=1000
    )
    assert small.ranges[1][1] - small.ranges[1][0] < 4
    assert small.slowest_seconds <= even.slowest_seconds * 10
    assert small.stream_seconds == pytest.approx(sum(small.stage_seconds) + small.link_seconds)


def test_plan_override_and_its_refusals():
    ranks = [_rank(0, 1000), _rank(1, 1000), _rank(2, 1000)]
    plan = plan_stages(ranks, [1] * 6, [1] * 6, 0, 0, 8, override="1,2,3")
    assert plan.ranges == [(0, 1), (1, 3), (3, 6)] and plan.source == "--stages"
    for bad in ("1,2", "0,3,3", "2,2,3", "a,b,c"):
        with pytest.raises(KnobError):
            parse_counts(bad, 6, 3)
    with pytest.raises(KnobError, match="at most 2"):
        plan_stages(ranks, [1, 1], [1, 1], 0, 0, 8)


_CLOSE_LEAVES_NO_THREADS = """
import os, sys
from rocketllm_cli.distributed.group import StageGroup
from rocketllm_cli.distributed.torchrun import Launch

group = StageGroup(Launch(0, 1, 0, 1, "127.0.0.1", int(sys.argv[1]), False), 30)
import torch.distributed.nn.functional  # what loading a tokenizer imports, after the group formed
group.close(orderly=True)
print([open(f"/proc/self/task/{t}/comm").read().strip() for t in sorted(os.listdir("/proc/self/task"))])
"""


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="reads the process's threads from /proc")
def test_a_closed_group_leaves_no_gloo_or_store_thread_to_meet_the_exit():
    # a group kept alive past destroy_process_group (torch.distributed.nn binds it as a default argument) left gloo's
    # and the store's threads running into the interpreter's exit, which now and then aborted rank 0 (SIGABRT)
    done = subprocess.run(
        [sys.executable, "-c", _CLOSE_LEAVES_NO_THREADS, str(_port())],
        env={**_env(0, 1, 0), "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    threads = done.stdout.strip().splitlines()[-1]
    assert "gloo" not in threads and "tcpstore" not in threads, threads


def test_stages_that_do_not_fit_are_one_line_from_rank_0(dense):
    results = library(dense, 3, {**FP32, "stages": "1,2"})
    (code0, _, err0), *others = results
    assert code0 == 1 and "stages '1,2' does not fit: give 3 layer counts" in err0 and "Traceback" not in err0, (
        f"rank 0 exited {code0}: {err0[-2000:]}"
    )  # rank 0 once ended with SIGABRT in a full suite: say what it printed
    assert all(code == 1 and "error:" not in err for code, _, err in others)  # every rank stops; rank 0 says why
