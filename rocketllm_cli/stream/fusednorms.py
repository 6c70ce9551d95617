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

Where the products run on the native kernels (fp32 on a CPU), a class is probed the same way against their one-call
norm (`rms_norm`: the sum of squares added in the order torch's CPU sum adds a row, 8- or 16-float vectors, Gemma's
1 + weight inline), which a contiguous input then takes. F.rms_norm is still ~13 aten ops inside: in a SmolLM2
decode on a 2-core Xeon a norm took ~30 us, a quarter of the aten calls of a token; the native call ~9 us, and the
token 28.6 -> 24.8 ms.
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
_CPU = torch.device("cpu")


class _FusedNorm:
    """Mixed in before a norm's class: a plain call runs its probed form."""

    fused_form = None  # FORMS' function, or None: the module's own forward
    fused_native = None  # f(x, weight): the native kernels' norm where it gives the bits, else None
    fused_shape = ()  # (width,)
    fused_eps = 0.0
    fused_dtype = None  # the dtype of x and weight the form was probed in

    def __call__(self, x, *args, **kwargs):
        weight = self._parameters["weight"]
        if x.dtype != self.fused_dtype or weight.dtype != self.fused_dtype or module_call_needed(self, args, kwargs):
            return nn.Module.__call__(self, x, *args, **kwargs)
        native = self.fused_native
        if (
            native is not None
            and x.is_contiguous()
            and x.shape[-1] == self.fused_shape[0]
            and x.is_cpu
            and weight.is_cpu
            and weight.is_contiguous()
            and not (x.requires_grad or weight.requires_grad)  # the native call records no gradient
        ):
            return native(x, weight)
        if self.fused_form is None:
            return nn.Module.__call__(self, x, *args, **kwargs)
        return self.fused_form(x, weight, self.fused_shape, self.fused_eps)


_CLASSES: dict[type, type] = {}


def fuse_norms(model: nn.Module, dtype: torch.dtype, native: bool = False, device=_CPU) -> str:
    """Give each RMS norm of MODEL whose class a form matches that form (for x and weight in DTYPE); what was done,
    in words. NATIVE: the model's products run on the native kernels (built already), whose norm (one call) a class
    then runs where it too gives the forward's bits, fp32 alone. A model on another DEVICE keeps its norms."""
    if torch.device(device).type != "cpu":
        return "not on this device"
    kernels = None
    if native and dtype == torch.float32:
        from ..native import kernels as native_kernels

        kernels = native_kernels()
    verdicts: dict[tuple, tuple[str | None, tuple | None]] = {}
    fused, found, natively = 0, 0, 0
    for module in model.modules():
        candidate = _candidate(module)
        if candidate is None:
            continue
        found += 1
        width, eps, state = candidate
        key = (type(module), width, eps, dtype, state)  # instances of a class that differ in a flag differ here
        if key not in verdicts:
            verdicts[key] = (_probe(module, width, eps, dtype), _probe_native(module, width, eps, kernels))
        form, native_form = verdicts[key]
        if form is None and native_form is None:
            continue
        cls = type(module)
        fused_cls = _CLASSES.get(cls)
        if fused_cls is None:
            fused_cls = _CLASSES[cls] = type(f"Fused{cls.__name__}", (_FusedNorm, cls), {})
        module.__class__ = fused_cls
        module.fused_form, module.fused_shape, module.fused_eps = FORMS.get(form), (width,), eps
        module.fused_native = None if native_form is None else kernels.rms_norm(width, eps, *native_form)
        module.fused_dtype = dtype
        fused += 1
        natively += native_form is not None
    if not found:
        return "no RMS norm modules"
    forms = sorted({f for f, _ in verdicts.values() if f is not None})
    on = f", {natively} of them on the native kernels" if natively else ""
    return f"{fused} of {found} norm modules run torch's fused RMS norm ({', '.join(forms) or 'no form matched'}){on}"


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
    # "1 + weight" hands the fused call an fp32 weight: beside x in another dtype torch does not fuse it and warns
    # once a process, so it is a form for fp32 alone
    forms = {name: form for name, form in FORMS.items() if name != "1 + weight" or dtype == torch.float32}
    return _first_match(
        module, width, dtype, {name: lambda x, w, f=f: f(x, w, (width,), eps) for name, f in forms.items()}
    )


def _probe_native(module: nn.Module, width: int, eps: float, kernels) -> tuple[int, bool] | None:
    """(lanes, one_plus) of the native norm that equals MODULE's fp32 forward bit for bit on the probe's inputs, else
    None: torch's sum adds a row in vectors of 8 or 16 floats as its build dispatches (torch 2.13 adds in 8 under its
    AVX-512, AVX2 and default dispatch alike), so both are tried."""
    if kernels is None:
        return None
    forms = {
        (lanes, one_plus): kernels.rms_norm(width, eps, lanes, one_plus) for lanes in (16, 8) for one_plus in (0, 1)
    }
    return _first_match(module, width, torch.float32, forms)


def _first_match(module: nn.Module, width: int, dtype: torch.dtype, forms: dict):
    """The first key of FORMS (each f(x, weight)) whose output equals MODULE's forward bit for bit on the probe's
    inputs (a random weight of WIDTH put in for the probe), else None."""
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
            for key, form in forms.items():
                try:
                    if all(torch.equal(form(x, probe_weight), want) for x, want in zip(inputs, wanted)):
                        return key
                except (RuntimeError, TypeError, ValueError):
                    continue
    except Exception:  # noqa: BLE001 - a module that is not a norm after all keeps its forward
        return None
    finally:
        module._parameters["weight"] = held
    return None
