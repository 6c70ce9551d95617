"""A model's rotary embedding in fewer torch ops, where that gives its bits.

transformers applies rotary position embeddings as `q * cos + rotate_half(q) * sin`, and the same for k, where
`rotate_half(x)` is `cat(-x2, x1)` of x's two halves: seven ops for q, seven for k, two unsqueezes, and two module
calls, since transformers 5 routes the function through a per-attention-module wrapper (the `kernels` package's
`use_kernelized_func`). On a 2-core AMD EPYC that was 30.6 us a layer, 8.5% of a SmolLM2 decode step.

`cat(-x2, x1) * sin` is `roll(x, half) * cat(-sin1, sin2)` element for element: each product is the same two numbers
with the same sign moved from one factor to the other, which IEEE multiplication rounds identically, and the sum
keeps transformers' order. The signed sin (and both unsqueezes) depend on the position alone, so they are made once a
forward pass, by the first layer that sees that pass's cos and sin, and every other layer reuses them: four ops for q,
four for k.

Where the model's products run on the native kernels (fp32 on a CPU), one native call rotates q and k (`rope`: each
product and the sum rounded apart, no FMA). Inside a real decode the eight ops cost 45 us a layer, not the 13.5 they
cost alone: each product streams a layer's weights through the core's caches and evicts the interpreter's and torch's
working set, so the code between products runs cold, and one call is less code than eight. With its wrapper it took
21.5 us (SmolLM2, a 2-core Xeon).

Nothing here names an architecture. A module is a candidate where transformers gave it a private rotary function
(`_kernel_funcs`, the per-instance wrapper of transformers 5); each such class is probed once per head width and
dtype against that function on random inputs (a decode step, a prompt, a batch): where the outputs equal it bit for
bit and laid out alike, its instances call this form (and the native one, probed the same way). A call outside the
form's case (another unsqueeze dim, partial rotary, extra arguments) runs transformers' function, as does a compiled
forward; one the native call does not take (a batch, a strided cos) the torch form.
"""

from __future__ import annotations

import types

import torch

from .packedbind import tensor_version

PROBE_SHAPES = ((1, 3, 1, 1), (1, 3, 5, 1), (2, 2, 3, 2))  # (batch, heads, positions, kv heads)


class _Angles:
    """One forward pass's cos and sin as the form takes them: cos unsqueezed, sin signed and unsqueezed."""

    __slots__ = ("cos", "sin", "versions", "cos_u", "sin_u")

    def __init__(self, cos: torch.Tensor, sin: torch.Tensor) -> None:
        half = sin.shape[-1] // 2
        self.cos, self.sin = cos, sin  # held, so that an identity check never meets a reused id
        self.versions = (tensor_version(cos), tensor_version(sin))
        self.cos_u = cos.unsqueeze(1)
        self.sin_u = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1).unsqueeze(1)


_last: _Angles | None = None  # the angles of the latest pass (the layers of one pass share cos and sin)


def _angles(cos: torch.Tensor, sin: torch.Tensor) -> _Angles:
    global _last
    last = _last
    if last is not None and last.cos is cos and last.sin is sin:
        if last.versions == (tensor_version(cos), tensor_version(sin)):
            return last
    made = _Angles(cos, sin)
    _last = made
    return made


