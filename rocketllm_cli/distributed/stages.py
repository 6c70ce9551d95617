"""This rank's share of a pipeline: its units of the shard set, its layers of the stack, and the hidden states that
cross to the next rank.

Every rank builds the whole model on the meta device, binds only its own units (the rest stay unbound placeholders
and are never read) and cuts the decoder stack down to its own layers, renumbering their `layer_idx` and the config's
layer count, so transformers' forward runs unchanged and the KV cache it makes holds this rank's layers only.

Rank 0 runs transformers' generate() as a single process would: the embeddings, its layers, then, in a forward hook on
its last layer, the hidden state goes to rank 1 with the attention mask, position ids and cache positions; each rank
runs its layers on it (its own forward of the base model, the received state put in at its first layer) and passes it
on; the last rank sends it back, and rank 0's final norm and head make the logits. Sampling, stopping, grammars and
speculation stay on rank 0. Every pass carries rank 0's cache length before it, so a rank whose cache is longer (a
speculative rollback) crops its own to match, and a new cache id (a new request) starts a new one.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
import weakref

import torch
from torch import nn

from ..checkpoint.manifest import Manifest
from ..tiers import TIERS
from .group import (
    F_CACHE,
    F_COMPUTE_US,
    F_DEVICE_B,
    F_FINAL,
    F_HOST_B,
    F_OP,
    F_PAST,
    F_SEQ,
    F_STORAGE_B,
    HEADER_LEN,
    OP_FAIL,
    OP_PASS,
    OP_RESULT,
    OP_STOP,
    StageGroup,
    pack,
    unpack,
)
from .torchrun import StageError
from .stageplan import StagePlan

TIER_FIELDS = {"device": F_DEVICE_B, "host": F_HOST_B, "storage": F_STORAGE_B}
FIRST_ONLY_KINDS = ("embed", "lm_head")  # units only rank 0 reads: the token lookup and the head


def local_manifest(manifest: Manifest, start: int, stop: int, first: bool) -> Manifest:
    """The units rank's share reads: layers (and their experts) in [start, stop), and the non-layer units its forward
    touches (rank 0: all of them; the others: all but the embeddings and the head)."""
    keep = []
    for u in manifest.units:
        if u.kind in ("layer", "expert"):
            if start <= u.index < stop:
                keep.append(u)
        elif first or u.kind not in FIRST_ONLY_KINDS:
            keep.append(u)
    return dataclasses.replace(manifest, units=keep)


def cut_stack(model: nn.Module, stack: str, start: int, stop: int) -> tuple[nn.Module, nn.Module, nn.Module]:
    """Keep layers [start, stop) of the stack at STACK; returns (the stack's parent, its first and last kept layer)."""
    parent_path, _, attr = stack.rpartition(".")
    parent = model.get_submodule(parent_path) if parent_path else model
    layers = getattr(parent, attr)
    kept = nn.ModuleList([layers[i] for i in range(start, stop)])
    for layer in kept:
        for module in layer.modules():
            idx = module.__dict__.get("layer_idx")
            if isinstance(idx, int) and not isinstance(idx, bool):
                module.layer_idx = idx - start  # the index of its cache layer, which holds this rank's layers only
    setattr(parent, attr, kept)
    config = model.config.get_text_config(decoder=True)
    total = config.num_hidden_layers
    config.num_hidden_layers = stop - start
    types = getattr(config, "layer_types", None)
    if isinstance(types, (list, tuple)) and len(types) == total:
        config.layer_types = list(types[start:stop])
    return parent, kept[0], kept[-1]


def _hidden(output):
    return output if isinstance(output, torch.Tensor) else output[0]


def _with_hidden(output, hidden: torch.Tensor):
    if isinstance(output, torch.Tensor):
        return hidden
    return (hidden, *output[1:])


class Stage:
    """This rank's place in the pipeline: the group, the plan, its layer range and what crossing the links cost."""

    def __init__(
        self,
        group: StageGroup,
        plan: StagePlan,
        streamed,
        base: nn.Module,
        first_layer: nn.Module,
        last_layer: nn.Module,
    ) -> None:
        self.group, self.plan, self.streamed, self.base = group, plan, streamed, base
        self.rank, self.world = group.rank, group.world
        self.start, self.stop = plan.ranges[self.rank]
        self.wire = group.device  # where messages live: the host for gloo, this rank's GPU for NCCL
        self.passes = 0
        self.stopped = False  # rank 0: the other ranks were told to close this model
        group.open_stage = self
        self.link_s = 0.0  # rank 0: ring time not spent computing on another rank
        self.remote_compute_s = 0.0
        self._seq = itertools.count(1)
        self._hooks = []
        import inspect

        accepted = inspect.signature(base.forward).parameters
        self._cache_kw = "cache" if "cache" in accepted else "past_key_values"  # transformers 5 renamed it
        self._takes_cache_position = "cache_position" in accepted
        if self.rank == 0:
            self._ids: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
            self._next_id = itertools.count(1)
            self._stash = None
            self._hooks.append(base.register_forward_pre_hook(self._capture, with_kwargs=True))
            self._hooks.append(last_layer.register_forward_hook(self._ring))
        else:
            self._incoming: torch.Tensor | None = None
            self._outgoing: torch.Tensor | None = None
            self._caches: dict[int, object] = {}
            self._hooks.append(first_layer.register_forward_pre_hook(self._inject, with_kwargs=True))
            self._hooks.append(last_layer.register_forward_hook(self._capture_out))

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    def describe(self) -> str:
        return self.plan.describe()

    def figures(self) -> dict:
        """Rank 0: the plan and what the links and the other ranks took per pass, measured (--stats, bench, /health)."""
        n = max(1, self.passes)
        return {
            "plan": self.plan.describe(),
            "ranges": [list(r) for r in self.plan.ranges],
            "hosts": self.plan.hosts,
            "passes": self.passes,
            "link_ms_per_pass": round(1000 * self.link_s / n, 3),
            "other_ranks_ms_per_pass": round(1000 * self.remote_compute_s / n, 3),
            "projected_link_ms_per_token": round(1000 * self.plan.link_seconds, 3),
        }

    # -- rank 0 ------------------------------------------------------------------------------------------------------
    def _capture(self, module, args, kwargs):
        cache = kwargs.get(self._cache_kw)
        cache_id, past = 0, 0
        use_cache = kwargs.get("use_cache")
        if use_cache is None:
            use_cache = getattr(module.config, "use_cache", False)
        if cache is None and use_cache:
            # the model would make its own inside the forward, too late to name it to the other ranks: make it here
            cache = self._new_cache()
            kwargs = {**kwargs, self._cache_kw: cache}
        if cache is not None:
            cache_id = self._ids.get(cache)
            if cache_id is None:
                cache_id = self._ids[cache] = next(self._next_id)
            past = int(cache.get_seq_length())
        mask = kwargs.get("attention_mask")
        if mask is not None and not isinstance(mask, torch.Tensor):
            raise StageError(
                "this model passes its attention mask as a mapping, which cannot cross stages; run it in one process"
            )
        self._stash = (mask, kwargs.get("position_ids"), kwargs.get("cache_position"), past, cache_id)
        return args, kwargs

    def _ring(self, module, args, output):
        hidden = _hidden(output)
        mask, position_ids, cache_position, past, cache_id = self._stash
        header = torch.zeros(HEADER_LEN, dtype=torch.int64)
        header[F_OP], header[F_PAST], header[F_CACHE], header[F_SEQ] = OP_PASS, past, cache_id, next(self._seq)
        payload = pack(header, [self._out(hidden), self._out(mask), self._out(position_ids), self._out(cache_position)])
        started = time.perf_counter()
        self.group.send(self._to_wire(header), self._to_wire(payload), 1)
        back, body = self.group.recv(self.world - 1)
        elapsed = time.perf_counter() - started
        if int(back[F_OP]) == OP_FAIL:
            (message,) = unpack(back, body)
            raise StageError(bytes(message.cpu().tolist()).decode("utf-8", "replace"))
        (result,) = unpack(back, body)
        remote = int(back[F_COMPUTE_US]) / 1e6
        self.passes += 1
        self.remote_compute_s += remote
        self.link_s += max(0.0, elapsed - remote)
        ledger = self.streamed.ledger
        for tier, field in TIER_FIELDS.items():
            ledger.serve(tier, int(back[field]))
        ledger.add_time("stages: other ranks computing", remote)
        ledger.add_time("stages: links", max(0.0, elapsed - remote))
        return _with_hidden(output, result.to(hidden.device, hidden.dtype))

    def _out(self, t):
        return None if t is None else t.detach().to(self.wire)

    def _to_wire(self, t: torch.Tensor) -> torch.Tensor:
        return t if t.device == self.wire else t.to(self.wire)

    def stop_all(self, final: bool = False) -> None:
        """Rank 0: the other ranks close this model and wait for the next load (FINAL: they end); quiet if one is
        gone."""
        if self.rank != 0 or self.group.failure or self.stopped:
            return
        self.stopped = True
        header = torch.zeros(HEADER_LEN, dtype=torch.int64)
        header[F_OP] = OP_STOP
        header[F_FINAL] = int(final)
        try:
            self.group.send(self._to_wire(header), torch.zeros(0, dtype=torch.uint8, device=self.wire), 1)
        except StageError:
            pass

    # -- other ranks -------------------------------------------------------------------------------------------------
    def _inject(self, module, args, kwargs):
        incoming = self._incoming
        if args:
            return (incoming, *args[1:]), kwargs
        kwargs = dict(kwargs)
        kwargs["hidden_states"] = incoming
        return args, kwargs

    def _capture_out(self, module, args, output):
        self._outgoing = _hidden(output)

    def serve(self) -> bool:
        """Run this rank's layers on every pass rank 0 starts, until it says stop (returns True when no model follows)
        or a rank fails (StageError)."""
        prev, nxt = self.rank - 1, (self.rank + 1) % self.world
        last = self.rank == self.world - 1
        while True:
            header, payload = self.group.recv(prev)
            op = int(header[F_OP])
            if op == OP_STOP:
                if not last:
                    self.group.send(header, payload, nxt)
                return bool(int(header[F_FINAL]))
            if op == OP_FAIL:
                self.group.send(header, payload, nxt)
                continue
            hidden, mask, position_ids, cache_position = unpack(header, payload)
            started = time.perf_counter()
            try:
                out, served = self._run(
                    hidden, mask, position_ids, cache_position, int(header[F_PAST]), int(header[F_CACHE])
                )
            except StageError as e:
                if self.group.failure:
                    raise
                self._refuse(header, nxt, str(e))
                continue
            except Exception as e:  # noqa: BLE001 - the request fails on rank 0 with this rank's reason; the stage lives on
                if self.group.failure:
                    raise
                from ..errors import describe

                self._refuse(header, nxt, describe(e)[0])
                continue
            header = header.clone()
            header[F_COMPUTE_US] += int((time.perf_counter() - started) * 1e6)
            for tier, field in TIER_FIELDS.items():
                header[field] += served.get(tier, 0)
            if last:
                header[F_OP] = OP_RESULT
                body = pack(header, [out])
            else:
                body = pack(header, [out, mask, position_ids, cache_position])
            self.group.send(header, body, nxt)

    def _refuse(self, header: torch.Tensor, nxt: int, reason: str) -> None:
        fail = torch.zeros(HEADER_LEN, dtype=torch.int64)
        fail[F_OP], fail[F_SEQ] = OP_FAIL, header[F_SEQ]
        text = f"{self.group.name(self.rank)} failed running layers {self.start}-{self.stop - 1}: {reason}"
        body = pack(fail, [torch.tensor(list(text.encode()), dtype=torch.uint8, device=self.wire)])
        self.group.send(fail, body, nxt)

    def _cache(self, cache_id: int, past: int):
        if not cache_id:
            return None
        cache = self._caches.get(cache_id)
        if cache is None:
            self._caches.clear()  # a new request: rank 0 has moved on from the previous cache
            cache = self._caches[cache_id] = self._new_cache()
        held = int(cache.get_seq_length())
        if held > past:
            cache.crop(past - held)  # negative: tokens to drop (transformers 5 takes only that; 4.x takes both)
        elif held < past:
            raise StageError(
                f"{self.group.name(self.rank)} holds {held} tokens of KV cache where rank 0 holds {past}; "
                f"restart the stages"
            )
        return cache

    def _new_cache(self):
        from ..stream.appendcache import appending_cache

        cache = self.streamed.new_kv_cache()
        if cache is None:
            cache = appending_cache(self.streamed.model.config)  # appended in place, where the model allows
        if cache is None:
            from transformers import DynamicCache

            try:
                cache = DynamicCache(config=self.streamed.model.config)
            except TypeError:  # a transformers without the config keyword
                cache = DynamicCache()
        return cache

    @torch.inference_mode()
    def _run(self, hidden, mask, position_ids, cache_position, past: int, cache_id: int):
        streamed = self.streamed
        cache = self._cache(cache_id, past)
        device, dtype = streamed.device, streamed.dtype
        self._incoming = hidden.to(device, dtype)
        embeds = torch.zeros(hidden.shape, dtype=dtype, device=device)
        streamed._begin_pass(None, (), {"inputs_embeds": embeds})
        try:
            extra = (
                {"cache_position": cache_position.to(device)}
                if cache_position is not None and self._takes_cache_position
                else {}
            )
            self.base(
                inputs_embeds=embeds,
                attention_mask=None if mask is None else mask.to(device),
                position_ids=None if position_ids is None else position_ids.to(device),
                use_cache=cache is not None,
                **{self._cache_kw: cache},
                **extra,
            )
        finally:
            streamed._end_pass(None, (), None)
            self._incoming = None
        out, self._outgoing = self._outgoing, None
        ledger = streamed.ledger
        served = dict(ledger.steps[-1].served) if ledger.steps else {}
        del ledger.steps[:-1]  # a stage serves for as long as the server runs: keep the latest pass only
        return out.to(self.wire), {t: int(served.get(t, 0)) for t in TIERS}

    def close(self) -> None:
        if self.group.open_stage is self:
            self.group.open_stage = None
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
