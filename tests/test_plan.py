"""`rocketllm plan`: configurations enumerated from headers alone, ranked by the cost model's projection, each fitting
its
memory; what-if hardware, constraints, the defaults' own row, --json, --verify, and a 70B GGUF header planned in
seconds.

Profiles here are synthetic (nothing is measured); the 70B file is a GGUF header with its data left sparse."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
from cli_contract import one_error_line
from typer.testing import CliRunner

from rocketllm_cli.app import app
from rocketllm_cli.planning.commandlines import commands
from rocketllm_cli.planning.formats import read_source
from rocketllm_cli.planning.planner import SIGNIFICANT, PlanError, make_plan
from rocketllm_cli.planning.projection import context_of
from rocketllm_cli.planning.request import PlanRequest
from rocketllm_cli.planning.whatif import profile_from_file, what_if
from rocketllm_cli.profiles import (
    Capability,
    HardwareProfile,
    Measurement,
    model_facts_from_path,
    resolve_knobs,
)
from rocketllm_cli.profiles.cost import plan_tier_bytes, project
from rocketllm_cli.profiles.knobs.expression import evaluate

pytestmark = pytest.mark.compat

GiB = 1024**3
BANDWIDTHS = {
    "host_memory": 20e9,
    "device_memory": 20e9,
    "page_cache_read": 10e9,
    "storage_read": 2e9,
    "storage_read_direct": 2.5e9,
    "matvec_bf16": 20e9,
    "matvec_fp32": 12e9,
}


def cpu_profile(ram: int = 16 * GiB, free: float = 0.9, **bandwidths) -> HardwareProfile:
    found = {
        name: Measurement(name, bps, "synthetic", int(bps), 1.0) for name, bps in {**BANDWIDTHS, **bandwidths}.items()
    }
    return HardwareProfile(
        "plan-test",
        "cpu",
        8,
        ram,
        int(ram * free),
        measurements=found,
        capabilities={
            "compute_dtype": Capability("compute_dtype", "bf16", None, "synthetic"),
            "direct_io": Capability("direct_io", True),
            "storage_kind": Capability("storage_kind", "nvme"),
        },
    )


def llama_config(
    path: Path, hidden=4096, layers=32, inter=14336, heads=32, kv_heads=8, vocab=128256, positions=131072
) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(
        json.dumps(
            {
                "model_type": "llama",
                "hidden_size": hidden,
                "intermediate_size": inter,
                "num_hidden_layers": layers,
                "num_attention_heads": heads,
                "num_key_value_heads": kv_heads,
                "vocab_size": vocab,
                "max_position_embeddings": positions,
                "torch_dtype": "bfloat16",
                "tie_word_embeddings": False,
            }
        )
    )
    return path / "config.json"


@pytest.fixture(scope="module")
def gguf_70b(tmp_path_factory) -> Path:
    """A Llama-70B-shaped Q4_0 GGUF: its header written by the gguf package, its 37 GiB of data a sparse hole."""
    import numpy as np
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter

    path = tmp_path_factory.mktemp("plan70b") / "llama-70b.Q4_0.gguf"
    writer = GGUFWriter(path, "llama")
    hidden, layers, inter, heads, kv_heads, vocab = 8192, 80, 28672, 64, 8, 128256
    for add, value in (
        (writer.add_context_length, 8192),
        (writer.add_embedding_length, hidden),
        (writer.add_block_count, layers),
        (writer.add_feed_forward_length, inter),
        (writer.add_head_count, heads),
        (writer.add_head_count_kv, kv_heads),
        (writer.add_file_type, 2),
    ):
        add(value)
    sizes = []

    def matrix(name, rows, cols, kind="Q4_0"):
        qtype = GGMLQuantizationType[kind]
        block, size = GGML_QUANT_SIZES[qtype]
        sizes.append(rows * cols // block * size)
        writer.add_tensor_info(name, (rows, cols // block * size), np.dtype(np.uint8), sizes[-1], raw_dtype=qtype)

    def norm(name):
        sizes.append(4 * hidden)
        writer.add_tensor_info(name, (hidden,), np.dtype(np.float32), sizes[-1])

    matrix("token_embd.weight", vocab, hidden)
    for i in range(layers):
        norm(f"blk.{i}.attn_norm.weight")
        norm(f"blk.{i}.ffn_norm.weight")
        for name, rows, cols in (
            ("attn_q", hidden, hidden),
            ("attn_k", kv_heads * 128, hidden),
            ("attn_v", kv_heads * 128, hidden),
            ("attn_output", hidden, hidden),
            ("ffn_gate", inter, hidden),
            ("ffn_up", inter, hidden),
            ("ffn_down", hidden, inter),
        ):
            matrix(f"blk.{i}.{name}.weight", rows, cols)
    norm("output_norm.weight")
    matrix("output.weight", vocab, hidden, "Q6_K")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    out = writer.fout[0]
    out.flush()
    start = -(-out.tell() // writer.data_alignment) * writer.data_alignment
    # sparse: no data written
    out.truncate(start + sum(-(-n // writer.data_alignment) * writer.data_alignment for n in sizes))
    out.close()
    return path


def test_rows_are_ranked_fit_their_budget_and_recompute_from_what_they_print(tmp_path):
    profile = cpu_profile(ram=8 * GiB)
    source = read_source(llama_config(tmp_path / "llama8b"))
    plan = make_plan(source, profile, PlanRequest())
    assert {f.name for f in source.formats()} == {"as stored", "int4", "int8"}
    speeds = [float(f"{r.tokens_per_s:.{SIGNIFICANT}g}") for r in plan.rows]
    assert speeds == sorted(speeds, reverse=True) and [r.rank for r in plan.rows] == list(range(1, len(plan.rows) + 1))
    for row in plan.rows:
        m = row.memory
        assert m["used"] <= m["budget"]["memory"], row.short()  # every printed row fits
        assert (
            m["device"]["total"]
            == m["device"]["weights"] + m["device"]["kv"] + m["device"]["buffers"] + m["device"]["runtime"]
        )
        assert math.isclose(evaluate(row.formula, row.inputs), row.tokens_per_s)
        # the projection is the cost model's, on the bytes per tier doctor projects from
        flags = {k: v for k, v in row.flags.items() if k != "speculate"}
        knobs = resolve_knobs(profile, row.format.facts, flags=flags, env={})
        computed = replace(
            profile,
            capabilities={**profile.capabilities, "compute_dtype": Capability("compute_dtype", row.compute_dtype)},
        )
        seconds = project(computed, row.format.facts, plan_tier_bytes(row.format.facts, knobs)).overlapped_seconds
        assert math.isclose(row.tokens_per_s, 1 / seconds, rel_tol=1e-9), row.short()
    print(f"{len(plan.rows)} rows in {plan.seconds:.3f} s; left out {plan.left_out}")


def test_a_speculating_row_projects_at_the_tokens_per_pass_bench_measured(tmp_path, monkeypatch):
    """Prompt lookup's gain is the text's, not the hardware's: a row projects at the tokens per pass bench measured for
    the set (probe/acceptance.py), its speculation-off twin at one, and both recompute from what they print."""
    from types import SimpleNamespace

    from rocketllm_cli.profiles.probe import acceptance

    monkeypatch.setenv("ROCKETLLM_CACHE", str(tmp_path / "cache"))
    profile = cpu_profile(ram=8 * GiB)  # an 8B model streams here: speculation is derived on
    source = read_source(llama_config(tmp_path / "llama8b"))
    unmeasured = make_plan(source, profile, PlanRequest())
    on = [r for r in unmeasured.rows if r.speculate == "prompt-lookup"]
    assert on and all("tokens_per_pass" not in r.inputs and any("a floor" in n for n in r.notes) for r in on)

    manifest = SimpleNamespace(key="fp32-blocks")
    acceptance.record(tmp_path, manifest, {"mode": "off"})  # nothing to keep
    acceptance.record(
        tmp_path,
        manifest,
        {
            "mode": "prompt-lookup",
            "proposed": 90,
            "accepted": 38,
            "passes": 26,
            "tokens": 64,
            "decode_positions_per_pass": 3.46,
        },
    )
    found = acceptance.lookup(tmp_path, manifest, ("off", "prompt-lookup", "draft"))
    assert list(found) == ["prompt-lookup"] and found["prompt-lookup"]["tokens_per_pass"] == pytest.approx(64 / 26)

    plan = make_plan(replace(source, speculation=found), profile, PlanRequest())
    by_key = {}
    for row in plan.rows:
        assert math.isclose(evaluate(row.formula, row.inputs), row.tokens_per_s)
        by_key[(row.format.name, row.compute_dtype, row.kv_dtype, row.residency, row.context, row.speculate)] = row
    pairs = [
        (row, by_key[(*key[:-1], "off")])
        for key, row in by_key.items()
        if key[-1] == "prompt-lookup" and row.format.stored
    ]
    assert pairs
    for spec, off in pairs:
        assert (
            spec.inputs["tokens_per_pass"] == pytest.approx(64 / 26, abs=1e-3) and "tokens_per_pass" not in off.inputs
        )
        assert spec.tokens_per_s == pytest.approx(off.tokens_per_s * 64 / 26, rel=1e-3)
        assert any("as bench measured this set" in n and "computes 3.46 positions" in n for n in spec.notes)
        # a checkpoint's float weights have no row-count measurement: the pass of 3 positions is costed as one, said
        assert any("a pass of 3 positions is costed as one" in n for n in spec.notes)
        assert off.flags.get("speculate") == "off" and not any("positions" in n for n in off.notes)
    assert plan.rows[0].speculate == "prompt-lookup"  # measured gain: the speculating rows rank first


def test_the_first_row_is_the_defaults_or_says_why_they_differ(tmp_path):
    source = read_source(llama_config(tmp_path / "llama8b"))
    for profile in (cpu_profile(ram=64 * GiB), cpu_profile(ram=8 * GiB)):
        plan = make_plan(source, profile, PlanRequest())
        knobs = resolve_knobs(profile, source.facts, env={})
        default = plan.default
        assert default.flags == {} and default.format.stored
        assert default.memory["device"]["weights"] == min(knobs.value("device_cache_bytes"), source.facts.total_bytes)
        assert default.context == knobs.value("max_context")
        assert default.compute_dtype == context_of(profile, source.facts, knobs).compute_dtype()
        assert plan.rows[0].default or plan.rows[0].why, plan.rows[0].short()
    small = read_source(
        llama_config(tmp_path / "small", hidden=512, layers=4, inter=1024, heads=8, kv_heads=8, vocab=32000)
    )
    plan = make_plan(small, cpu_profile(ram=64 * GiB), PlanRequest())
    assert plan.rows[0].format.quantize == "int4" and "never requantise" in plan.rows[0].why  # fewer bytes a token
    plan = make_plan(small, cpu_profile(ram=64 * GiB), PlanRequest(quality=0.0))  # the weights as they are
    assert plan.rows[0].default and plan.rows[0].residency_text() == "all resident" and not plan.rows[0].why
    big = make_plan(source, cpu_profile(ram=8 * GiB), PlanRequest())
    assert not big.rows[0].default and "never requantise" in big.rows[0].why  # int4 makes the 15 GiB model fit 8 GiB


def test_what_if_hardware_changes_the_plan(gguf_70b):
    source = read_source(gguf_70b)
    here = cpu_profile(ram=16 * GiB)
    small, notes = what_if(here, ram=24 * GiB)
    assert (
        small.ram_total == 24 * GiB and abs(small.ram_available / small.ram_total - 0.9) < 1e-6 and "--ram" in notes[0]
    )
    tight = make_plan(source, small, PlanRequest())
    assert (
        tight.rows[0].residency_text() != "all resident"
        and tight.rows[0].memory["device"]["weights"] < source.facts.total_bytes
    )
    roomy = make_plan(source, what_if(here, ram=128 * GiB)[0], PlanRequest())
    assert roomy.rows[0].residency_text() == "all resident" and roomy.default.residency_text() == "all resident"
    faster = make_plan(source, what_if(small, disk_bps=14e9)[0], PlanRequest())
    assert faster.rows[0].tokens_per_s > 2 * tight.rows[0].tokens_per_s  # streamed bytes at 14 instead of 2.5 GB/s
    stages = make_plan(source, small, PlanRequest(hosts=4, link_bps=1.25e9, link_latency_s=1e-4))
    first = stages.rows[0]
    assert first.hosts in (2, 4) and first.stages and first.tokens_per_s > 3 * tight.rows[0].tokens_per_s
    for host in first.memory["per_host"]:
        assert host["device"] + host["host"] <= first.memory["budget"]["memory"]
    assert sum(b - a for a, b in (h["layers"] for h in first.memory["per_host"])) == source.facts.num_layers
    assert "torchrun --nnodes" in commands(first, source, "m.gguf")["generate"]
    with pytest.raises(Exception, match="--vram"):
        what_if(here, vram=80 * GiB)


def test_constraints_filter_rows(tmp_path, gguf_70b):
    source = read_source(llama_config(tmp_path / "llama8b"))
    profile = cpu_profile(ram=32 * GiB)
    plan = make_plan(source, profile, PlanRequest(min_context=32768))
    assert plan.rows and all(r.context >= 32768 for r in plan.rows)
    capped = make_plan(source, profile, PlanRequest(max_memory=6 * GiB))
    assert capped.rows and all(r.memory["used"] <= 6 * GiB for r in capped.rows)
    # a capped row spells out its caches: this machine would derive more
    assert all("device_cache_bytes" in r.flags for r in capped.rows if not r.stages)
    batched = make_plan(source, profile, PlanRequest(batch=4, min_context=4096))
    assert all(r.batch == 4 and r.context == 4096 and r.memory["tokens"] == 4 * 4096 for r in batched.rows)
    exact = make_plan(source, profile, PlanRequest(quality=0.0))
    assert exact.rows and all(r.format.kl == 0 and r.format.stored for r in exact.rows)
    with pytest.raises(PlanError, match=r"--quality .*no format with a measured KL.*nearest: #1 "):
        make_plan(read_source(gguf_70b), profile, PlanRequest(quality=0.01))


def test_a_request_beyond_every_row_is_one_line_naming_the_nearest(tmp_path, gguf_70b):
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps(cpu_profile(ram=24 * GiB).to_dict()))
    result = CliRunner().invoke(app, ["plan", str(gguf_70b), "--profile", str(profile), "--min-context", "1000000"])
    line = one_error_line(result)
    assert "--min-context 1000000" in line and "at most 8192 tokens of context, the model's own limit" in line
    assert "nearest: #" in line and "tokens/s" in line
    line = one_error_line(
        CliRunner().invoke(app, ["plan", str(gguf_70b), "--profile", str(profile), "--max-memory", "100MiB"])
    )
    assert "--max-memory 100.00 MiB" in line and "nearest: #" in line


def test_json_is_one_document_with_commands(tmp_path, gguf_70b):
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps(cpu_profile(ram=24 * GiB).to_dict()))
    result = CliRunner().invoke(
        app, ["plan", str(gguf_70b), "--profile", str(profile), "--hosts", "2", "--link-bw", "1.25GB/s", "--json"]
    )
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["rows"] and doc["defaults_rank"] >= 1 and doc["summary"].startswith("rocketllm plan llama-70b.Q4_0")
    first = doc["rows"][0]
    assert {"tokens_per_s", "formula", "inputs", "memory", "commands", "flags"} <= set(first)
    assert first["commands"]["generate"] and "bench" in first["commands"]["bench"]
    people = CliRunner().invoke(app, ["plan", str(gguf_70b), "--profile", str(profile), "--top", "3"])
    assert (
        people.exit_code == 0
        and "why the defaults differ:" in people.stdout
        and "\nsummary: rocketllm plan" in people.stdout
    )
    one = CliRunner().invoke(app, ["plan", str(gguf_70b), "--profile", str(profile), "--summary"])
    assert one.exit_code == 0 and len(one.stdout.strip().splitlines()) == 1


def test_a_70b_header_plans_in_seconds(tmp_path, gguf_70b):
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps(cpu_profile(ram=64 * GiB).to_dict()))
    for args in ([], ["--hosts", "2", "--link-bw", "1.25GB/s"], ["--hosts", "4", "--link-bw", "1.25GB/s"]):
        started = time.perf_counter()
        result = CliRunner().invoke(
            app, ["plan", str(gguf_70b), "--profile", str(profile), "--ram", "24GiB", *args, "--json"]
        )
        seconds = time.perf_counter() - started
        assert result.exit_code == 0, result.output
        print(
            f"plan 70B GGUF header, 24 GiB, {args or 'one host'}: {len(json.loads(result.stdout)['rows'])} rows in "
            f"{seconds:.2f} s"
        )
        assert seconds < 10  # about 0.1-0.5 s here; the budget is 2 s


def test_a_doctor_document_is_a_profile(tmp_path, gguf_70b):
    from rocketllm_cli.profiles.report import document

    original = cpu_profile(ram=24 * GiB)
    path = tmp_path / "doctor.json"
    path.write_text(json.dumps(document.build(original, None, None)))
    loaded = profile_from_file(path)
    source = read_source(gguf_70b)
    assert (
        make_plan(source, loaded, PlanRequest()).rows[0].tokens_per_s
        == make_plan(source, original, PlanRequest()).rows[0].tokens_per_s
    )


def test_formats_of_a_checkpoint_and_a_shard_set_from_their_headers(tiny_checkpoint):
    source = read_source(tiny_checkpoint)
    formats = {f.name: f for f in source.formats()}
    assert formats["as stored"].facts == model_facts_from_path(tiny_checkpoint) and formats["as stored"].kl == 0
    assert formats["int8"].facts.total_bytes < formats["as stored"].facts.total_bytes
    assert formats["int4"].facts.total_bytes < formats["int8"].facts.total_bytes and formats["int4"].kl is None
    plan = make_plan(source, cpu_profile(), PlanRequest())
    requantised = next(r for r in plan.rows if not r.format.stored)
    lines = commands(requantised, source, "tiny")
    assert lines["shard"] == (
        f"rocketllm shard tiny --quantize {requantised.format.quantize} --out "
        f"{source.name}-{requantised.format.quantize}"
    )


@pytest.mark.parametrize(
    "args, code, says",
    [
        (["/no/such/model.gguf"], 1, "model path not found"),
        (["M", "--hosts", "2"], 2, "--hosts needs --link-bw"),
        (["M", "--link-bw", "1GB/s"], 2, "--link-bw and --link-latency go with --hosts"),
        (["M", "--ram", "lots"], 2, "--ram: cannot read 'lots' as a size"),
        (["M", "--disk-bw", "0"], 2, "--disk-bw must be more than 0"),
        (["M", "--vram", "80GiB"], 2, "--vram: this profile computes on cpu"),
        (["M", "--profile", "BAD"], 2, "--profile bad.json: not JSON"),
        (["M", "--batch", "0"], 2, "--batch"),
    ],
)
def test_bad_inputs_are_one_error_line(args, code, says, tmp_path, gguf_70b):
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps(cpu_profile().to_dict()))
    (tmp_path / "bad.json").write_text("{not json")
    args = [str(gguf_70b) if a == "M" else str(tmp_path / "bad.json") if a == "BAD" else a for a in args]
    if "--profile" not in args:
        args += ["--profile", str(profile)]
    done = subprocess.run(
        [sys.executable, "-m", "rocketllm_cli", "plan", *args], capture_output=True, text=True, timeout=120
    )
    lines = done.stderr.strip().splitlines()
    assert done.returncode == code and len(lines) == 1 and lines[0].startswith("error: ") and done.stdout == "", (
        done.stderr
    )
    assert says in lines[0] and "Traceback" not in done.stderr and "internal error" not in lines[0], lines[0]


def test_verify_benches_the_top_rows_that_run_here(monkeypatch, tmp_path):
    """--verify runs `rocketllm bench` per row (faked here): a row needing other hosts is skipped, a row assuming less
    RAM
    runs under ROCKETLLM_WITH_RAM's wrapper, or says it was measured without the cap."""
    from rocketllm_cli.bench import planverify

    source = read_source(
        llama_config(tmp_path / "small", hidden=512, layers=4, inter=1024, heads=8, kv_heads=8, vocab=32000)
    )
    profile, _ = what_if(cpu_profile(ram=64 * GiB), ram=GiB)
    plan = make_plan(source, profile, PlanRequest(quality=0.0))  # the weights as stored: no shard step
    calls = []

    def fake_run(command, **kwargs):
        calls.append((command, kwargs.get("env", {})))
        doc = {
            "rows": [
                {
                    "name": "rocketllm",
                    "status": "measured",
                    "ms_per_token": {"median": 20.0, "p10": 19.0, "p90": 22.0},
                    "tokens_per_s": 49.0,
                }
            ]
        }
        return subprocess.CompletedProcess(command, 0, json.dumps(doc), "")

    monkeypatch.setattr(planverify.subprocess, "run", fake_run)
    monkeypatch.setattr("rocketllm_cli.profiles.probe.machine.memory", lambda: (64 * GiB, 60 * GiB))
    monkeypatch.delenv(planverify.WITH_RAM, raising=False)
    measured = planverify.verify_rows(plan, str(source.run_path), 2, lambda m: None)
    assert [m["status"] for m in measured] == ["measured", "measured"] and measured[0]["tokens_per_s"] == 50.0
    assert calls[0][0][3:5] == ["bench", str(source.run_path)] and "--json" in calls[0][0]
    assert any("without the" in note for note in measured[0]["notes"])
    # a capped row starts cold: what this machine caches of the model would serve it from outside its cap
    assert any(
        note.startswith("started cold: ") and "evicted from the page cache" in note for note in measured[0]["notes"]
    )
    monkeypatch.setenv(planverify.WITH_RAM, "/opt/with-ram")
    calls.clear()
    planverify.verify_rows(plan, str(source.run_path), 1, lambda m: None)
    assert calls[0][0][:3] == ["/opt/with-ram", f"{GiB // 2**20}M", "--"]
    calls.clear()
    requantised = make_plan(source, profile, PlanRequest())
    assert requantised.rows[0].format.quantize == "int4"
    planverify.verify_rows(requantised, str(source.run_path), 1, lambda m: None)
    assert calls[0][0][3:6] == ["shard", str(source.run_path), "--quantize"] and "bench" in calls[1][0]


