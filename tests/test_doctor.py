"""rocketllm doctor: a paste-able report whose --json has the same fields, private data redacted, no network."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from rocketllm_cli.app import app
from rocketllm_cli.profiles import cache_dir
from rocketllm_cli.profiles.report.markdown import SECTIONS


@pytest.fixture(autouse=True)
def small_probe(monkeypatch):
    monkeypatch.setenv("ROCKETLLM_PROBE_BYTES", "32MiB")


def doctor(*args, env=None):
    return CliRunner().invoke(app, ["doctor", *args], env=env)


def test_text_report_has_every_section_and_json_the_same_fields():
    text, js = (
        doctor("--model-size", "70B", "--weight-bits", "4"),
        doctor("--model-size", "70B", "--weight-bits", "4", "--json"),
    )
    assert text.exit_code == 0 and js.exit_code == 0, text.output + js.output
    doc = json.loads(js.stdout)
    assert list(doc) == list(SECTIONS)
    for heading, _ in SECTIONS.values():
        assert f"\n## {heading}\n" in text.stdout
    for m in doc["measurements"]:
        assert f"| {m['name']} | " in text.stdout
    for c in doc["capabilities"]:
        assert f"| {c['name']} | {c['value']} | " in text.stdout
    packed = {c["name"]: c for c in doc["capabilities"] if c["name"].startswith("packed_")}
    # the kernel probe's dtype, with each dtype's timed call; and GGUF blocks' dense crossover once a set measured it
    assert {"packed_int4", "packed_int8"} <= set(packed) <= {"packed_int4", "packed_int8", "packed_native_dense"}
    assert all(c["value"] is False or " us" in c["reason"] for n, c in packed.items() if n != "packed_native_dense")
    assert "packed_native_dense" not in packed or "rows" in packed["packed_native_dense"]["reason"]
    for p in doc["optional_packages"]:
        assert f"| {p['package']} | " in text.stdout
    assert doc["profile"]["fingerprint"] in text.stdout
    assert doc["versions"]["torch"] in text.stdout and doc["cpu"]["model"] in text.stdout
    projection = doc["projection"]
    for tier in ("device", "host", "storage"):
        assert f"| {tier} | " in text.stdout
    assert projection["serial_seconds"] == pytest.approx(sum(t["seconds"] for t in projection["tiers"].values()))
    assert sum(t["bytes"] for t in projection["tiers"].values()) == doc["model"]["total_bytes"] == 35_000_000_000


def test_report_with_a_model_directory(tiny_checkpoint):
    result = doctor("--model", str(tiny_checkpoint), "--json")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["model"]["num_layers"] > 0 and doc["model"]["source"] == "path"
    assert doc["projection"]["tiers"]["device"]["bytes"] == doc["model"]["total_bytes"]  # a tiny model fits


@pytest.fixture
def no_bench_records(tmp_path, monkeypatch):
    """A cache with this machine's profile and no set measured by bench yet (other tests' runs record theirs)."""
    import shutil

    from rocketllm_cli.profiles import HardwareProfile
    from rocketllm_cli.profiles.cache import profile_dir
    from rocketllm_cli.profiles.probe.decodecompute import FILE

    fingerprint = HardwareProfile.load().fingerprint
    source = profile_dir(fingerprint)
    monkeypatch.setenv("ROCKETLLM_CACHE", str(tmp_path / "cache"))
    shutil.copytree(source, profile_dir(fingerprint), ignore=shutil.ignore_patterns(FILE))


def test_a_set_bench_measured_is_projected_from_that_measurement(tiny_checkpoint, tmp_path, no_bench_records):
    """Until bench has measured a set, compute is the matvec floor plus the layers' own work as the probe measured it
    on tiny models of the architecture, and the report says so; once bench recorded its resident decode here, every
    regime is projected from it: compute as measured, io as before; and another set of this machine is projected with
    the per-layer work that measurement found beyond the floor."""
    import shutil

    from rocketllm_cli.checkpoint.manifest import Manifest
    from rocketllm_cli.checkpoint.modelfacts import model_facts_from_path
    from rocketllm_cli.profiles import HardwareProfile
    from rocketllm_cli.profiles.probe.decodecompute import layer_overhead, record

    shards = tmp_path / "set"
    assert CliRunner().invoke(app, ["shard", str(tiny_checkpoint), "--out", str(shards)]).exit_code == 0
    before = json.loads(doctor("--model", str(shards), "--json").stdout)
    note, probed = before["model"]["note"], before["model"]["layer_overhead"]
    assert "the work the probe measured on small models of its architecture" in note
    assert "until `rocketllm bench` measures this set" in note
    assert probed["source"] == "probe" and probed["architecture"] == "llama" and probed["seconds"] > 0
    assert before["projection"]["compute_bandwidth"].startswith("decode-shaped matvec")
    assert "models of the set's widths" in before["projection"]["compute_bandwidth"]
    text = doctor("--model", str(shards)).stdout
    assert "(per-layer work as the probe measured it on small models of the architecture" in text

    resident = before["projection"]["regimes"]["resident"]  # each of bench's regimes, measured or not
    assert (
        set(before["projection"]["regimes"]) == {"resident", "host", "storage"}
        and resident["tiers"]["device"]["bytes"] > 0
    )
    compute_dtype = next(c["value"] for c in before["capabilities"] if c["name"] == "compute_dtype")
    record(
        HardwareProfile.load(),
        shards,
        Manifest.load(shards),
        compute_dtype,
        {"median": 40.0, "p10": 35.0, "n": 8},
        "1 of 2",
        model_facts_from_path(shards),
    )
    after = json.loads(doctor("--model", str(shards), "--json").stdout)
    projection = after["projection"]
    assert projection["compute_seconds"] == pytest.approx(0.040)
    assert (
        "measured by `rocketllm bench`" in projection["compute_bandwidth"]
        and "1 of 2 compute threads" in projection["compute_bandwidth"]
    )
    for regime, r in projection["regimes"].items():  # max(io of every byte from the regime's tier, measured compute)
        assert r["overlapped_seconds"] == pytest.approx(max(r["io_seconds"], 0.040)), regime
    assert projection["regimes"]["resident"]["overlapped_seconds"] == pytest.approx(0.040)
    assert "as `rocketllm bench` measured this set" in after["model"]["note"]
    assert "(an upper bound" not in doctor("--model", str(shards)).stdout
    other = tmp_path / "other"  # a copy of the set at another place: no decode of its own recorded
    shutil.copytree(shards, other)
    elsewhere = json.loads(doctor("--model", str(other), "--json").stdout)["projection"]
    layers = after["model"]["num_layers"]
    floor = before["projection"]["compute_seconds"] - layers * probed["seconds"] - probed["token_seconds"]
    # (0.040 - the floor as the engine computes) / layers
    measured = layer_overhead(HardwareProfile.load(), compute_dtype)
    assert 0 < measured["seconds"] * layers < 0.040
    assert elsewhere["compute_seconds"] == pytest.approx(floor + layers * measured["seconds"])
    assert f"plus {layers} layers x" in elsewhere["compute_bandwidth"]


def test_report_without_a_model_says_so():
    result = doctor()
    assert result.exit_code == 0
    assert "none given" in result.stdout and "## Projected cost per decode token\n\n- no model given" in result.stdout


def test_environment_section_lists_rocketllm_variables_and_hides_secrets():
    result = doctor("--json", env={"ROCKETLLM_PREFETCH_DEPTH": "2", "ROCKETLLM_HF_TOKEN": "zq9secret"})
    variables = json.loads(result.stdout)["environment"]["variables"]
    assert variables["ROCKETLLM_PREFETCH_DEPTH"] == "2" and variables["ROCKETLLM_HF_TOKEN"] == "<redacted>"
    assert "PYTORCH_CUDA_ALLOC_CONF" in variables and "zq9secret" not in result.output


def test_second_run_uses_the_cache():
    doctor()
    where = next((cache_dir() / "profiles").iterdir())
    stamp = {p.name: p.stat().st_mtime_ns for p in where.glob("*.json")}
    again = doctor("--json")
    assert json.loads(again.stdout)["profile"]["from_cache"] is True
    assert {p.name: p.stat().st_mtime_ns for p in where.glob("*.json")} == stamp


@pytest.mark.parametrize(
    "args, code, words",
    [
        (["--model", "/nonexistent/model"], 1, "model path not found"),
        (["--model-size", "abc"], 1, "parameter count"),
        (["--model-size", "70B", "--weight-bits", "0"], 1, "--weight-bits"),
        (["--model-size", "70B", "--weight-bits", "64"], 1, "--weight-bits"),
        (["--model", ".", "--model-size", "7B"], 2, "not both"),
        (["--weight-bits", "4"], 2, "--model-size"),
    ],
)
def test_bad_inputs_give_one_line_and_an_exit_code(args, code, words):
    result = doctor(*args)
    assert result.exit_code == code and result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and words in lines[0]


def test_works_with_sockets_blocked(monkeypatch, tmp_path):
    def no_network(*args, **kwargs):
        raise AssertionError("doctor opened a socket")

    monkeypatch.setattr(socket, "socket", no_network)
    monkeypatch.setattr(socket, "create_connection", no_network)
    result = doctor("--refresh", env={"ROCKETLLM_CACHE": str(tmp_path / "cache")})
    assert result.exit_code == 0, result.output
    assert "## Measured bandwidths" in result.stdout


def test_no_private_data_in_any_output(tmp_path, tiny_checkpoint):
    home = tmp_path / "zq9user"
    (home / "models").mkdir(parents=True)
    model = home / "models" / "tiny"
    model.mkdir()
    for f in tiny_checkpoint.iterdir():
        (model / f.name).write_bytes(f.read_bytes())
    env = {k: v for k, v in os.environ.items() if k not in ("ROCKETLLM_CACHE", "XDG_CACHE_HOME")}
    env.update(
        HOME=str(home), USER="zq9user", LOGNAME="zq9user", ROCKETLLM_PROBE_BYTES="32MiB", ROCKETLLM_API_TOKEN="zq9token"
    )
    runs = [
        ["doctor", "--model", str(model)],
        ["doctor", "--model", str(model), "--json"],
        ["profile", "--model", str(model)],
        ["doctor", "--model", str(home)],
        ["doctor", "--model", str(home / "missing")],
    ]
    for args in runs:
        done = subprocess.run(
            [sys.executable, "-m", "rocketllm_cli", *args], env=env, capture_output=True, text=True, timeout=120
        )
        seen = done.stdout + done.stderr
        assert "zq9user" not in seen and "zq9token" not in seen, seen
        assert "Traceback" not in seen
    assert done.returncode == 1 and "~/missing" in done.stderr
    assert (home / ".cache" / "rocketllm" / "profiles").is_dir()  # it did measure under that home


def test_native_kernels_section_says_which_path_each_type_takes(monkeypatch):
    """Each GGUF block type: its path here (the native variant, or the torch reference), each kernel mode's rate on
    one fixed product and int16's and int8's errors against exact; measured once per kernel build, read back after."""
    from rocketllm_cli import native
    from rocketllm_cli.native.kernels import GGML_IDS

    if native.kernels() is None:
        pytest.skip(f"no native kernels here: {native.why_not()}")
    monkeypatch.setenv("ROCKETLLM_KERNEL", "int8")
    first = doctor("--json")
    assert first.exit_code == 0, first.output
    section = json.loads(first.stdout)["native_kernels"]
    assert section["built"] and section["isa"] == native.kernels().isa and section["kernel"] == "int8"
    rows = {r["type"]: r for r in section["types"]}
    assert list(rows) == list(GGML_IDS)
    for name, row in rows.items():
        assert row["path"] == f"native ({section['isa']})", name
        assert row["exact_bps"] > 0 and row["int16_bps"] > 0 and row["int8_bps"] > 0, name
        assert 1e-4 < row["int8_rel_error"] < 5e-2, (name, row)  # 8-bit activations: about 5e-3
        assert 1e-7 < row["int16_rel_error"] < 1e-4, (name, row)  # 16-bit activations: about 2e-5
    assert "IQ2_XXS" in section["decoder_types"] and "F32" not in section["decoder_types"]
    again = doctor()
    assert again.exit_code == 0, again.output
    for name, row in rows.items():  # the stored figures, not a second measurement
        line = (
            f"| {name} | {row['path']} | {row['exact_bps'] / 1e9:.2f} | {row['int16_bps'] / 1e9:.2f} | "
            f"{row['int8_bps'] / 1e9:.2f} | "
        )
        assert line in again.stdout, name
    assert "- kernel: int8 (" in again.stdout and "through the torch reference (no kernel): " in again.stdout


def test_native_kernels_section_without_a_compiler_says_why_and_what_to_do(monkeypatch):
    from rocketllm_cli import native

    monkeypatch.setattr(native, "kernels", lambda isa=None: None)
    monkeypatch.setattr(native, "why_not", lambda isa=None: "g++ is not on PATH")
    result = doctor()
    assert result.exit_code == 0, result.output
    assert "- not built: g++ is not on PATH" in result.stdout and "install g++ and run again" in result.stdout
