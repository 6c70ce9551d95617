"""bench --perplexity: the streamed perplexity equals plain transformers' on the same weights and windows, a model
against itself agrees everywhere with KL 0, agreement and KL divergence against another model equal what transformers'
own distributions give, the windows score every token once, the scratch file never outlives a run, and every bad input
is one `error:` line."""

from __future__ import annotations

import functools
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from rocketllm_cli.app import app
from rocketllm_cli.bench.divergence import divergence, scratch_directory
from rocketllm_cli.bench.perplexity import check_same_tokenizer, windows
from rocketllm_cli.cachehome import cache_root
from rocketllm_cli.errors import RocketError, UsageError

TEXT = Path(__file__).parent / "fixtures" / "perplexity.txt"
WINDOW, STRIDE = 64, 24
PIECE = 1200  # characters of the text the tiny-model tests score (its byte tokenizer makes ~700 tokens of them)


@pytest.fixture(scope="module")
def text_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("perplexity") / "piece.txt"
    path.write_text(TEXT.read_text()[:PIECE])
    return path


def _bench(model: Path, text_file: Path, *extra: str) -> dict:
    result = CliRunner().invoke(
        app,
        [
            "bench",
            str(model),
            "--perplexity",
            str(text_file),
            "--window",
            str(WINDOW),
            "--stride",
            str(STRIDE),
            "--json",
            *extra,
        ],
    )
    assert result.exit_code == 0, result.stderr
    return json.loads(result.stdout)


def _plain_scores(path: Path, text: str) -> tuple[float, list[int], int]:
    """Perplexity and per-position argmax by the textbook sliding window: labels of already-scored tokens set to
    -100."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ids = torch.tensor([AutoTokenizer.from_pretrained(path)(text).input_ids])
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    n, nll_sum, count, argmax, prev_end = ids.shape[1], 0.0, 0, [], 0
    with torch.no_grad():
        for begin in range(0, n, STRIDE):
            end = min(begin + WINDOW, n)
            x = ids[:, begin:end]
            labels = x.clone()
            labels[:, : prev_end - begin] = -100  # scored by an earlier window
            out = model(input_ids=x, labels=labels)
            scored = int((labels[0, 1:] != -100).sum())  # transformers shifts labels by one inside the loss
            nll_sum += out.loss.item() * scored
            count += scored
            first = max(prev_end - begin, 1)
            argmax += out.logits[0, first - 1 : end - begin - 1].argmax(-1).tolist()
            prev_end = end
            if end == n:
                break
    return math.exp(nll_sum / count), argmax, count


@functools.lru_cache(maxsize=8)
def _plain_logprobs(path: Path, text: str) -> torch.Tensor:
    """[scored positions, vocabulary] float64 log-probabilities of the same textbook sliding window, in position
    order."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ids = torch.tensor([AutoTokenizer.from_pretrained(path)(text).input_ids])
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    n, rows, prev_end = ids.shape[1], [], 1
    with torch.no_grad():
        for begin in range(0, n, STRIDE):
            end = min(begin + WINDOW, n)
            logits = model(input_ids=ids[:, begin:end]).logits[0].double()
            rows.append(torch.log_softmax(logits[prev_end - begin - 1 : end - begin - 1], dim=-1))
            prev_end = end
            if end == n:
                break
    return torch.cat(rows)


def _kl_summary(model: Path, reference: Path, text: str) -> dict:
    """KL(reference || model) per position by torch's own kl_div on transformers' distributions: mean, p99, max."""
    per_token = torch.nn.functional.kl_div(
        _plain_logprobs(model, text), _plain_logprobs(reference, text), reduction="none", log_target=True
    ).sum(-1)
    return {
        "mean": per_token.mean().item(),
        "p99": torch.quantile(per_token, 0.99).item(),
        "max": per_token.max().item(),
        "n": len(per_token),
    }


def _no_scratch_left() -> bool:
    return not list(cache_root().glob("perplexity-kl-*"))


@pytest.fixture(scope="module")
def tiny_pair(tiny_factory):
    return tiny_factory("llama", seed=13), tiny_factory("llama", seed=14)