def test_verify_of_a_streaming_speculating_row(monkeypatch, tmp_path):
    """A speculating run's rate is its tokens over its decode time (the median token sits in the passes that made the
    most); a streaming row is projected again at the bandwidth bench read off the disk just after the run."""
    from rocketllm_cli.bench import planverify

    source = read_source(llama_config(tmp_path / "llama8b"))
    plan = make_plan(source, cpu_profile(ram=8 * GiB), PlanRequest())
    row = plan.rows[0]
    assert row.speculate == "prompt-lookup" and "storage_bps" in row.inputs

    def fake_run(command, **kwargs):
        doc = {
            "rows": [
                {
                    "name": "rocketllm",
                    "status": "measured",
                    "ms_per_token": {"median": 100.0, "p10": 90.0, "p90": 300.0},
                    "tokens_per_s": 5.0,
                    "speculation": {"mode": "prompt-lookup", "passes": 5, "tokens": 10, "tokens_per_pass": 2.0},
                    "disk_now": {"bps": 1e8, "how": "O_DIRECT x2"},
                }
            ]
        }
        return subprocess.CompletedProcess(command, 0, json.dumps(doc), "")

    monkeypatch.setattr(planverify.subprocess, "run", fake_run)
    monkeypatch.setattr("rocketllm_cli.profiles.probe.machine.memory", lambda: (64 * GiB, 60 * GiB))
    monkeypatch.setattr(planverify, "_evict_model", lambda *paths: "0 files")
    [measured] = planverify.verify_rows(plan, str(source.run_path), 1, lambda m: None)
    assert measured["tokens_per_s"] == 5.0 and measured["rate"] == "mean"  # not 1000 / 100 ms
    assert measured["command"].endswith(f"--tokens {planverify.SPECULATING_TOKENS}")  # passes enough to average
    again = measured["disk_now"]["projected_tokens_per_s"]
    assert again == pytest.approx(evaluate(row.formula, {**row.inputs, "storage_bps": 1e8}))
    assert again < row.tokens_per_s  # 0.1 GB/s against the profile's 2.5
    from rocketllm_cli.planning.report import verify_lines

    text = "\n".join(verify_lines([measured]))
    assert "tokens over decode time" in text and "at the 0.10 GB/s the disk read just after the run" in text

    # a row projected at the set's own reads is held to the way the run read now, not to the fastest way
    from rocketllm_cli.bench.planverify import _at_disk_now

    from rocketllm_cli.profiles.probe.unitreads import UnitReadRow, UnitReads

    reads = UnitReads(1 << 20, 2, 1, [UnitReadRow(True, 1, 1 << 20, 0.01, 0.0)]).to_dict()
    own = replace(row, format=replace(row.format, facts=replace(row.format.facts, unit_reads=reads)))
    entry = {"status": "measured", "disk_now": {"bps": 1e8, "run_way": {"bps": 5e7, "how": "O_DIRECT x1"}}}
    assert _at_disk_now(own, dict(entry))["disk_now"]["bps"] == 5e7
    assert _at_disk_now(row, dict(entry))["disk_now"]["bps"] == 1e8


