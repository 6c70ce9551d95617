"""Pre-quantized safetensors checkpoints (compressed-tensors, GPTQ, AWQ, bitsandbytes): sharded with their int4/int8
kept packed, exactly (bitsandbytes nf4/fp4: re-quantized to int4, with a bounded error), and streamed with the same
greedy tokens as transformers on the format's own dequantized weights.

compressed-tensors checkpoints are written by the compressed-tensors library itself and loaded back by transformers.
GPTQ and AWQ checkpoints are written here by a small reference packer (round-to-nearest with each format's own
conventions: bit order, AWQ's nibble order, GPTQ's zeros stored minus one), because the libraries that write and
load them (gptqmodel, autoawq) build GPU kernels and do not install on a CPU-only machine; the reference is plain
transformers with the packer's own dequantized weights. bitsandbytes checkpoints are written by transformers' own
BitsAndBytesConfig loading and save_pretrained on the CPU.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from rocketllm_cli.checkpoint.packedformat import PackedFormat, PackedTensor
from rocketllm_cli.compat import dtype_kwargs
from rocketllm_cli.errors import ModelError
from rocketllm_cli.packed import dequantize
from rocketllm_cli.packed.fromint import IntWeight
from rocketllm_cli.shard.sharder import shard
from rocketllm_cli.stream.engineconfig import EngineConfig
from rocketllm_cli.stream.model import StreamingModel

PROMPT = torch.tensor([[1, 40, 57, 60, 71, 85, 90]])
NEW_TOKENS = 8
SHAPE = {"hidden_size": 128, "intermediate_size": 256}  # K of 128 and 256: GPTQ's usual group of 128 fits
# AutoAWQ's GEMM packing: field i of a word holds column AWQ_PACK_ORDER[i] of its 8
AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="session")
def float_checkpoint(tiny_factory) -> Path:
    return tiny_factory("llama", **SHAPE)


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


def _stored_weights(manifest, directory: Path) -> dict[str, torch.Tensor]:
    """{parameter: its packed weight dequantized in fp32} of every packed tensor of a shard set."""
    out = {}
    for unit in manifest.units:
        for record in unit.tensors:
            if record.packed is not None:
                data = torch.from_file(str(directory / unit.file), size=unit.bytes, dtype=torch.uint8)
                weight = dequantize(
                    PackedTensor.from_bytes(
                        PackedFormat.from_dict(record.packed), data[record.offset : record.offset + record.nbytes]
                    )
                )
                members = record.fused or [[record.name, weight.shape[0]]]  # a fused weight: its members' rows in turn
                out.update(zip([m for m, _ in members], weight.split([n for _, n in members])))
    return out


def _packed_formats(manifest) -> dict[str, dict]:
    """{parameter: the packed format it is stored in} (a fused weight's members share its format)."""
    return {
        m: t.packed
        for u in manifest.units
        for t in u.tensors
        if t.packed is not None
        for m, _ in (t.fused or [[t.name, 0]])
    }


def _assert_streams_like(directory: Path, reference) -> None:
    with StreamingModel(directory, EngineConfig(compute_dtype="fp32")) as model:
        got = _greedy(model)
        with torch.inference_mode():
            logits = model(PROMPT).logits
    with torch.inference_mode():
        want = reference(PROMPT).logits
    assert torch.equal(got, _greedy(reference))
    assert torch.allclose(logits, want, atol=1e-4, rtol=1e-4), float((logits - want).abs().max())


def _copy_tokenizer(source: Path, dest: Path) -> None:
    for f in source.iterdir():
        if f.name not in ("config.json", "model.safetensors"):
            shutil.copy(f, dest / f.name)


# -- compressed-tensors: written and loaded by the library itself ---------------------------
CT_CASES = {  # name: (bits, strategy, group, symmetric, scale dtype)
    "int4-group32": (4, "group", 32, True, torch.float32),
    "int8-channel": (8, "channel", None, True, torch.float32),
    "int4-asym-group32": (4, "group", 32, False, torch.float32),
}


def _ct_checkpoint(float_checkpoint: Path, dest: Path, bits: int, strategy: str, group, symmetric: bool, dtype) -> Path:
    """The float checkpoint quantized and saved by compressed-tensors (its own qparams, quantize and pack-quantized)."""
    ct = pytest.importorskip(
        "compressed_tensors", reason="compressed-tensors is not installed (pip install compressed-tensors)"
    )
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationConfig,
        QuantizationScheme,
        QuantizationStatus,
        apply_quantization_config,
    )
    from compressed_tensors.quantization.utils import calculate_qparams

    del ct
    model = AutoModelForCausalLM.from_pretrained(float_checkpoint, **dtype_kwargs(dtype))
    args = QuantizationArgs(num_bits=bits, type="int", symmetric=symmetric, strategy=strategy, group_size=group)
    config = QuantizationConfig(
        config_groups={"group_0": QuantizationScheme(targets=["Linear"], weights=args)},
        ignore=["lm_head"],
        quantization_status=QuantizationStatus.INITIALIZED,
    )
    apply_quantization_config(model, config, show_progress=False)
    for module in model.modules():
        if hasattr(module, "quantization_scheme"):
            w = module.weight.data
            w = w.reshape(w.shape[0], -1, group) if group else w.unsqueeze(1)
            scale, zero = calculate_qparams(w.amin(-1), w.amax(-1), args)
            module.weight_scale.data.copy_(scale.reshape(module.weight_scale.shape))
            if hasattr(module, "weight_zero_point"):
                module.weight_zero_point.data.copy_(zero.reshape(module.weight_zero_point.shape))
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format="pack-quantized")
    compressor.compress_model(model)
    model.save_pretrained(dest)
    compressor.update_config(dest)
    _copy_tokenizer(float_checkpoint, dest)
    return dest


