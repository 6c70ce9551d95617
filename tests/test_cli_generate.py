"""rocketllm generate: stdout carries exactly the text plain transformers produces for the same ids, whatever
the residency or prefetch; --json/--stats report per tier; the Python API is transformers' surface; every
bad input is one `error:` line with nothing written."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from cli_contract import one_error_line
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.generation.utils import GenerateDecoderOnlyOutput
from typer.testing import CliRunner

from rocketllm_cli.app import app
from rocketllm_cli.checkpoint.manifest import Manifest
from rocketllm_cli.compat import dtype_kwargs
from rocketllm_cli.shard.sharder import shard

pytestmark = pytest.mark.compat

PROMPT = "Hello"
NEW = 8
SEED = 7  # weights of this module's own tiny model: no other test's shards of it sit in the session cache


def invoke(*args, input: str | None = None, env: dict | None = None):
    return CliRunner().invoke(app, ["generate", *map(str, args)], input=input, env=env)


def generate_json(model, *args, prompt: str = PROMPT) -> dict:
    result = invoke(model, prompt, "-n", NEW, "--json", *args)
    assert result.exit_code == 0, result.stderr
    return json.loads(result.stdout)


@pytest.fixture(scope="module")
def tiny_model(tiny_factory) -> Path:
    return tiny_factory("llama", seed=SEED)


@pytest.fixture(scope="module")
def plain(tiny_model):
    """Greedy text from plain transformers on the source checkpoint: the answer every path must give."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model, **dtype_kwargs(torch.float32))
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)

    def ids(prompt: str = PROMPT, chat: bool = False) -> torch.Tensor:
        if chat:
            messages = [{"role": "user", "content": prompt}]
            return tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
            )["input_ids"]
        return tokenizer(prompt, return_tensors="pt").input_ids

    def sequences(prompt_ids: torch.Tensor, n: int = NEW) -> torch.Tensor:
        with torch.inference_mode():
            return model.generate(
                prompt_ids,
                attention_mask=torch.ones_like(prompt_ids),
                max_new_tokens=n,
                do_sample=False,
                pad_token_id=3,
            )

    def text(prompt: str = PROMPT, chat: bool = False) -> str:
        prompt_ids = ids(prompt, chat)
        return tokenizer.decode(sequences(prompt_ids)[0, prompt_ids.shape[1] :], skip_special_tokens=True)

    return SimpleNamespace(ids=ids, sequences=sequences, text=text)


@pytest.fixture(scope="module")
def shards(tiny_model) -> Path:
    """The tiny model sharded where generate looks for it (the session cache), so later runs reuse it."""
    _, directory, _ = shard(tiny_model, log=lambda m: None)
    return directory


@pytest.fixture(scope="module")
def resident(shards, plain) -> dict:
    """The fully resident run; its text is plain transformers' (this also caches the hardware profile)."""
    doc = generate_json(shards, "--raw", "--device-cache-bytes", "1GB")
    assert doc["text"] == plain.text() and doc["text"].strip()
    return doc


def test_pipeline_stdout_is_only_the_generated_text(tiny_model, shards, resident, plain):
    cli = [sys.executable, "-m", "rocketllm_cli", "generate", str(tiny_model), "--raw", "-n", str(NEW)]
    done = subprocess.run(
        ["bash", "-c", 'echo "Hello" | "$@"', "sh", *cli],
        env={**os.environ, "PYTHONIOENCODING": "utf-8"},
        capture_output=True,
        timeout=180,
    )
    assert done.returncode == 0, done.stderr.decode()
    assert done.stdout.decode("utf-8") == plain.text() + "\n"  # the text and its newline, no logs
    assert b"Traceback" not in done.stderr


@pytest.mark.parametrize("prompt, stdin", [("-", "Hello\n"), (PROMPT, None), (PROMPT, "ignored when PROMPT is given")])
def test_prompt_from_stdin_or_argument(prompt, stdin, shards, plain):
    result = invoke(shards, prompt, "--raw", "-n", NEW, input=stdin)
    assert result.exit_code == 0, result.stderr
    assert result.stdout == plain.text() + "\n"


def test_json_reports_counts_and_bytes_per_tier(resident, plain):
    assert resident["prompt_tokens"] == plain.ids().shape[1]
    assert 1 <= resident["new_tokens"] <= NEW
    per_tier = resident["stats"]["bytes_per_token"]
    assert set(per_tier) == {"device", "host", "storage"}
    assert per_tier["device"] > 0 and per_tier["host"] == per_tier["storage"] == 0


