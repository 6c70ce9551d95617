"""A decoder layer's own work on this machine, measured on models of an architecture at small width, as the engine
runs them: what profiles/probe/layercost.py keeps and projections add per layer.

transformers builds the architecture from its default config with the set's attention shape (its heads, KV heads and
head size, its hidden width up to MAX_HIDDEN) and every other width tiny (an MLP of 128, a vocabulary of 512), with one
layer and with two. Where the set's products run on the native kernels (a GGUF set on a CPU), each Linear but the head
computes on Q8_0 blocks through the engine's own binding (packedbind.py, packed/bound.py) in the kernel's mode, its
decode attention takes the decode_attention knob's path, and the decode runs on the engine's threads (torch one, the
kernels the free cores); the KV cache is the one the engine gives generate (appendcache.py). Each model greedy-decodes
a few tokens, in turns. The two-layer model's token less the one-layer model's is one layer's work; the one-layer
model's token less that is a token's work outside the layers (the embedding, the final norm, the generation loop).

The set's products are counted apart (the kernel rates), so the probe's own are timed and taken off, all but each
call's fixed cost (a call into the kernels, its activations' quantization: timed on a 32-wide product), which the
rates leave out. Tiny widths everywhere measured Gemma 3's layer at 0.40 ms where it costs 0.52 in the model: its
norms, rotary and attention work on 640-wide states and four 256-wide heads, not on 64 and 16. What the set's
vocabulary adds to a token (its logits: a greedy argmax over Gemma's 262,144 is 0.25 ms on one thread) comes from two
more one-layer models at tiny width, of 512 entries and of the set's. Half a second to a second after the imports.
"""

from __future__ import annotations

import math
import time

TOKENS = 24  # decode tokens per timed run (and 4 for the short one whose time is taken off)
ROUNDS = 3  # runs of each model, in turns; the fastest counts
MAX_ROUNDS = 9  # while a layer measures no time, or more than a token's (noise: another process took the cores)
# The set's attention widths that the probe's models take (its hidden width capped at MAX_HIDDEN: a 4096-wide model's
# probe would build and bind 100 MB of weights a layer for norms that cost little beside its products); a shape's
# vocab_size goes to models of its own.
WIDTH_KEYS = ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim")
MAX_HIDDEN = 1024
TINY = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 512,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
}


def measure(architecture: str, compute_dtype: str, kernel: str = "", shape: dict | None = None) -> dict:
    """{"seconds", "token_seconds"} of ARCHITECTURE in COMPUTE_DTYPE here (the module docstring's method), its
    products on the native kernels in mode KERNEL where given, its SHAPE (WIDTH_KEYS and vocab_size: the set's config's)
    where given, or {"reason": why it could not be measured}. The profile's probe (profiles/probe/layercost.py
    layer_cost) takes it as its measure and keeps what it returns."""
    import torch

    from ..dtypes import torch_dtype
    from ..threads import COMPUTE_THREADS

    clock = _Clock()
    vocab = int((shape or {}).get("vocab_size") or 0)
    try:
        dtype = torch_dtype(compute_dtype)
        try:
            models = {layers: _tiny_model(architecture, layers, dtype, shape) for layers in (1, 2)}
        except Exception:  # noqa: BLE001 - widths this architecture's config refuses: its tiny ones, as before
            models = {layers: _tiny_model(architecture, layers, dtype) for layers in (1, 2)}
        if vocab > TINY["vocab_size"]:  # what the set's vocabulary adds to a token (its logits), at tiny width
            models["small"], models["vocab"] = (_tiny_model(architecture, 1, dtype, None, v) for v in (0, vocab))
        native = bool(kernel) and all(
            _as_engine(model, kernel, head=layers == "vocab") for layers, model in models.items()
        )
        fixed = _fixed_linear(dtype)
        if native:
            _as_engine(fixed, kernel)
        for layers, model in (*models.items(), (0, fixed)):
            clock.time_products(model, head=layers == "vocab")
    except Exception as exc:  # noqa: BLE001 - any architecture transformers cannot build small: the floor stands
        return {"reason": _short(exc)}
    ids = torch.arange(3, 11).unsqueeze(0)
    best = {layers: float("inf") for layers in models}
    threads = torch.get_num_threads()
    try:
        # a decode on the native kernels runs as the engine's does: torch on one thread, the kernels on the free cores
        COMPUTE_THREADS.poll(native_decode=native)
        with torch.inference_mode():
            clock.fixed = _call_seconds(fixed, dtype)
            for model in models.values():
                _decode(model, ids, 2)  # first calls: lazy imports and allocations
            rounds = 0
            # a busy machine can leave the differences at or under zero: more rounds, up to MAX_ROUNDS, until not
            while rounds < ROUNDS or (rounds < MAX_ROUNDS and not best[1] < best[2] < 2 * best[1]):
                rounds += 1
                for layers, model in models.items():
                    long = clock.less_products(_decode, model, ids, TOKENS)
                    short = clock.less_products(_decode, model, ids, 4)
                    best[layers] = min(best[layers], max(0.0, long - short) / (TOKENS - 4))
    except Exception as exc:  # noqa: BLE001 - a forward that fails at tiny width: the floor stands
        return {"reason": _short(exc)}
    finally:  # the caller's threads as they were (the next pass polls again)
        COMPUTE_THREADS.native_pass = False
        torch.set_num_threads(threads)
    per_layer = max(0.0, best[2] - best[1])
    logits = max(0.0, best["vocab"] - best["small"]) if "vocab" in best else 0.0
    return {"seconds": per_layer, "token_seconds": max(0.0, best[1] - per_layer) + logits}


