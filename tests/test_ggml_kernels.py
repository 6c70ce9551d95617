"""bench/ggmlkernels.py: llama.cpp's own product on `bench --kernels`' blocks, in a worker process.

llama.cpp's y against our exact kernel's on the same blocks and x (its activations are quantized to q8, so they
differ by ~5e-3, never by a wrong layout's ~1), on a shape small enough to take a moment: 1024 columns, which its
AMX buffer takes where the CPU has AMX (K a multiple of 1024, N of 32), so the path bench times is the one checked.
A missing llama_cpp, a worker that ends early and a bad product are notes and "-", never a failed bench.
"""

from __future__ import annotations

import pytest
import torch

from rocketllm_cli import native
from rocketllm_cli.bench import ggmlkernels
from rocketllm_cli.bench.ggmlkernels import LlamaCppRates
from rocketllm_cli.bench.kernels import render_kernels
from rocketllm_cli.bench.llamacpp import NOT_INSTALLED, installed
from rocketllm_cli.native.kernels import GGML_IDS
from rocketllm_cli.native.sample import sample_blocks

ROWS, COLS = 64, 1024
needs_llamacpp = pytest.mark.skipif(not installed(), reason=NOT_INSTALLED)


@needs_llamacpp
def test_llamacpp_computes_the_product_ours_does(nk):
    x = torch.randn(1, COLS, generator=torch.Generator().manual_seed(2))
    blocks = {name: sample_blocks(name, ROWS, COLS, seed=3) for name in ("Q4_0", "Q4_K")}
    with LlamaCppRates() as theirs:
        for name, b in blocks.items():
            theirs.add(name, GGML_IDS[name], b, COLS)
        found = theirs.measure(x[0].tolist(), threads=2, pool_bytes=1 << 20, repeats=1)
    assert found["version"] and found["version"].startswith("llama-cpp-python"), found["reason"]
    assert set(found["rows"]) == set(blocks), found["notes"]
    for name, b in blocks.items():
        row = found["rows"][name]
        ours = nk.matmul(b, name, x)[0].double()
        error = float((torch.tensor(row["y"], dtype=torch.float64) - ours).norm() / ours.norm())
        assert 1e-5 < error < 2e-2, (name, row["buffer"], error)
        assert row["bytes_per_s"] > 0 and row["buffer"]


