"""A resident decode on a CUDA GPU as CUDA graphs: a static KV cache and transformers' own compiled decode step.

A decode step of a model whose every unit is resident is hundreds of small kernels, each launched from Python: on a
fast GPU the launches, not the weights, bound the token (a 1B model: ~4,500 launches and 117 ms of host time for 8
tokens against 14 ms on the GPU). transformers compiles its decode step with torch.compile (mode reduce-overhead:
CUDA graphs) when generate is given a static cache on a GPU; this module gives it one, sized in buckets so a graph
recorded once serves the next request, and keeps the engine's per-pass accounting outside the captured forward:

    cache, why = static_cache(streamed, input_ids, max_new_tokens)   # None and the reason where it does not apply
    with graphed(streamed, kwargs):                                 # the pass hooks step aside; a processor counts
        streamed.model.generate(..., cache=cache, **kwargs)

The prefill runs eagerly (transformers' rule: one shape per prompt). A compile that fails falls back to the eager
step for good, logged once; the tokens are the same function of the weights either way (the GPU check compares them).
"""

from __future__ import annotations

import contextlib
import logging

import torch

from ..sizes import round_up

BUCKET = 256  # cache lengths come in multiples of this: a graph recorded for one request serves the next ones
LOG = logging.getLogger("rocketllm")


def wanted(streamed) -> str:
    """'' where the decode step may run as CUDA graphs, else why not (in words, for --stats and the GPU check)."""
    if streamed.config_engine.decode_graphs != "on":
        return "decode_graphs is off"
    if streamed.device.type != "cuda":
        return "the compute device is not a CUDA GPU"
    if any(tier != "device" for tier in streamed.plan.tier.values()):
        return "some units stream: their weights change under a captured graph"
    if streamed.kv_dtype not in ("auto", streamed.config_engine.compute_dtype):
        return f"the KV cache stores {streamed.kv_dtype}: a static cache holds the compute dtype"
    if not getattr(streamed.model, "_can_compile_fullgraph", False):
        return f"transformers does not compile {type(streamed.model).__name__} whole"
    if streamed.graphs_failed:
        return f"compiling the decode step failed once ({streamed.graphs_failed})"
    return ""


def static_cache(streamed, input_ids: torch.Tensor, max_new_tokens: int | None):
    """(a reset StaticCache for this batch and length, '') or (None, why not). One cache per shape is kept, so its
    tensors keep the addresses the recorded graphs read."""
    why = wanted(streamed)
    if why:
        return None, why
    if max_new_tokens is None or input_ids is None or input_ids.dim() != 2:
        return None, "the request gives no max_new_tokens"
    rows, length = input_ids.shape
    text = streamed.model.config.get_text_config()
    limit = int(getattr(text, "max_position_embeddings", 0) or 0)
    size = round_up(length + int(max_new_tokens), BUCKET)
    size = min(size, limit) if limit else size
    if size < length + int(max_new_tokens):
        return None, "the request is longer than the model's positions"
    key = (rows, size)
    cache = streamed.static_caches.get(key)
    if cache is None:
        from transformers import StaticCache

        try:
            cache = StaticCache(config=streamed.model.config, max_cache_len=size)
        except (TypeError, ValueError) as exc:  # an older transformers' signature, or a config it cannot size
            return None, f"no static cache for this model ({type(exc).__name__}: {exc})"
        streamed.static_caches.clear()  # one shape at a time: each holds a whole context of KV on the device
        streamed.static_caches[key] = cache
    else:
        cache.reset()
    return cache, ""


class GuardedCompile:
    """The model's compiled call, falling back to the eager one for good if compiling or running it fails."""

    def __init__(self, streamed) -> None:
        model = streamed.model
        self.streamed, self.eager = streamed, model.__call__
        config = model._default_compile_config()
        self.compiled = torch.compile(model.__call__, **config.to_dict())
        # transformers' get_compiled_call returns this object while the compile config stays the default
        model._compiled_call, model._last_compile_config = self, config

    def __call__(self, *args, **kwargs):
        if not self.streamed.graphs_failed:
            try:
                return self.compiled(*args, **kwargs)
            except Exception as exc:  # noqa: BLE001 - any compiler failure: the eager step computes the same
                self.streamed.graphs_failed = " ".join(f"{type(exc).__name__}: {exc}".split())[:200]
                LOG.warning("the decode step runs eagerly: compiling it failed (%s)", self.streamed.graphs_failed)
        return self.eager(*args, **kwargs)


class PassClock:
    """A logits processor that closes one pass in the ledger and opens the next: transformers calls processors once
    per forward, outside the captured step, so --stats and bench count passes as the pass hooks do elsewhere."""

    def __init__(self, streamed, rows: int) -> None:
        self.streamed, self.rows = streamed, rows

    def __call__(self, input_ids, scores):
        self.streamed._end_pass(None, None, None)
        self.streamed.begin_pass(self.rows)
        return scores


@contextlib.contextmanager
def graphed(streamed, kwargs: dict, input_ids: torch.Tensor):
    """Run one generate call with the decode step compiled: the root pass hooks step aside (a captured graph runs no
    Python), a PassClock counts the passes, and the pass left open after the last token is dropped."""
    from transformers import LogitsProcessorList

    if not isinstance(getattr(streamed.model, "_compiled_call", None), GuardedCompile):
        GuardedCompile(streamed)
    for hook in streamed.pass_hooks:
        hook.remove()
    kwargs["logits_processor"] = LogitsProcessorList(
        [*(kwargs.get("logits_processor") or []), PassClock(streamed, int(input_ids.shape[0]))]
    )
    streamed.begin_pass(int(input_ids.numel()))
    try:
        yield
    finally:
        streamed.ledger.drop_open()
        streamed.pass_hooks = streamed.register_pass_hooks()


def graphs_excluded(kwargs: dict) -> bool:
    """A generate call the graphed decode leaves eager: speculation (its passes vary in length) and a caller that keeps
    the output's cache (a prefix cache stores it; a static cache is reset by the next request)."""
    return bool(
        kwargs.get("prompt_lookup_num_tokens") or kwargs.get("assistant_model") or kwargs.get("return_dict_in_generate")
    )