def with_measured_speed(profile, facts, directory, manifest, knobs):
    """FACTS as this machine measured the set's speed, for KNOBS' compute dtype and kernel: bench's record of the set
    (its resident decode), else its block products at the kernels' measured rates and the layers' own work as the
    probe measured it (measured now where not yet), so a knob that projects a token's time (serve's
    default_max_tokens) takes the token a run takes here, not the products' floor."""
    from dataclasses import replace

    from ..profiles.probe.decodecompute import lookup, with_layer_overhead
    from ..profiles.probe.kernelrates import with_kernel_rates

    dtype, kernel = str(knobs.value("compute_dtype")), str(knobs.value("kernel"))
    recorded = lookup(profile, directory, manifest, dtype, kernel)
    if recorded:
        return replace(facts, decode_compute=recorded)
    return with_layer_overhead(profile, with_kernel_rates(profile, facts, kernel), dtype, kernel, measure=measure)


class _Clock:
    """The probe's products' time: each Linear's forward timed (`time_products`), and a decode's seconds less what its
    products spent beyond each call's fixed cost (`fixed`, seconds a call)."""

    def __init__(self) -> None:
        self.spent, self.calls, self.fixed = 0.0, 0, 0.0

    def time_products(self, model, head: bool = False) -> None:
        """Time MODEL's Linears, its head too where HEAD (bound as the set's is: its product is the set's, counted
        apart)."""
        from torch import nn

        left_out = None if head else _head(model)
        for module in model.modules():
            if isinstance(module, nn.Linear) and module is not left_out:
                module.forward = self._timed(module.forward)

    def _timed(self, forward):
        def timed(x):
            start = time.perf_counter()
            y = forward(x)
            self.spent += time.perf_counter() - start
            self.calls += 1
            return y

        return timed

    def less_products(self, run, *args) -> float:
        self.spent, self.calls = 0.0, 0
        seconds = run(*args)
        return seconds - max(0.0, self.spent - self.calls * self.fixed)


def _fixed_linear(dtype):
    """A 32-wide Linear in a module, bound as the probe's models are: a product call's cost with no bytes to read."""
    from torch import nn

    return nn.Sequential(nn.Linear(32, 32, bias=False, dtype=dtype))


def _call_seconds(module, dtype, calls: int = 64) -> float:
    import torch

    x = torch.ones(1, 32, dtype=dtype)
    linear = module[0]
    linear.forward(x)
    best = float("inf")
    for _ in range(calls):
        start = time.perf_counter()
        linear.forward(x)
        best = min(best, time.perf_counter() - start)
    return best