@pytest.fixture(scope="module")
def perturbed(tiny_pair, tmp_path_factory) -> Path:
    """The first tiny model with noise on every weight (0.3% of its mean magnitude): close to it, as a quantisation
    is."""
    from safetensors.torch import load_file, save_file

    dest = tmp_path_factory.mktemp("perturbed") / "llama-perturbed"
    shutil.copytree(tiny_pair[0], dest)
    weights = load_file(dest / "model.safetensors")
    generator = torch.Generator().manual_seed(5)
    noisy = {
        name: w + 0.003 * w.abs().mean() * torch.randn(w.shape, generator=generator) for name, w in weights.items()
    }
    save_file(noisy, dest / "model.safetensors", metadata={"format": "pt"})
    return dest


def test_perplexity_equals_plain_transformers_and_a_model_agrees_with_itself(tiny_pair, text_file):
    model = tiny_pair[0]
    doc = _bench(model, text_file, "--reference", str(model))
    want, _, count = _plain_scores(model, text_file.read_text())
    rows = {r["role"]: r for r in doc["rows"]}
    assert set(rows) == {"model", "reference"}
    assert rows["model"]["compute_dtype"] == "float32"
    assert rows["model"]["tokens_scored"] == count == doc["text"]["tokens"] - 1
    assert rows["model"]["perplexity"] == pytest.approx(want, rel=1e-3)
    assert rows["reference"]["perplexity"] == rows["model"]["perplexity"]
    assert doc["agreement"] == 1.0 and doc["perplexity_diff_pct"] == 0.0
    assert all(abs(doc["kl_divergence"][k]) <= 1e-6 for k in ("mean", "p99", "max")), doc["kl_divergence"]
    assert _no_scratch_left()
    assert doc["windows"] == len(windows(doc["text"]["tokens"], WINDOW, STRIDE)) and doc["regime"] == "storage"
    assert rows["model"]["ms_per_window"]["n"] == doc["windows"]


def test_agreement_with_another_model_is_the_share_of_equal_argmax(tiny_pair, text_file):
    model, other = tiny_pair
    doc = _bench(model, text_file, "--reference", str(other), "--regime", "resident")
    ppl_a, argmax_a, _ = _plain_scores(model, text_file.read_text())
    ppl_b, argmax_b, _ = _plain_scores(other, text_file.read_text())
    agreement = sum(a == b for a, b in zip(argmax_a, argmax_b)) / len(argmax_a)
    assert doc["agreement"] == pytest.approx(agreement, abs=2 / len(argmax_a))  # a near-tie may round either way
    assert doc["agreement"] < 1.0
    rows = {r["role"]: r for r in doc["rows"]}
    assert rows["reference"]["perplexity"] == pytest.approx(ppl_b, rel=1e-3)
    assert doc["perplexity_diff_pct"] == pytest.approx(100 * (ppl_a / ppl_b - 1), abs=0.05)
    want, backwards = _kl_summary(model, other, text_file.read_text()), _kl_summary(other, model, text_file.read_text())
    assert want["n"] == rows["model"]["tokens_scored"]
    assert {k: doc["kl_divergence"][k] for k in ("mean", "p99", "max")} == pytest.approx(
        {k: want[k] for k in ("mean", "p99", "max")}, rel=1e-5
    )
    assert abs(want["mean"] - backwards["mean"]) > 0.01 * want["mean"]  # so the direction above is the one checked


def test_kl_against_a_close_model_equals_transformers_own(tiny_pair, perturbed, text_file):
    """A small divergence (a quantisation's size) computed over exactly the scored positions: mean, p99 and max equal
    torch's kl_div on transformers' float64 log-softmaxes of the same windows."""
    model = tiny_pair[0]
    doc = _bench(model, text_file, "--reference", str(perturbed), "--regime", "resident")
    want, got = _kl_summary(model, perturbed, text_file.read_text()), doc["kl_divergence"]
    assert 1e-3 < want["mean"] < 0.05, want
    assert got["mean"] == pytest.approx(want["mean"], rel=1e-5, abs=1e-7)
    assert got["p99"] == pytest.approx(want["p99"], rel=1e-5, abs=1e-7)
    assert got["max"] == pytest.approx(want["max"], rel=1e-5, abs=1e-7)
    assert _no_scratch_left()


