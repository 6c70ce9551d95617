"""A decoder layer's own work on this machine, measured on models of an architecture at tiny width, as the engine
runs them: what profiles/probe/layercost.py keeps and projections add per layer.

transformers builds the architecture from its default config with every width tiny (hidden 64, 4 heads of 16,
vocabulary 512), with one layer and with two. Where the set's products run on the native kernels (a GGUF set on a
CPU), each Linear but the head computes on Q8_0 blocks through the engine's own binding (packedbind.py,
packed/bound.py) in the kernel's mode, its decode attention takes the decode_attention knob's path, and the decode
runs on the engine's threads (torch one, the kernels the free cores); the KV cache is the one the engine gives
generate (appendcache.py). Each model greedy-decodes a few tokens, in turns. The two-layer model's token less the
one-layer model's is one layer's work; the one-layer token less that is a token's work outside the layers (the
embedding, the final norm, the generation loop). The products of tiny widths cost next to nothing, and the set's own
are counted apart (the kernel rates), so nothing is counted twice. About half a second after the imports.
"""

from __future__ import annotations

import time

TOKENS = 24  # decode tokens per timed run (and 4 for the short one whose time is taken off)
ROUNDS = 3  # runs of each model, in turns; the fastest counts
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


def measure(architecture: str, compute_dtype: str, kernel: str = "") -> dict:
    """{"seconds", "token_seconds"} of ARCHITECTURE in COMPUTE_DTYPE here (the module docstring's method), its
    products on the native kernels in mode KERNEL where given, or {"reason": why it could not be measured}. The
    profile's probe (profiles/probe/layercost.py layer_cost) takes it as its measure and keeps what it returns."""
    import torch

    from ..dtypes import torch_dtype
    from ..threads import COMPUTE_THREADS

    try:
        dtype = torch_dtype(compute_dtype)
        models = {layers: _tiny_model(architecture, layers, dtype) for layers in (1, 2)}
        native = bool(kernel) and all(_as_engine(model, kernel) for model in models.values())
    except Exception as exc:  # noqa: BLE001 - any architecture transformers cannot build small: the floor stands
        return {"reason": _short(exc)}
    ids = torch.arange(3, 11).unsqueeze(0)
    best = {layers: float("inf") for layers in models}
    threads = torch.get_num_threads()
    try:
        # a decode on the native kernels runs as the engine's does: torch on one thread, the kernels on the free cores
        COMPUTE_THREADS.poll(native_decode=native)
        with torch.inference_mode():
            for model in models.values():
                _decode(model, ids, 2)  # first calls: lazy imports and allocations
            for _ in range(ROUNDS):
                for layers, model in models.items():
                    long, short = _decode(model, ids, TOKENS), _decode(model, ids, 4)
                    best[layers] = min(best[layers], max(0.0, long - short) / (TOKENS - 4))
    except Exception as exc:  # noqa: BLE001 - a forward that fails at tiny width: the floor stands
        return {"reason": _short(exc)}
    finally:  # the caller's threads as they were (the next pass polls again)
        COMPUTE_THREADS.native_pass = False
        torch.set_num_threads(threads)
    per_layer = max(0.0, best[2] - best[1])
    return {"seconds": per_layer, "token_seconds": max(0.0, best[1] - per_layer)}


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


def _tiny_model(architecture: str, layers: int, dtype):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from ..compat import dtype_kwargs

    config = AutoConfig.for_model(architecture, num_hidden_layers=layers, **TINY)
    text = config.get_text_config()
    if text is not config:  # a composite model's config: its decoder's model type, built alone
        config = AutoConfig.for_model(text.model_type, num_hidden_layers=layers, **TINY)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, **dtype_kwargs(dtype))
    model.generation_config.eos_token_id = None  # every run decodes its count: no stop, no processor holding it off
    return model.eval()


def _as_engine(model, kernel: str) -> bool:
    """Bind MODEL's Linears (its head aside) to Q8_0 blocks on the native kernels in mode KERNEL, as the engine binds
    a GGUF set's, and route its decode attention as the decode_attention knob's formula does; False (MODEL unchanged)
    where the kernels are not built here."""
    import torch
    from torch import nn

    from ..checkpoint.packedformat import PackedFormat, PackedTensor
    from ..native import kernels
    from ..native.sample import sample_blocks
    from ..packed.bound import BoundWeight
    from ..profiles.knobs.table import NATIVE_ATTENTION_KERNELS
    from .decodeattention import use_native_attention
    from .packedbind import make_packed

    if kernels() is None:
        return False
    head = model.get_output_embeddings()
    for name, module in model.named_modules():
        if type(module) is not nn.Linear or module is head or module.in_features % 32:
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
    if kernel in NATIVE_ATTENTION_KERNELS:  # decode_attention's formula (knobs/running.py)
        use_native_attention(model)
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
