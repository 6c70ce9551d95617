"""bench --baseline llamacpp: a skipped row with the install command when llama-cpp-python is missing, the reason when
the model has no GGUF file, and the same timing method as every row (driven here by a stand-in Llama; the real one runs
only where llama-cpp-python is installed and the SmolLM2 GGUF is present)."""

from __future__ import annotations

import json
import sys
import time
import types
from types import SimpleNamespace
from typing import ClassVar

import pytest
from typer.testing import CliRunner

from rocketllm_cli.app import app
from rocketllm_cli.bench.llamacpp import NOT_INSTALLED, gguf_file, run_llamacpp
from rocketllm_cli.bench.timing import WARMUP


def _bench_rows(model, *args) -> tuple[list[dict], str]:
    result = CliRunner().invoke(app, ["bench", str(model), "--tokens", "2", "--prompt-tokens", "4", "--regime", "resident",
                                      "--baseline", "llamacpp", *args])
    assert result.exit_code == 0, result.stderr
    return (json.loads(result.stdout)["rows"] if "--json" in args else []), result.stdout


def test_missing_llama_cpp_is_a_skipped_row_with_the_install_command(tiny_checkpoint, monkeypatch):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # `import llama_cpp` raises ImportError
    rows, _ = _bench_rows(tiny_checkpoint, "--json")
    assert [(r["name"], r["regime"], r["status"], r["reason"]) for r in rows if r["name"] == "llamacpp"] == [
        ("llamacpp", "resident", "skipped", NOT_INSTALLED)]
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


class _FakeLlama:
    """Stands in for llama_cpp.Llama: records its arguments; each token takes STEP_S."""

    STEP_S = 0.01
    made: ClassVar[list[dict]] = []

    def __init__(self, **kwargs) -> None:
        self.kwargs = kwargs
        _FakeLlama.made.append(kwargs)

    def tokenize(self, text: bytes, add_bos: bool = True) -> list[int]:
        return list(text[:5])

    def generate(self, tokens, **sampling):
        self.prompt, self.sampling = list(tokens), sampling
        while True:
            time.sleep(self.STEP_S)
            yield 7


def test_llamacpp_row_is_timed_like_every_row(tmp_path, monkeypatch):
    fake = types.ModuleType("llama_cpp")
    fake.Llama, fake.__version__ = _FakeLlama, "0.0-test"
    monkeypatch.setitem(sys.modules, "llama_cpp", fake)
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF" + bytes(60))
    profile = SimpleNamespace(cpu_cores=3, compute_device="cpu")
    row = run_llamacpp(gguf, "", "resident", 4, 6, profile, log=lambda m: None)
    assert row["status"] == "measured", row
    kwargs = _FakeLlama.made[-1]
    assert kwargs["n_threads"] == 3 and kwargs["n_gpu_layers"] == 0 and kwargs["use_mmap"] is True
    assert kwargs["n_ctx"] >= 6 + 1 + WARMUP + 4 and kwargs["model_path"] == str(gguf)
    assert row["ms_per_token"]["n"] == 4 and row["ms_per_token"]["median"] >= 1000 * _FakeLlama.STEP_S * 0.9
    assert row["ttft_ms"] >= 1000 * _FakeLlama.STEP_S * 0.9
    assert row["llamacpp"] == {"version": "0.0-test", "n_threads": 3, "n_gpu_layers": 0, "use_mmap": True, "gguf": "m.gguf",
                               "gguf_bytes": 64}
    gpu = run_llamacpp(gguf, "", "resident", 1, 2, SimpleNamespace(cpu_cores=2, compute_device="cuda"), log=lambda m: None)
    assert gpu["status"] == "measured" and _FakeLlama.made[-1]["n_gpu_layers"] == -1


@pytest.mark.realmodel
def test_llamacpp_measures_the_real_gguf(smollm2_gguf):
    pytest.importorskip("llama_cpp")
    rows, _ = _bench_rows(smollm2_gguf, "--json")
    row = next(r for r in rows if r["name"] == "llamacpp")
    assert row["status"] == "measured", row["reason"]
    assert row["ms_per_token"]["n"] == 2 and row["ms_per_token"]["median"] > 0
    ours = next(r for r in rows if r["name"] == "rocketllm")
    assert "llamacpp" in ours["speedup"]