def test_divergence_keeps_rows_on_disk_and_skips_zero_probabilities():
    """The meter alone: rows kept in chunks come back in order; a token the reference rules out (log p = -inf) adds 0,
    where the model's -inf too would make nan of a plain product."""
    generator = torch.Generator().manual_seed(3)
    model, ref = (torch.randn(10, 33, generator=generator) * 3 for _ in range(2))
    model[:, 5] = ref[:, 5] = float("-inf")
    ref[:, 7] = float("-inf")
    model, ref = model.log_softmax(-1), ref.log_softmax(-1)
    want = (ref.exp() * (ref - model)).nan_to_num(nan=0.0).sum(-1).double()
    with divergence(10, 33, ("a", "b")) as meter:
        for at in (0, 4, 7):
            meter.keep(model[at : at + {0: 4, 4: 3, 7: 3}[at]])
        for at in (0, 6):
            meter.compare(ref[at : at + {0: 6, 6: 4}[at]])
        summary = meter.summary()
    assert torch.allclose(torch.tensor(meter.values, dtype=torch.float64), want, rtol=1e-5, atol=1e-7)
    assert summary["max"] == pytest.approx(want.max().item(), rel=1e-5) and math.isfinite(summary["mean"])
    with divergence(2, 33, ("a", "b")) as meter:
        meter.keep(model[:2])
        meter.compare(torch.zeros(2, 34).log_softmax(-1))  # a padded head: no KL, and the reason
        assert meter.summary() is None and "33 tokens" in meter.why_not and "34" in meter.why_not


def test_the_scratch_file_is_removed_on_ctrl_c_and_a_full_disk_is_one_line():
    with pytest.raises(KeyboardInterrupt):
        with divergence(4, 8, ("a", "b")) as meter:
            meter.keep(torch.zeros(4, 8).log_softmax(-1))
            scratch = meter.path.parent
            assert meter.path.exists()
            raise KeyboardInterrupt
    assert not scratch.exists() and _no_scratch_left()
    with pytest.raises(
        RocketError, match=r"KL divergence needs .* of scratch space .* set ROCKETLLM_CACHE or TMPDIR"
    ) as caught:
        scratch_directory(10**9, 10**9)
    assert "\n" not in str(caught.value)


def test_markdown_has_both_rows_and_the_difference(tiny_pair, text_file):
    model, other = tiny_pair
    result = CliRunner().invoke(
        app, ["bench", str(model), "--perplexity", str(text_file), "--window", str(WINDOW), "--reference", str(other)]
    )
    assert result.exit_code == 0, result.stderr
    table = [line for line in result.stdout.splitlines() if line.startswith("| ")]
    assert table[0].startswith("| run | model | perplexity |")
    assert table[1].startswith(f"| model | {model.name} |") and "%" in table[1]
    assert table[2].startswith(f"| reference | {other.name} |")


@pytest.mark.parametrize("n,window,stride", [(10, 4, 2), (10, 4, 3), (11, 5, 3), (3, 8, 4), (100, 7, 1), (2, 2, 1)])
def test_windows_score_every_token_once_with_context(n, window, stride):
    scored = []
    for begin, end, first in windows(n, window, stride):
        assert 0 <= begin < end <= n and end - begin <= window and first >= 1
        scored += range(begin + first, end)
        if begin > 0:
            assert first >= window - stride or end == n  # context before the first scored token
    assert scored == list(range(1, n))


class _Tok:
    def __init__(self, size: int) -> None:
        self.size = size

    def __len__(self) -> int:
        return self.size


def test_tokenizer_mismatch_names_the_size_or_the_first_different_token():
    with pytest.raises(UsageError, match="a has 320 tokens, --reference b has 321"):
        check_same_tokenizer(_Tok(320), _Tok(321), [1, 2], [1, 2], ("a", "b"))
    with pytest.raises(UsageError, match=r"from token 1 on \(a \[2, 3\], --reference b \[9, 3\]"):
        check_same_tokenizer(_Tok(320), _Tok(320), [1, 2, 3], [1, 9, 3], ("a", "b"))
    check_same_tokenizer(_Tok(320), _Tok(320), [1, 2], [1, 2], ("a", "b"))


