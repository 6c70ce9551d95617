"""Residency plan: which units live on the device, which in the host cache, which stream from storage.

Units that are not layers (embeddings, norm, head, extras) are placed first:
they are needed every token and are few. Then as many layers as fit stay resident,
and the streamed ones are spaced evenly through the stack, so each streamed layer
has the compute time of the resident layers before it to arrive.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import ParameterError
from ..shard.manifest import Manifest
from ..sizes import format_bytes
from ..tiers import TIERS

RESIDENT_KINDS = ("root", "vision")  # always on the device, their bytes taken from the device budget first


@dataclass
class ResidencyPlan:
    """Which tier serves each unit (device, host or storage), with the formula and inputs that placed them.

    What make_plan decided from the two cache budgets; the weight store loads by it and `--stats` prints it (describe)."""

    tier: dict[str, str]  # unit name -> device | host | storage
    formula: str
    inputs: dict[str, int] = field(default_factory=dict)
    expert_cache_bytes: int = 0  # device budget left for the expert cache (experts streamed from storage)

    def units_in(self, tier: str) -> list[str]:
        return [u for u, t in self.tier.items() if t == tier]

    def bytes_per_tier(self, manifest: Manifest) -> dict[str, int]:
        sizes = {u.name: u.tensor_bytes for u in manifest.units}
        out = dict.fromkeys(TIERS, 0)
        for name, tier in self.tier.items():
            out[tier] += sizes[name]
        return out

    def describe(self, manifest: Manifest) -> str:
        layers = [u.name for u in manifest.layers]
        marks = {"device": "D", "host": "H", "storage": "S"}
        strip = "".join(marks[self.tier[n]] for n in layers)
        per = self.bytes_per_tier(manifest)
        counts = ", ".join(f"{t} {len(self.units_in(t))} units / {format_bytes(per[t])}" for t in TIERS)
        experts = [u.name for u in manifest.experts]
        moe = ""
        if experts:
            by = {t: sum(1 for e in experts if self.tier[e] == t) for t in TIERS}
            moe = (f"; experts: {by['device']} device, {by['host']} host, {by['storage']} storage of {len(experts)}, "
                   f"expert cache {format_bytes(self.expert_cache_bytes)}")
        return f"residency: {counts}; layers [{strip}] (D device, H host cache, S storage){moe}; {self.formula}"

    def to_dict(self) -> dict:
        return {"tier": self.tier, "formula": self.formula, "inputs": self.inputs, "expert_cache_bytes": self.expert_cache_bytes}


def spaced(n: int, k: int) -> list[int]:
    """k indices spread evenly over range(n): the i-th at floor((i + 0.5) * n / k)."""
    return [int((i + 0.5) * n / k) for i in range(k)] if k > 0 else []


def make_plan(manifest: Manifest, device_cache_bytes: int, host_cache_bytes: int) -> ResidencyPlan:
    """Place every unit of MANIFEST within the device and host budgets (bytes); what fits neither streams from storage.

    Units hooked on the whole model and vision towers always on the device, then the other non-layer units, then as many layers as fit,
    the streamed ones spread evenly through the stack; a MoE model's experts last: all on the device if they fit,
    else the device budget left over is their cache (expert_cache_bytes)."""
    units = {u.name: u for u in manifest.units}
    tier: dict[str, str] = {}
    budget = {"device": device_cache_bytes, "host": host_cache_bytes}

    def place(name: str, order=("device", "host", "storage")) -> None:
        size = units[name].tensor_bytes
        for t in order:
            if t == "storage" or budget[t] >= size:
                if t != "storage":
                    budget[t] -= size
                tier[name] = t
                return

    # Units hooked on the whole model hold their weights for the entire forward: keep them resident. So is a vision
    # tower (with its projector): it runs once per request, and streaming it would read it again for every picture.
    for u in manifest.units:
        if u.kind in RESIDENT_KINDS:
            tier[u.name] = "device"
            budget["device"] -= u.tensor_bytes
    for u in sorted((u for u in manifest.units if u.kind not in ("layer", "expert", *RESIDENT_KINDS)), key=lambda u: u.tensor_bytes):
        place(u.name)
    layers = manifest.layers
    n = len(layers)
    sizes = [u.tensor_bytes for u in layers]
    layer_bytes = max(sizes, default=0)
    # The most layers that fit by their own sizes (a GGUF mixes block types, so its layers differ): a set whose
    # layers sum to the budget stays whole on the device even where the largest layer times N would not fit.
    fit_device = next(k for k in range(n, -1, -1) if _kept_bytes(sizes, set(spaced(n, n - k))) <= max(0, budget["device"]))
    streamed = set(spaced(n, n - fit_device))
    streamed_sorted = sorted(streamed)
    fit_host = next(k for k in range(len(streamed_sorted), -1, -1)
                    if sum(sizes[streamed_sorted[i]] for i in spaced(len(streamed_sorted), k)) <= max(0, budget["host"]))
    host_idx = {streamed_sorted[i] for i in spaced(len(streamed_sorted), fit_host)}
    for i, u in enumerate(layers):
        tier[u.name] = "host" if i in host_idx else "storage" if i in streamed else "device"
    budget["device"] -= sum(layers[i].tensor_bytes for i in range(n) if tier[layers[i].name] == "device")
    budget["host"] -= sum(layers[i].tensor_bytes for i in host_idx)
    cache = _place_experts(manifest, tier, budget)
    formula = (
        f"device layers = the most of N whose own bytes fit the device budget left = {fit_device}; "
        f"streamed every ~N/(N-k) = {n / max(1, n - fit_device):.1f} layers; host layers = {fit_host} of the streamed"
    )
    inputs = {
        "N": n, "layer_bytes": layer_bytes, "device_cache_bytes": device_cache_bytes, "host_cache_bytes": host_cache_bytes,
        "k": fit_device,
    }
    if manifest.experts:
        formula += ("; experts (after every layer's dense part): all on the device if they fit, else the device budget left "
                    "is an expert cache and the host budget left holds experts spread evenly")
    return ResidencyPlan(tier, formula, inputs, cache)


def _kept_bytes(sizes: list[int], streamed: set[int]) -> int:
    """Bytes of the layers that are not in STREAMED."""
    return sum(size for i, size in enumerate(sizes) if i not in streamed)


def _place_experts(manifest: Manifest, tier: dict[str, str], budget: dict[str, int]) -> int:
    """Experts go after the dense parts (every token needs those, an expert only when routed). Returns the cache bytes."""
    experts = manifest.experts
    if not experts:
        return 0
    total = sum(u.tensor_bytes for u in experts)
    if budget["device"] >= total:
        for u in experts:
            tier[u.name] = "device"
        return 0
    size = max(u.tensor_bytes for u in experts)
    fit_host = min(len(experts), max(0, budget["host"]) // size) if size else 0
    host = set(spaced(len(experts), fit_host))
    for i, u in enumerate(experts):
        tier[u.name] = "host" if i in host else "storage"
    return max(0, budget["device"])


def check_budget(resident_bytes: int, streaming_bytes: int, available: int | None) -> None:
    """A machine that cannot hold the units that must stay resident plus the streaming buffers cannot run the model."""
    if available is None:
        return
    minimum = resident_bytes + streaming_bytes
    if available < minimum:
        raise ParameterError(
            f"not enough memory to stream this model: need at least {format_bytes(minimum)} (resident minimum + two streaming "
            f"buffers of the largest unit), have {format_bytes(max(0, available))} after {{reserve_bytes}} and {{kv_cache_bytes}}; "
            "lower them or free memory", "reserve_bytes", "kv_cache_bytes",
        )
