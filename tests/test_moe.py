"""Mixture-of-experts streaming: only routed experts are read, and output equals plain transformers token for token.

Tiny random Mixtral, Qwen3-MoE and Qwen2-MoE (a shared expert beside the routed ones, and one dense layer), from
per-expert checkpoints (as published and as save_pretrained writes them) and from fused 3D expert tensors,
fully resident, nothing resident (host or storage) and partly resident with the expert cache in play.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM

from rocketllm_cli.checkpoint import stfile
from rocketllm_cli.checkpoint.manifest import MANIFEST, Manifest
from rocketllm_cli.shard.sharder import shard
from rocketllm_cli.stream.engineconfig import EngineConfig
from rocketllm_cli.stream.experts import ExpertCache
from rocketllm_cli.stream.model import StreamingModel
from rocketllm_cli.synthetic import MOE_ARCHS

pytestmark = pytest.mark.compat

FUSED_MODULES = int(transformers.__version__.split(".")[0]) >= 5  # 5.x runs experts as one batched module
PROMPT = torch.tensor([[1, 40, 57, 60, 71, 85, 90, 44]])
NEW_TOKENS = 10
HUGE = 1 << 40
LAYOUTS = ["per-expert", "fused"]


def _greedy(model) -> torch.Tensor:
    with torch.inference_mode():
        return model.generate(
            PROMPT,
            attention_mask=torch.ones_like(PROMPT),
            max_new_tokens=NEW_TOKENS,
            min_new_tokens=NEW_TOKENS,
            do_sample=False,
            pad_token_id=3,
        )


def _fused_copy(src, dst):
    """The same weights stored the way transformers 5 holds them: fused [E, ...] expert tensors under module names."""
    from safetensors.torch import save_file

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    dst.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, dst / "model.safetensors")
    for f in src.iterdir():
        if f.is_file() and f.suffix == ".json":
            shutil.copy(f, dst / f.name)
    return dst


@pytest.fixture(scope="module")
def moe(tiny_factory, tmp_path_factory):
    root = tmp_path_factory.mktemp("moe")
    built = {}

    def get(arch: str, layout: str = "per-expert"):
        if (arch, layout) not in built:
            src = tiny_factory(arch)
            if layout == "fused":
                if not FUSED_MODULES:
                    pytest.skip("transformers 4.x loads experts only from per-expert checkpoints")
                src = _fused_copy(src, root / f"{arch}-fused-src")
            manifest, directory, _ = shard(src, out=root / f"{arch}-{layout}", log=lambda m: None)
            reference = _greedy(AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32))
            built[arch, layout] = (manifest, directory, reference, src)
        return built[arch, layout]

    return get


def _residencies(manifest: Manifest) -> dict[str, tuple[int, int]]:
    dense = sum(u.tensor_bytes for u in manifest.units if u.kind != "expert")
    experts = sum(u.tensor_bytes for u in manifest.experts)
    return {
        "all": (HUGE, 0),
        "none-host": (0, HUGE),
        "none-storage": (0, 0),
        # dense parts resident, a quarter of the experts' bytes as expert cache, a quarter on the host tier
        "partial": (dense + experts // 4, experts // 4),
    }


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("arch", sorted(MOE_ARCHS))
def test_streamed_moe_equals_transformers(arch, layout, moe):
    manifest, directory, expected, _ = moe(arch, layout)
    assert manifest.experts, "every expert is a unit of its own"
    for residency, (device, host) in _residencies(manifest).items():
        for depth in (0, 2):
            if residency in ("all", "none-host") and depth == 2:
                continue  # nothing is read per use there: prefetch changes nothing
            config = EngineConfig(device_cache_bytes=device, host_cache_bytes=host, prefetch_depth=depth, io_workers=2)
            with StreamingModel(directory, config) as model:
                got = _greedy(model)
                summary = model.ledger.summary()
            assert torch.equal(got, expected), f"{arch} {layout} {residency} depth {depth}"
            assert summary["per_token_experts"] > 0
            if residency == "partial":
                assert summary["expert_cache"]["lookups"] > 0


def _routed_per_pass(src, config) -> list[dict[int, set[int]]]:
    """Plain transformers on the same weights and tokens: {layer: experts its router chose} for every forward pass."""
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    k = config.num_experts_per_tok
    passes: list[dict[int, set[int]]] = []
    stack = model.model.layers

    def router_hook(layer):
        def hook(module, args, output):
            logits = output[0] if isinstance(output, tuple) else output
            chosen = torch.topk(logits.reshape(-1, logits.shape[-1]).float(), k, dim=-1).indices
            passes[-1][layer] = set(chosen.reshape(-1).tolist())

        return hook

    model.register_forward_pre_hook(lambda m, a: passes.append({}))
    for i, layer in enumerate(stack):
        for name, module in layer.named_modules():
            if name.endswith("gate") and not name.endswith("shared_expert_gate") and "experts" not in name:
                module.register_forward_hook(router_hook(i))
    _greedy(model)
    return passes


@pytest.mark.parametrize("arch", sorted(MOE_ARCHS))
def test_bytes_per_token_are_the_dense_part_plus_exactly_the_routed_experts(arch, moe, tiny_factory):
    manifest, directory, _, src = moe(arch)
    config = transformers.AutoConfig.from_pretrained(src)
    routed = _routed_per_pass(src, config)
    sizes = {u.name: u.tensor_bytes for u in manifest.units}
    expert_bytes = {(u.index, int(u.name.rsplit(".", 1)[1])): u.tensor_bytes for u in manifest.experts}
    embed = manifest.unit("embed")
    row = embed.tensor_bytes // embed.tensors[0].shape[0]
    dense_without_embed = sum(b for n, b in sizes.items() if n != "embed" and not n.count(".expert."))
    with StreamingModel(directory, EngineConfig(device_cache_bytes=0, host_cache_bytes=0, prefetch_depth=2)) as model:
        _greedy(model)
        steps = model.ledger.steps
    assert len(steps) == len(routed) == NEW_TOKENS
    whole_layer = sum(sizes.values()) - embed.tensor_bytes + row
    for i, (step, choice) in enumerate(zip(steps, routed)):
        tokens = PROMPT.shape[1] if i == 0 else 1
        rows = len(set(PROMPT[0].tolist())) if i == 0 else 1
        want = (
            dense_without_embed
            + rows * row
            + sum(expert_bytes[layer, e] for layer, chosen in choice.items() for e in chosen)
        )
        assert step.tokens == tokens
        assert step.served["storage"] == want, f"pass {i}"
        assert step.served["device"] == 0 and step.served["host"] == 0
        assert step.experts == sum(len(c) for c in choice.values())
        if i > 0:
            assert step.served["storage"] < whole_layer  # a decode token reads k of E experts per layer, not all


def test_expert_cache_policies_on_a_layer_cycle():
    """Decode walks the layers in order; with room for fewer experts than a pass routes, LRU never hits, LFU keeps a
    set."""
    pattern = [f"layer.{layer:03d}.expert.{e:03d}" for layer in range(4) for e in (0, 1)] * 20
    rates = {}
    for policy in ("lru", "lfu"):
        cache = ExpertCache(capacity=3 * 100, policy=policy)
        hits = 0
        for name in pattern:
            cache.count(name)
            if cache.get(name) is not None:
                hits += 1
            else:
                cache.put(name, {}, 100)
            assert cache.used <= cache.capacity
        rates[policy] = hits / len(pattern)
    assert rates["lru"] == 0
    assert rates["lfu"] > 0.3


def test_lfu_admits_only_over_less_used_experts():
    cache = ExpertCache(capacity=200, policy="lfu")
    for name, uses in (("a", 3), ("b", 2), ("c", 1)):
        for _ in range(uses):
            cache.count(name)
    assert cache.put("a", {}, 100) and cache.put("b", {}, 100)
    assert not cache.put("c", {}, 100)  # used less than everything cached
    for _ in range(5):
        cache.count("c")
    assert cache.put("c", {}, 100) and cache.get("b") is None and cache.get("a") is not None


def test_each_expert_is_a_file_of_its_own(moe):
    manifest, directory, _, _ = moe("qwen3_moe")
    from rocketllm_cli.shard.expertlayout import expert_count

    config = transformers.AutoConfig.from_pretrained(directory)
    assert len(manifest.experts) == config.num_hidden_layers * expert_count(config)
    for u in manifest.experts[:3]:
        header = stfile.read_header(directory / u.file)
        assert header.metadata["unit"] == u.name
        assert set(header.entries) == {t.name for t in u.tensors}
        assert all(f".experts.{int(u.name[-3:])}." in t.name for t in u.tensors)
    layer = manifest.unit("layer.000")
    assert not any(".experts." in t.name for t in layer.tensors)  # attention, norms, router stay with the layer


def test_fused_source_is_split_per_expert(moe):
    if not FUSED_MODULES:
        pytest.skip("fused checkpoints need transformers 5.x")
    manifest, _, _, _ = moe("mixtral", "fused")
    first = manifest.experts[0]
    assert {t.source for t in first.tensors} == {
        "model.layers.0.mlp.experts.gate_up_proj[0]",
        "model.layers.0.mlp.experts.down_proj[0]",
    }


def test_a_dense_format_1_manifest_still_loads(tiny_checkpoint, tmp_path):
    _, directory, _ = shard(tiny_checkpoint, out=tmp_path / "dense", log=lambda m: None)
    doc = json.loads((directory / MANIFEST).read_text())
    doc["format_version"] = 1
    (directory / MANIFEST).write_text(json.dumps(doc))
    assert Manifest.load(directory).format_version == 1


def test_generate_stats_report_experts_and_cache(moe, tiny_factory):
    from typer.testing import CliRunner

    from rocketllm_cli.app import app

    src = tiny_factory("mixtral")
    result = CliRunner().invoke(
        app,
        [
            "generate",
            str(src),
            "hello there",
            "--raw",
            "-n",
            "6",
            "--stats",
            "--device-cache-bytes",
            "0",
            "--host-cache-bytes",
            "0",
        ],
    )
    assert result.exit_code == 0, result.output
    line = next(l for l in result.output.splitlines() if l.startswith("experts:"))
    assert "routed expert uses per token" in line and "hit rate" in line


def test_cost_model_counts_a_token_s_routed_experts_not_every_weight(moe):
    from rocketllm_cli.checkpoint.modelfacts import (
        facts_from_manifest,
        model_facts_from_path,
    )

    manifest, directory, _, src = moe("mixtral")
    config = transformers.AutoConfig.from_pretrained(directory)
    k, count = config.num_experts_per_tok, config.num_local_experts
    experts = sum(u.tensor_bytes for u in manifest.experts)
    dense = manifest.total_bytes - experts
    facts = facts_from_manifest(manifest, config)
    assert facts.active_bytes == dense + experts * k // count
    assert facts.non_layer_bytes == sum(u.tensor_bytes for u in manifest.units if u.kind not in ("layer", "expert"))
    from_headers = model_facts_from_path(src)  # before sharding, from the checkpoint's own tensor names
    assert from_headers.active_bytes == from_headers.total_bytes - experts + experts * k // count
    assert model_facts_from_path(directory).active_bytes == facts.active_bytes


def test_a_checkpoint_missing_one_expert_tensor_is_one_error_line(tiny_factory, tmp_path):
    from cli_contract import one_error_line
    from safetensors.torch import load_file, save_file

    src = tiny_factory("qwen3_moe")
    broken = tmp_path / "broken"
    shutil.copytree(src, broken)
    tensors = load_file(broken / "model.safetensors")
    gone = next(n for n in tensors if n.endswith("layers.1.mlp.experts.2.up_proj.weight"))
    del tensors[gone]
    save_file(tensors, broken / "model.safetensors")
    from typer.testing import CliRunner

    from rocketllm_cli.app import app

    line = one_error_line(CliRunner().invoke(app, ["shard", str(broken), "--out", str(tmp_path / "out")]))
    assert "expert" in line and "layers.1" in line
    assert not (tmp_path / "out").exists()