@needs_llamacpp
def test_a_bad_product_is_a_note_and_the_others_are_measured():
    with LlamaCppRates() as theirs:
        theirs.add("Q4_0", GGML_IDS["Q4_0"], sample_blocks("Q4_0", ROWS, COLS, seed=3), COLS // 2)  # 2x the bytes
        theirs.add("Q8_0", GGML_IDS["Q8_0"], sample_blocks("Q8_0", ROWS, COLS, seed=3), COLS)
        found = theirs.measure([0.5] * COLS, threads=1, pool_bytes=1 << 20, repeats=1)
    assert set(found["rows"]) == {"Q8_0"}
    assert len(found["notes"]) == 1 and found["notes"][0].startswith("Q4_0: llama.cpp failed:"), found["notes"]


@needs_llamacpp
def test_a_worker_that_ends_before_it_is_ready_leaves_nothing_measured(monkeypatch):
    monkeypatch.setattr(ggmlkernels, "WORKER", "rocketllm_cli.bench.no_such_worker")
    with LlamaCppRates() as theirs:
        theirs.add("Q8_0", GGML_IDS["Q8_0"], sample_blocks("Q8_0", ROWS, COLS, seed=3), COLS)
        found = theirs.measure([0.5] * COLS, threads=1, pool_bytes=1 << 20, repeats=1)
    assert found["version"] is None and not found["rows"]
    assert found["reason"].startswith("crashed (exit status 1)") and "no_such_worker" in found["reason"]


def test_a_crash_retries_that_type_without_extra_buffers_and_goes_on(monkeypatch):
    """A worker that dies in Q8_0's product with the extra buffer types on: Q8_0 once more with them off (here it
    dies again), then the rest in a fresh worker; each type's note says what happened."""
    runs = []

    def fake(request):
        names, extra = [p["type"] for p in request["products"]], request["extra_buffers"]
        runs.append((names, extra))
        answers = [{"ready": "llama-cpp-python 0.0 (ggml 0.0)"}]
        for name in names:
            if name == "Q8_0" or (name == "Q6_K" and extra):
                return answers, "crashed (signal SIGSEGV)"
            answers.append({"type": name, "bytes_per_s": 1e9, "buffer": "AMX" if extra else "CPU", "y": [1.0]})
        return answers, ""

    monkeypatch.setattr(ggmlkernels, "_run_worker", fake)
    monkeypatch.setattr(ggmlkernels, "installed", lambda: True)
    with LlamaCppRates() as theirs:
        for name in ("Q4_0", "Q8_0", "Q6_K", "Q4_K"):
            theirs.add(name, GGML_IDS[name], sample_blocks(name, 1, 256), 256)
        found = theirs.measure([0.5] * 256, threads=1, pool_bytes=1 << 20, repeats=1)
    assert runs == [
        (["Q4_0", "Q8_0", "Q6_K", "Q4_K"], True),
        (["Q8_0"], False),
        (["Q6_K", "Q4_K"], True),
        (["Q6_K"], False),
        (["Q4_K"], True),
    ]
    assert {n: r["buffer"] for n, r in found["rows"].items()} == {"Q4_0": "AMX", "Q6_K": "CPU", "Q4_K": "AMX"}
    assert found["rows"]["Q6_K"]["extra_buffers"] is False
    assert found["notes"] == [
        "Q8_0: llama.cpp crashed (signal SIGSEGV) (with its extra buffer types off: crashed (signal SIGSEGV))",
        "Q6_K: llama.cpp crashed (signal SIGSEGV) with its extra buffer types on; measured with them off",
    ]


def test_without_llamacpp_nothing_is_written_and_the_reason_is_the_install_command(monkeypatch):
    monkeypatch.setattr(ggmlkernels, "installed", lambda: False)
    with LlamaCppRates() as theirs:
        assert not theirs.wanted
        theirs.add("Q8_0", GGML_IDS["Q8_0"], sample_blocks("Q8_0", 1, 32), 32)
        found = theirs.measure([0.5] * 32, threads=1, pool_bytes=1 << 20, repeats=1)
    assert found == {"version": None, "reason": NOT_INSTALLED, "rows": {}, "notes": []}


def _doc(llamacpp: dict, gbps: float | None) -> dict:
    row = {
        "type": "Q4_K",
        "bits_per_weight": 4.5,
        "exact_gb_per_s": 10.0,
        "int16_gb_per_s": 12.0,
        "int8_gb_per_s": 15.0,
        "exact_rel_error": 1e-7,
        "int16_rel_error": 2e-5,
        "int8_rel_error": 6e-3,
        "torch_decoder_gb_per_s": 0.3,
        "llamacpp_gb_per_s": gbps,
        "llamacpp_buffer": "AMX" if gbps else None,
        "llamacpp_rel_error": 5e-3 if gbps else None,
    }
    return {
        "cpu": "a CPU",
        "isa": "avx2",
        "isas": ["avx2", "scalar"],
        "threads": 2,
        "shape": "[1,4096] x [4096,4096]",
    } | {
        "rows": [row],
        "llamacpp": llamacpp,
    }


def test_render_shows_a_dash_and_the_reason_when_llamacpp_is_not_measured():
    text = render_kernels(_doc({"reason": NOT_INSTALLED}, None))
    assert "| llama.cpp GB/s | our int16 ÷ llama.cpp | our int8 ÷ llama.cpp |" in text
    assert "| 0.3 | - | - | - |" in text and f"llama.cpp: not measured: {NOT_INSTALLED}" in text


def test_render_shows_llamacpp_its_buffer_our_int8_over_it_and_its_notes():
    text = render_kernels(_doc({"version": "llama-cpp-python 0.3.36 (ggml 0.25.3)", "notes": ["Q6_K: crashed"]}, 20.0))
    assert (
        "| 10.0 | 12.0 | 15.0 | 1.20x | 1.50x | 1.0e-07 | 2.0e-05 | 6.0e-03 | 0.3 | 20.0 (AMX) | 0.60x | 0.75x |"
        in text
    )
    assert "llama.cpp: llama-cpp-python 0.3.36 (ggml 0.25.3), its own mul_mat" in text
    assert text.endswith("llama.cpp: Q6_K: crashed")