def test_a_capped_verify_evicts_the_model_and_its_sets(tmp_path, monkeypatch):
    from rocketllm_cli.bench import planverify

    monkeypatch.setenv("ROCKETLLM_CACHE", str(tmp_path / "cache"))
    model = tmp_path / "tiny.gguf"
    model.write_bytes(b"GGUF" + bytes(4092))
    shards = tmp_path / "cache" / "shards"
    for name in ("tiny-0123-fp32-blocks", "tinyother-4567-fp32", "tiny-89ab-bf16"):
        (shards / name).mkdir(parents=True)
        (shards / name / "layer.000.safetensors").write_bytes(bytes(8192))
    found = planverify._sets_of(model)
    assert [p.name for p in found] == ["tiny-0123-fp32-blocks", "tiny-89ab-bf16"]  # another model's set is not its
    assert planverify._evict_model(model, *found) == "3 files (20.00 KiB)"


@pytest.mark.realmodel
def test_plan_of_a_gguf_projects_from_the_decode_bench_measured_on_its_set(smollm2_gguf, tmp_path, monkeypatch):
    """A GGUF whose default set is in the cache and was benched here: its stored format projects from that record, as
    `plan SHARDS` and `doctor --model SHARDS` do, the record of the kernel it runs on (int16 on a CPU, not exact's);
    found by the file's content fingerprint, which is not taken again."""
    from typer.testing import CliRunner

    from rocketllm_cli.app import app
    from rocketllm_cli.checkpoint.manifest import Manifest
    from rocketllm_cli.planning.formats import sets_of_gguf
    from rocketllm_cli.profiles import HardwareProfile
    from rocketllm_cli.profiles.probe.decodecompute import record
    from rocketllm_cli.shard import identity
    from rocketllm_cli.synthetic.gguf import write_llama_gguf

    monkeypatch.setenv("ROCKETLLM_CACHE", str(tmp_path / "cache"))
    model = write_llama_gguf(
        tmp_path / "tiny.gguf",
        smollm2_gguf,
        hidden=256,
        layers=2,
        intermediate=512,
        heads=4,
        kv_heads=2,
        qtype="Q4_K",
        embed_type="Q8_0",
    )
    assert sets_of_gguf(model) == []  # never sharded: nothing known, nothing hashed
    done = CliRunner().invoke(app, ["shard", str(model), "--json"])
    assert done.exit_code == 0, done.stderr
    [directory] = sets_of_gguf(model)
    monkeypatch.setattr(identity, "file_digest", lambda path: pytest.fail("plan hashed the file"))
    profile = HardwareProfile.load()
    knob = str(profile.capability("compute_dtype"))
    record(profile, directory, Manifest.load(directory), knob, {"median": 40.0, "p10": 38.0, "n": 8}, 2)
    record(profile, directory, Manifest.load(directory), knob, {"median": 30.0, "p10": 28.0, "n": 8}, 2, None, "int16")
    doc = json.loads(CliRunner().invoke(app, ["plan", str(model), "--json"]).stdout)
    default = next(row for row in doc["rows"] if row["default"])
    measured = 0.030 if profile.is_cpu else 0.040  # the default kernel's own record: int16 on a CPU
    assert default["formula"] == "batch / (compute_s)" and default["inputs"]["compute_s"] == pytest.approx(measured)


def test_a_shard_sets_rows_stream_at_its_own_reads_measured_here(tiny_checkpoint, tmp_path, monkeypatch):
    """plan reads a set's units cold once on this machine (as a streaming load does) and projects its storage tier at
    that rate; for another machine's profile nothing is measured here."""
    from rocketllm_cli.planning.formats import with_measured_decode
    from rocketllm_cli.shard.sharder import shard

    monkeypatch.setenv("ROCKETLLM_CACHE", str(tmp_path / "cache"))
    _, directory, _ = shard(tiny_checkpoint, out=tmp_path / "set", log=lambda m: None)
    here = HardwareProfile.load()
    source = with_measured_decode(read_source(directory), here)
    assert source.facts.unit_reads and source.formats()[0].facts.unit_reads == source.facts.unit_reads
    storage = project(here, source.facts, {"storage": source.facts.total_bytes}).tiers["storage"]
    assert "own units read cold" in storage.bandwidth
    elsewhere = replace(here, fingerprint="another-machine")
    assert not with_measured_decode(read_source(directory), elsewhere).facts.unit_reads
