"""The synthetic checkpoint writer: what transformers loads, what save_pretrained writes, layouts, sizes, memory."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from rocketllm_cli.synthetic import (
    ARCHS,
    MOE_ARCHS,
    VOCAB_SIZE,
    config_for,
    config_from_spec,
    count_params,
    parse_size,
    saved_tensors,
    write_checkpoint,
)

pytestmark = pytest.mark.compat

PROMPT = "The capital of France is"
REPO_ROOT = Path(__file__).resolve().parent.parent


def _load(path: Path):
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(path, output_loading_info=True)
    return model.eval(), info


def _weights(path: Path) -> dict[str, torch.Tensor]:
    if (path / "pytorch_model.bin").exists():
        return torch.load(path / "pytorch_model.bin", weights_only=True)
    return {name: t for file in sorted(path.glob("*.safetensors")) for name, t in load_file(file).items()}


def _greedy(model, tokenizer, prompt: str = PROMPT, tokens: int = 8) -> list[int]:
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(
            ids, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id
        )
    return out[0, ids.shape[1] :].tolist()


@pytest.mark.parametrize("layout", ["single", "sharded", "bin"])
def test_every_layout_loads_with_no_missing_or_unexpected_keys(tiny_arch, layout, tiny_factory):
    path = tiny_factory(tiny_arch, layout)
    _, info = _load(path)
    assert {key: list(value) for key, value in info.items() if value} == {}


def test_written_keys_and_shapes_equal_what_save_pretrained_writes(tiny_arch, tmp_path):
    from transformers import AutoModelForCausalLM

    config = config_for(tiny_arch)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    with safe_open(tmp_path / "model.safetensors", "pt") as f:
        expected = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
    assert {spec.name: spec.shape for spec in saved_tensors(config)} == expected


def test_loaded_weights_equal_the_written_ones(tiny_arch, tiny_factory, tmp_path):
    # Saving the loaded model undoes every load-time conversion (MoE fusing), so it must give back the file.
    path = tiny_factory(tiny_arch, "sharded")
    model, _ = _load(path)
    model.save_pretrained(tmp_path)
    written, resaved = _weights(path), _weights(tmp_path)
    assert written.keys() == resaved.keys()
    assert all(torch.equal(written[name], resaved[name]) for name in written)


def test_norms_are_stored_at_the_identity_transformers_initialises(tiny_arch, tiny_factory):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    fresh = AutoModelForCausalLM.from_config(config_for(tiny_arch)).state_dict()
    written = _weights(tiny_factory(tiny_arch))
    norms = [spec.name for spec in saved_tensors(config_for(tiny_arch)) if spec.kind == "norm"]
    assert norms
    for name in norms:
        assert torch.equal(written[name], fresh[name]), name
        assert torch.all(written[name] == ARCHS[tiny_arch].norm_init), name


def test_greedy_output_is_deterministic_and_the_same_for_every_layout(tiny_arch, tiny_factory):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_factory(tiny_arch))
    runs = {
        layout: _greedy(_load(tiny_factory(tiny_arch, layout))[0], tokenizer) for layout in ("single", "sharded", "bin")
    }
    runs["again"] = _greedy(_load(tiny_factory(tiny_arch))[0], tokenizer)
    assert len({tuple(tokens) for tokens in runs.values()}) == 1, runs
    assert len(runs["single"]) == 8 and max(runs["single"]) < VOCAB_SIZE


def test_greedy_output_is_varied_for_most_architectures(tiny_factory):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_factory("llama"))
    distinct = {arch: len(set(_greedy(_load(tiny_factory(arch))[0], tokenizer))) for arch in ARCHS}
    repeating = [arch for arch, count in distinct.items() if count == 1]
    # Gemma's sandwich norms make random weights settle on few tokens; every other family varies.
    assert len(repeating) <= 2, distinct
    assert sum(distinct.values()) / len(distinct) >= 4, distinct


@pytest.mark.parametrize("arch", ["llama", "gpt2", *MOE_ARCHS])
def test_sharded_layout_splits_a_layer_across_files_out_of_order(arch, tiny_factory):
    path = tiny_factory(arch, "sharded")
    weight_map = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    specs = saved_tensors(config_for(arch))
    layer_of = {spec.name: spec.layer for spec in specs}
    files_of_layer: dict[int, set[str]] = {}
    for name, file in weight_map.items():
        if layer_of[name] is not None:
            files_of_layer.setdefault(layer_of[name], set()).add(file)
    assert any(len(files) >= 2 for files in files_of_layer.values())

    files = sorted(set(weight_map.values()))
    assert len(files) >= 3
    first_layer = [min(layer for layer, fs in files_of_layer.items() if file in fs) for file in files]
    assert first_layer != sorted(first_layer), "files hold the layers in order"
    # Within a file the data is not in stack order either: tensors of several layers are interleaved.
    header = json.loads(_header(path / files[0]))
    header.pop("__metadata__")
    stored = sorted(header, key=lambda name: header[name]["data_offsets"][0])
    assert stored != [spec.name for spec in specs if spec.name in header]
    assert len({layer_of[name] for name in stored}) >= 2


def _header(path: Path) -> str:
    with open(path, "rb") as f:
        return f.read(int.from_bytes(f.read(8), "little")).decode()


def test_layouts_and_seeds(tiny_factory):
    single, sharded, bin_ = (_weights(tiny_factory("qwen3", layout)) for layout in ("single", "sharded", "bin"))
    assert single.keys() == sharded.keys() == bin_.keys()
    assert all(torch.equal(single[n], sharded[n]) and torch.equal(single[n], bin_[n]) for n in single)
    other = _weights(tiny_factory("qwen3", seed=1))
    assert not torch.equal(single["model.embed_tokens.weight"], other["model.embed_tokens.weight"])
    bf16 = _weights(tiny_factory("qwen3", dtype=torch.bfloat16))
    assert bf16["model.embed_tokens.weight"].dtype == torch.bfloat16


def test_single_layout_splits_in_order_past_max_file_bytes(tmp_path):
    path = write_checkpoint(config_for("llama"), tmp_path, layout="single", max_file_bytes=200_000, tokenizer=False)
    weight_map = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    order = [spec.name for spec in saved_tensors(config_for("llama"))]
    assert [weight_map[name] for name in order] == sorted(weight_map[name] for name in order)
    assert len(set(weight_map.values())) > 1
    assert all(p.stat().st_size < 400_000 for p in path.glob("*.safetensors"))
    assert not _load(path)[1]["missing_keys"]


def test_tokenizer_round_trips_and_has_a_chat_template(tiny_factory):
    from transformers import AutoTokenizer

    text = "Hello, world!\n\tdef f(x): return x ** 2  # ~{}[]|"
    for arch in ("llama", "qwen2", "gpt2"):  # qwen2 loads through its own tokenizer class
        path = tiny_factory(arch)
        tokenizer = AutoTokenizer.from_pretrained(path)
        ids = tokenizer.encode(text)
        assert tokenizer.decode(ids) == text
        assert max(ids) < json.loads((path / "config.json").read_text())["vocab_size"]
        chat = tokenizer.apply_chat_template(
            [{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False
        )
        assert chat == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
        config = json.loads((path / "config.json").read_text())
        assert (config["bos_token_id"], config["eos_token_id"]) == (tokenizer.bos_token_id, tokenizer.eos_token_id)


SIZE_CASES = [(arch, size) for arch in ARCHS for size in ("135M", "1B")] + [
    (arch, size) for arch in ("llama", "gemma3", "mixtral", "qwen3_moe") for size in ("8B", "16B")
]


@pytest.mark.parametrize("arch,size", SIZE_CASES)
def test_config_for_sizes_hit_their_parameter_targets(arch, size):
    config = config_for(arch, size)
    assert config.vocab_size == 32_000
    assert abs(count_params(config) / parse_size(size) - 1) < 0.10


def test_config_for_rejects_bad_input():
    with pytest.raises(ValueError, match="unknown architecture"):
        config_for("llama4000")
    with pytest.raises(ValueError, match="model size"):
        config_for("llama", "big")
    with pytest.raises(ValueError, match="layout"):
        write_checkpoint(config_for("llama"), Path("unused"), layout="zip")
    with pytest.raises(ValueError, match="in memory"):
        write_checkpoint(config_for("llama", "1B"), Path("unused"), layout="bin")
    assert config_for("llama", num_hidden_layers=7).num_hidden_layers == 7
    assert config_from_spec("qwen3_moe:1B").to_dict() == config_for("qwen3_moe", "1B").to_dict()


def test_writing_a_large_model_streams_in_little_memory(tmp_path):
    script = REPO_ROOT / "tests" / "fixtures" / "peak_rss_write.py"
    result = subprocess.run(
        [sys.executable, str(script), "llama", "400M", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO_ROOT,
    )
    assert result.returncode == 0, f"exit {result.returncode}: {result.stderr[-3000:]}"  # the child's own error
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["file_bytes"] > 700_000_000
    assert report["rss_growth"] < min(300_000_000, report["file_bytes"] / 3), report
