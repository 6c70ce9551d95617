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
    text, js = doctor("--model-size", "70B", "--weight-bits", "4"), doctor("--model-size", "70B", "--weight-bits", "4", "--json")
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
    assert set(packed) == {"packed_int4", "packed_int8"}  # the kernel probe's dtype, with each dtype's timed call
    assert all(c["value"] is False or " us" in c["reason"] for c in packed.values())
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


@pytest.mark.parametrize("args, code, words", [
    (["--model", "/nonexistent/model"], 1, "model path not found"),
    (["--model-size", "abc"], 1, "parameter count"),
    (["--model-size", "70B", "--weight-bits", "0"], 1, "--weight-bits"),
    (["--model-size", "70B", "--weight-bits", "64"], 1, "--weight-bits"),
    (["--model", ".", "--model-size", "7B"], 2, "not both"),
    (["--weight-bits", "4"], 2, "--model-size"),
])
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
    env.update(HOME=str(home), USER="zq9user", LOGNAME="zq9user", ROCKETLLM_PROBE_BYTES="32MiB", ROCKETLLM_API_TOKEN="zq9token")
    runs = [["doctor", "--model", str(model)], ["doctor", "--model", str(model), "--json"], ["profile", "--model", str(model)],
            ["doctor", "--model", str(home)], ["doctor", "--model", str(home / "missing")]]
    for args in runs:
        done = subprocess.run([sys.executable, "-m", "rocketllm_cli", *args], env=env, capture_output=True, text=True, timeout=120)
        seen = done.stdout + done.stderr
        assert "zq9user" not in seen and "zq9token" not in seen, seen
        assert "Traceback" not in seen
    assert done.returncode == 1 and "~/missing" in done.stderr
    assert (home / ".cache" / "rocketllm" / "profiles").is_dir()  # it did measure under that home
