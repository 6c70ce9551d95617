"""Packed weights end to end: shards store low-bit bytes, the streamed model computes on them, and its output equals
plain transformers running the same (dequantized) weights; the ledger counts the packed bytes."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM

from rocketllm_cli.checkpoint.manifest import INT4_LAYOUTS, Manifest
from rocketllm_cli.checkpoint.packedformat import PackedFormat, PackedTensor
from rocketllm_cli.compat import dtype_kwargs
from rocketllm_cli.errors import ShardError
from rocketllm_cli.packed import dequantize
from rocketllm_cli.packed.cpulayout import LAYOUTS, cpu_layout, from_layout, to_layout
from rocketllm_cli.packed.kernelform import to_kernel_form, to_portable
from rocketllm_cli.packed.rtn import quantize_rtn
from rocketllm_cli.shard.sharder import shard
from rocketllm_cli.stream.engineconfig import EngineConfig
from rocketllm_cli.stream.model import StreamingModel
from rocketllm_cli.stream.packedbind import PackedBinding
from rocketllm_cli.stream.unbound import UnboundWeightError

PROMPT = torch.tensor([[1, 40, 57, 60, 71, 85, 90]])
NEW_TOKENS = 10
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


@pytest.fixture(scope="module", params=["int4", "int8"])
def quantized(request, tiny_factory, tmp_path_factory):
    """(mode, manifest, directory, reference model): a tiny Llama sharded with --quantize MODE, and plain
    transformers on the same checkpoint with every packed weight replaced by its dequantized value."""
    mode = request.param
    checkpoint = tiny_factory("llama", intermediate_size=128)
    manifest, directory, summary = shard(
        checkpoint, out=tmp_path_factory.mktemp("q") / mode, packing=mode, log=lambda m: None
    )
    assert summary["packing"] == mode and summary["packed_tensors"] > 0
    reference = AutoModelForCausalLM.from_pretrained(checkpoint, **dtype_kwargs(torch.float32))
    params = dict(reference.named_parameters())
    for unit in manifest.units:
        for record in unit.tensors:
            if record.packed is not None:
                fmt = PackedFormat.from_dict(record.packed)
                data = torch.from_file(str(directory / unit.file), size=unit.bytes, dtype=torch.uint8)[
                    record.offset : record.offset + record.nbytes
                ]
                weight = dequantize(PackedTensor.from_bytes(fmt, data))
                # a fused weight holds its members' rows in turn
                members = record.fused or [[record.name, fmt.shape[0]]]
                with torch.no_grad():
                    for (member, rows), part in zip(members, weight.split([n for _, n in members])):
                        params[member].copy_(part)
    return mode, manifest, directory, reference


def test_quantized_shards_hold_packed_linear_weights_only(quantized):
    mode, manifest, directory, _ = quantized
    packed = {t.name: t for u in manifest.units for t in u.tensors if t.packed is not None}
    # 4: gate/up (and, where whole blocks, q/k/v) fused
    assert manifest.packing == mode and manifest.format_version == 4
    order = (cpu_layout() or "rows") if mode == "int4" else ""  # an int8 set writes no int4, so names no order
    assert manifest.int4_layout == order and manifest.key == f"{manifest.dtype}-{mode}" + (
        f"-{order}" if order not in ("", "rows") else ""
    )
    assert all(n.endswith(("_proj.weight", "lm_head.weight")) for n in packed), sorted(packed)
    assert not any("embed_tokens" in n or "norm" in n for n in packed)
    for record in packed.values():
        fmt = PackedFormat.from_dict(record.packed)
        assert fmt.kind == mode and record.dtype == "U8" and record.nbytes == fmt.offsets()[1]
    assert Manifest.load(directory).packing == mode  # a packed set validates like any other


@pytest.mark.parametrize("residency", ["none", "host", "all"])
def test_packed_stream_equals_transformers_on_the_dequantized_weights(quantized, residency):
    mode, manifest, directory, reference = quantized
    device, host = {"none": (0, 0), "host": (0, HUGE), "all": (HUGE, 0)}[residency]
    with StreamingModel(
        directory, EngineConfig(compute_dtype="fp32", device_cache_bytes=device, host_cache_bytes=host)
    ) as model:
        paths = {
            b.path
            for by in model.bindings.values()
            for group in by.values()
            for b in group
            if isinstance(b, PackedBinding)
        }
        assert paths == {mode}, f"every packed weight computes in the {mode} kernel, got {paths}"
        got = _greedy(model)
        with torch.inference_mode():
            logits = model(PROMPT).logits
    with torch.inference_mode():
        want = reference(PROMPT).logits
    assert torch.equal(got, _greedy(reference))
    assert torch.allclose(logits, want, atol=1e-4, rtol=1e-4), float((logits - want).abs().max())


@pytest.mark.parametrize("residency", ["none", "all"])
def test_a_pass_of_many_rows_multiplied_densely_equals_transformers(quantized, residency, monkeypatch):
    """From the probe's row count on (2 here, so the 7-token prompt), packed weights are dequantized a block of rows
    at a time and multiplied densely (packed/dense.py): the prompt's logits and the greedy tokens stay transformers'."""
    from rocketllm_cli.packed import compute, dense

    mode, manifest, directory, reference = quantized
    if not dense.supported(mode, torch.device("cpu")):
        pytest.skip(f"no {mode} kernel form dense.py can read on this CPU")
    compute.capabilities("cpu")  # the kernel probe runs its own dense multiplies: before they are counted
    rows = []
    real = dense.dense_linear
    monkeypatch.setattr(compute, "dense_plan", lambda path, dtype, device: (2, None))
    monkeypatch.setattr(
        dense, "dense_linear", lambda x, weight, scratch=None: rows.append(x.shape[0]) or real(x, weight)
    )
    device = {"none": 0, "all": HUGE}[residency]
    with StreamingModel(
        directory, EngineConfig(compute_dtype="fp32", device_cache_bytes=device, host_cache_bytes=0)
    ) as model:
        got = _greedy(model)
        with torch.inference_mode():
            logits = model(PROMPT).logits
    with torch.inference_mode():
        want = reference(PROMPT).logits
    assert rows and set(rows) == {PROMPT.shape[1]}  # the prompts went dense, every decode step through the kernel
    assert torch.equal(got, _greedy(reference))
    assert torch.allclose(logits, want, atol=1e-4, rtol=1e-4), float((logits - want).abs().max())


def test_storage_regime_moves_the_packed_bytes(quantized):
    mode, manifest, directory, _ = quantized
    with StreamingModel(directory, EngineConfig(compute_dtype="fp32")) as model:
        with torch.inference_mode():
            model(PROMPT[:, :1])
        moved = model.ledger.steps[-1].served["storage"]
    float_bytes = sum(u.tensor_bytes for u in manifest.units) - sum(
        t.nbytes for u in manifest.units for t in u.tensors if t.packed is not None
    )
    packed_bytes = manifest.total_bytes - float_bytes
    assert packed_bytes <= moved <= manifest.total_bytes * 1.05, (moved, packed_bytes, manifest.total_bytes)


def test_an_unbound_packed_linear_raises(quantized):
    _, _, directory, _ = quantized
    with StreamingModel(directory, EngineConfig(compute_dtype="fp32")) as model:
        layer = model.model.model.layers[0].mlp.up_proj
        assert layer.weight.shape == (128, 64) and layer.weight.dtype == torch.float32
        with pytest.raises(UnboundWeightError, match="up_proj"):
            layer(torch.randn(1, 64))


def test_a_tampered_packed_format_is_refused_in_one_line(quantized, tmp_path):
    import shutil

    _, _, directory, _ = quantized
    copy = tmp_path / "set"
    shutil.copytree(directory, copy)
    doc = json.loads((copy / "manifest.json").read_text())
    record = next(t for u in doc["units"] for t in u["tensors"] if "packed" in t)
    record["packed"]["shape"][0] *= 2
    (copy / "manifest.json").write_text(json.dumps(doc))
    with pytest.raises(ShardError) as caught:
        Manifest.load(copy)
    assert "packed" in str(caught.value) and "\n" not in str(caught.value) and "rocketllm shard" in str(caught.value)


def test_cli_quantize_flag_and_its_bad_value(tiny_factory, tmp_path):
    checkpoint = tiny_factory("llama", intermediate_size=128)
    run = [sys.executable, "-m", "rocketllm_cli", "shard", str(checkpoint), "--out", str(tmp_path / "s"), "--json"]
    done = subprocess.run(run + ["--quantize", "int4"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["packing"] == "int4"
    bad = subprocess.run(run + ["--quantize", "int3"], capture_output=True, text=True)
    assert bad.returncode != 0 and "--quantize" in bad.stderr and "Traceback" not in bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("rows", [16, 48, 64, 80, 192, 256])
def test_cpu_layouts_are_the_kernels_own_and_invert(rows):
    codes = torch.randint(0, 16, (rows, 96), generator=torch.Generator().manual_seed(rows), dtype=torch.int32)
    portable = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8)
    for name in LAYOUTS:
        assert torch.equal(from_layout(to_layout(portable, name), name), portable), name
    kernel = cpu_layout()
    if kernel is None:
        pytest.skip("this torch has no CPU int4 kernel layout to compare with")
    assert torch.equal(to_layout(portable, kernel), torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 8))


def test_kernel_form_round_trips_and_dequantizes_the_same():
    weight = torch.randn(64, 128, generator=torch.Generator().manual_seed(1))
    packed = quantize_rtn(weight, bits=4, group=32)
    for layout in LAYOUTS[1:]:
        kernel = to_kernel_form(packed, layout)
        assert kernel.format.layout == layout and set(kernel.parts) == {"codes", "sz"}
        assert torch.equal(dequantize(kernel), dequantize(packed))
        back = to_portable(kernel)
        assert torch.equal(back.parts["codes"], packed.parts["codes"])
        assert torch.equal(PackedTensor.from_bytes(kernel.format, kernel.to_bytes()).parts["sz"], kernel.parts["sz"])


# Q4_1: the real model. Every kept type stays as its own blocks (kind gguf).
# The grid types (IQ2_XXS, TQ2_0, MXFP4 here) have no native kernel: their blocks are decoded by the torch decoder.
GGUF_EXACT = {
    "Q4_0": "gguf",
    "Q4_K": "gguf",
    "Q6_K": "gguf",
    "Q8_0": "gguf",
    "Q5_0": "gguf",
    "IQ2_XXS": "gguf",
    "TQ2_0": "gguf",
    "MXFP4": "gguf",
}


@pytest.mark.parametrize("qtype", list(GGUF_EXACT))
def test_gguf_types_stream_like_transformers_loads_them(qtype, smollm2_gguf, tmp_path):
    """A tiny Llama GGUF written by the gguf package (the real model's vocabulary): every type is kept packed (int4,
    or the file's own blocks, on the native kernels where they are built) and computes what transformers' own
    dequantization gives, to fp32 rounding, with the same greedy tokens."""
    from rocketllm_cli.synthetic.gguf import write_llama_gguf

    path = write_llama_gguf(
        tmp_path / "m.gguf",
        smollm2_gguf,
        hidden=256,
        layers=2,
        intermediate=512,
        heads=4,
        kv_heads=2,
        qtype=qtype,
        embed_type="F16",
    )
    manifest, directory, summary = shard(path, out=tmp_path / "s", dtype="fp32", log=lambda m: None)
    kinds = {t.packed["kind"] for u in manifest.units for t in u.tensors if t.packed is not None}
    assert kinds == {GGUF_EXACT[qtype]}
    reference = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name, **dtype_kwargs(torch.float32))
    ids = torch.tensor([[1, 400, 5000, 77, 9000, 12]])
    with StreamingModel(directory, EngineConfig(compute_dtype="fp32")) as model, torch.inference_mode():
        got, want = model(ids).logits, reference(ids).logits
        tokens = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False, pad_token_id=0
        )
        expected = reference.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False, pad_token_id=0
        )
    assert float((got - want).abs().max()) <= 1e-5 * max(1.0, float(want.abs().max()))
    assert torch.equal(tokens, expected)


def test_int4_shards_in_another_cpus_order_say_so_when_they_stream(quantized):
    """A packed set written where the int4 kernel reads another order is reordered on each streamed use: the load
    says so (and how to avoid it); in this CPU's own order it says nothing."""
    import copy

    from transformers import AutoConfig

    from rocketllm_cli.auto import engine_config
    from rocketllm_cli.checkpoint.modelfacts import facts_from_manifest
    from rocketllm_cli.packed.cpulayout import LAYOUTS
    from rocketllm_cli.profiles import HardwareProfile, resolve_knobs

    mode, manifest, directory, _ = quantized
    here = cpu_layout()
    if mode != "int4" or here is None:
        pytest.skip("needs int4 shards and a CPU int4 kernel")
    profile = HardwareProfile.load(storage_path=directory)
    knobs = resolve_knobs(profile, facts_from_manifest(manifest, AutoConfig.from_pretrained(directory)))
    assert not [n for n in engine_config(profile, knobs, manifest)[1] if "int4 shards" in n]
    other = next(name for name in LAYOUTS[1:] if name != here)
    foreign = copy.deepcopy(manifest)
    for unit in foreign.units:
        for record in unit.tensors:
            if record.packed is not None and record.packed.get("kind") == "int4":
                record.packed["layout"] = other
    notes = [n for n in engine_config(profile, knobs, foreign)[1] if "int4 shards" in n]
    assert notes == [
        f"int4 shards are in the {other} order another CPU's kernel reads, this one reads {here}: each "
        f"streamed use "
        "reorders them (to avoid it, run the source itself, or `rocketllm shard` it: a set's name carries "
        "its "
        "int4 order, so this machine writes its own set beside this one)"
    ]
    assert manifest.int4_layout == here and manifest.key.endswith(f"-int4-{here}")  # the set's name carries its order
    assert INT4_LAYOUTS == LAYOUTS  # the manifest's torch-free list of orders is the kernel's