@pytest.fixture(scope="module")
def other_tokenizer(tiny_factory, tmp_path_factory) -> Path:
    """The tiny model with one token added to its tokenizer: same weights, another vocabulary."""
    from transformers import AutoTokenizer

    dest = tmp_path_factory.mktemp("other-tokenizer") / "llama-extra-token"
    shutil.copytree(tiny_factory("llama", seed=13), dest)
    tokenizer = AutoTokenizer.from_pretrained(dest)
    tokenizer.add_tokens(["<extra>"])
    tokenizer.save_pretrained(dest)
    return dest


def _bad(name, tmp_path):
    if name == "empty":
        (tmp_path / "empty.txt").write_text("  \n")
        return ["--perplexity", str(tmp_path / "empty.txt")], "the text is empty"
    return {
        "missing": (["--perplexity", str(tmp_path / "nope.txt")], "no such file"),
        "directory": (["--perplexity", str(tmp_path)], "not a file"),
        "window": (["--perplexity", str(TEXT), "--window", "1"], "--window must be at least 2"),
        "stride": (["--perplexity", str(TEXT), "--window", "8", "--stride", "8"], "must be less than --window"),
        "no-file": (["--reference", "x"], "go with --perplexity FILE"),
        "baseline": (["--perplexity", str(TEXT), "--baseline", "transformers"], "drop --baseline"),
        "regimes": (["--perplexity", str(TEXT), "--regime", "host", "storage"], "one regime"),
        "reference": (
            ["--perplexity", str(TEXT), "--reference", str(tmp_path / "nope")],
            "--reference: model path not found",
        ),
    }[name]


@pytest.mark.parametrize(
    "name", ["missing", "empty", "directory", "window", "stride", "no-file", "baseline", "regimes", "reference"]
)
def test_bad_input_is_one_error_line(name, tiny_pair, tmp_path):
    args, words = _bad(name, tmp_path)
    result = CliRunner().invoke(app, ["bench", str(tiny_pair[0]), *args])
    assert result.exit_code in (1, 2) and result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and words in lines[0], result.stderr


def test_tokenizer_mismatch_is_one_error_line_in_a_fresh_process(tiny_pair, other_tokenizer, tmp_path):
    env = {**os.environ, "ROCKETLLM_CACHE": str(tmp_path)}
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "rocketllm_cli",
            "bench",
            str(tiny_pair[0]),
            "--perplexity",
            str(TEXT),
            "--reference",
            str(other_tokenizer),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=False,
    )
    assert run.returncode == 2 and run.stdout == ""
    errors = [line for line in run.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "tokenizer mismatch" in errors[0] and "320 tokens" in errors[0], run.stderr
    assert "Traceback" not in run.stderr


@pytest.mark.realmodel
def test_smollm2_perplexity_on_the_shipped_text(smollm2_gguf):
    """The real model reads English: its perplexity on the shipped text is far below a uniform guess (49152)."""
    result = CliRunner().invoke(
        app, ["bench", str(smollm2_gguf), "--perplexity", str(TEXT), "--regime", "host", "--json"]
    )
    assert result.exit_code == 0, result.stderr
    row = json.loads(result.stdout)["rows"][0]
    assert 1 < row["perplexity"] < 100


@pytest.mark.realmodel
def test_the_reference_runs_exact_kernels_so_int8_is_measured_against_them(smollm2_gguf, text_file):
    """`--kernel int8 --reference MODEL` compares the model's int8 products with the same file's exact ones: the
    reference row is the exact run's, bit for bit, and the model row differs from it by int8's small error."""
    flags = ("--regime", "resident", "--compute-dtype", "fp32")
    exact = _bench(smollm2_gguf, text_file, *flags, "--kernel", "exact")["rows"][0]
    doc = _bench(smollm2_gguf, text_file, *flags, "--kernel", "int8", "--reference", str(smollm2_gguf))
    rows = {r["role"]: r for r in doc["rows"]}
    assert rows["reference"]["perplexity"] == exact["perplexity"]
    assert rows["reference"]["nll_mean"] == exact["nll_mean"]
    assert rows["model"]["nll_mean"] != exact["nll_mean"]
    assert 0 < doc["kl_divergence"]["mean"] < 0.02, doc["kl_divergence"]
    assert doc["agreement"] > 0.9