def rotate(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """transformers' rotary form, `(x * cos) + (rotate_half(x) * sin)` for x in q and k, in four ops each."""
    a = _angles(cos, sin)
    half = q.shape[-1] // 2
    return q * a.cos_u + q.roll(half, -1) * a.sin_u, k * a.cos_u + k.roll(half, -1) * a.sin_u


def _native_case(q, k, cos, sin) -> bool:
    """Whether the native kernels' rotary takes these (their call checks nothing): one sequence of fp32 on the CPU,
    q, k, cos and sin over the same positions (no broadcast), each last dimension contiguous, cos and sin alike."""
    qs, cs = q.shape, cos.shape
    return (
        q.dtype == torch.float32
        and q.is_cpu
        and qs[0] == k.shape[0] == cs[0] == 1
        and qs[2] == k.shape[2] == cs[1]
        and sin.shape == cs
        and q.stride(-1) == k.stride(-1) == cos.stride(-1) == 1
        and cos.stride() == sin.stride()
    )


def _form_case(q, k, cos, sin, rest: tuple, kwargs: dict) -> bool:
    unsqueeze = rest[0] if rest else kwargs.get("unsqueeze_dim", 1)
    return (
        unsqueeze == 1
        and len(rest) <= 1
        and set(kwargs) <= {"unsqueeze_dim"}
        and q.dim() == k.dim() == 4
        and cos.dim() == sin.dim() == 3
        and q.shape[-1] == k.shape[-1] == cos.shape[-1] == sin.shape[-1]
        and q.shape[-1] % 2 == 0
        and q.dtype == k.dtype == cos.dtype == sin.dtype
    )


class _FastRotary:
    """Stands in a module's `_kernel_funcs` for transformers' wrapper of its rotary function: a plain call runs the
    form in its case, else the wrapper it replaced. Its `forward` is the wrapper class's own, so that a compiled
    forward (which calls `forward` on the model-wide wrapper) runs transformers' function."""

    def __init__(self, original, native=None) -> None:
        self.original = original
        self.native = native  # the native kernels, where their rotary (one call for q and k) gives the same bits
        self.forward = types.MethodType(type(original).forward, original)

    def __call__(self, q, k, cos, sin, *rest, **kwargs):
        if _form_case(q, k, cos, sin, rest, kwargs):
            if self.native is not None and _native_case(q, k, cos, sin):
                return self.native.rope(q, k, cos, sin)
            return rotate(q, k, cos, sin)
        return self.original(q, k, cos, sin, *rest, **kwargs)


def _rotary_keys(module) -> list[str]:
    funcs = module.__dict__.get("_kernel_funcs")
    if not isinstance(funcs, dict):
        return []
    return [name for name, f in funcs.items() if "rotary" in name and not isinstance(f, _FastRotary)]


def fast_rotary(model: torch.nn.Module, dtype: torch.dtype, device: torch.device, native: bool = False) -> str:
    """Give each attention module of MODEL whose rotary function the form matches (for DTYPE) the form; what was
    done, in words. NATIVE: the model's products run on the native kernels (built already), whose rotary then runs
    an fp32 form where it too gives the function's bits."""
    if device.type != "cpu":
        return "not on this device"
    kernels = None
    if native and dtype == torch.float32:
        from ..native import kernels as native_kernels

        kernels = native_kernels()
    verdicts: dict[tuple, tuple[bool, bool]] = {}
    found = done = natively = 0
    for module in model.modules():
        for name in _rotary_keys(module):
            found += 1
            width = getattr(module, "head_dim", None)
            if not isinstance(width, int) or width <= 0 or width % 2:
                continue
            original = module._kernel_funcs[name]
            key = (type(module), name, width, dtype)
            if key not in verdicts:
                torch_form = _probe(original, width, dtype, rotate)
                verdicts[key] = (
                    torch_form,
                    torch_form
                    and kernels is not None
                    and _probe(original, width, dtype, _FastRotary(original, kernels)),
                )
            torch_form, native_form = verdicts[key]
            if torch_form:
                module._kernel_funcs[name] = _FastRotary(original, kernels if native_form else None)
                done += 1
                natively += native_form
    if not found:
        return "no per-module rotary function"
    on = f", {natively} of them on the native kernels" if natively else ""
    return f"{done} of {found} attention modules run the rotary form of four ops a tensor{on}"


def _probe(original, width: int, dtype: torch.dtype, form) -> bool:
    """Whether FORM equals ORIGINAL bit for bit, laid out alike, on random decode, prompt and batch inputs
    (q and k as transformers hands them: views of [batch, positions, heads, width] transposed)."""
    g = torch.Generator().manual_seed(width)
    try:
        with torch.inference_mode():
            for batch, heads, positions, kv_heads in PROBE_SHAPES:
                q = torch.randn(batch, positions, heads, width, generator=g).to(dtype).transpose(1, 2)
                k = (4 * torch.randn(batch, positions, kv_heads, width, generator=g)).to(dtype).transpose(1, 2)
                angle = torch.rand(batch, positions, width, generator=g) * 100
                cos, sin = angle.cos().to(dtype), angle.sin().to(dtype)
                want = original(q, k, cos, sin)
                got = form(q, k, cos, sin)
                if not all(torch.equal(w, h) and _layout(w) == _layout(h) for w, h in zip(want, got)):
                    return False
    except Exception:  # noqa: BLE001 - a function that is not this rotary after all keeps its own
        return False
    finally:
        global _last
        _last = None
    return True


def _layout(t: torch.Tensor) -> tuple:
    """T's strides where they matter: a dimension of one element has no step to take."""
    return tuple(stride for size, stride in zip(t.shape, t.stride()) if size > 1)
