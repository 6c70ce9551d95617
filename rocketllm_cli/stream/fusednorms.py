"""A model's RMS norms as one torch call, where that gives their bits.

A decoder layer's RMS norm is six to eight small torch ops in transformers' Python (Llama: `pow`, `mean`, `add`,
`rsqrt`, `mul`, `mul`; Gemma adds `float()` and `1.0 + weight`), called twice a layer (Gemma: six times, its q and k
norms among them). On a 2-core AMD EPYC a call took 16-17.5 us where `torch.nn.functional.rms_norm`, which runs the
same ops in C++, took 9.8; SmolLM2 calls 61 a token, Gemma 3 270M 109.

Nothing here names an architecture. A module is a candidate by its shape: no children, one parameter `weight` of one
dimension, no buffers, and a small positive float attribute (its epsilon). Each candidate class is probed once per
width, epsilon and dtype, with a random weight put in for the probe (the model's may be unbound, on meta or streamed)
and inputs of several shapes and magnitudes: the first of FORMS whose output equals the module's own forward bit for
bit is the one it runs from then on; a class no form matches keeps its forward. A call another dtype reaches, or one
with hooks, extra arguments or a compiled call, goes through the module's own forward as before.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .packedbind import module_call_needed


def _one_plus(w: torch.Tensor) -> torch.Tensor:  # Gemma's (1 + weight), in fp32
    return w.float() + 1.0


# name -> f(x, weight, shape, eps): the forms probed, in order
FORMS = {
    "weight": lambda x, w, shape, eps: F.rms_norm(x, shape, w, eps),
    "1 + weight": lambda x, w, shape, eps: F.rms_norm(x, shape, _one_plus(w), eps),
    "weight, after the cast": lambda x, w, shape, eps: w * F.rms_norm(x.float(), shape, None, eps).to(x.dtype),
    "1 + weight, before the cast": lambda x, w, shape, eps: F.rms_norm(x.float(), shape, _one_plus(w), eps).to(x.dtype),
}
PROBE_SHAPES = ((1, 1), (1, 5), (2, 3), (1, 4, 1))  # leading dims of x: a decode step, a prompt, a batch, a head
PROBE_SCALES = (1e-3, 1.0, 60.0)


class _FusedNorm:
    """Mixed in before a norm's class: a plain call runs its probed form."""

    fused_form = None  # FORMS' function
    fused_shape = ()  # (width,)
    fused_eps = 0.0
    fused_dtype = None  # the dtype of x and weight the form was probed in

    def __call__(self, x, *args, **kwargs):
        weight = self._parameters["weight"]
        if x.dtype != self.fused_dtype or weight.dtype != self.fused_dtype or module_call_needed(self, args, kwargs):
            return nn.Module.__call__(self, x, *args, **kwargs)
        return self.fused_form(x, weight, self.fused_shape, self.fused_eps)


_CLASSES: dict[type, type] = {}


def fuse_norms(model: nn.Module, dtype: torch.dtype) -> str:
    """Give each RMS norm of MODEL whose class a form matches that form (for x and weight in DTYPE); what was done,
    in words."""
    verdicts: dict[tuple, str | None] = {}
    fused, found = 0, 0
    for module in model.modules():
        candidate = _candidate(module)
        if candidate is None:
            continue
        found += 1
        width, eps, state = candidate
        key = (type(module), width, eps, dtype, state)  # instances of a class that differ in a flag differ here
        if key not in verdicts:
            verdicts[key] = _probe(module, width, eps, dtype)
        form = verdicts[key]
        if form is None:
            continue
        cls = type(module)
        fused_cls = _CLASSES.get(cls)
        if fused_cls is None:
            fused_cls = _CLASSES[cls] = type(f"Fused{cls.__name__}", (_FusedNorm, cls), {})
        module.__class__ = fused_cls
        module.fused_form, module.fused_shape, module.fused_eps = FORMS[form], (width,), eps
        module.fused_dtype = dtype
        fused += 1
    if not found:
        return "no RMS norm modules"
    forms = sorted({f for f in verdicts.values() if f is not None})
    return f"{fused} of {found} norm modules run torch's fused RMS norm ({', '.join(forms) or 'no form matched'})"


def _candidate(module: nn.Module) -> tuple[int, float, tuple] | None:
    """(width, epsilon, its other attributes) of a module shaped like an RMS norm, else None. Attributes that are not
    plain values (another object a forward could consult) make it no candidate."""
    if module._modules or module._buffers or isinstance(module, _FusedNorm):
        return None
    params = module._parameters
    if set(params) != {"weight"} or params["weight"] is None or params["weight"].dim() != 1:
        return None
    public = {k: v for k, v in vars(module).items() if not k.startswith("_")}
    if any(v is not None and type(v) not in (bool, int, float, str) for v in public.values()):
        return None
    eps = [v for v in public.values() if type(v) is float and 0 < v <= 1e-2]
    if len(eps) != 1:
        return None
    return int(params["weight"].shape[0]), eps[0], tuple(sorted(public.items()))


def _probe(module: nn.Module, width: int, eps: float, dtype: torch.dtype) -> str | None:
    """The first form whose output equals MODULE's forward bit for bit on the probe's inputs, else None."""
    held = module._parameters["weight"]
    g = torch.Generator().manual_seed(width)
    probe_weight = (0.5 * torch.randn(width, generator=g)).to(dtype)
    inputs = [
        (scale * torch.randn(*lead, width, generator=g)).to(dtype) for lead in PROBE_SHAPES for scale in PROBE_SCALES
    ]
    try:
        module._parameters["weight"] = nn.Parameter(probe_weight, requires_grad=False)
        with torch.no_grad():
            wanted = [type(module).forward(module, x) for x in inputs]
            for name, form in FORMS.items():
                # "1 + weight" hands the fused call an fp32 weight: beside x in another dtype torch does not fuse it
                # and warns once a process, so it is a form for fp32 alone
                if name == "1 + weight" and dtype != torch.float32:
                    continue
                try:
                    if all(torch.equal(form(x, probe_weight, (width,), eps), want) for x, want in zip(inputs, wanted)):
                        return name
                except (RuntimeError, TypeError, ValueError):
                    continue
    except Exception:  # noqa: BLE001 - a module that is not a norm after all keeps its forward
        return None
    finally:
        module._parameters["weight"] = held
    return None
