"""The rotary embedding in four torch ops a tensor (stream/rotary.py): transformers' bits, or transformers' function."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from rocketllm_cli.stream import rotary

pytest.importorskip("transformers")


def _tiny(kind: str, dtype: torch.dtype):
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig, LlamaForCausalLM

    config_class, model_class = {
        "llama": (LlamaConfig, LlamaForCausalLM),
        "gemma3": (Gemma3TextConfig, Gemma3ForCausalLM),
    }[kind]
    config = config_class(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=120,
    )
    torch.manual_seed(0)
    reference = model_class(config).to(dtype).eval()
    model = model_class(config).to(dtype).eval()
    model.load_state_dict(reference.state_dict())
    return reference, model


def _same_generation(reference, model) -> None:
    """Six greedy tokens of a 7-token prompt: the same tokens and the same logits, bit for bit."""
    ids = torch.randint(0, 120, (1, 7), generator=torch.Generator().manual_seed(1))
    kwargs = dict(max_new_tokens=6, do_sample=False, output_logits=True, return_dict_in_generate=True)
    with torch.inference_mode():
        want = reference.generate(ids, **kwargs)
        got = model.generate(ids, **kwargs)
    assert torch.equal(want.sequences, got.sequences)
    assert all(torch.equal(w, g) for w, g in zip(want.logits, got.logits))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kind", ["llama", "gemma3"])
def test_generate_gives_transformers_logits_bit_for_bit(kind, dtype, monkeypatch):
    reference, model = _tiny(kind, dtype)
    if not rotary._rotary_keys(model.model.layers[0].self_attn):
        pytest.skip("this transformers gives attention modules no per-module rotary function")
    said = rotary.fast_rotary(model, dtype, torch.device("cpu"))
    assert said == "2 of 2 attention modules run the rotary form of four ops a tensor"
    calls = []
    form = rotary.rotate
    monkeypatch.setattr(rotary, "rotate", lambda *a: calls.append(a[0].shape) or form(*a))
    _same_generation(reference, model)
    assert len(calls) == 2 * 6  # two layers, a prompt pass and five decode steps: every call ran the form
    assert calls[0][2] == 7 and calls[-1][2] == 1


class _Recorder:
    """A rotary function as transformers' wrapper is called: records its calls, computes `compute`."""

    def __init__(self, compute) -> None:
        self.compute, self.calls = compute, []

    def __call__(self, *args, **kwargs):
        self.calls.append((args, kwargs))
        return self.compute(*args, **kwargs)

    def forward(self, *args, **kwargs):  # the wrapper class's forward, which a compiled forward calls
        return self(*args, **kwargs)


