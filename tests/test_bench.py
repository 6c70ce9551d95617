"""rocketllm bench: its accounting recomputes from what it prints, the synthetic checkpoint is one transformers
loads and that streams equal to resident, --json has a fixed schema, a missing baseline is a skipped row
(exit 0), and every bad input is one `error:` line."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from typer.testing import CliRunner

from rocketllm_cli.app import app

TOKENS = 2
TIERS = ("device", "host", "storage")


@pytest.fixture(scope="module")
def bench_doc(tiny_factory) -> dict:
    """One bench run on a tiny model, every regime, with transformers and a deliberately missing airllm."""
    model = tiny_factory("llama", seed=11)
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(sys.modules, "airllm", None)  # `import airllm` raises ImportError
        result = CliRunner().invoke(
            app,
            [
                "bench",
                str(model),
                "--tokens",
                str(TOKENS),
                "--prompt-tokens",
                "4",
                "--baseline",
                "transformers",
                "airllm",
                "--json",
            ],
        )
    assert result.exit_code == 0, result.stderr
    return json.loads(result.stdout)


def test_json_schema(bench_doc):
    assert isinstance(bench_doc["hardware"], str) and bench_doc["profile"]["fingerprint"] in bench_doc["hardware"]
    assert isinstance(bench_doc["profile"]["fingerprint"], str)
    assert {"name", "total_bytes", "dtype", "num_layers"} <= set(bench_doc["model"])
    assert set(bench_doc["residency"]) == {"resident", "host", "storage"}
    assert all(isinstance(plan["tier"], dict) for plan in bench_doc["residency"].values())
    assert bench_doc["tokens"] == TOKENS and bench_doc["warmup"] >= 1
    assert {"before", "after", "cores"} <= set(bench_doc["load"])
    ours = [r for r in bench_doc["rows"] if r["name"] == "rocketllm"]
    assert [r["regime"] for r in ours] == ["resident", "host", "storage"]
    for row in ours:
        assert row["status"] == "measured"
        assert set(row["ms_per_token"]) == {"median", "p10", "p90", "n"} and row["ms_per_token"]["n"] == TOKENS
        assert row["ms_per_token"]["p10"] <= row["ms_per_token"]["median"] <= row["ms_per_token"]["p90"]
        assert isinstance(row["ttft_ms"], float) and row["ttft_ms"] > 0
        assert set(row["bytes_per_token"]) == set(TIERS) and all(
            isinstance(v, int) for v in row["bytes_per_token"].values()
        )
        assert isinstance(row["storage_witnessed_per_token"], int)
        for key in ("projected_ms", "limit_ms", "efficiency"):
            assert isinstance(row[key], float), key
        assert isinstance(row["speedup"], dict)
    served = {r["regime"]: r["bytes_per_token"] for r in ours}
    assert served["resident"]["host"] == served["resident"]["storage"] == 0
    assert served["host"]["device"] == served["host"]["storage"] == 0 and served["host"]["host"] > 0
    assert served["storage"]["device"] == served["storage"]["host"] == 0 and served["storage"]["storage"] > 0
    assert ours[2]["read_method"] in ("O_DIRECT", "buffered read + POSIX_FADV_DONTNEED")


def test_projection_limit_and_efficiency_recompute_from_printed_inputs(bench_doc):
    measured = {
        (r["name"], r["regime"]): r["ms_per_token"]["median"] for r in bench_doc["rows"] if r["status"] == "measured"
    }
    fastest = {
        (r["name"], r["regime"]): r["ms_per_token"]["p10"] for r in bench_doc["rows"] if r["status"] == "measured"
    }
    for row in (r for r in bench_doc["rows"] if r["name"] == "rocketllm"):
        proj = row["projection"]
        tiers = proj["tiers"]
        assert {t: tiers[t]["bytes"] for t in TIERS} == row["bytes_per_token"]
        seconds = {t: tiers[t]["bytes"] / tiers[t]["bandwidth_bps"] if tiers[t]["bytes"] else 0.0 for t in TIERS}
        io = seconds["host"] + seconds["storage"]
        # the products at the matvec, and the layers' own work as the probe measured it (layercost.py); the untied
        # embedding table is served by its tier and looked up by rows, no product
        assert 0 < proj["lookup_bytes"] < sum(tiers[t]["bytes"] for t in TIERS)
        products = (sum(tiers[t]["bytes"] for t in TIERS) - proj["lookup_bytes"]) / proj["compute_bandwidth_bps"]
        assert proj["products_seconds"] == pytest.approx(products) and proj["layer_work_seconds"] >= 0
        compute = products + proj["layer_work_seconds"]
        assert row["projected_ms"] == pytest.approx(1000 * max(io, compute), abs=0.01)
        unique = row["unique_bytes_per_tier"]
        io = sum(unique[t] / tiers[t]["bandwidth_bps"] for t in ("host", "storage") if unique[t])
        # the floor is the fastest tenth of a resident run's tokens (any engine's, or the row's own), never a median
        floor = (
            min(fastest[("transformers", "resident")], fastest[("rocketllm", row["regime"])])
            if row["regime"] == "resident"
            else min(
                fastest[("rocketllm", "resident")],
                fastest[("transformers", "resident")],
                fastest[("rocketllm", row["regime"])],
            )
        )
        limit = max(1000 * io, floor)
        assert row["limit_ms"] == pytest.approx(limit, abs=0.01)
        assert row["efficiency"] == pytest.approx(limit / row["ms_per_token"]["median"], abs=0.002)
        if limit > 1000 * io:  # compute-bound: no row beats its own floor
            assert row["efficiency"] <= 1
        if unique["storage"]:  # beside it, the limit at what the disk gave the run's own units read cold just after it
            disk = row["disk_now"]
            assert disk["bps"] > 0 and disk["units"] >= 2 and disk["bytes"] > 0
            # the way the run read, measured beside the fastest: what a projection at the set's own reads is held to
            way = f"{'O_DIRECT' if row['knobs']['direct_io'] else 'buffered'} x{row['knobs']['io_workers']}"
            assert disk["run_way"]["how"].startswith(way) and 0 < disk["run_way"]["bps"] <= disk["bps"]
            now = max(
                1000
                * (
                    unique["storage"] / disk["bps"]
                    + (unique["host"] / tiers["host"]["bandwidth_bps"] if unique["host"] else 0)
                ),
                floor,
            )
            assert row["disk_now_limit_ms"] == pytest.approx(now, abs=0.01)
            assert row["disk_now_efficiency"] == pytest.approx(now / row["ms_per_token"]["median"], abs=0.002)
        else:
            assert "disk_now" not in row and "disk_now_limit_ms" not in row
    resident = next(r for r in bench_doc["rows"] if r["name"] == "rocketllm" and r["regime"] == "resident")
    assert resident["speedup"]["transformers"] == pytest.approx(
        measured[("transformers", "resident")] / measured[("rocketllm", "resident")], abs=0.01
    )


def test_missing_baseline_is_a_skipped_row_with_its_reason(bench_doc):
    airllm = [r for r in bench_doc["rows"] if r["name"] == "airllm"]
    assert [r["regime"] for r in airllm] == ["storage"]
    assert airllm[0]["status"] == "skipped" and "airllm not importable" in airllm[0]["reason"]
    plain = [r for r in bench_doc["rows"] if r["name"] == "transformers"]
    assert [(r["regime"], r["status"]) for r in plain] == [("resident", "measured")]


def test_markdown_table_has_a_row_per_run(tiny_factory):
    from rocketllm_cli.bench.report import render

    doc = {
        "hardware": "CPU X, 2 cores",
        "model": {"name": "m", "total_bytes": 1, "dtype": "bf16", "num_layers": 1},
        "prompt_tokens": 4,
        "tokens": 2,
        "warmup": 1,
        "load": {"before": 0.1, "after": 0.2, "cores": 2},
        "batch": None,
        "rows": [{"name": "airllm", "regime": "storage", "status": "skipped", "reason": "airllm not importable"}],
    }
    text = render(doc)
    assert text.splitlines()[0] == "**Hardware:** CPU X, 2 cores"
    assert "| airllm | storage | skipped: airllm not importable |" in text


def test_synthetic_checkpoint_loads_in_transformers_and_streams_equal_to_resident():
    from transformers import AutoModelForCausalLM

    from rocketllm import AutoModel
    from rocketllm_cli.bench.sources import synthetic_checkpoint

    path = synthetic_checkpoint("llama:tiny")
    assert synthetic_checkpoint("llama:tiny") == path  # written once, then reused
    ids = torch.tensor([[5, 6, 7, 8]])
    with AutoModel.from_pretrained(path, device_cache_bytes=0, host_cache_bytes=0) as streamed:
        got = streamed.generate(ids, max_new_tokens=4, do_sample=False)
        # The reference computes in the dtype the engine chose on this CPU (bf16 with native bf16, else fp32).
        plain = AutoModelForCausalLM.from_pretrained(path, dtype=streamed.dtype)
    want = plain.generate(ids, max_new_tokens=4, do_sample=False)
    assert got.tolist() == want.tolist()


@pytest.mark.parametrize(
    "args",
    [
        ["--synthetic", "nosuch:1B"],
        ["--synthetic", "llama:tiny", "--regime", "bogus"],
        ["--synthetic", "llama:tiny", "--tokens", "0"],
        ["--synthetic", "llama:tiny", "--baseline", "nosuch"],
        ["--synthetic", "llama:tiny", "--batch", "0"],
        ["./a", "--model", "./b"],  # MODEL given twice
        [],  # neither MODEL nor --synthetic: help
    ],
)
def test_bad_input_is_one_error_line(args, tmp_path):
    env = {**__import__("os").environ, "ROCKETLLM_CACHE": str(tmp_path)}
    if not args:
        args = ["--tokens", "2"]
    run = subprocess.run(
        [sys.executable, "-m", "rocketllm_cli", "bench", *args], capture_output=True, text=True, env=env, timeout=120
    )
    assert run.returncode in (1, 2)
    assert run.stdout == ""
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), run.stderr
    assert "Traceback" not in run.stderr
    assert not (tmp_path / "synthetic").exists() or not any((tmp_path / "synthetic").iterdir())


def test_batch_sweep_reports_throughput_against_batch_of_one(tiny_factory):
    model = tiny_factory("llama", seed=11)
    result = CliRunner().invoke(
        app, ["bench", str(model), "--batch", "1", "2", "--tokens", str(TOKENS), "--prompt-tokens", "4", "--json"]
    )
    assert result.exit_code == 0, result.stderr
    batch = json.loads(result.stdout)["batch"]
    assert batch["regime"] == "storage" and batch["speedup_base"] == 1
    assert [r["batch"] for r in batch["rows"]] == [1, 2]
    for r in batch["rows"]:
        median = r["ms_per_step"]["median"]  # rounded to 0.01 ms; tokens/s is computed before that rounding
        assert r["tokens_per_s"] == pytest.approx(
            1000 * r["batch"] / median, abs=1000 * r["batch"] * 0.005 / median**2 + 1e-3
        )
        assert r["speedup_vs_1"] == pytest.approx(r["tokens_per_s"] / batch["rows"][0]["tokens_per_s"], abs=0.01)


def test_moe_bench_reports_routed_experts_and_the_cache(tiny_factory):
    """A MoE model gets the expert-cache regime too; rows carry expert uses, cache hit rate and whole-layer bytes."""
    model = tiny_factory("qwen3_moe", seed=5)
    result = CliRunner().invoke(
        app,
        ["bench", str(model), "--tokens", "4", "--prompt-tokens", "4", "--regime", "storage", "expert-cache", "--json"],
    )
    assert result.exit_code == 0, result.stderr
    doc = json.loads(result.stdout)
    rows = {r["regime"]: r for r in doc["rows"]}
    assert set(rows) == {"storage", "expert-cache"}
    for row in rows.values():
        assert row["experts_per_token"] > 0
        assert sum(row["bytes_per_token"].values()) < row["whole_layer_bytes_per_token"]
    assert rows["storage"]["expert_cache"]["lookups"] == 0  # no cache without a device budget
    cache = rows["expert-cache"]["expert_cache"]
    assert cache["lookups"] > 0 and 0 <= cache["hits"] <= cache["lookups"]
    assert rows["expert-cache"]["bytes_per_token"]["storage"] < rows["storage"]["bytes_per_token"]["storage"]


def test_the_auto_regime_runs_the_derived_plan_with_the_kv_this_run_holds(tiny_factory):
    """--regime auto overrides no residency knob (what generate does here), and sizes the KV cache for the run's
    tokens as llama.cpp's row gets n_ctx: prompt, warm-up and measured tokens and the margin."""
    from math import ceil

    from rocketllm_cli.bench.timing import WARMUP
    from rocketllm_cli.checkpoint.modelfacts import model_facts_from_path
    from rocketllm_cli.profiles.knobs.derivation import engine_compute_dtype
    from rocketllm_cli.profiles.knobs.shape import pass_shape_of
    from rocketllm_cli.stream.context import RUN_MARGIN_TOKENS

    model = tiny_factory("llama", seed=11)
    result = CliRunner().invoke(
        app, ["bench", str(model), "--tokens", "2", "--prompt-tokens", "3", "--regime", "auto", "--json"]
    )
    assert result.exit_code == 0, result.stderr
    doc = json.loads(result.stdout)
    row = next(r for r in doc["rows"] if r["name"] == "rocketllm")
    assert row["regime"] == "auto" and row["status"] == "measured" and row["ms_per_token"]["n"] == 2
    assert set(doc["residency"]) == {"auto"} and sum(row["bytes_per_token"].values()) > 0
    facts = model_facts_from_path(model)
    # K and V's
    value = 4 if engine_compute_dtype(row["knobs"]["compute_dtype"], False, facts.dtype, "cpu") == "fp32" else 2
    tokens = 3 + 1 + WARMUP + 2 + RUN_MARGIN_TOKENS
    # each token its K and V, and the activations of a pass over it (a prefill's)
    per_token = (
        facts.kv_values_per_token * (value + value / facts.kv_growing_layers)
        + pass_shape_of(model).activation_bytes_per_token
    )
    assert row["knobs"]["kv_cache_bytes"] == ceil((tokens + 1) * per_token)
    assert row["knobs"]["max_context"] >= tokens


