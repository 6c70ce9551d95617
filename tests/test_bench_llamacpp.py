"""bench --baseline llamacpp: a skipped row with the install command when llama-cpp-python is missing, the reason when
the model has no GGUF file, and the same timing method as every row (driven here by a stand-in Llama; the real one runs
only where llama-cpp-python is installed and the SmolLM2 GGUF is present)."""

from __future__ import annotations

import json
import os
import sys
import types
from types import SimpleNamespace

import pytest
from typer.testing import CliRunner

from rocketllm_cli.app import app
from rocketllm_cli.bench.llamacpp import NOT_INSTALLED, gguf_file, run_llamacpp
from rocketllm_cli.bench.timing import WARMUP


def _bench_rows(model, *args) -> tuple[list[dict], str]:
    result = CliRunner().invoke(
        app,
        [
            "bench",
            str(model),
            "--tokens",
            "2",
            "--prompt-tokens",
            "4",
            "--regime",
            "resident",
            "--baseline",
            "llamacpp",
            *args,
        ],
    )
    assert result.exit_code == 0, result.stderr
    return (json.loads(result.stdout)["rows"] if "--json" in args else []), result.stdout


def test_missing_llama_cpp_is_a_skipped_row_with_the_install_command(tiny_checkpoint, monkeypatch):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # `import llama_cpp` raises ImportError
    rows, _ = _bench_rows(tiny_checkpoint, "--json")
    assert [(r["name"], r["regime"], r["status"], r["reason"]) for r in rows if r["name"] == "llamacpp"] == [
        ("llamacpp", "resident", "skipped", NOT_INSTALLED)
    ]
    assert NOT_INSTALLED == "llama-cpp-python is not installed (pip install llama-cpp-python)"
    _, text = _bench_rows(tiny_checkpoint)
    assert f"| llamacpp | resident | skipped: {NOT_INSTALLED} |" in text


def test_a_model_without_a_gguf_file_says_so(tiny_checkpoint, monkeypatch):
    monkeypatch.setitem(sys.modules, "llama_cpp", types.ModuleType("llama_cpp"))  # importable, never called
    rows, _ = _bench_rows(tiny_checkpoint, "--json")
    row = next(r for r in rows if r["name"] == "llamacpp")
    assert row["status"] == "skipped" and "has no GGUF file" in row["reason"]


def test_gguf_source_of_each_kind_of_model(tmp_path):
    gguf = tmp_path / "m.Q4_1.gguf"
    gguf.write_bytes(b"GGUF")
    from_gguf = SimpleNamespace(source={"kind": "gguf", "name": "m.Q4_1"})
    assert gguf_file(str(gguf), from_gguf) == (gguf, "")
    assert gguf_file(str(tmp_path), from_gguf) == (gguf, "")  # a directory with one GGUF and no config.json
    shards = tmp_path / "shards"
    shards.mkdir()
    (shards / "manifest.json").write_text("{}")
    path, why = gguf_file(str(shards), from_gguf)
    assert path is None and "shard set of m.Q4_1.gguf: pass the .gguf file" in why
    path, why = gguf_file(None, SimpleNamespace(source={"kind": "safetensors", "name": "x"}))
    assert path is None and "no GGUF file" in why


FAKE = """
import json, os, signal, time
__version__ = "0.0-test"
STEP_S = 0.01

class _Params:
    use_extra_bufts = True

class _LowLevel:  # llama_cpp.llama.llama_cpp: where Llama takes its model parameters from
    @staticmethod
    def llama_model_default_params():
        return _Params()

class llama:  # the submodule, as the worker reaches it
    llama_cpp = _LowLevel

class Llama:
    def __init__(self, **kwargs):
        extra = llama.llama_cpp.llama_model_default_params().use_extra_bufts
        with open(os.environ["FAKE_LLAMA_LOG"], "w") as f:
            json.dump({**kwargs, "use_extra_bufts": extra}, f)
        crash = os.environ.get("FAKE_LLAMA_CRASH")  # "always", or "repacked": only with the extra buffer types on
        if crash == "always" or (crash == "repacked" and extra):
            os.kill(os.getpid(), signal.SIGSEGV)

    def tokenize(self, text, add_bos=True):
        return list(text[:5])

    def generate(self, tokens, **sampling):
        while True:
            time.sleep(STEP_S)
            yield 7
"""