def test_stats_go_to_stderr_only(shards, resident):
    result = invoke(shards, PROMPT, "--raw", "-n", NEW, "--stats")
    assert result.exit_code == 0, result.stderr
    assert result.stdout == resident["text"] + "\n"
    assert "bytes per token:" in result.stderr and "tokens:" in result.stderr and "residency:" in result.stderr
    assert "bytes per token" not in result.stdout


def test_load_time_is_reported_beside_generation_time(shards, resident):
    """total_s is generation alone; load_s is finding the shards and loading them, measured around the load."""
    assert resident["stats"]["load_s"] > 0 and resident["stats"]["total_s"] > 0
    result = invoke(shards, PROMPT, "--raw", "-n", NEW, "--stats")
    assert result.exit_code == 0, result.stderr
    line = next(line for line in result.stderr.splitlines() if line.startswith("time: "))
    assert re.fullmatch(
        r"time: \d+\.\d+ s to find or write the shards and load them, then \d+\.\d+ s to generate", line
    ), line


@pytest.mark.parametrize(
    "knobs",
    [
        ("--device-cache-bytes", "0", "--host-cache-bytes", "0"),
        ("--device-cache-bytes", "0", "--host-cache-bytes", "1GB"),
        ("--device-cache-bytes", "0", "--host-cache-bytes", "0", "--prefetch-depth", "0"),
        ("--prefetch-depth", "0"),
    ],
)
def test_streamed_text_equals_resident_text(knobs, shards, resident):
    doc = generate_json(shards, "--raw", *knobs)
    assert doc["text"] == resident["text"] and doc["new_tokens"] == resident["new_tokens"]
    per_tier = doc["stats"]["bytes_per_token"]
    if "--device-cache-bytes" in knobs:  # the flags reached the plan: nothing stays on the device
        assert per_tier["device"] == 0
        tier = "host" if "1GB" in knobs else "storage"
        # Every unit is served from that tier each token; the embedding lookup reads only the rows it needs,
        # and a tied head serves the table again.
        manifest = Manifest.load(shards)
        embed = next(u for u in manifest.units if u.kind == "embed")
        rows = embed.tensor_bytes // embed.tensors[0].shape[0]
        tied = any(src in {t.name for t in embed.tensors} for src in manifest.aliases.values())
        assert per_tier[tier] == manifest.total_bytes - embed.tensor_bytes + rows + (embed.tensor_bytes if tied else 0)
        assert resident["stats"]["bytes_per_token"]["device"] == manifest.total_bytes


def test_chat_template_is_the_default_and_raw_skips_it(shards, plain):
    chat, default, raw = (generate_json(shards, *flag) for flag in (["--chat"], [], ["--raw"]))
    assert chat["prompt_tokens"] == default["prompt_tokens"] == plain.ids(chat=True).shape[1]
    assert raw["prompt_tokens"] == plain.ids().shape[1] < chat["prompt_tokens"]
    assert chat["text"] == default["text"] == plain.text(chat=True)


def test_sampling_with_a_seed_repeats(shards):
    first, second = (generate_json(shards, "--raw", "--temperature", "0.8", "--seed", "7") for _ in range(2))
    assert first["text"] == second["text"] and first["new_tokens"] >= 1


def test_python_api_is_transformers_generate(tiny_model, shards, plain):
    from rocketllm import AutoModel

    model = AutoModel.from_pretrained(tiny_model, device_cache_bytes=0)
    try:
        assert model.directory == shards  # found the shards made earlier instead of sharding again
        assert model.device == torch.device("cpu") and model.tokenizer is not None
        assert all(tier != "device" for tier in model.plan.tier.values())  # the keyword reached the plan
        ids = model.tokenizer(PROMPT, return_tensors="pt").input_ids
        out = model.generate(ids, max_new_tokens=5, do_sample=False, return_dict_in_generate=True)
    finally:
        model.close()
    assert isinstance(out, GenerateDecoderOnlyOutput)
    assert torch.equal(out.sequences, plain.sequences(ids, n=5))


# -- bad inputs ---------------------------------------------------------------------------------------------

LONG_PROMPT = "the quick brown fox jumps over the lazy dog " * 4

