"""A decode step's attention on the native kernels (native/src/attend.h, stream/decodeattention.py).

The kernel against the fp64 softmax(scale · q Kᵀ) V in every variant this CPU runs (grouped heads, head widths that
are and are not a multiple of a vector, cache lengths across its chunks, views of a longer cache), threads agreeing
bit for bit, NaN where the cache holds one, one-line errors. Then a model: a tiny GGUF on the native kernels decodes
the same greedy tokens with the knob native as with torch's SDPA, its logits within fp32 rounding, the decode steps'
attention taken natively and everything else (the prefill) left to SDPA; a set without GGUF blocks keeps SDPA.
"""

from __future__ import annotations

import pytest
import torch

from rocketllm_cli import native
from rocketllm_cli.native.kernels import NativeKernels
from rocketllm_cli.stream import decodeattention
from rocketllm_cli.stream.engineconfig import EngineConfig
from rocketllm_cli.stream.model import StreamingModel

# (query heads, key/value heads, head width, cache length): widths 64 / 128 / 256 and 80 / 72 (a vector's tail);
# lengths inside one chunk (64 positions), on its edge and across several
SHAPES = [(9, 3, 64, 1), (9, 3, 64, 64), (9, 3, 64, 65), (4, 1, 256, 300), (8, 8, 72, 130), (32, 8, 80, 2050)]


def reference(q, k, v, scale):
    group = q.shape[0] // k.shape[0]
    kk, vv = k.double().repeat_interleave(group, 0), v.double().repeat_interleave(group, 0)
    weights = torch.softmax(scale * torch.einsum("hd,hld->hl", q.double(), kk), dim=-1)
    return torch.einsum("hl,hld->hd", weights, vv)