@pytest.fixture
def fake_llama_cpp(tmp_path, monkeypatch):
    """A stand-in llama_cpp package on the path of this process and of the worker it starts; returns its log file."""
    package = tmp_path / "fake" / "llama_cpp"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(FAKE)
    monkeypatch.syspath_prepend(str(package.parent))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(package.parent), os.environ.get("PYTHONPATH")])))
    monkeypatch.setenv("FAKE_LLAMA_LOG", str(tmp_path / "llama-args.json"))
    return tmp_path / "llama-args.json"


def test_llamacpp_row_is_timed_like_every_row_in_a_process_of_its_own(fake_llama_cpp, tmp_path):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF" + bytes(60))
    profile = SimpleNamespace(cpu_cores=3, compute_device="cpu")
    row = run_llamacpp(gguf, "", "resident", 4, 6, profile, log=lambda m: None)
    assert row["status"] == "measured", row
    kwargs = json.loads(fake_llama_cpp.read_text())
    assert kwargs["n_threads"] == 3 and kwargs["n_gpu_layers"] == 0 and kwargs["use_mmap"] is True
    assert kwargs["n_ctx"] >= 6 + 1 + WARMUP + 4 and kwargs["model_path"] == str(gguf)
    assert row["ms_per_token"]["n"] == 4 and row["ms_per_token"]["median"] >= 9  # each fake step sleeps 10 ms
    assert row["ttft_ms"] >= 9
    assert row["llamacpp"] == {
        "version": "0.0-test",
        "n_threads": 3,
        "n_gpu_layers": 0,
        "use_mmap": True,
        "gguf": "m.gguf",
        "gguf_bytes": 64,
    }
    gpu = run_llamacpp(
        gguf, "", "resident", 1, 2, SimpleNamespace(cpu_cores=2, compute_device="cuda"), log=lambda m: None
    )
    assert gpu["status"] == "measured" and json.loads(fake_llama_cpp.read_text())["n_gpu_layers"] == -1


def test_a_crash_in_llama_cpp_is_a_skipped_row(fake_llama_cpp, tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_LLAMA_CRASH", "always")
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    row = run_llamacpp(
        gguf, "", "resident", 2, 4, SimpleNamespace(cpu_cores=2, compute_device="cpu"), log=lambda m: None
    )
    assert row["status"] == "skipped" and row["reason"].startswith("llama.cpp crashed (signal SIGSEGV)")
    assert "with its extra buffer types off; with them on it crashed (signal SIGSEGV)" in row["reason"]  # tried both


def test_a_build_whose_repacked_weights_crash_is_measured_without_them(fake_llama_cpp, tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_LLAMA_CRASH", "repacked")
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    said = []
    row = run_llamacpp(gguf, "", "resident", 2, 4, SimpleNamespace(cpu_cores=2, compute_device="cpu"), log=said.append)
    assert row["status"] == "measured", row
    assert json.loads(fake_llama_cpp.read_text())["use_extra_bufts"] is False
    assert row["llamacpp"]["extra_buffers"] == (
        "its default crashed (signal SIGSEGV); measured with its extra buffer types off (use_extra_bufts=False)"
    )
    assert "extra buffer types off" in said[-1]


@pytest.mark.realmodel
def test_llamacpp_measures_the_real_gguf(smollm2_gguf):
    pytest.importorskip("llama_cpp")
    rows, _ = _bench_rows(smollm2_gguf, "--json")
    row = next(r for r in rows if r["name"] == "llamacpp")
    # inside llama.cpp (a CPU feature its build uses and this machine refuses)
    if row["reason"].startswith("llama.cpp crashed"):
        pytest.skip(row["reason"])
    assert row["status"] == "measured", row["reason"]
    assert row["ms_per_token"]["n"] == 2 and row["ms_per_token"]["median"] > 0
    ours = next(r for r in rows if r["name"] == "rocketllm")
    assert "llamacpp" in ours["speedup"]