def test_dense_model_has_no_expert_cache_regime(tiny_checkpoint):
    result = CliRunner().invoke(
        app,
        ["bench", str(tiny_checkpoint), "--tokens", "1", "--prompt-tokens", "2", "--regime", "expert-cache", "--json"],
    )
    assert result.exit_code == 0, result.stderr
    rows = json.loads(result.stdout)["rows"]
    assert [(r["regime"], r["status"], r["reason"]) for r in rows] == [
        ("expert-cache", "skipped", "not a mixture-of-experts model")
    ]


def test_the_resident_row_is_kept_for_doctor_to_project_from(bench_doc):
    """bench records the resident row's decode time per set and compute dtype (profiles/probe/decodecompute.py)."""
    from rocketllm_cli.profiles import HardwareProfile, cache_dir
    from rocketllm_cli.profiles.probe.decodecompute import FILE

    resident = next(r for r in bench_doc["rows"] if r["name"] == "rocketllm" and r["regime"] == "resident")
    stored = json.loads((cache_dir() / "profiles" / HardwareProfile.load().fingerprint / FILE).read_text())
    entries = [
        e
        for k, e in stored.items()
        if k != "cache_format"
        and e["compute_dtype"] == resident["knobs"]["compute_dtype"]
        and e["seconds"] == pytest.approx(resident["ms_per_token"]["median"] / 1000)
    ]
    assert entries and entries[0]["p10_seconds"] == pytest.approx(resident["ms_per_token"]["p10"] / 1000)


def test_any_engines_resident_run_is_a_compute_floor():
    """llama.cpp's resident tokens bound ours: a row slower than them is below 1, and theirs is judged by their own
    p10 or by a faster engine's, never by a matvec figure that a 4-bit kernel beats."""
    from rocketllm_cli.bench.accounting import compute_floor

    proj = {"compute_seconds": 0.130}
    fastest = {("rocketllm", "resident"): 0.098, ("llamacpp", "resident"): 0.053, ("rocketllm", "host"): 0.100}
    assert compute_floor("resident", fastest, proj, own=0.098) == (0.053, "compute = llamacpp resident, p10 measured")
    assert compute_floor("resident", fastest, proj, own=0.050)[0] == 0.050  # faster than every other engine: its own
    assert compute_floor("host", fastest, proj, own=0.100)[0] == 0.053
    ours_alone = {("rocketllm", "resident"): 0.098}
    assert compute_floor("resident", ours_alone, proj, own=0.098) == (
        0.130,
        "compute = the weights' products at measured speeds (no baseline ran)",
    )
    assert compute_floor("storage", ours_alone, proj, own=0.2) == (0.098, "compute = our resident regime, p10 measured")
    assert compute_floor("storage", {}, proj, own=0.2)[0] == 0.130