def cache(kv_heads, length, dim, seed):
    """K and V as views of a longer cache (its rows contiguous, its heads not), as transformers' cache hands them."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(kv_heads, length + 37, dim, generator=g)[:, :length]
    v = torch.randn(kv_heads, length + 37, dim, generator=g)[:, :length]
    return k, v


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_every_variant_matches_the_fp64_softmax(nk, shape):
    heads, kv_heads, dim, length = shape
    k, v = cache(kv_heads, length, dim, seed=length)
    q = 3 * torch.randn(heads, dim, generator=torch.Generator().manual_seed(dim))  # peaked weights, not uniform
    scale = dim**-0.5
    want = reference(q, k, v, scale)
    for isa in nk.isas:
        got = nk.with_isa(isa).attend(q, k, v, scale, threads=2)
        assert got.shape == (heads, dim) and got.dtype == torch.float32
        assert float((got.double() - want).abs().max()) < 2e-5, isa


def test_threads_agree_bit_for_bit_and_out_is_written(nk):
    k, v = cache(8, 1000, 128, seed=1)
    q = torch.randn(32, 128)
    one = nk.attend(q, k, v, 0.1, threads=1)
    out = torch.full((32, 128), float("nan"))
    assert nk.attend(q, k, v, 0.1, out=out, threads=2) is out
    assert torch.equal(one, out)  # the chunks are the same whoever computes them; the merge is one thread's


def test_transformers_shapes_give_attends_bits(nk):
    """attend_heads, the decode path's call, on [1, H, 1, D] and [1, KH, L, D] views of a longer cache (as the
    append cache hands them over) gives what attend gives on the same tensors selected."""
    kbuf, vbuf = (torch.randn(1, 4, 300, 64, generator=torch.Generator().manual_seed(s)) for s in (5, 6))
    k, v = kbuf[:, :, :130], vbuf[:, :, :130]
    q = torch.randn(1, 1, 12, 64, generator=torch.Generator().manual_seed(7)).transpose(1, 2)  # as transformers has it
    got = nk.attend_heads(q, k, v, 0.125, 2)
    assert got.shape == (1, 1, 12, 64) and got.is_contiguous()
    assert torch.equal(got[0, 0], nk.attend(q[0, :, 0], k[0], v[0], 0.125, threads=2))


def test_a_nan_in_the_cache_reaches_its_heads_alone(nk):
    k, v = cache(2, 100, 64, seed=2)
    k = k.clone()
    k[1, 50, 3] = float("nan")
    got = nk.attend(torch.randn(4, 64), k, v, 0.125)
    assert got[2:].isnan().all() and not got[:2].isnan().any()  # heads 2 and 3 read key/value head 1


@pytest.mark.parametrize(
    "args, message",
    [
        ((torch.randn(4, 64), torch.randn(3, 10, 64), torch.randn(3, 10, 64)), "H a multiple of KH"),
        ((torch.randn(4, 64), torch.randn(2, 10, 32), torch.randn(2, 10, 32)), "H a multiple of KH"),
        ((torch.randn(4, 64), torch.randn(2, 0, 64), torch.randn(2, 0, 64)), "L >= 1"),
        ((torch.randn(4, 64).double(), torch.randn(2, 10, 64), torch.randn(2, 10, 64)), "q must be a 2-D float32"),
        ((torch.randn(4, 64), torch.randn(2, 64, 10).transpose(1, 2), torch.randn(2, 10, 64)), "last dimension"),
    ],
)
def test_bad_inputs_raise_one_line(nk, args, message):
    with pytest.raises(ValueError, match=message) as info:
        nk.attend(*args, 0.125)
    assert "\n" not in str(info.value)


@pytest.fixture(scope="module")
def tiny_gguf_set(smollm2_gguf, tmp_path_factory):
    from rocketllm_cli.shard.sharder import shard
    from rocketllm_cli.synthetic.gguf import write_llama_gguf

    root = tmp_path_factory.mktemp("decode-attention")
    path = write_llama_gguf(
        root / "m.gguf", smollm2_gguf, hidden=256, layers=2, intermediate=512, heads=4, kv_heads=2, qtype="Q8_0"
    )
    return shard(path, out=root / "s", dtype="fp32", log=lambda m: None)[1]


def decode(directory, attention, ids):
    config = EngineConfig(compute_dtype="fp32", native_mode="int16", decode_attention=attention)
    with StreamingModel(directory, config) as model, torch.inference_mode():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=8,
            do_sample=False,
            pad_token_id=0,
            output_scores=True,
            return_dict_in_generate=True,
        )
        return model.decode_attention, out.sequences, torch.stack(out.scores)


def test_a_gguf_model_decodes_the_same_tokens_attending_natively(nk, tiny_gguf_set, monkeypatch):
    calls = {"native": 0}
    attend = NativeKernels.attend_heads

    def counted(self, *args, **kwargs):
        calls["native"] += 1
        return attend(self, *args, **kwargs)

    monkeypatch.setattr(NativeKernels, "attend_heads", counted)
    ids = torch.randint(5, 40000, (1, 90), generator=torch.Generator().manual_seed(0))  # two chunks of the cache
    path_torch, tokens_torch, scores_torch = decode(tiny_gguf_set, "torch", ids)
    assert (path_torch, calls["native"]) == ("torch", 0)
    path_native, tokens_native, scores_native = decode(tiny_gguf_set, "native", ids)
    assert path_native == "native"
    assert calls["native"] == 2 * 7  # each layer of each decode step; the prefill is SDPA's
    assert torch.equal(tokens_native, tokens_torch)
    assert float((scores_native - scores_torch).abs().max()) <= 1e-4 * float(scores_torch.abs().max())


def test_a_set_without_gguf_blocks_keeps_sdpa(tiny_checkpoint, tmp_path):
    from rocketllm_cli.shard.sharder import shard

    directory = shard(tiny_checkpoint, out=tmp_path / "s", dtype="fp32", log=lambda m: None)[1]
    with StreamingModel(directory, EngineConfig(compute_dtype="fp32", decode_attention="native")) as model:
        assert model.decode_attention == "torch (its products are not on the native kernels)"
        assert model.model.config.get_text_config()._attn_implementation != decodeattention.NAME


def test_masks_that_hide_no_key_attend_natively_and_others_go_to_sdpa(nk, monkeypatch):
    """transformers hands a sliding window's layer an all-true mask while its cache holds the window alone: that is
    no mask. A mask that hides a key, a batch of two or a prefill is SDPA's call, bit for bit."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    monkeypatch.setattr(decodeattention, "_kernels", nk)
    calls, attend = [], NativeKernels.attend_heads
    monkeypatch.setattr(NativeKernels, "attend_heads", lambda self, *a, **k: calls.append(1) or attend(self, *a, **k))
    g = torch.Generator().manual_seed(3)
    q, k, v = torch.randn(1, 4, 1, 64, generator=g), torch.randn(1, 2, 50, 64, generator=g), torch.randn(1, 2, 50, 64)
    module = torch.nn.Module()
    module.is_causal, module.num_key_value_groups = True, 2
    hidden = torch.ones(1, 1, 1, 50, dtype=torch.bool)
    hidden[..., 7] = False
    bias = torch.zeros(1, 1, 1, 50)
    bias[..., 7] = float("-inf")
    cases = {
        "none": (None, True),
        "all true": (torch.ones(1, 1, 1, 50, dtype=torch.bool), True),
        "zeros": (torch.zeros(1, 1, 1, 50), True),
        "one hidden": (hidden, False),
        "one -inf": (bias, False),
    }
    for name, (mask, native_expected) in cases.items():
        calls.clear()
        got, _ = decodeattention.attention(module, q, k, v, mask, scaling=0.125)
        want, _ = sdpa_attention_forward(module, q, k, v, mask, scaling=0.125)
        assert bool(calls) is native_expected, name
        assert got.shape == want.shape == (1, 1, 4, 64)
        if native_expected:
            assert float((got - want).abs().max()) < 1e-5, name
        else:
            assert torch.equal(got, want), name
    calls.clear()
    batch = (q.expand(2, -1, -1, -1), k.expand(2, -1, -1, -1), v.expand(2, -1, -1, -1))
    assert torch.equal(
        decodeattention.attention(module, *batch, None, scaling=0.125)[0],
        sdpa_attention_forward(module, *batch, None, scaling=0.125)[0],
    )
    assert not calls
