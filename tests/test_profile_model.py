"""Model facts read from headers (safetensors, shard manifest, GGUF) and the per-tier cost model."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from rocketllm_cli.errors import ModelError
from rocketllm_cli.profiles import (
    Capability,
    HardwareProfile,
    Measurement,
    ModelFacts,
    model_facts_from_path,
    parse_param_count,
    plan_tier_bytes,
    project,
    resolve_knobs,
)

GiB = 1024**3


def _write_safetensors(path: Path, tensors: dict[str, tuple[str, list[int]]]) -> dict[str, int]:
    """A valid safetensors file of zeros; returns name -> bytes."""
    itemsize = {"BF16": 2, "F32": 4}
    header, offset, sizes = {}, 0, {}
    for name, (dtype, shape) in tensors.items():
        n = itemsize[dtype]
        for dim in shape:
            n *= dim
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + n]}
        sizes[name], offset = n, offset + n
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(offset))
    return sizes


def test_hf_directory_facts_match_the_checkpoint(tiny_checkpoint):
    from safetensors import safe_open

    config = json.loads((tiny_checkpoint / "config.json").read_text())
    sizes = {}
    for f in tiny_checkpoint.glob("*.safetensors"):
        with safe_open(f, "pt") as st:
            for name in st.keys():
                sl = st.get_slice(name)
                n = {"F32": 4, "BF16": 2, "F16": 2}[sl.get_dtype()]
                for d in sl.get_shape():
                    n *= d
                sizes[name] = n
    facts = model_facts_from_path(tiny_checkpoint)
    layers = config["num_hidden_layers"]
    per_layer = [sum(b for k, b in sizes.items() if f".layers.{i}." in k) for i in range(layers)]
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    assert facts.total_bytes == sum(sizes.values())
    assert facts.num_layers == layers and facts.layer_bytes == max(per_layer)
    assert facts.non_layer_bytes == sum(sizes.values()) - sum(per_layer)
    assert facts.largest_unit_bytes >= facts.layer_bytes
    itemsize = 4 if config.get("torch_dtype", config.get("dtype")) == "float32" else 2  # KV in the stored dtype
    assert facts.kv_bytes_per_token == layers * 2 * config.get("num_key_value_heads", heads) * head_dim * itemsize
    assert facts.max_positions == config["max_position_embeddings"]


def test_shard_directory_and_its_source_give_the_same_facts(tiny_checkpoint, tmp_path):
    from rocketllm_cli.shard.sharder import shard

    _, directory, _ = shard(tiny_checkpoint, out=tmp_path / "shards", dtype="auto", progress=None, log=lambda m: None)
    assert (directory / "manifest.json").is_file()
    source, shards = model_facts_from_path(tiny_checkpoint), model_facts_from_path(directory)
    assert shards == source


# every field a checkpoint and its shard set must agree on (the name may differ: a directory's or the manifest's)
AGREEING = (
    "total_bytes",
    "num_layers",
    "layer_bytes",
    "largest_unit_bytes",
    "non_layer_bytes",
    "kv_bytes_per_token",
    "max_positions",
    "dtype",
    "active_bytes",
)


@pytest.mark.parametrize("arch", ["llama", "mixtral"])
def test_one_builder_agrees_with_itself_across_forms(tiny_factory, tmp_path, arch):
    from transformers import AutoConfig

    from rocketllm_cli.checkpoint.modelfacts import facts_from_manifest
    from rocketllm_cli.shard.sharder import shard

    src = tiny_factory(arch)
    manifest, directory, _ = shard(src, out=tmp_path / "shards", dtype="auto", progress=None, log=lambda m: None)
    source = model_facts_from_path(src)  # safetensors headers + config.json, before sharding
    forms = {
        "shard directory": model_facts_from_path(directory),
        "manifest + config object": facts_from_manifest(manifest, AutoConfig.from_pretrained(directory)),
        "manifest + config.json": facts_from_manifest(manifest, json.loads((directory / "config.json").read_text())),
    }
    for form, facts in forms.items():
        for name in AGREEING:
            assert getattr(facts, name) == getattr(source, name), f"{form}: {name}"
    assert source.total_bytes == manifest.total_bytes and source.num_layers == len(manifest.layers)
    assert source.largest_unit_bytes == max(u.tensor_bytes for u in manifest.units)
    if manifest.experts:  # a decode token reads the dense part and top-k of each layer's experts
        config = json.loads((src / "config.json").read_text())
        experts = sum(u.tensor_bytes for u in manifest.experts)
        k, count = config["num_experts_per_tok"], config["num_local_experts"]
        assert source.active_bytes == manifest.total_bytes - experts + experts * k // count < source.total_bytes
    else:
        assert source.active_bytes is None


def test_facts_from_a_path_import_neither_torch_nor_transformers(tiny_checkpoint, tmp_path):
    from rocketllm_cli.shard.sharder import shard

    _, directory, _ = shard(tiny_checkpoint, out=tmp_path / "shards", progress=None, log=lambda m: None)
    code = (
        "import sys; from rocketllm_cli.profiles import model_facts_from_path; [model_facts_from_path(p) for p in "
        "sys.argv[1:]]; print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    )
    run = subprocess.run(
        [sys.executable, "-c", code, str(tiny_checkpoint), str(directory)], capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "[]"


def test_the_decoder_is_the_largest_stack_not_the_vision_tower(tmp_path):
    tensors = {"model.embed_tokens.weight": ("BF16", [1000, 64]), "lm_head.weight": ("BF16", [1000, 64])}
    for i in range(3):
        tensors[f"model.language_model.layers.{i}.mlp.weight"] = ("BF16", [256, 64])
    for i in range(5):
        tensors[f"vision_tower.encoder.layers.{i}.mlp.weight"] = ("BF16", [16, 16])
    sizes = _write_safetensors(tmp_path / "model.safetensors", tensors)
    config = {
        "text_config": {
            "num_hidden_layers": 3,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "hidden_size": 64,
            "max_position_embeddings": 512,
            "torch_dtype": "bfloat16",
        }
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    facts = model_facts_from_path(tmp_path)
    assert facts.num_layers == 3 and facts.layer_bytes == 256 * 64 * 2
    assert facts.largest_unit_bytes == 1000 * 64 * 2 and facts.total_bytes == sum(sizes.values())
    assert facts.kv_bytes_per_token == 3 * 2 * 2 * 16 * 2 and facts.max_positions == 512 and facts.dtype == "bf16"


def test_shard_manifest_facts(tmp_path):
    def unit(name, kind, nbytes):
        return {"name": name, "kind": kind, "tensors": [{"name": f"{name}.w", "nbytes": nbytes}]}

    units = [
        unit("embed", "embed", 5000),
        unit("layer.000", "layer", 3000),
        unit("layer.001", "layer", 3100),
        unit("lm_head", "lm_head", 5000),
    ]
    (tmp_path / "manifest.json").write_text(json.dumps({"format_version": 1, "dtype": "bf16", "units": units}))
    (tmp_path / "config.json").write_text(
        json.dumps({"num_hidden_layers": 2, "num_attention_heads": 2, "hidden_size": 8, "max_position_embeddings": 64})
    )
    facts = model_facts_from_path(tmp_path)
    assert (
        facts.total_bytes,
        facts.num_layers,
        facts.layer_bytes,
        facts.largest_unit_bytes,
        facts.non_layer_bytes,
    ) == (16100, 2, 3100, 5000, 10000)
    assert facts.kv_bytes_per_token == 2 * 2 * 2 * 4 * 2 and facts.dtype == "bf16"


def _gguf_string(text: str) -> bytes:
    raw = text.encode()
    return struct.pack("<Q", len(raw)) + raw


def test_handmade_gguf_header(tmp_path):
    kv = [
        ("general.architecture", 8, _gguf_string("llama")),
        ("llama.block_count", 4, struct.pack("<I", 2)),
        ("llama.context_length", 4, struct.pack("<I", 128)),
        ("llama.embedding_length", 4, struct.pack("<I", 32)),
        ("llama.attention.head_count", 4, struct.pack("<I", 4)),
        ("llama.attention.head_count_kv", 4, struct.pack("<I", 2)),
        ("tokenizer.ggml.tokens", 9, struct.pack("<IQ", 8, 3) + b"".join(_gguf_string(t) for t in ("a", "bb", "ccc"))),
    ]
    # ggml I8: a byte each
    tensors = [("token_embd.weight", 4096), ("blk.0.attn_q.weight", 1024), ("blk.1.attn_q.weight", 1024)]
    body = b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(kv))
    body += b"".join(_gguf_string(k) + struct.pack("<I", t) + v for k, t, v in kv)
    offset = 0
    for name, nbytes in tensors:
        body += (
            _gguf_string(name)
            + struct.pack("<I", 1)
            + struct.pack("<Q", nbytes)
            + struct.pack("<I", 24)
            + struct.pack("<Q", offset)
        )
        offset += nbytes
    body += bytes(-len(body) % 32) + bytes(offset)
    (tmp_path / "tiny.gguf").write_bytes(body)
    facts = model_facts_from_path(tmp_path / "tiny.gguf")
    # sized as the shard set holds them: 1-D int8 tensors are not matrices kept packed, so they become bf16
    assert (facts.total_bytes, facts.num_layers, facts.layer_bytes, facts.largest_unit_bytes) == (12288, 2, 2048, 8192)
    assert facts.kv_bytes_per_token == 2 * 2 * 2 * 8 * 2 and facts.max_positions == 128


def test_real_gguf_model(smollm2_gguf):
    facts = model_facts_from_path(smollm2_gguf)
    assert facts.num_layers == 30 and facts.max_positions == 8192 and facts.dtype == "gguf-Q4_1"
    assert facts.kv_bytes_per_token == 30 * 2 * 3 * 64 * 2
    assert 90e6 < facts.total_bytes <= smollm2_gguf.stat().st_size


@pytest.mark.parametrize("make", ["missing", "empty", "bad-safetensors", "bad-gguf", "plain-file"])
def test_unusable_model_paths_are_one_line_model_errors(tmp_path, make):
    path = tmp_path / "m"
    if make == "empty":
        path.mkdir()
    elif make == "bad-safetensors":
        path.mkdir()
        (path / "config.json").write_text("{}")
        (path / "model.safetensors").write_bytes(b"\xff" * 16)
    elif make == "bad-gguf":
        path = tmp_path / "m.gguf"
        path.write_bytes(b"NOPE" + bytes(64))
    elif make == "plain-file":
        path.write_text("hello")
    with pytest.raises(ModelError) as err:
        model_facts_from_path(path)
    assert "\n" not in str(err.value)


def test_parameter_counts_and_sized_facts():
    assert parse_param_count("70B") == 70e9 and parse_param_count("135m") == 135e6 and parse_param_count("1e9") == 1e9
    for bad in ("abc", "0", "-7B", "B", "7BB", "inf"):
        with pytest.raises(ValueError):
            parse_param_count(bad)
    facts = ModelFacts.from_size(70e9, 4)
    assert facts.total_bytes == 35_000_000_000 and facts.num_layers > 40


def _synthetic(device: str = "cpu", **bps) -> HardwareProfile:
    def m(name, value):
        return (
            Measurement(name, value, "synthetic", 1, 1.0)
            if value
            else Measurement.unavailable(name, "synthetic", "not measured here")
        )

    names = (
        "host_memory",
        "device_memory",
        "page_cache_read",
        "storage_read",
        "storage_read_direct",
        "h2d_pinned",
        "h2d_pageable",
        "matvec_bf16",
    )
    return HardwareProfile(
        "synthetic",
        device,
        8,
        64 * GiB,
        60 * GiB,
        80 * GiB if device != "cpu" else None,
        78 * GiB if device != "cpu" else None,
        measurements={n: m(n, bps.get(n)) for n in names},
        capabilities={
            "compute_dtype": Capability("compute_dtype", "bf16"),
            "direct_io": Capability("direct_io", False),
            "storage_kind": Capability("storage_kind", "nvme"),
            "pin_memory": Capability("pin_memory", device != "cpu"),
        },
        storage={"mount_point": "/", "kind": "nvme"},
    )


def test_projection_is_bytes_over_bandwidth_per_tier():
    profile = _synthetic(device_memory=20e9, page_cache_read=10e9, storage_read=2e9, matvec_bf16=10e9)
    model = ModelFacts.from_size(8e9, 16)
    tiers = {"device": 4_000_000_000, "host": 2_000_000_000, "storage": 10_000_000_000}
    p = project(profile, model, tiers)
    assert p.tiers["device"].seconds == pytest.approx(0.2) and p.tiers["host"].seconds == pytest.approx(0.2)
    assert p.tiers["storage"].seconds == pytest.approx(5.0) and p.serial_seconds == pytest.approx(5.4)
    assert p.io_seconds == pytest.approx(5.2) and p.compute_seconds == pytest.approx(1.6)
    assert p.overlapped_seconds == pytest.approx(5.2) and p.tokens_per_second == pytest.approx(1 / 5.2)


def test_gpu_host_tier_is_the_pinned_copy_speed():
    profile = _synthetic("cuda:0", device_memory=2000e9, h2d_pinned=25e9, h2d_pageable=10e9, storage_read=5e9)
    p = project(profile, ModelFacts.from_size(8e9, 16), {"device": 0, "host": 25_000_000_000, "storage": 0})
    assert p.tiers["host"].bandwidth_bps == 25e9 and p.tiers["host"].seconds == pytest.approx(1.0)
    assert "pinned" in p.tiers["host"].bandwidth


def test_an_unmeasured_tier_is_unavailable_not_guessed():
    profile = _synthetic(device_memory=20e9, page_cache_read=10e9)  # no storage measurement
    p = project(profile, ModelFacts.from_size(8e9, 16), {"device": 1000, "host": 0, "storage": 1000})
    assert not p.available and p.serial_seconds is None and p.overlapped_seconds is None
    assert (
        not p.tiers["storage"].available and p.tiers["storage"].reason == "not measured here" and "storage" in p.reason
    )
    fine = project(profile, ModelFacts.from_size(8e9, 16), {"device": 1000, "host": 0, "storage": 0})
    assert fine.available  # an unmeasured tier that serves nothing costs nothing


@pytest.mark.parametrize("params", [135e6, 8e9, 70e9, 400e9])
def test_default_plan_splits_the_whole_model(params):
    profile = _synthetic(device_memory=20e9, page_cache_read=10e9, storage_read=2e9, matvec_bf16=10e9)
    model = ModelFacts.from_size(params, 4)
    split = plan_tier_bytes(model, resolve_knobs(profile, model, env={}))
    assert sum(split.values()) == model.total_bytes and min(split.values()) >= 0
    assert split["device"] <= resolve_knobs(profile, model, env={}).value("device_cache_bytes")


def test_a_slow_measurement_is_timed_once_within_its_budget(monkeypatch):
    """measure._best: the warm-up counts against the budget, so a step the device runs slowly (fp16 matmuls on most
    CPUs) is timed once, and a fast one as many times as asked. A clock that advances only where told."""
    from types import SimpleNamespace

    from rocketllm_cli.profiles.probe import measure

    now = [0.0]
    monkeypatch.setattr(measure, "time", SimpleNamespace(perf_counter=lambda: now[0]))
    monkeypatch.setattr(measure, "synchronize", lambda device: None)
    for seconds, timed in ((0.09, 1), (0.001, 3)):
        calls = []

        def step(seconds=seconds, calls=calls):
            calls.append(seconds)
            now[0] += seconds

        assert measure._best(step, "cpu", repeats=3, budget=0.15) == pytest.approx(seconds)
        assert len(calls) == 1 + timed  # the warm-up and the timed runs