@pytest.fixture(scope="session", params=list(CT_CASES))
def ct_checkpoint(request, float_checkpoint, tmp_path_factory) -> tuple[str, Path]:
    return request.param, _ct_checkpoint(
        float_checkpoint, tmp_path_factory.mktemp("ct") / request.param, *CT_CASES[request.param]
    )


def _ct_reference(path: Path, symmetric: bool):
    """transformers' own loading of the checkpoint (it decompresses); for asymmetric int4, transformers 5 with
    compressed-tensors 0.20 refuses the packed zero points' shape, so the library's own decompress fills a plain
    model."""
    if symmetric:
        return AutoModelForCausalLM.from_pretrained(path, **dtype_kwargs(torch.float32))
    from compressed_tensors.compressors.pack_quantized import (
        PackedQuantizationCompressor,
    )
    from compressed_tensors.quantization import QuantizationScheme
    from transformers import AutoConfig

    group = json.loads((path / "config.json").read_text())["quantization_config"]["config_groups"]["group_0"]
    scheme = QuantizationScheme(**{k: v for k, v in group.items() if k != "format"})
    config = AutoConfig.from_pretrained(path)
    del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, **dtype_kwargs(torch.float32))
    state = load_file(path / "model.safetensors")
    for name in [n for n in state if n.endswith(".weight_packed")]:
        module = name.removesuffix(".weight_packed")
        local = {k.removeprefix(module + "."): v for k, v in state.items() if k.startswith(module + ".")}
        state[module + ".weight"] = PackedQuantizationCompressor.decompress(local, scheme)["weight"]
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(state[name])
    return model.eval()


