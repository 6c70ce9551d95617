"""Streamed generation equals plain transformers token for token, for every dense architecture,
at every residency, with prefetch on and off, from single-file and out-of-order multi-file checkpoints,
on every supported transformers line."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from rocketllm_cli.compat import dtype_kwargs
from rocketllm_cli.shard.sharder import shard
from rocketllm_cli.stream.engineconfig import EngineConfig
from rocketllm_cli.stream.model import StreamingModel
from rocketllm_cli.stream.residency import spaced
from rocketllm_cli.synthetic import ARCHS, MOE_ARCHS

pytestmark = pytest.mark.compat

DENSE = [a for a in ARCHS if a not in MOE_ARCHS]
PROMPT = torch.tensor([[1, 40, 57, 60, 71, 85, 90]])
NEW_TOKENS = 12
HUGE = 1 << 40


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


@pytest.fixture(scope="module")
def reference(tiny_factory):
    cache = {}

    def get(arch: str) -> torch.Tensor:
        if arch not in cache:
            model = AutoModelForCausalLM.from_pretrained(tiny_factory(arch), **dtype_kwargs(torch.float32))
            cache[arch] = _greedy(model)
        return cache[arch]

    return get


@pytest.fixture(scope="module")
def shards(tiny_factory, tmp_path_factory):
    root = tmp_path_factory.mktemp("shards")
    cache = {}

    def get(arch: str, layout: str = "single"):
        if (arch, layout) not in cache:
            manifest, directory, _ = shard(
                tiny_factory(arch, layout), out=root / f"{arch}-{layout}", log=lambda m: None
            )
            cache[arch, layout] = (manifest, directory)
        return cache[arch, layout]

    return get


RESIDENCIES = {
    "all": lambda total: (HUGE, 0),
    "none-host": lambda total: (0, HUGE),
    "none-storage": lambda total: (0, 0),
    "partial": lambda total: (total // 2, total // 4),
}


@pytest.mark.parametrize("arch", DENSE)
def test_streamed_equals_transformers(arch, reference, shards):
    expected = reference(arch)
    new = expected[0, PROMPT.shape[1] :].tolist()
    # A reference that repeats one token could be matched by a stream that got the weights wrong.
    assert len(new) == NEW_TOKENS and len(set(new)) > 1, f"{arch}: degenerate reference {new}"
    for layout in ("single", "sharded"):
        manifest, directory = shards(arch, layout)
        for residency, budget in RESIDENCIES.items():
            for depth in (0, 2):
                if layout == "sharded" and (residency, depth) not in {("none-storage", 2), ("partial", 0)}:
                    continue  # the layout only changes the sharder's input; two runs prove it
                device, host = budget(manifest.total_bytes)
                config = EngineConfig(device_cache_bytes=device, host_cache_bytes=host, prefetch_depth=depth)
                with StreamingModel(directory, config) as model:
                    got = _greedy(model)
                assert torch.equal(got, expected), (
                    f"{arch} {layout} {residency} prefetch={depth}: {got.tolist()} != {expected.tolist()}"
                )


def test_partial_plan_spaces_streamed_layers(shards):
    manifest, directory = shards("llama")
    layer = max(u.tensor_bytes for u in manifest.layers)
    non_layer = sum(u.tensor_bytes for u in manifest.units if u.kind != "layer")
    with StreamingModel(directory, EngineConfig(device_cache_bytes=non_layer + 2 * layer, host_cache_bytes=0)) as model:
        tiers = [model.plan.tier[u.name] for u in manifest.layers]
    streamed = [i for i, t in enumerate(tiers) if t == "storage"]
    assert tiers.count("device") == 2
    assert streamed == spaced(len(tiers), len(tiers) - 2)  # 4 layers: [1, 3], never two streamed side by side


def test_bf16_shards_match_transformers_in_bf16(tiny_factory, tmp_path):
    source = tiny_factory("qwen3")
    _, directory, _ = shard(source, out=tmp_path / "bf16", dtype="bf16", log=lambda m: None)
    plain = AutoModelForCausalLM.from_pretrained(source, **dtype_kwargs(torch.bfloat16))
    with StreamingModel(
        directory, EngineConfig(compute_dtype="bf16", device_cache_bytes=0, host_cache_bytes=0, prefetch_depth=1)
    ) as model:
        assert torch.equal(_greedy(model), _greedy(plain))


def test_model_device_and_generate_surface(shards):
    _, directory = shards("llama")
    with StreamingModel(directory, EngineConfig()) as model:
        assert model.device == torch.device("cpu")
        out = model.generate(
            PROMPT, max_new_tokens=3, do_sample=False, return_dict_in_generate=True, output_scores=True, pad_token_id=3
        )
        assert out.sequences.shape == (1, PROMPT.shape[1] + 3) and len(out.scores) == 3


def test_streaming_buffers_fit_the_layers_and_one_larger_unit(tiny_factory, tmp_path):
    """A tied embedding and head larger than a layer gets one buffer of its own; the read-ahead pool is sized for the
    layers (prefetch_depth + 1 of them); nothing else is allocated, and the tokens are transformers'."""
    from rocketllm_cli.sizes import round_up

    checkpoint = tiny_factory("llama", tie_word_embeddings=True, vocab_size=4096)
    manifest, directory, _ = shard(checkpoint, out=tmp_path / "s", log=lambda m: None)
    layer, largest = round_up(max(u.bytes for u in manifest.layers)), round_up(max(u.bytes for u in manifest.units))
    assert largest > layer
    with StreamingModel(directory, EngineConfig(compute_dtype="fp32", prefetch_depth=2)) as model:
        assert model.store.buffers() == [(layer, 3), (largest, 1)]
        got = _greedy(model)
        sizes = [s.host.numel() for s in model.store._slots]
        assert sizes.count(largest) == 1 and sizes.count(layer) == len(sizes) - 1 <= 3
        assert (
            "streaming buffers: 3 x" in model.residency_text()
            and "(larger units); read-ahead 2 units" in model.residency_text()
        )
    plain = AutoModelForCausalLM.from_pretrained(checkpoint, **dtype_kwargs(torch.float32))
    assert torch.equal(got, _greedy(plain))


def test_layers_of_different_sizes_fit_by_their_own_bytes():
    """A GGUF mixes block types, so its layers differ in size (Gemma 3 270M Q4_K_M: Q5_0, Q4_K, Q6_K layers): a
    budget that holds every layer's own bytes keeps them all on the device (sized by the largest layer, 2 of 18
    streamed on every token while profile said the whole set fits), and a smaller one streams the fewest layers."""
    from types import SimpleNamespace

    from rocketllm_cli.stream.residency import make_plan

    sizes = [100, 140, 100, 100, 140, 100]
    units = [SimpleNamespace(name=f"layer.{i}", kind="layer", tensor_bytes=b) for i, b in enumerate(sizes)]
    units.append(SimpleNamespace(name="embed", kind="embed", tensor_bytes=50))
    manifest = SimpleNamespace(units=units, layers=units[:-1], experts=[])
    whole = make_plan(manifest, 50 + sum(sizes), 0)
    assert set(whole.tier.values()) == {"device"}
    short = make_plan(manifest, 50 + sum(sizes) - 1, 0)  # one byte short: one layer streams, not two
    assert [short.tier[u.name] for u in units[:-1]].count("storage") == 1
    host = make_plan(manifest, 50 + 340, 240)  # three layers on the device; of the three streamed, the host holds two
    tiers = [host.tier[u.name] for u in units[:-1]]
    assert tiers.count("device") == 3 and tiers.count("host") == 2 and tiers.count("storage") == 1