def _transformers_form(q, k, cos, sin, unsqueeze_dim=1):
    def half(x):
        return torch.cat((-x[..., x.shape[-1] // 2 :], x[..., : x.shape[-1] // 2]), dim=-1)

    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    return q * cos + half(q) * sin, k * cos + half(k) * sin


def _interleaved(q, k, cos, sin, unsqueeze_dim=1):  # pairs (0, 1), (2, 3), ... rotated: another rotary convention
    def pairs(x):
        return torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)

    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    return q * cos + pairs(q) * sin, k * cos + pairs(k) * sin


def _attention(function) -> nn.Module:
    module = nn.Module()
    module.head_dim = 8
    module._kernel_funcs = {"rotary_pos_emb": _Recorder(function)}
    return module


def test_a_rotary_of_another_convention_keeps_its_function():
    module = _attention(_interleaved)
    original = module._kernel_funcs["rotary_pos_emb"]
    assert (
        rotary.fast_rotary(module, torch.float32, torch.device("cpu"))
        == "0 of 1 attention modules run the rotary form of four ops a tensor"
    )
    assert module._kernel_funcs["rotary_pos_emb"] is original


def test_calls_outside_the_form_run_the_function_it_replaced():
    module = _attention(_transformers_form)
    assert rotary.fast_rotary(module, torch.float32, torch.device("cpu")).startswith("1 of 1")
    fast = module._kernel_funcs["rotary_pos_emb"]
    original = fast.original
    assert fast.forward.__func__ is _Recorder.forward  # a compiled forward runs the wrapper's own
    g = torch.Generator().manual_seed(3)
    q, k = torch.randn(1, 2, 3, 8, generator=g), torch.randn(1, 1, 3, 8, generator=g)
    cos, sin = torch.randn(1, 3, 8, generator=g), torch.randn(1, 3, 8, generator=g)
    original.calls.clear()
    fast(q, k, cos, sin)
    assert not original.calls
    partial = cos[..., :4], sin[..., :4]  # partial rotary: cos narrower than a head
    for args, kwargs in [((q, k, cos, sin, 2), {}), ((q, k, *partial), {}), ((q, k, cos, sin), {"position_ids": 1})]:
        original.calls.clear()
        try:
            fast(*args, **kwargs)
        except (RuntimeError, TypeError):
            pass  # the plain function may refuse these: what matters is that it, not the form, was asked
        assert len(original.calls) == 1


def test_angles_made_again_when_sin_changes_in_place():
    g = torch.Generator().manual_seed(4)
    q, k = torch.randn(1, 2, 1, 8, generator=g), torch.randn(1, 1, 1, 8, generator=g)
    cos, sin = torch.randn(1, 1, 8, generator=g), torch.randn(1, 1, 8, generator=g)
    first = rotary.rotate(q, k, cos, sin)
    assert all(torch.equal(a, b) for a, b in zip(first, _transformers_form(q, k, cos, sin)))
    sin.mul_(-0.5)  # the same tensor object, changed: the form must not reuse the signed sin it made from it
    again = rotary.rotate(q, k, cos, sin)
    assert all(torch.equal(a, b) for a, b in zip(again, _transformers_form(q, k, cos, sin)))


def test_the_native_rotary_gives_the_torch_forms_bits_on_strided_views(nk):
    g = torch.Generator().manual_seed(5)
    for positions in (1, 6):
        fused = torch.randn(1, positions, 4 * 16 + 2 * 2 * 16, generator=g)  # q | k | v of one product, as transformers
        q = fused[..., : 4 * 16].view(1, positions, 4, 16).transpose(1, 2)  # views them: strided, not contiguous
        k = fused[..., 4 * 16 : 6 * 16].view(1, positions, 2, 16).transpose(1, 2)
        angle = torch.rand(1, positions, 16, generator=g) * 1000
        cos, sin = angle.cos(), angle.sin()
        want, got = _transformers_form(q, k, cos, sin), nk.rope(q, k, cos, sin)
        for w, h in zip(want, got):
            assert torch.equal(w, h) and rotary._layout(w) == rotary._layout(h)


def test_a_model_on_the_native_kernels_rotates_on_them_with_transformers_bits(nk, monkeypatch):
    reference, model = _tiny("llama", torch.float32)
    if not rotary._rotary_keys(model.model.layers[0].self_attn):
        pytest.skip("this transformers gives attention modules no per-module rotary function")
    said = rotary.fast_rotary(model, torch.float32, torch.device("cpu"), native=True)
    assert said.endswith("2 of them on the native kernels"), said
    calls = []
    real = type(nk).rope
    monkeypatch.setattr(type(nk), "rope", lambda self, *a: calls.append(a[0].shape) or real(self, *a))
    _same_generation(reference, model)
    assert len(calls) == 2 * 6


def test_a_cos_broadcast_over_positions_takes_the_torch_form(nk):
    g = torch.Generator().manual_seed(6)
    q, k = torch.randn(1, 2, 5, 8, generator=g), torch.randn(1, 1, 5, 8, generator=g)
    cos, sin = torch.randn(1, 1, 8, generator=g), torch.randn(1, 1, 8, generator=g)  # one position for all five
    assert not rotary._native_case(q, k, cos, sin)
    fast = rotary._FastRotary(_Recorder(_transformers_form), nk)
    assert all(torch.equal(a, b) for a, b in zip(fast(q, k, cos, sin), _transformers_form(q, k, cos, sin)))
