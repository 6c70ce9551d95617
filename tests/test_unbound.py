"""An unbound weight never computes: every use raises, naming it, while its shape, dtype and device still answer.

A meta-device placeholder is not enough: in torch 2.13, F.linear with a CPU input and a meta weight returns
uninitialised memory instead of raising, so a weight used outside its module's forward would compute on garbage.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn

from rocketllm_cli.errors import RocketError, describe
from rocketllm_cli.shard.sharder import shard
from rocketllm_cli.stream.engineconfig import EngineConfig
from rocketllm_cli.stream.model import StreamingModel
from rocketllm_cli.stream.unbound import Unbound, UnboundWeightError

PROMPT = torch.tensor([[1, 40, 57, 60, 71]])
NOTHING_RESIDENT = {"device_cache_bytes": 0, "host_cache_bytes": 0}


@pytest.fixture(scope="module")
def streamed(tiny_factory, tmp_path_factory):
    manifest, directory, _ = shard(
        tiny_factory("llama"), out=tmp_path_factory.mktemp("unbound") / "llama", log=lambda m: None
    )
    with StreamingModel(directory, EngineConfig(**NOTHING_RESIDENT), manifest) as model:
        yield model, manifest


def _record(manifest, name: str):
    return next(t for u in manifest.units for t in u.tensors if t.name == name)


def test_unbound_weight_raises_for_every_use(streamed):
    model, _ = streamed
    down = model.model.model.layers[1].mlp.down_proj
    weight = down.weight  # [hidden, intermediate]
    assert isinstance(weight, Unbound)
    x = torch.randn(2, weight.shape[1])
    uses = {
        "F.linear": lambda: F.linear(x, weight),
        "torch.matmul": lambda: torch.matmul(torch.randn(2, weight.shape[0]), weight),
        "@": lambda: torch.randn(3, weight.shape[0]) @ weight,
        "the module's own forward, hooks bypassed": lambda: down.forward(x),
        ".to(device)": lambda: weight.to("cpu"),
        ".to(dtype)": lambda: weight.to(torch.float16),
        "arithmetic": lambda: weight * 2,
    }
    for what, use in uses.items():
        with pytest.raises(UnboundWeightError, match=r"model\.layers\.1\.mlp\.down_proj\.weight") as caught:
            use()
        assert "not bound" in str(caught.value) and "model.layers.1" in str(caught.value), what
        assert isinstance(caught.value, RocketError) and "\n" not in describe(caught.value)[0], what


def test_unbound_embedding_lookup_raises(streamed):
    model, _ = streamed
    weight = model.model.model.layers[1].mlp.down_proj.weight
    with pytest.raises(UnboundWeightError, match=r"model\.layers\.1\.mlp\.down_proj\.weight"):
        F.embedding(PROMPT, weight)
    table = nn.Embedding(*weight.shape)
    table._parameters["weight"] = weight
    with pytest.raises(UnboundWeightError, match=r"model\.layers\.1\.mlp\.down_proj\.weight"):
        table(PROMPT)  # an nn.Embedding lookup in a table no store can read by rows


def test_streamed_table_answers_lookups_with_its_rows_and_nothing_else(streamed, tiny_factory):
    model, _ = streamed
    stored = load_file(tiny_factory("llama") / "model.safetensors")["model.embed_tokens.weight"]
    embed = model.model.get_input_embeddings()
    weight = embed.weight
    assert isinstance(weight, Unbound) and weight.rows is not None
    # Lookups read just their rows, from the model's own forward or from outside it (a pad row, a position table).
    assert torch.equal(embed.forward(PROMPT), stored[PROMPT])
    assert torch.equal(F.embedding(PROMPT, weight), stored[PROMPT])
    assert (
        torch.equal(weight[7], stored[7])
        and torch.equal(weight[7, :], stored[7])
        and torch.equal(weight[2:5], stored[2:5])
    )
    assert torch.equal(weight[PROMPT[0]], stored[PROMPT[0]])
    for use in (
        lambda: torch.randn(2, weight.shape[0]) @ weight,
        lambda: weight.to("cpu"),
        lambda: weight.sum(),
        lambda: weight[None, :, :],
        lambda: weight[:, 3],
    ):
        with pytest.raises(UnboundWeightError, match=r"embed_tokens\.weight"):
            use()


def test_unbound_weight_answers_metadata(streamed):
    model, manifest = streamed
    for name in ("model.layers.2.self_attn.q_proj.weight", "model.embed_tokens.weight", "model.norm.weight"):
        weight = model.model.get_parameter(name)
        assert isinstance(weight, Unbound) and isinstance(weight, nn.Parameter)
        shape = _record(manifest, name).shape
        assert weight.device == model.device == torch.device("cpu")  # the compute device, never meta
        assert weight.dtype == torch.float32 and weight.is_floating_point()
        assert list(weight.shape) == list(weight.size()) == shape and weight.dim() == len(shape)
        assert weight.numel() == shape[0] * (shape[1] if len(shape) > 1 else 1)
        assert name in repr(weight)
    ids = PROMPT.to(model.model.get_input_embeddings().weight.device)  # how Llama 4 routes its input ids
    assert ids.device == torch.device("cpu")


def test_bound_weights_are_ordinary_parameters_and_placeholders_come_back(streamed):
    model, _ = streamed
    down = model.model.model.layers[1].mlp.down_proj
    seen = []
    # Registered after the streaming hooks, so it runs once the weight is bound.
    handle = down.register_forward_pre_hook(lambda module, args: seen.append(type(module.weight)))
    try:
        with torch.inference_mode():
            model.generate(
                PROMPT, attention_mask=torch.ones_like(PROMPT), max_new_tokens=2, do_sample=False, pad_token_id=3
            )
    finally:
        handle.remove()
    assert seen and all(t is nn.Parameter for t in seen)  # nothing on the hot path sees the placeholder
    assert isinstance(down.weight, Unbound)


def test_unbound_experts_raise(tiny_factory, tmp_path):
    manifest, directory, _ = shard(tiny_factory("qwen3_moe"), out=tmp_path / "moe", log=lambda m: None)
    with StreamingModel(directory, EngineConfig(**NOTHING_RESIDENT), manifest) as model:
        # fused [E, ...] on 5.x, one expert's on 4.x
        expert = next(model.model.model.layers[0].mlp.experts.parameters())
        assert isinstance(expert, Unbound) and expert.shape == expert.size() and expert.dim() >= 2
        with pytest.raises(UnboundWeightError, match=r"model\.layers\.0\.mlp\.experts\."):
            torch.matmul(torch.randn(2, expert.shape[-2]), expert)


def test_placeholder_alone():
    weight = Unbound(
        "block.proj.weight", torch.empty(3, 4, device="meta"), torch.device("cpu"), "block (unit layer.000)"
    )
    assert (weight.shape, weight.dtype, weight.device) == (torch.Size([3, 4]), torch.float32, torch.device("cpu"))
    for use in (
        lambda: F.linear(torch.randn(1, 4), weight),
        lambda: weight.cpu(),
        lambda: weight.detach(),
        lambda: weight[0],
        lambda: weight.data,
        lambda: torch.unique(weight),
    ):
        with pytest.raises(UnboundWeightError, match=r"block\.proj\.weight .*forward of block \(unit layer\.000\)"):
            use()
