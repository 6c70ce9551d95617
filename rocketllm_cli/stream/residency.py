"""Residency plan: which units live on the device, which in the host cache, which stream from storage.

Units that are not layers (embeddings, norm, head, extras) are placed first:
they are needed every token and are few. Then as many layers as fit stay resident,
and the streamed ones are spaced evenly through the stack, so each streamed layer
has the compute time of the resident layers before it to arrive.

On a CPU an input embedding table of its own (not tied to the head) is looked up by rows: streamed, a token reads a
few rows of it (stream/rows.py), so it is placed after the layers, with what they leave. A unit is placed by the
bytes it holds resident: its float tensors converted to the compute dtype where they are stored in another.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from math import ceil

from ..checkpoint.manifest import Manifest
from ..checkpoint.units import is_lookup_table
from ..errors import ParameterError
from ..sizes import format_bytes
from ..tiers import RESIDENT_KINDS, TIERS

_FLOAT_ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2}  # safetensors names of the float dtypes a unit may hold


@dataclass
class ResidencyPlan:
    """Which tier serves each unit (device, host or storage), with the formula and inputs that placed them.

    What make_plan decided from the two cache budgets; the weight store loads by it and `--stats` prints it
    (describe)."""

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
            moe = (
                f"; experts: {by['device']} device, {by['host']} host, {by['storage']} storage of {len(experts)}, "
                f"expert cache {format_bytes(self.expert_cache_bytes)}"
            )
        return f"residency: {counts}; layers [{strip}] (D device, H host cache, S storage){moe}; {self.formula}"

    def to_dict(self) -> dict:
        return {
            "tier": self.tier,
            "formula": self.formula,
            "inputs": self.inputs,
            "expert_cache_bytes": self.expert_cache_bytes,
        }


def spaced(n: int, k: int) -> list[int]:
    """k indices spread evenly over range(n): the i-th at floor((i + 0.5) * n / k)."""
    return [int((i + 0.5) * n / k) for i in range(k)] if k > 0 else []


def row_tables(manifest: Manifest, device: str) -> set[str]:
    """Units a CPU serves by rows when they stream: input embedding tables not tied to an output head."""
    if device != "cpu":
        return set()
    return {u.name for u in manifest.units if is_lookup_table(u.kind, [t.name for t in u.tensors], manifest.aliases)}


def resident_bytes(unit, compute_itemsize: int | None) -> int:
    """What UNIT holds once resident: its float tensors in the compute dtype (of COMPUTE_ITEMSIZE bytes; None: as
    stored)."""
    if not compute_itemsize:
        return unit.tensor_bytes
    return sum(
        t.nbytes * compute_itemsize // _FLOAT_ITEMSIZE[t.dtype] if t.dtype in _FLOAT_ITEMSIZE else t.nbytes
        for t in unit.tensors
    )


def make_plan(
    manifest: Manifest,
    device_cache_bytes: int,
    host_cache_bytes: int,
    *,
    device: str = "",
    compute_itemsize: int | None = None,
) -> ResidencyPlan:
    """Place every unit of MANIFEST within the device and host budgets (bytes); what fits neither streams from storage.

    Units hooked on the whole model and vision towers always on the device, then the other non-layer units, then as many
    layers as fit,
    the streamed ones spread evenly through the stack; a MoE model's experts last: all on the device if they fit,
    else the device budget left over is their cache (expert_cache_bytes). DEVICE "cpu": an embedding table looked up
    by rows goes after the layers (row_tables). COMPUTE_ITEMSIZE: the compute dtype's bytes, which a unit's float
    tensors take on the device (resident_bytes); None counts every unit as stored."""
    units = {u.name: u for u in manifest.units}
    tier: dict[str, str] = {}
    budget = {"device": device_cache_bytes, "host": host_cache_bytes}
    by_rows = row_tables(manifest, device)

    def place(name: str, order=("device", "host", "storage")) -> None:
        size = units[name].tensor_bytes
        for t in order:
            if t == "device":  # resident, its float tensors are in the compute dtype
                if budget[t] >= resident_bytes(units[name], compute_itemsize):
                    budget[t] -= resident_bytes(units[name], compute_itemsize)
                    tier[name] = t
                    return
                continue
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
            budget["device"] -= resident_bytes(u, compute_itemsize)
    for u in sorted(
        (u for u in manifest.units if u.kind not in ("layer", "expert", *RESIDENT_KINDS) and u.name not in by_rows),
        key=lambda u: u.tensor_bytes,
    ):
        place(u.name)
    layers = manifest.layers
    n = len(layers)
    sizes = [resident_bytes(u, compute_itemsize) for u in layers]
    layer_bytes = max(sizes, default=0)
    # The most layers that fit by their own sizes (a GGUF mixes block types, so its layers differ): a set whose
    # layers sum to the budget stays whole on the device even where the largest layer times N would not fit.
    fit_device = next(
        k for k in range(n, -1, -1) if _kept_bytes(sizes, set(spaced(n, n - k))) <= max(0, budget["device"])
    )
    streamed = set(spaced(n, n - fit_device))
    streamed_sorted = sorted(streamed)
    host_sizes = [u.tensor_bytes for u in layers]  # the host tier holds the files as stored
    fit_host = next(
        k
        for k in range(len(streamed_sorted), -1, -1)
        if sum(host_sizes[streamed_sorted[i]] for i in spaced(len(streamed_sorted), k)) <= max(0, budget["host"])
    )
    host_idx = {streamed_sorted[i] for i in spaced(len(streamed_sorted), fit_host)}
    for i, u in enumerate(layers):
        tier[u.name] = "host" if i in host_idx else "storage" if i in streamed else "device"
    budget["device"] -= sum(sizes[i] for i in range(n) if tier[layers[i].name] == "device")
    budget["host"] -= sum(host_sizes[i] for i in host_idx)
    for name in sorted(by_rows, key=lambda n: units[n].tensor_bytes):  # a token reads a few rows of it: what is left
        place(name)
    cache = _place_experts(manifest, tier, budget)
    formula = (
        f"device layers = the most of N whose own bytes fit the device budget left = {fit_device}; "
        f"streamed every ~N/(N-k) = {n / max(1, n - fit_device):.1f} layers; host layers = {fit_host} of the streamed"
    )
    inputs = {
        "N": n,
        "layer_bytes": layer_bytes,
        "device_cache_bytes": device_cache_bytes,
        "host_cache_bytes": host_cache_bytes,
        "k": fit_device,
    }
    if by_rows:
        formula += f"; {', '.join(sorted(by_rows))} (looked up by rows) after the layers"
    if manifest.experts:
        formula += (
            "; experts (after every layer's dense part): all on the device if they fit, else the device budget left is "
            "an expert cache and the host budget left holds experts spread evenly"
        )
    return ResidencyPlan(tier, formula, inputs, cache)


def _kept_bytes(sizes: list[int], streamed: set[int]) -> int:
    """Bytes of the layers that are not in STREAMED."""
    return sum(size for i, size in enumerate(sizes) if i not in streamed)


def _place_experts(manifest: Manifest, tier: dict[str, str], budget: dict[str, int]) -> int:
    """Experts go after the dense parts (every token needs those, an expert only when routed). Returns the cache
    bytes."""
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


def check_floor(profile, floor, reserve_given: bool = False) -> None:
    """Refuse, in one line and before anything loads, a memory that cannot hold what these settings need at the
    least (FLOOR: profiles/knobs/memory.py memory_floor, a Derivation). The line gives the floor and its parts,
    what this process has, and what to do; a memory cgroup's limit to raise is worked out with the reserve that
    grows with it (unless RESERVE_GIVEN: set by hand)."""
    from ..profiles.knobs.derivation import CGROUP_RESERVE_FRACTION
    from ..profiles.knobs.expression import evaluate

    inputs = floor.inputs
    need = int(evaluate(floor.formula, inputs))
    own = int(inputs.get("process_rss_bytes", 0))  # memory_available excludes what this process holds already
    have = own + max(0, int(inputs["memory_available"]))
    if have >= need:
        return
    runtime = own + inputs.get("runtime_bytes", 0)
    reserve, resident = inputs["reserve_bytes"], inputs["resident_bytes"]
    buffers = 2 * inputs["layer_bytes"] + max(0, inputs["largest_unit_bytes"] - inputs["layer_bytes"])
    context = need - runtime - reserve - resident - buffers
    what = (
        f"a context of {min(inputs['floor_tokens'], inputs['max_positions'])} tokens"
        if "floor_tokens" in inputs
        else "the KV cache"
    )
    parts = [
        f"runtime {format_bytes(runtime)}" if "runtime_bytes" in inputs else "",
        f"streaming buffers {format_bytes(buffers)}",
        f"{what} {format_bytes(context)}",
        f"resident units {format_bytes(resident)}" if resident else "",
        f"reserve {format_bytes(reserve)}",
    ]
    needs = f"need at least {format_bytes(need)} ({', '.join(p for p in parts if p)})"
    if profile.compute_device == "cpu" and profile.ram_bound == "cgroup":
        # In the limit's terms: raising it by L frees L more, and takes a tenth of L more into the reserve (unless it
        # is given). The process's own figures count the pages it maps, which the group may not be charged for.
        fraction = 0.0 if reserve_given else CGROUP_RESERVE_FRACTION
        limit = format_bytes(profile.ram_total + ceil((need - have) / (1 - fraction)))
        message = (
            f"not enough memory to run this model: it needs a memory limit of at least {limit}, this one is "
            f"{format_bytes(profile.ram_total)}: the process would {needs} and {format_bytes(have)} is free to it; "
            f"raise the limit to {limit} or more, or lower {{reserve_bytes}}"
        )
    else:
        where, todo = (
            ("free", "free memory or run it on a machine with more")
            if profile.compute_device == "cpu"
            else (f"free on {profile.compute_device}", "free device memory or use a larger device")
        )
        message = (
            f"not enough memory to run this model: {needs}, have {format_bytes(have)} {where}; {todo}, or lower "
            f"{{reserve_bytes}}"
        )
    raise ParameterError(message, "reserve_bytes")
