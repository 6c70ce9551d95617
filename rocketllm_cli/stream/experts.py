"""Routed experts only: after the router has chosen, read and bind just the experts it named.

Batched experts module (transformers 5.x): a forward pre-hook reads `top_k_index`, fetches every
routed expert of the batch at once (storage reads in parallel), copies each into its slice of a
full-shaped fused tensor, binds that, and unbinds after. The fused tensor is an anonymous mapping
on a CPU, so slices of experts never routed cost no memory.
Per-expert modules (transformers 4.x): only routed experts' modules run; each binds its own
tensors in a pre-hook; a hook on the router starts the reads of all routed experts as soon as
the router's logits exist.
Experts read from storage are kept in a cache of `expert_cache_bytes` (LFU by default; the device budget
the plan left over); hits and lookups go to the ledger.
"""

from __future__ import annotations

import mmap
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

import torch
from torch import nn

from ..checkpoint.manifest import Manifest
from ..profiles.knobs.table import EXPERT_CACHE_POLICIES
from ..shard.expertlayout import Direct, Fused, resolve_pieces, top_k
from ..sizes import round_up
from .buffers import aligned_buffer
from .ledger import Ledger
from .residency import ResidencyPlan
from .store import WeightStore


class ExpertCache:
    """Experts kept in memory, up to `capacity` bytes: unit -> its tensors.

    policy "lfu" (the knob's default): keep the experts routed most often so far; a newcomer is admitted only by
    evicting
    experts used less often than it. A decode pass walks every layer in order, so recency is a poor guide:
    with room for fewer experts than one pass routes, LRU evicts each expert just before its layer comes
    round again and never hits, while frequency keeps a stable set. policy "lru": least recently used out.
    """

    def __init__(self, capacity: int, policy: str) -> None:
        if policy not in EXPERT_CACHE_POLICIES:
            raise ValueError(f"expert cache policy {policy!r}: expected {' or '.join(EXPERT_CACHE_POLICIES)}")
        self.capacity = capacity
        self.policy = policy
        self.used = 0
        self.uses: dict[str, int] = {}
        self._items: OrderedDict[str, tuple[dict[str, torch.Tensor], int]] = OrderedDict()

    def get(self, name: str) -> dict[str, torch.Tensor] | None:
        item = self._items.get(name)
        if item is None:
            return None
        self._items.move_to_end(name)
        return item[0]

    def count(self, name: str) -> None:
        self.uses[name] = self.uses.get(name, 0) + 1

    def fits(self, nbytes: int) -> bool:
        return 0 < nbytes <= self.capacity

    def put(self, name: str, tensors: dict[str, torch.Tensor], nbytes: int) -> bool:
        """Admit `name` if the policy lets it in; returns whether it was kept."""
        if self.policy == "lfu":
            victims, freed = [], self.capacity - self.used
            for other in sorted(self._items, key=lambda n: self.uses.get(n, 0)):
                if freed >= nbytes:
                    break
                if self.uses.get(other, 0) >= self.uses.get(name, 0):
                    return False
                victims.append(other)
                freed += self._items[other][1]
            if freed < nbytes:
                return False
            for other in victims:
                self.used -= self._items.pop(other)[1]
        else:
            while self._items and self.used + nbytes > self.capacity:
                _, (_, size) = self._items.popitem(last=False)
                self.used -= size
        self._items[name] = (tensors, nbytes)
        self.used += nbytes
        return True