BAD_INPUTS = {
    # case: (model: "model" | "missing" | "empty dir" | "t5", args after the model, stdin, env, what the message says)
    "missing path": ("missing", [PROMPT], None, {}, "model path not found"),
    "not a model directory": ("empty dir", [PROMPT], None, {}, "no config.json"),
    "unsupported architecture": ("t5", [PROMPT], None, {}, "unsupported architecture 't5'"),
    "--max-new-tokens 0": (
        "model",
        [PROMPT, "--max-new-tokens", "0"],
        None,
        {},
        "--max-new-tokens must be at least 1 (got 0)",
    ),
    "--max-new-tokens -1": ("model", [PROMPT, "-n", "-1"], None, {}, "--max-new-tokens must be at least 1 (got -1)"),
    "empty stdin": ("model", [], "", {}, "empty prompt"),
    "empty stdin with -": ("model", ["-"], "", {}, "empty prompt"),
    "whitespace-only stdin": ("model", [], " \n\t\n", {}, "empty prompt"),
    "whitespace-only prompt": ("model", ["   "], None, {}, "empty prompt"),
    "--device-cache-bytes lots": (
        "model",
        [PROMPT, "--device-cache-bytes", "lots"],
        None,
        {},
        "bad value 'lots' for device_cache_bytes",
    ),
    "--io-workers 0": ("model", [PROMPT, "--io-workers", "0"], None, {}, "bad value '0' for io_workers"),
    "--dtype fp8": ("model", [PROMPT, "--dtype", "fp8"], None, {}, "bad value 'fp8' for compute_dtype"),
    "ROCKETLLM_PREFETCH_DEPTH=-3": (
        "model",
        [PROMPT],
        None,
        {"ROCKETLLM_PREFETCH_DEPTH": "-3"},
        "bad value '-3' for prefetch_depth (from ROCKETLLM_PREFETCH_DEPTH)",
    ),
    "--temperature -1": ("model", [PROMPT, "--temperature", "-1"], None, {}, "--temperature must be >= 0"),
    "--top-p 0": ("model", [PROMPT, "--top-p", "0"], None, {}, "--top-p must be in (0, 1]"),
    "--top-k -1": ("model", [PROMPT, "--top-k", "-1"], None, {}, "--top-k must be >= 0"),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_is_one_error_line_and_writes_nothing(case, tiny_checkpoint, tmp_path):
    which, args, stdin, env, says = BAD_INPUTS[case]
    if which == "t5":
        model = tmp_path / "t5"
        model.mkdir()
        for f in tiny_checkpoint.iterdir():
            (model / f.name).write_bytes(f.read_bytes())
        (model / "config.json").write_text(json.dumps({"model_type": "t5"}))
    else:
        (tmp_path / "empty").mkdir()
        model = {"model": tiny_checkpoint, "missing": tmp_path / "missing", "empty dir": tmp_path / "empty"}[which]
    cache = tmp_path / "cache"
    result = invoke(model, *args, input=stdin, env={"ROCKETLLM_CACHE": str(cache), **env})
    line = one_error_line(result)
    assert says in line, line
    assert not [p for p in cache.rglob("*") if p.is_file()] and not (cache / "shards").exists()  # no shards, no profile


def test_an_unparseable_number_is_a_usage_error(tiny_model, tmp_path):
    cache = tmp_path / "cache"
    result = invoke(tiny_model, PROMPT, "-n", "abc", env={"ROCKETLLM_CACHE": str(cache)})
    assert result.exit_code == 2 and result.stdout == "" and "Traceback" not in result.stderr
    assert "Invalid value for" in result.stderr and "--max-new-tokens" in result.stderr
    assert not cache.exists()


def test_prompt_longer_than_the_context_is_refused(shards, tiny_factory):
    line = one_error_line(invoke(shards, LONG_PROMPT, "--raw", "-n", NEW, "--max-context", "16"))
    assert "but the context allows 16" in line and "shorten the prompt" in line
    short_context = tiny_factory("llama", max_position_embeddings=32)  # the limit the model itself sets
    result = invoke(short_context, LONG_PROMPT, "--raw", "-n", NEW)
    assert result.exit_code == 1 and result.stdout == "" and "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    # the tokenizer comes with the shards: a log line may precede it
    assert errors == result.stderr.strip().splitlines()[-1:]
    assert "but the context allows 32" in errors[0]


def test_debug_shows_the_traceback_across_the_process_boundary(shards):
    command = [sys.executable, "-m", "rocketllm_cli", "generate", str(shards), PROMPT, "--io-workers", "0"]
    base = {k: v for k, v in os.environ.items() if k != "ROCKETLLM_DEBUG"}
    plain_run = subprocess.Popen(command, env=base, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    debug_run = subprocess.Popen(
        command, env={**base, "ROCKETLLM_DEBUG": "1"}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    out, err = plain_run.communicate(timeout=120)
    dout, derr = debug_run.communicate(timeout=120)
    assert plain_run.returncode == debug_run.returncode == 1 and out == dout == ""
    assert len(err.strip().splitlines()) == 1 and err.startswith("error: bad value '0' for io_workers")
    assert "Traceback (most recent call last)" in derr and derr.strip().splitlines()[-1] == err.strip()
