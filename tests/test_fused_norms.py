"""RMS norms as torch's fused call (stream/fusednorms.py): found by their shape, not their class; a form is taken only
where it gives the module's own bits; anything else (hooks, another dtype, a module that is not a norm) runs the
module's forward as before; the engine's model does it on the CPU and still matches plain transformers."""

from __future__ import annotations

import torch
from torch import nn
from transformers import Gemma3TextConfig, LlamaConfig
from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from rocketllm_cli.stream.fusednorms import _FusedNorm, fuse_norms


def _inputs(width: int, dtype=torch.float32):
    g = torch.Generator().manual_seed(width)
    return [
        (s * torch.randn(*lead, width, generator=g)).to(dtype) for lead in ((1, 1), (1, 9), (3, 2, 1)) for s in (1, 40)
    ]


def _eager(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return type(module).__mro__[2].forward(module, x) if isinstance(module, _FusedNorm) else module(x)


def test_llama_and_gemma_norms_take_their_form_and_give_the_same_bits():
    llama, gemma = LlamaRMSNorm(96, eps=1e-5), Gemma3RMSNorm(64, eps=1e-6)
    with torch.no_grad():
        llama.weight.normal_()
        gemma.weight.normal_()
    model = nn.ModuleDict({"a": llama, "b": gemma, "c": nn.Linear(4, 4)})
    before = {name: [m(x) for x in _inputs(m.weight.shape[0])] for name, m in (("a", llama), ("b", gemma))}
    said = fuse_norms(model, torch.float32)
    assert said == "2 of 2 norm modules run torch's fused RMS norm (1 + weight, weight)"
    assert isinstance(llama, _FusedNorm) and isinstance(llama, LlamaRMSNorm) and isinstance(gemma, _FusedNorm)
    assert type(model["c"]) is nn.Linear
    for name, module in (("a", llama), ("b", gemma)):
        after = [module(x) for x in _inputs(module.weight.shape[0])]
        assert all(torch.equal(a, b) for a, b in zip(after, before[name]))
    with torch.no_grad():  # the weight is read at each call: a streamed unit's is bound afresh
        llama.weight.mul_(2)
    x = _inputs(96)[0]
    assert torch.equal(llama(x), _eager(llama, x))


def test_a_bf16_model_takes_the_forms_that_cast_where_its_norm_does():
    """Llama multiplies by its weight after casting back to bf16, Gemma before: each probe finds its own."""
    llama, gemma = LlamaRMSNorm(96).to(torch.bfloat16), Gemma3RMSNorm(64).to(torch.bfloat16)
    assert fuse_norms(llama, torch.bfloat16).endswith("(weight, after the cast)")
    assert fuse_norms(gemma, torch.bfloat16).endswith("(1 + weight, before the cast)")
    for module in (llama, gemma):
        with torch.no_grad():
            module.weight.normal_()
        for x in _inputs(module.weight.shape[0], torch.bfloat16):
            assert torch.equal(module(x), _eager(module, x))


def test_another_dtype_hooks_and_a_compiled_call_go_through_the_modules_own_call():
    norm = LlamaRMSNorm(32)
    fuse_norms(norm, torch.float32)
    calls = []
    handle = norm.register_forward_hook(lambda module, args, out: calls.append(1))
    x = torch.randn(1, 1, 32)
    assert torch.equal(norm(x), _eager(norm, x)) and calls == [1]
    handle.remove()
    norm._compiled_call_impl = lambda *args: calls.append("compiled") or _eager(norm, *args)  # as module.compile()
    assert torch.equal(norm(x), _eager(norm, x)) and calls == [1, "compiled"]
    norm._compiled_call_impl = None
    xb = x.to(torch.bfloat16)
    with torch.no_grad():
        norm.weight.data = norm.weight.data.to(torch.bfloat16)
    assert torch.equal(norm(xb), _eager(norm, xb))  # bf16 was not probed: the module's own ops


def test_a_module_shaped_like_a_norm_that_is_not_one_keeps_its_forward():
    class Scale(nn.Module):  # one 1-D weight and an epsilon, but no normalisation
        def __init__(self):
            super().__init__()
            self.eps = 1e-6
            self.weight = nn.Parameter(torch.ones(16))

        def forward(self, x):
            return x * self.weight + self.eps

    scale = Scale()
    assert fuse_norms(scale, torch.float32) == "0 of 1 norm modules run torch's fused RMS norm (no form matched)"
    assert type(scale) is Scale
    assert fuse_norms(nn.Linear(3, 3), torch.float32) == "no RMS norm modules"


def test_instances_of_one_class_that_differ_in_a_flag_are_probed_apart():
    class Norm(nn.Module):  # one class, two behaviours: the flag decides
        def __init__(self, offset: bool):
            super().__init__()
            self.eps, self.offset = 1e-6, offset
            self.weight = nn.Parameter(torch.randn(32))

        def forward(self, x):
            normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
            return normed * (1.0 + self.weight.float()) if self.offset else normed * self.weight

    plain, offset = Norm(False), Norm(True)
    said = fuse_norms(nn.ModuleList([plain, offset]), torch.float32)
    assert said == "2 of 2 norm modules run torch's fused RMS norm (1 + weight, weight)"
    for module in (plain, offset):
        for x in _inputs(32):
            assert torch.equal(module(x), _eager(module, x))


def test_probing_a_model_on_meta_leaves_its_weights_as_they_were():
    from rocketllm_cli.shard.discover import build_meta_model

    for config in (
        LlamaConfig(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_hidden_layers=2, vocab_size=128),
        Gemma3TextConfig(
            hidden_size=64,
            intermediate_size=96,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            num_hidden_layers=2,
            vocab_size=128,
        ),
    ):
        model = build_meta_model(config, torch.float32)
        weights = {name: p for name, p in model.named_parameters()}
        said = fuse_norms(model, torch.float32)
        assert said.startswith(f"{sum(isinstance(m, _FusedNorm) for m in model.modules())} of ")
        assert sum(isinstance(m, _FusedNorm) for m in model.modules()) == (
            5 if "Llama" in type(config).__name__ else 13
        )
        assert all(p is weights[name] and p.is_meta for name, p in model.named_parameters())


def test_the_native_norm_gives_the_modules_bits_at_every_width_and_shape(nk, monkeypatch):
    """One native call where the module's forward was six to eight torch ops: its sum of squares added in the order
    torch's CPU sum adds a row (vectors, four at a time, a cascade of levels past 16 steps), found by the probe."""
    made, ran = [], []
    real = type(nk).rms_norm

    def counted(self, *a):
        norm = real(self, *a)
        made.append(a)
        return lambda x, w: ran.append(a[3]) or norm(x, w)

    monkeypatch.setattr(type(nk), "rms_norm", counted)
    for width in (12, 100, 576, 2560, 8192):  # under one vector, a tail past whole vectors, SmolLM2, cascades
        llama, gemma = LlamaRMSNorm(width, eps=1e-5), Gemma3RMSNorm(width, eps=1e-6)
        with torch.no_grad():
            llama.weight.normal_()
            gemma.weight.normal_()
        for module in (llama, gemma):
            module.requires_grad_(False)  # as the engine binds weights: a call recording gradients takes torch's form
        said = fuse_norms(nn.ModuleList([llama, gemma]), torch.float32, native=True)
        assert said.endswith(", 2 of them on the native kernels"), (width, said)
        assert llama.fused_native is not None and gemma.fused_native is not None
        for module in (llama, gemma):
            inputs = _inputs(width) + [1e-3 * torch.randn(1, 1, width), 300 * torch.randn(2, 7, width)]
            before = len(ran)
            for x in inputs:
                assert torch.equal(module(x), _eager(module, x)), (width, type(module).__name__, x.shape)
            assert len(ran) - before == len(inputs)  # every call on the native norm
    assert {a[3] for a in made} == {True, False} == set(ran)  # Gemma's 1 + weight and Llama's weight


def test_a_strided_input_takes_the_torch_form_and_no_kernels_none_of_them(nk):
    norm = LlamaRMSNorm(64)
    with torch.no_grad():
        norm.weight.normal_()
    assert fuse_norms(norm, torch.float32, native=True).endswith("1 of them on the native kernels")
    norm.requires_grad_(False)
    x = torch.randn(1, 64, 3).transpose(1, 2)  # each row strided: the native call reads rows by pointer
    assert not x.is_contiguous() and torch.equal(norm(x), _eager(norm, x))
    plain = LlamaRMSNorm(64)
    assert fuse_norms(plain, torch.float32, native=False).endswith("(weight)") and plain.fused_native is None
    grad = torch.randn(1, 2, 64, requires_grad=True)  # a call that records gradients takes torch's form
    norm(grad).sum().backward()
    assert grad.grad is not None and grad.grad.abs().sum() > 0
    half = LlamaRMSNorm(64).to(torch.bfloat16)  # a bf16 model: the native norm is fp32 alone
    assert "native" not in fuse_norms(half, torch.bfloat16, native=True) and half.fused_native is None