def _tiny_model(architecture: str, layers: int, dtype, shape: dict | None = None, vocab: int = 0):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from ..compat import dtype_kwargs

    widths = {**TINY, **_widths(shape), **({"vocab_size": vocab} if vocab else {})}
    config = AutoConfig.for_model(architecture, num_hidden_layers=layers, **widths)
    text = config.get_text_config()
    if text is not config:  # a composite model's config: its decoder's model type, built alone
        config = AutoConfig.for_model(text.model_type, num_hidden_layers=layers, **widths)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, **dtype_kwargs(dtype))
    model.generation_config.eos_token_id = None  # every run decodes its count: no stop, no processor holding it off
    return model.eval()


def _widths(shape: dict | None) -> dict:
    """The set's attention shape as the probe's model takes it (WIDTH_KEYS, the hidden width capped), {} for none."""
    found = {k: int(v) for k, v in (shape or {}).items() if k in WIDTH_KEYS and isinstance(v, int) and v > 0}
    if "hidden_size" in found:  # capped at a multiple of the heads (configs that derive a head's size check it) and
        # of a block's 32 (a Linear the kernels take)
        step = math.lcm(found.get("num_attention_heads", 1), 32)
        found["hidden_size"] = min(found["hidden_size"], max(step, MAX_HIDDEN // step * step))
    return found


def _head(model):
    return model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None


def _as_engine(model, kernel: str, head: bool = False) -> bool:
    """Bind MODEL's Linears (its head aside, but where HEAD) to Q8_0 blocks on the native kernels in mode KERNEL, as
    the engine binds a GGUF set's, and route its decode attention as the decode_attention knob's formula does; False
    (MODEL unchanged) where the kernels are not built here."""
    import torch
    from torch import nn

    from ..checkpoint.packedformat import PackedFormat, PackedTensor
    from ..native import kernels
    from ..native.sample import sample_blocks
    from ..packed.bound import BoundWeight
    from ..profiles.knobs.table import NATIVE_ATTENTION_KERNELS
    from .decodeattention import use_native_attention
    from .fusednorms import fuse_norms
    from .packedbind import make_packed
    from .rotary import fast_rotary

    if kernels() is None:
        return False
    left_out = None if head else _head(model)
    for name, module in model.named_modules():
        if type(module) is not nn.Linear or module is left_out or module.in_features % 32:
            continue
        n, k = module.out_features, module.in_features
        blocks = sample_blocks("Q8_0", n, k, seed=0)
        fmt = PackedFormat("gguf", (n, k), 32, gguf_type="Q8_0", block_bytes=blocks.shape[1] // (k // 32))
        make_packed(module, f"{name}.weight", "the probe's model")
        module.packed_weight = BoundWeight(
            fmt,
            torch.float32,
            torch.device("cpu"),
            "native",
            portable=PackedTensor(fmt, {"blocks": blocks}),
            mode=kernel,
        )
    if kernel in NATIVE_ATTENTION_KERNELS and hasattr(model, "config"):  # decode_attention's formula (running.py)
        use_native_attention(model)
    fuse_norms(model, torch.float32, native=True)  # as the engine's model on a CPU (fusednorms.py, rotary.py)
    fast_rotary(model, torch.float32, torch.device("cpu"), native=True)
    return True


def _decode(model, ids, tokens: int) -> float:
    """Seconds for a greedy decode of TOKENS new tokens after IDS, in the KV cache the engine gives generate."""
    from transformers.utils import logging

    from .appendcache import appending_cache
    from .kvcache import generate_cache_kwarg

    verbosity = logging.get_verbosity()
    logging.set_verbosity_error()  # generation-config notes about the tiny model's ids
    try:
        cache = appending_cache(model.config, ids.shape[1] + tokens)
        kwargs = {generate_cache_kwarg(): cache} if cache is not None else {}
        start = time.perf_counter()
        model.generate(ids, max_new_tokens=tokens, do_sample=False, pad_token_id=0, **kwargs)
        return time.perf_counter() - start
    finally:
        logging.set_verbosity(verbosity)


def _short(exc: Exception) -> str:
    return " ".join(f"{type(exc).__name__}: {exc}".split())[:200]