class ExpertStreamer:
    def __init__(
        self,
        model: nn.Module,
        manifest: Manifest,
        plan: ResidencyPlan,
        store: WeightStore,
        ledger: Ledger,
        *,
        io_workers: int,
        candidates,
        cache_policy: str,
    ) -> None:
        self.store, self.ledger, self.plan = store, ledger, plan
        self.device, self.dtype = store.device, store.dtype
        self.units = {u.name: u for u in manifest.experts}
        self.stack = manifest.stack
        self.cache = ExpertCache(plan.expert_cache_bytes, cache_policy)
        self._pool = ThreadPoolExecutor(max(1, io_workers), thread_name_prefix="rocketllm-experts")
        self._staging: list[torch.Tensor] = []
        self._staging_lock = threading.Lock()
        self._staging_bytes = round_up(max((u.bytes for u in self.units.values()), default=0))
        self._pending: dict[str, Future] = {}
        self._arenas: dict[tuple, torch.Tensor] = {}  # (attr, shape) -> full-shaped tensor shared by every layer
        self._params: dict[int, nn.Parameter] = {}  # arena data_ptr -> the Parameter bound over it
        self._hooks: list = []
        self._held: dict[str, tuple[list, torch.Tensor | None]] = {}
        self._k = top_k(model.config)
        pieces = {t.name: tuple(t.shape) for u in self.units.values() for t in u.tensors}
        where = resolve_pieces(model, pieces, candidates)
        # by expert unit: its pieces' targets
        self.targets: dict[str, list[tuple[str, Direct | Fused]]] = {
            u.name: [(t.name, where[t.name]) for t in u.tensors] for u in self.units.values()
        }
        self._wire(model)

    # -- wiring -----------------------------------------------------------------------
    def _wire(self, model: nn.Module) -> None:
        fused: dict[str, dict[int, str]] = {}  # batched module path -> expert -> unit
        direct: dict[str, str] = {}  # per-expert module path -> unit
        modules: dict[str, nn.Module] = {}
        for unit, targets in self.targets.items():
            for _, t in targets:
                if isinstance(t, Fused):
                    modules[t.path] = t.module
                    fused.setdefault(t.path, {})[t.expert] = unit
                else:
                    path = _expert_module_path(model, t.path, self.stack)
                    modules[path] = model.get_submodule(path)
                    direct[path] = unit
        for path, experts in fused.items():
            module = modules[path]
            resident = all(self.plan.tier[u] == "device" for u in experts.values())
            if resident:
                self._bind_fused_resident(module, experts)
            self._hooks.append(
                module.register_forward_pre_hook(self._fused_pre(module, experts, resident), with_kwargs=True)
            )
            if not resident:
                self._hooks.append(module.register_forward_hook(self._fused_post(module)))
        routers: dict[int, tuple[nn.Module, dict[int, str]]] = {}
        for path, unit in direct.items():
            module = modules[path]
            self._hooks.append(module.register_forward_pre_hook(self._direct_pre(unit)))
            self._hooks.append(module.register_forward_hook(self._direct_post(unit)))
            parent_path, _, index = path.rpartition(".")
            container = model.get_submodule(parent_path)
            block = model.get_submodule(parent_path.rpartition(".")[0])
            routers.setdefault(id(container), (block, {}))[1][int(index)] = unit
        for block, experts in routers.values():
            router = _router_of(block, len(experts))
            if router is not None:
                self._hooks.append(
                    router.register_forward_hook(self._router_hook(experts, getattr(block, "top_k", None) or self._k))
                )

    # -- fetching one expert ----------------------------------------------------------------
    def _fetch(self, unit: str) -> tuple[dict[str, torch.Tensor], torch.Tensor | None]:
        """The expert's tensors and the staging buffer holding them (to give back after use), counting bytes by tier."""
        record = self.units[unit]
        tier = self.plan.tier[unit]
        size = record.tensor_bytes
        caching = self.cache.fits(size)
        if caching:
            self.cache.count(unit)
        if tier == "device":
            self.ledger.serve_expert("device", size, cached=None)
            return self.store.resident(unit), None
        hit = self.cache.get(unit)
        if hit is not None:
            self.ledger.serve_expert("device", size, cached=True)
            return hit, None
        if tier == "host" and not self.store.cuda:  # the page cache through a persistent mapping: nothing to keep
            self.ledger.serve_expert("host", size, cached=None)
            return self.store._host_views[unit], None
        self.ledger.serve_expert(tier, size, cached=False if caching else None)
        waited = time.perf_counter()
        future = self._pending.pop(unit, None)
        if tier == "host":  # CUDA: the pinned copy in RAM
            buf, staged = self.store._host[unit], None
        else:
            buf = staged = future.result() if future is not None else self._read(unit)
        self.ledger.add_time("wait", time.perf_counter() - waited)
        views = self.store._views(record, buf)
        if self.store.cuda:
            views = {k: v.to(self.device) for k, v in views.items()}
        if caching and self.cache.put(unit, views, size):
            # On a CPU the cached views live in the staging buffer: it now belongs to the cache.
            return views, staged if self.store.cuda else None
        return views, staged

    def _read(self, unit: str) -> torch.Tensor:
        """Read one storage-tier expert's file into a staging buffer (on an IO thread or the caller's)."""
        with self._staging_lock:
            buf = self._staging.pop() if self._staging else None
        if buf is None:
            buf = aligned_buffer(self._staging_bytes, self.store.pin)
        self.store._read(self.units[unit], buf, evict=True)
        return buf

    def _give_back(self, buf: torch.Tensor | None) -> None:
        if buf is not None:
            with self._staging_lock:
                self._staging.append(buf)

    def _prefetch(self, units: list[str]) -> None:
        for unit in units:
            if unit in self._pending or self.plan.tier[unit] == "device" or self.cache.get(unit) is not None:
                continue
            if self.plan.tier[unit] != "storage":
                continue
            self._pending[unit] = self._pool.submit(self._read, unit)

    # -- batched experts (fused parameters) -----------------------------------------------------
    def _arena(self, module: nn.Module, attr: str) -> torch.Tensor:
        placeholder = module._parameters[attr]
        key = (attr, tuple(placeholder.shape))
        arena = self._arenas.get(key)
        if arena is None:
            nbytes = placeholder.numel() * self.dtype.itemsize
            if self.device.type == "cpu":
                raw = torch.frombuffer(mmap.mmap(-1, max(nbytes, 1)), dtype=torch.uint8)[:nbytes]
                arena = raw.view(self.dtype).view(placeholder.shape)
            else:
                arena = torch.empty(placeholder.shape, dtype=self.dtype, device=self.device)
            self._arenas[key] = arena
        return arena

    def _place(
        self, unit: str, module: nn.Module, tensors: dict[str, torch.Tensor], arenas: dict[str, torch.Tensor]
    ) -> None:
        """Copy UNIT's pieces that belong to MODULE into its slices of ARENAS (one expert may span several batched
        modules: JetMoE's MLP experts and attention experts)."""
        for name, t in self.targets[unit]:
            if isinstance(t, Fused) and t.module is module:
                arenas[t.attr][t.expert].narrow(t.dim, t.offset, t.size).copy_(tensors[name])

    def _bind_fused_resident(self, module: nn.Module, experts: dict[int, str]) -> None:
        attrs = {
            t.attr for u in experts.values() for _, t in self.targets[u] if isinstance(t, Fused) and t.module is module
        }
        full = {a: torch.empty(module._parameters[a].shape, dtype=self.dtype, device=self.device) for a in attrs}
        for unit in experts.values():
            self._place(unit, module, self.store.resident(unit), full)
        for a, tensor in full.items():
            module._parameters[a] = nn.Parameter(tensor, requires_grad=False)

    def _fused_pre(self, module: nn.Module, experts: dict[int, str], resident: bool):
        placeholders = dict(module._parameters)

        def hook(mod, args, kwargs):
            index = kwargs.get("top_k_index", args[1] if len(args) > 1 else None)
            if torch.is_tensor(index) and not index.is_floating_point():
                routed = sorted(int(e) for e in torch.unique(index).tolist() if int(e) in experts)
            else:  # a forward that is not given the routing (JetMoE's takes counts per expert): every expert
                routed = sorted(experts)
            units = [experts[e] for e in routed]
            if resident:
                for unit in units:
                    self.ledger.serve_expert("device", self.units[unit].tensor_bytes, cached=None)
                return None
            self._prefetch(units)
            arenas = {a: self._arena(mod, a) for a in placeholders}
            for unit in units:
                tensors, buf = self._fetch(unit)
                self._place(unit, mod, tensors, arenas)
                self._give_back(buf)
            for a, arena in arenas.items():
                mod._parameters[a] = self._parameter(arena)
            return None

        return hook

    def _fused_post(self, module: nn.Module):
        placeholders = dict(module._parameters)

        def hook(mod, args, output):
            mod._parameters.update(placeholders)

        return hook

    def _parameter(self, arena: torch.Tensor) -> nn.Parameter:
        param = self._params.get(arena.data_ptr())
        if param is None:
            param = self._params[arena.data_ptr()] = nn.Parameter(arena, requires_grad=False)
        return param

    # -- per-expert modules ---------------------------------------------------------------------
    def _direct_pre(self, unit: str):
        if self.plan.tier[unit] == "device":  # bound for good; the hook only counts the use
            resident = self.store.resident(unit)
            for name, t in self.targets[unit]:
                t.module._parameters[t.attr] = nn.Parameter(resident[name], requires_grad=False)
            size = self.units[unit].tensor_bytes
            return lambda module, args: self.ledger.serve_expert("device", size, cached=None)

        def hook(module, args):
            tensors, buf = self._fetch(unit)
            saved = []
            for name, t in self.targets[unit]:
                saved.append((t.module, t.attr, t.module._parameters[t.attr]))
                t.module._parameters[t.attr] = nn.Parameter(tensors[name], requires_grad=False)
            self._held[unit] = (saved, buf)

        return hook

    def _direct_post(self, unit: str):
        def hook(module, args, output):
            held = self._held.pop(unit, None)
            if held is None:
                return
            saved, buf = held
            for mod, attr, placeholder in saved:
                mod._parameters[attr] = placeholder
            self._give_back(buf)

        return hook

    def _router_hook(self, experts: dict[int, str], k: int | None):
        def hook(module, args, output):
            logits = output[0] if isinstance(output, tuple) else output
            if k is None or not torch.is_tensor(logits) or logits.shape[-1] != len(experts):
                return
            chosen = torch.unique(torch.topk(logits.reshape(-1, logits.shape[-1]), k, dim=-1).indices).tolist()
            self._prefetch([experts[e] for e in chosen if e in experts])

        return hook

    def end_pass(self) -> None:
        """Reads started for experts that were never used (a router prefetch the model did not follow)."""
        for unit, future in list(self._pending.items()):
            self._give_back(future.result())
        self._pending.clear()

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._pending.clear()
        self._arenas.clear()
        self._params.clear()
        self._staging.clear()


def _expert_module_path(model: nn.Module, path: str, stack: str) -> str:
    """The per-expert module a parameter's module sits in: the entry of a ModuleList (not the decoder stack) on its
    path."""
    parts = path.split(".")
    for i in range(len(parts) - 1, 0, -1):
        parent = ".".join(parts[:i])
        if parts[i].isdigit() and parent != stack and isinstance(model.get_submodule(parent), nn.ModuleList):
            return f"{parent}.{parts[i]}"
    return path


def _router_of(block: nn.Module, num_experts: int) -> nn.Module | None:
    """The router of a per-expert block: its child Linear with one output per expert."""
    for child in block.children():
        if isinstance(child, nn.Linear) and child.out_features == num_experts:
            return child
    return None