def test_compressed_tensors_keep_their_packing_and_stream_like_transformers(ct_checkpoint, tmp_path):
    case, path = ct_checkpoint
    bits, _, group, symmetric, _ = CT_CASES[case]
    notes: list[str] = []
    manifest, directory, summary = shard(path, out=tmp_path / "s", dtype="fp32", log=notes.append)
    packed = _packed_formats(manifest)
    assert summary["packing"] == "packed" and len(packed) == 4 * len(LINEARS), sorted(packed)
    for fmt in packed.values():  # int4 at the checkpoint's group, int8 with one scale per row
        assert (fmt["kind"], fmt["group"]) == (("int4", group) if bits == 4 else ("int8", fmt["shape"][1]))
    assert "quantization_config" not in json.loads((directory / "config.json").read_text())
    assert not [n for n in notes if "quantized weight" in n], notes  # every weight packed: nothing to say
    _assert_streams_like(directory, _ct_reference(path, symmetric))


def test_compressed_tensors_with_16_bit_scales_dequantize_bit_for_bit(float_checkpoint, tmp_path):
    """bf16 scales with zero points: the packed set (fp32) holds exactly (q − z)·s computed in fp32 from the library's
    own unpacking, for every weight."""
    pytest.importorskip(
        "compressed_tensors", reason="compressed-tensors is not installed (pip install compressed-tensors)"
    )
    from compressed_tensors.compressors.pack_quantized import unpack_from_int32

    path = _ct_checkpoint(float_checkpoint, tmp_path / "ct", 4, "group", 32, False, torch.bfloat16)
    manifest, directory, _ = shard(path, out=tmp_path / "s", dtype="fp32", log=lambda m: None)
    stored = _stored_weights(manifest, directory)
    state = load_file(path / "model.safetensors")
    assert len(stored) == 4 * len(LINEARS)
    for name, got in stored.items():
        module = name.removesuffix(".weight")
        shape = tuple(state[f"{module}.weight_shape"].tolist())
        scale = state[f"{module}.weight_scale"]
        assert scale.dtype == torch.bfloat16
        q = unpack_from_int32(state[f"{module}.weight_packed"], 4, shape)
        z = unpack_from_int32(state[f"{module}.weight_zero_point"], 4, (shape[0], scale.shape[1]), packed_dim=0)
        want = (q.float() - z.float().repeat_interleave(32, 1)) * scale.float().repeat_interleave(32, 1)
        assert torch.equal(got, want), name


# -- GPTQ and AWQ: a reference packer of their formats --------------------------------------
def _rtn(weight: torch.Tensor, group: int, symmetric: bool, bits: int = 4, g_idx=None, lowest_zero: int = 0):
    """Round-to-nearest as GPTQ and AWQ define it: per group, scale s (fp16), zero z, q = clamp(round(w/s) + z).
    Returns q [N, K], z [N, G], s [N, G] fp16 and the reference dequantization (q − z)·s in fp32."""
    n, k = weight.shape
    top = (1 << bits) - 1
    g_idx = torch.arange(k) // group if g_idx is None else g_idx
    groups = k // group
    q = torch.empty(n, k, dtype=torch.int64)
    z = torch.empty(n, groups, dtype=torch.int64)
    s = torch.empty(n, groups, dtype=torch.float16)
    for g in range(groups):
        cols = (g_idx == g).nonzero().flatten()
        w = weight[:, cols].double()
        if symmetric:
            s[:, g] = (2 * w.abs().amax(1) / top).to(torch.float16)
            z[:, g] = (top + 1) // 2
        else:
            low, high = w.amin(1).clamp(max=0), w.amax(1).clamp(min=0)
            s[:, g] = ((high - low) / top).to(torch.float16)
            z[:, g] = (-low / s[:, g].double()).round().clamp(lowest_zero, top).long()
        q[:, cols] = ((w / s[:, g].double().unsqueeze(1)).round().long() + z[:, g].unsqueeze(1)).clamp(0, top)
    reference = (q - z[:, g_idx]).float() * s[:, g_idx].float()
    return q, z, s, reference


def _words(values: torch.Tensor, bits: int, order=None) -> torch.Tensor:
    """[R, C] unsigned values -> int32 [R, C·bits/32]: each run of 32/bits values in one word from the lowest bit up
    (field i holding value order[i] of its run)."""
    per = 32 // bits
    order = list(range(per)) if order is None else list(order)
    runs = values.to(torch.int64).reshape(values.shape[0], -1, per)
    word = sum(runs[:, :, order[i]] << (bits * i) for i in range(per))
    return torch.where(word >= 1 << 31, word - (1 << 32), word).to(torch.int32).contiguous()


