"""bench --perplexity: the streamed perplexity equals plain transformers' on the same weights and windows, a model
against itself agrees everywhere, agreement with another model equals the argmax agreement transformers computes,
the windows score every token once, and every bad input is one `error:` line."""

from __future__ import annotations

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
from rocketllm_cli.bench.perplexity import check_same_tokenizer, windows
from rocketllm_cli.errors import UsageError

TEXT = Path(__file__).parent / "fixtures" / "perplexity.txt"
WINDOW, STRIDE = 64, 24
PIECE = 1200  # characters of the text the tiny-model tests score (its byte tokenizer makes ~700 tokens of them)


@pytest.fixture(scope="module")
def text_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("perplexity") / "piece.txt"
    path.write_text(TEXT.read_text()[:PIECE])
    return path


def _bench(model: Path, text_file: Path, *extra: str) -> dict:
    result = CliRunner().invoke(app, ["bench", str(model), "--perplexity", str(text_file), "--window", str(WINDOW),
                                      "--stride", str(STRIDE), "--json", *extra])
    assert result.exit_code == 0, result.stderr
    return json.loads(result.stdout)


def _plain_scores(path: Path, text: str) -> tuple[float, list[int], int]:
    """Perplexity and per-position argmax by the textbook sliding window: labels of already-scored tokens set to -100."""
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


@pytest.fixture(scope="module")
def tiny_pair(tiny_factory):
    return tiny_factory("llama", seed=13), tiny_factory("llama", seed=14)


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


def test_markdown_has_both_rows_and_the_difference(tiny_pair, text_file):
    model, other = tiny_pair
    result = CliRunner().invoke(app, ["bench", str(model), "--perplexity", str(text_file), "--window", str(WINDOW),
                                      "--reference", str(other)])
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
        "reference": (["--perplexity", str(TEXT), "--reference", str(tmp_path / "nope")], "--reference: model path not found"),
    }[name]


@pytest.mark.parametrize("name", ["missing", "empty", "directory", "window", "stride", "no-file", "baseline", "regimes", "reference"])
def test_bad_input_is_one_error_line(name, tiny_pair, tmp_path):
    args, words = _bad(name, tmp_path)
    result = CliRunner().invoke(app, ["bench", str(tiny_pair[0]), *args])
    assert result.exit_code in (1, 2) and result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and words in lines[0], result.stderr


def test_tokenizer_mismatch_is_one_error_line_in_a_fresh_process(tiny_pair, other_tokenizer, tmp_path):
    env = {**os.environ, "ROCKETLLM_CACHE": str(tmp_path)}
    run = subprocess.run([sys.executable, "-m", "rocketllm_cli", "bench", str(tiny_pair[0]), "--perplexity", str(TEXT),
                          "--reference", str(other_tokenizer)], capture_output=True, text=True, env=env, timeout=300, check=False)
    assert run.returncode == 2 and run.stdout == ""
    errors = [line for line in run.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "tokenizer mismatch" in errors[0] and "320 tokens" in errors[0], run.stderr
    assert "Traceback" not in run.stderr


@pytest.mark.realmodel
def test_smollm2_perplexity_on_the_shipped_text(smollm2_gguf):
    """The real model reads English: its perplexity on the shipped text is far below a uniform guess (49152)."""
    result = CliRunner().invoke(app, ["bench", str(smollm2_gguf), "--perplexity", str(TEXT), "--regime", "host", "--json"])
    assert result.exit_code == 0, result.stderr
    row = json.loads(result.stdout)["rows"][0]
    assert 1 < row["perplexity"] < 100
