"""Fused projections (shard/fusion.py): packed Linears of a layer that read the same input are stored as one weight
and computed in one call. The grouping is traced, not declared; a fused set streams the same tokens as the unfused
set and as plain transformers on the same weights; a member called on another input still gets its own columns."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from test_packed_stream import (  # the packed sets' own prompt and greedy run
    HUGE,
    PROMPT,
    _greedy,
)
from transformers import AutoConfig, AutoModelForCausalLM

from rocketllm_cli.checkpoint.manifest import MANIFEST, RESHARD, Manifest
from rocketllm_cli.checkpoint.packedformat import PackedFormat, PackedTensor
from rocketllm_cli.compat import dtype_kwargs
from rocketllm_cli.errors import ShardError
from rocketllm_cli.packed import dequantize
from rocketllm_cli.packed.rtn import quantize_rtn
from rocketllm_cli.shard.fusion import fuse, shared_input_groups
from rocketllm_cli.shard.sharder import shard
from rocketllm_cli.stream.engineconfig import EngineConfig
from rocketllm_cli.stream.model import StreamingModel
from rocketllm_cli.stream.packedbind import FusedGroup


def test_the_trace_groups_linears_that_read_one_input(tiny_factory):
    """q/k/v and gate/up of every layer, in call order; never o_proj or down_proj, whose inputs are other tensors."""
    config = AutoConfig.from_pretrained(tiny_factory("llama"))
    groups, why = shared_input_groups(config, "model.layers")
    assert why == ""
    layers = config.num_hidden_layers
    assert len(groups) == 2 * layers
    for i in range(layers):
        attn, mlp = f"model.layers.{i}.self_attn", f"model.layers.{i}.mlp"
        assert (f"{attn}.q_proj", f"{attn}.k_proj", f"{attn}.v_proj") in groups
        assert (f"{mlp}.gate_proj", f"{mlp}.up_proj") in groups
    assert not any(m.endswith(("o_proj", "down_proj")) for g in groups for m in g)


@pytest.fixture(scope="module", params=["int4", "int8"])
def sets(request, tiny_factory, tmp_path_factory):
    """(mode, fused manifest, fused dir, unfused dir, reference): a tiny Llama (heads of 64 rows, so q/k/v fuse in
    the int4 kernel's 64-row blocks too) sharded with and without fusion, and plain transformers on the dequantized
    weights."""
    mode = request.param
    checkpoint = tiny_factory(
        "llama", hidden_size=128, num_attention_heads=2, num_key_value_heads=1, intermediate_size=256
    )
    root = tmp_path_factory.mktemp("fusion")
    manifest, fused, _ = shard(checkpoint, out=root / f"{mode}-fused", packing=mode, log=lambda m: None)
    plain_manifest, plain, _ = shard(
        checkpoint, out=root / f"{mode}-plain", packing=mode, fuse=False, log=lambda m: None
    )
    assert plain_manifest.format_version == 3 and not any(t.fused for u in plain_manifest.units for t in u.tensors)
    reference = AutoModelForCausalLM.from_pretrained(checkpoint, **dtype_kwargs(torch.float32))
    params = dict(reference.named_parameters())
    for unit in plain_manifest.units:  # the unfused set's weights: the fused set must hold exactly these rows
        for record in unit.tensors:
            if record.packed is not None:
                data = torch.from_file(str(plain / unit.file), size=unit.bytes, dtype=torch.uint8)[
                    record.offset : record.offset + record.nbytes
                ]
                with torch.no_grad():
                    params[record.name].copy_(
                        dequantize(PackedTensor.from_bytes(PackedFormat.from_dict(record.packed), data))
                    )
    return mode, manifest, fused, plain, reference


def test_a_fused_set_says_what_it_fused(sets):
    mode, manifest, fused, plain, _ = sets
    assert manifest.format_version == 4
    layers = len(manifest.layers)
    assert manifest.fusion == f"q_proj+k_proj+v_proj in {layers} layers, gate_proj+up_proj in {layers} layers"
    record = next(t for t in manifest.layers[0].tensors if t.fused and "q_proj" in t.name)
    assert record.name == "model.layers.0.self_attn.q_proj+k_proj+v_proj.weight"
    assert [m for m, _ in record.fused] == [f"model.layers.0.self_attn.{p}_proj.weight" for p in "qkv"]
    assert [n for _, n in record.fused] == [128, 64, 64] and PackedFormat.from_dict(record.packed).shape == (256, 128)
    assert " + " in record.source
    assert Manifest.load(fused).fusion == manifest.fusion  # it validates like any other set
    assert Manifest.load(plain).fusion == "none: off (--no-fuse)"


@pytest.mark.parametrize("residency", ["none", "host", "all"])
def test_a_fused_set_streams_the_unfused_sets_tokens_and_transformers(sets, residency):
    mode, manifest, fused, plain, reference = sets
    device, host = {"none": (0, 0), "host": (0, HUGE), "all": (HUGE, 0)}[residency]
    config = EngineConfig(compute_dtype="fp32", device_cache_bytes=device, host_cache_bytes=host)
    runs = {}
    for name, directory in (("fused", fused), ("plain", plain)):
        with StreamingModel(directory, config) as model:
            tokens = _greedy(model)
            with torch.inference_mode():
                runs[name] = (tokens, model(PROMPT).logits)
            if name == "fused":
                groups = {m.fused_group for m in model.model.modules() if getattr(m, "fused_group", None) is not None}
                assert len(groups) == 2 * len(manifest.layers)
    with torch.inference_mode():
        want = reference(PROMPT).logits
    assert torch.equal(runs["fused"][0], runs["plain"][0])
    assert torch.equal(runs["fused"][0], _greedy(reference))
    assert torch.allclose(runs["fused"][1], runs["plain"][1], atol=1e-5, rtol=1e-5)
    assert torch.allclose(runs["fused"][1], want, atol=1e-4, rtol=1e-4), float((runs["fused"][1] - want).abs().max())


def test_a_member_called_on_another_input_gets_its_own_columns():
    """The grouping could only cost time: k called first, q on another tensor, v on the first one changed in place,
    each still gets x·Wᵀ of its own rows (and its bias)."""
    from rocketllm_cli.packed import compute

    torch.manual_seed(0)
    weights = [torch.randn(n, 64) for n in (64, 32, 32)]
    packed = [quantize_rtn(w, 8, None) for w in weights]
    whole = fuse(packed)
    assert whole.format.shape == (128, 64)
    members = [torch.nn.Linear(64, n, bias=i == 2) for i, n in enumerate((64, 32, 32))]
    group = FusedGroup(members, [64, 32, 32], "test")
    group.bound = compute.bind(whole, "cpu", torch.float32)
    dense = [dequantize(p) for p in packed]

    def want(i, x):
        out = x @ dense[i].T
        return out + members[i].bias if members[i].bias is not None else out

    x, y = torch.randn(3, 64), torch.randn(3, 64)
    with torch.no_grad():
        for index, inp in ((1, x), (0, y), (0, y), (2, x)):
            assert torch.allclose(group.call(index, inp), want(index, inp), atol=1e-4)
        first = group.call(0, x)
        x.mul_(2)  # changed in place after q read it: k must not get the stale columns
        assert torch.allclose(group.call(1, x), want(1, x), atol=1e-4)
        assert torch.allclose(first, want(0, x / 2), atol=1e-4)


def test_inference_tensors_share_one_product_per_input(monkeypatch):
    """Under inference_mode (how generate runs) an input has no version counter: the group still computes once per
    input for all its members, and an input it has not seen gets its own product."""
    from rocketllm_cli.packed import compute

    torch.manual_seed(1)
    packed = [quantize_rtn(torch.randn(n, 64), 8, None) for n in (64, 32, 32)]
    members = [torch.nn.Linear(64, n, bias=False) for n in (64, 32, 32)]
    group = FusedGroup(members, [64, 32, 32], "test")
    group.bound = compute.bind(fuse(packed), "cpu", torch.float32)
    group.bound.fast = None  # every product goes through compute.linear, counted here
    products = []
    real = compute.linear
    monkeypatch.setattr(compute, "linear", lambda x, bound, bias: products.append(x) or real(x, bound, bias))
    dense = [dequantize(p) for p in packed]
    with torch.inference_mode():
        x, y = torch.randn(2, 64), torch.randn(2, 64)
        for index in (0, 1, 2):
            assert torch.allclose(group.call(index, x), x @ dense[index].T, atol=1e-4)
        assert len(products) == 1 and products[0] is x
        assert torch.allclose(group.call(1, y), y @ dense[1].T, atol=1e-4)
        assert len(products) == 2 and products[1] is y


def test_formats_that_disagree_stay_apart():
    weights = [torch.randn(64, 64), torch.randn(32, 128)]
    assert fuse([quantize_rtn(w, 8, None) for w in weights]) is None  # another K


@pytest.mark.parametrize(
    "edit, says",
    [
        (lambda t: t["fused"][0].__setitem__(1, t["fused"][0][1] + 1), "fused rows do not add up"),
        (lambda t: t["fused"].reverse(), "fused members do not match its name"),
        (lambda t: t.update(fused=[["x", 1]]), "bad fused members"),
    ],
)
def test_a_fused_record_that_does_not_add_up_is_refused(sets, tmp_path, edit, says):
    _, _, fused, _, _ = sets
    work = shutil.copytree(fused, tmp_path / "set")
    doc = json.loads((work / MANIFEST).read_text())
    record = next(t for u in doc["units"] for t in u["tensors"] if t.get("fused"))
    edit(record)
    (work / MANIFEST).write_text(json.dumps(doc))
    with pytest.raises(ShardError) as caught:
        Manifest.load(work)
    assert says in str(caught.value) and str(caught.value).endswith(RESHARD), caught.value