GPTQ_CASES = {  # name: (quantization_config, bits, group, symmetric)
    "gptq-v1-sym-g128": (
        {
            "quant_method": "gptq",
            "bits": 4,
            "group_size": 128,
            "desc_act": False,
            "sym": True,
            "checkpoint_format": "gptq",
        },
        4,
        128,
        True,
    ),
    "gptq-v2-asym-g64": (
        {
            "quant_method": "gptq",
            "bits": 4,
            "group_size": 64,
            "desc_act": False,
            "sym": False,
            "checkpoint_format": "gptq_v2",
        },
        4,
        64,
        False,
    ),
    "gptq-int8-channel": (
        {"quant_method": "gptq", "bits": 8, "group_size": -1, "desc_act": False, "sym": True},
        8,
        None,
        True,
    ),
    "gptq-act-order": (
        {
            "quant_method": "gptq",
            "bits": 4,
            "group_size": 64,
            "desc_act": True,
            "sym": True,
            "checkpoint_format": "gptq",
        },
        4,
        64,
        True,
    ),
    "awq-gemm-g64": (
        {"quant_method": "awq", "bits": 4, "group_size": 64, "zero_point": True, "version": "gemm"},
        4,
        64,
        False,
    ),
}


def _write_gptq_or_awq(float_checkpoint: Path, dest: Path, case: str) -> tuple[Path, dict[str, torch.Tensor]]:
    """The float checkpoint's linear layers packed as `case` says; returns (directory, {weight: reference fp32})."""
    config, bits, group, symmetric = GPTQ_CASES[case]
    state = load_file(float_checkpoint / "model.safetensors")
    references = {}
    generator = torch.Generator().manual_seed(7)
    for name in [n for n in state if n.endswith(".weight") and n.rsplit(".", 2)[-2] in LINEARS]:
        weight = state.pop(name)
        module = name.removesuffix(".weight")
        k = weight.shape[1]
        size = group or k
        g_idx = None
        if config.get("desc_act"):  # each column's group follows a random column order, as act-order leaves it
            g_idx = torch.empty(k, dtype=torch.int64)
            g_idx[torch.randperm(k, generator=generator)] = torch.arange(k) // size
        v1 = config["quant_method"] == "gptq" and config.get("checkpoint_format", "gptq") == "gptq"
        q, z, s, references[name] = _rtn(weight, size, symmetric, bits, g_idx, lowest_zero=1 if v1 else 0)
        if config["quant_method"] == "awq":
            state[f"{module}.qweight"] = _words(q.t(), 4, AWQ_PACK_ORDER)
            state[f"{module}.qzeros"] = _words(z.t(), 4, AWQ_PACK_ORDER)
        else:
            state[f"{module}.qweight"] = _words(q, bits).t().contiguous()  # packed along K: [K·bits/32, N]
            state[f"{module}.qzeros"] = _words(z.t() - (1 if v1 else 0), bits)
            state[f"{module}.g_idx"] = (torch.arange(k) // size if g_idx is None else g_idx).to(torch.int32)
        state[f"{module}.scales"] = s.t().contiguous()
    dest.mkdir(parents=True)
    save_file(state, dest / "model.safetensors", metadata={"format": "pt"})
    doc = json.loads((float_checkpoint / "config.json").read_text())
    (dest / "config.json").write_text(json.dumps({**doc, "quantization_config": config}))
    _copy_tokenizer(float_checkpoint, dest)
    return dest, references


@pytest.fixture(scope="session", params=list(GPTQ_CASES))
def packed_checkpoint(request, float_checkpoint, tmp_path_factory):
    path, references = _write_gptq_or_awq(float_checkpoint, tmp_path_factory.mktemp("q") / request.param, request.param)
    return request.param, path, references


def _reference_model(float_checkpoint: Path, weights: dict[str, torch.Tensor]):
    model = AutoModelForCausalLM.from_pretrained(float_checkpoint, **dtype_kwargs(torch.float32))
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, weight in weights.items():
            params[name].copy_(weight)
    return model


def test_gptq_and_awq_pack_exactly_and_stream_like_transformers(packed_checkpoint, float_checkpoint, tmp_path):
    case, path, references = packed_checkpoint
    _, bits, group, _ = GPTQ_CASES[case]
    notes: list[str] = []
    manifest, directory, summary = shard(path, out=tmp_path / "s", dtype="fp32", log=notes.append)
    stored = _stored_weights(manifest, directory)
    assert "quantization_config" not in json.loads((directory / "config.json").read_text())
    if case == "gptq-act-order":  # groups are not runs of columns: stored dequantized, and the output says so
        assert not stored and summary["packing"] == "packed"
        assert any(f"{len(references)} quantized weights: act-order" in n for n in notes), notes
        floats = load_file(directory / next(u.file for u in manifest.units if u.kind == "layer"))
        assert all(torch.equal(floats[name], references[name]) for name in floats if name in references)
    else:
        assert set(stored) == set(references)
        for name, got in stored.items():
            assert torch.equal(got, references[name]), name  # bit for bit, in fp32
        kinds = {(f["kind"], f["group"]) for f in _packed_formats(manifest).values()}
        assert {kind for kind, _ in kinds} == {"int4" if bits == 4 else "int8"} and (
            group is None or kinds == {("int4", group)}
        )
        assert not [n for n in notes if "quantized weight" in n], notes
    _assert_streams_like(directory, _reference_model(float_checkpoint, references))


@pytest.mark.parametrize("packed_checkpoint", ["awq-gemm-g64"], indirect=True)  # one format: the float read is shared
def test_quantize_none_stores_the_formats_own_dequantization(packed_checkpoint, tmp_path):
    _, path, references = packed_checkpoint
    manifest, directory, summary = shard(path, out=tmp_path / "s", dtype="fp32", packing="none", log=lambda m: None)
    assert summary["packing"] == "" and summary["packed_tensors"] == 0
    floats = {}
    for unit in manifest.units:
        floats.update(load_file(directory / unit.file))
    assert all(torch.equal(floats[name], want) for name, want in references.items())


def test_a_group_the_kernel_does_not_take_is_regrouped_exactly_or_kept_as_it_is():
    from rocketllm_cli.packed.layout import INT4_GROUPS

    generator = torch.Generator().manual_seed(3)
    for k, group, want in ((1024, 1024, 256), (512, 512, 256), (96, 96, 32), (128, 16, 16)):
        codes = torch.randint(0, 16, (32, k), dtype=torch.uint8, generator=generator)
        zeros = torch.randint(0, 16, (32, k // group), dtype=torch.int16, generator=generator)
        scale = (torch.rand(32, k // group, generator=generator) / 10).to(torch.float16)
        weight = IntWeight(4, codes, zeros, scale, group)
        packed = weight.to_packed()
        assert packed.format.group == want and (want in INT4_GROUPS) == (want != 16)
        assert torch.equal(dequantize(packed), weight.dequantize()), (k, group)


# -- bitsandbytes: quantized and saved by transformers' own integration ---------------------
BNB_4BIT = {  # name: BitsAndBytesConfig arguments
    "nf4-double": {"load_in_4bit": True, "bnb_4bit_quant_type": "nf4", "bnb_4bit_use_double_quant": True},
    "fp4": {"load_in_4bit": True, "bnb_4bit_quant_type": "fp4"},
}
BNB_RMS = {"nf4": 0.085, "fp4": 0.095}  # int4 g32 re-quantization vs the exact 4-bit values: measured 7.8e-2 / 8.8e-2


def _bnb_checkpoint(float_checkpoint: Path, dest: Path, **arguments) -> Path:
    """The float checkpoint loaded by transformers with a BitsAndBytesConfig (bitsandbytes quantizes it) and saved."""
    pytest.importorskip("bitsandbytes", reason="bitsandbytes is not installed (pip install bitsandbytes)")
    from transformers import BitsAndBytesConfig

    config = BitsAndBytesConfig(**arguments, bnb_4bit_compute_dtype=torch.float32)
    AutoModelForCausalLM.from_pretrained(
        float_checkpoint, quantization_config=config, device_map="cpu"
    ).save_pretrained(dest)
    _copy_tokenizer(float_checkpoint, dest)
    return dest


@pytest.fixture(scope="session", params=list(BNB_4BIT))
def bnb_4bit(request, float_checkpoint, tmp_path_factory) -> tuple[str, Path]:
    return request.param.split("-")[0], _bnb_checkpoint(
        float_checkpoint, tmp_path_factory.mktemp("bnb") / request.param, **BNB_4BIT[request.param]
    )


def _bnb_dequantized(path: Path) -> dict[str, torch.Tensor]:
    """{weight: bitsandbytes' own dequantization} of every quantized module of a saved checkpoint (fp32 model)."""
    import bitsandbytes.functional as bnbf

    state = load_file(path / "model.safetensors")
    out = {}
    for name in [n for n in state if n.endswith(".SCB")]:
        module = name.removesuffix(".SCB")
        out[f"{module}.weight"] = bnbf.int8_vectorwise_dequant(state[f"{module}.weight"], state[name])
    for name in [n for n in state if ".weight.quant_state.bitsandbytes__" in n]:
        base = name.split(".quant_state.")[0]
        local = {k.removeprefix(base + "."): v for k, v in state.items() if k.startswith(base + ".")}
        out[base] = bnbf.dequantize_4bit(state[base], bnbf.QuantState.from_dict(local, torch.device("cpu")))
    return out


def test_bnb_int8_is_int8_per_row_and_streams_like_transformers_dequantized(float_checkpoint, tmp_path):
    """The reference is transformers' own loading of the checkpoint with its weights dequantized by bitsandbytes
    (model.dequantize()): the loaded int8 model itself runs bitsandbytes' matmul, which casts activations to fp16 and
    quantizes them (outliers above llm_int8_threshold apart), and on this tiny model its greedy tokens part after
    four; the weights are what the checkpoint holds, and they are kept within one fp32 rounding."""
    path = _bnb_checkpoint(float_checkpoint, tmp_path / "int8", load_in_8bit=True)
    notes: list[str] = []
    manifest, directory, summary = shard(path, out=tmp_path / "s", dtype="fp32", log=notes.append)
    stored, want = _stored_weights(manifest, directory), _bnb_dequantized(path)
    assert summary["packing"] == "packed" and set(stored) == set(want) and len(stored) == 4 * len(LINEARS)
    assert {(f["kind"], f["group"]) for f in _packed_formats(manifest).values()} == {
        ("int8", SHAPE["hidden_size"]),
        ("int8", SHAPE["intermediate_size"]),
    }
    for name, got in stored.items():  # q·(SCB/127) vs bitsandbytes' (q·SCB)/127: one fp32 rounding apart at most
        assert torch.allclose(got, want[name], rtol=2**-23, atol=0), name
    assert any("outlier threshold" in n for n in notes), notes
    reference = AutoModelForCausalLM.from_pretrained(path, device_map="cpu")
    reference.dequantize()
    _assert_streams_like(directory, reference.float())
    none = shard(path, out=tmp_path / "f", dtype="fp32", packing="none", log=lambda m: None)[1]
    floats = {}
    for f in none.glob("*.safetensors"):
        floats.update(load_file(f))
    # bitsandbytes' own dequantization, bit for bit
    assert all(torch.equal(floats[name], w) for name, w in want.items())


def test_bnb_4bit_is_requantized_to_int4_within_its_bound_and_streams_like_its_weights(
    bnb_4bit, float_checkpoint, tmp_path
):
    """nf4/fp4 codebooks are not affine grids: the packed set holds an int4 g32 re-quantization of bitsandbytes' exact
    dequantization (error bounded and said), and streams exactly like transformers on that int4's dequantization;
    --quantize none holds bitsandbytes' dequantize_4bit bit for bit and streams like transformers on it."""
    kind, path = bnb_4bit
    notes: list[str] = []
    manifest, directory, summary = shard(path, out=tmp_path / "s", dtype="fp32", log=notes.append)
    stored, exact = _stored_weights(manifest, directory), _bnb_dequantized(path)
    assert summary["packing"] == "packed" and set(stored) == set(exact) and len(stored) == 4 * len(LINEARS)
    assert {(f["kind"], f["group"]) for f in _packed_formats(manifest).values()} == {("int4", 32)}
    error = sum(float((stored[n] - w).square().sum()) for n, w in exact.items())
    rms = (error / sum(float(w.square().sum()) for w in exact.values())) ** 0.5
    assert 0 < rms < BNB_RMS[kind], rms
    said = [n for n in notes if f"bitsandbytes {kind} weights re-quantized to int4: relative RMS error" in n]
    assert said and f"{rms:.1e}" in said[0], notes
    _assert_streams_like(directory, _reference_model(float_checkpoint, stored))
    manifest, none, summary = shard(path, out=tmp_path / "f", dtype="fp32", packing="none", log=lambda m: None)
    assert summary["packed_tensors"] == 0
    floats = {}
    for unit in manifest.units:
        floats.update(load_file(none / unit.file))
    assert all(torch.equal(floats[name], w) for name, w in exact.items())
    _assert_streams_like(none, _reference_model(float_checkpoint, exact))


# -- refused in one line, nothing written ----------------------------------------------------
def _with_config(float_checkpoint: Path, dest: Path, config: dict) -> Path:
    dest.mkdir(parents=True)
    doc = json.loads((float_checkpoint / "config.json").read_text())
    (dest / "config.json").write_text(json.dumps({**doc, "quantization_config": config}))
    shutil.copy(float_checkpoint / "model.safetensors", dest / "model.safetensors")
    return dest


def test_an_unsupported_bit_width_is_refused_by_the_cli_in_one_line(float_checkpoint, tmp_path):
    path = _with_config(
        float_checkpoint, tmp_path / "m", {"quant_method": "gptq", "bits": 3, "group_size": 128, "sym": True}
    )
    out = tmp_path / "out"
    done = subprocess.run(
        [sys.executable, "-m", "rocketllm_cli", "shard", str(path), "--out", str(out)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode != 0 and "Traceback" not in done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "3-bit GPTQ is not supported" in lines[0] and "unquantized checkpoint" in lines[0], (
        done.stderr
    )
    assert not out.exists() and not list(tmp_path.glob(".out*"))


@pytest.mark.parametrize(
    "config, says",
    [
        ({"quant_method": "awq", "bits": 4, "group_size": 64, "version": "gemv"}, "AWQ version 'gemv'"),
        (
            {"quant_method": "gptq", "bits": 4, "group_size": 64, "checkpoint_format": "marlin"},
            "checkpoint_format 'marlin'",
        ),
        (
            {"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "int4"},
            "bitsandbytes 4-bit quant_type 'int4'",
        ),
        ({"quant_method": "hqq", "nbits": 4}, "quantization method 'hqq'"),
    ],
)
def test_other_unsupported_quantizations_are_refused_before_writing(config, says, float_checkpoint, tmp_path):
    path = _with_config(float_checkpoint, tmp_path / "m", config)
    with pytest.raises(ModelError) as caught:
        shard(path, out=tmp_path / "out", log=lambda m: None)
    assert says in str(caught.value) and "\n" not in str(caught.value)
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out*"))
