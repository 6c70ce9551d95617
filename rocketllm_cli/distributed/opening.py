"""Opening a pipeline: every rank joins the one process group, the ranks check they run the same versions on the
same shard set, measure their links, share the cores and memory of a host they share, and each opens its own stage of
the plan rank 0 makes (stages.py runs it). doctor under torchrun plans from the model's facts alone."""

from __future__ import annotations

import dataclasses
import os
import time

import torch

from ..checkpoint.manifest import Manifest
from ..errors import RocketError
from .group import StageGroup
from .torchrun import StageError, memory_cgroup
from .stages import FIRST_ONLY_KINDS, Stage, cut_stack, local_manifest

_GROUP: StageGroup | None = None


# -- opening this rank's share
# ------------------------------------------------------------------------------------------
def _versions() -> dict:
    import transformers

    from .. import __version__

    return {
        "rocketllm": __version__,
        "torch": torch.__version__.split("+")[0],
        "transformers": transformers.__version__,
    }


def _identity(manifest: Manifest) -> dict:
    """What must be equal on every rank: the set's content (each unit's sha256, so a copy sharded on another host from
    its own copy of the checkpoint is the same set), its dtype and packing, and the versions that compute on it."""
    import hashlib

    content = hashlib.sha256("\n".join(f"{u.name} {u.bytes} {u.sha256}" for u in manifest.units).encode()).hexdigest()[
        :16
    ]
    return {
        "fingerprint": content,
        "set": manifest.key,
        "layers": len(manifest.layers),
        "units": len(manifest.units),
        **_versions(),
    }


def _check_same(group: StageGroup, ids: list[dict]) -> None:
    first = ids[0]
    for r, other in enumerate(ids[1:], start=1):
        for key in ("fingerprint", "set", "layers", "units", "rocketllm", "torch", "transformers"):
            if other[key] != first[key]:
                what = "shard set" if key in ("fingerprint", "set", "layers", "units") else f"{key} version"
                raise StageError(
                    f"{group.name(r)} has another {what} than rank 0 ({key} {other[key]} against "
                    f"{first[key]}): every "
                    "rank must run the same set (a shared directory, or a copy of it) with the same "
                    "rocketllm, torch and "
                    "transformers"
                )


def _refuse_together(group: StageGroup, err: RocketError) -> None:
    """A refusal every rank reached from the same exchanged facts: all leave the group together (a barrier, then each
    destroys its end), so rank 0's exit does not tell ranks that are already gone, and rank 0 alone says why."""
    err.rank0_reports = True
    group.close(orderly=True)
    raise err


def probe_links(group: StageGroup, hidden_bytes: int, rounds: int = 20) -> tuple[float, float]:
    """(one-way latency s, bytes/s) from this rank to the next in the ring: ping-pongs of one hidden state, then one
    4 MiB message; every pair in turn so no two probes share the wire."""
    import torch.distributed as dist

    device = group.device
    small = torch.zeros(max(1, hidden_bytes), dtype=torch.uint8, device=device)
    big = torch.zeros(4 << 20, dtype=torch.uint8, device=device)
    ack = torch.zeros(1, dtype=torch.uint8, device=device)
    mine = (0.0, 0.0)
    for r in range(group.world):
        peer = (r + 1) % group.world
        if group.rank == r:
            times = []
            for _ in range(rounds):
                t = time.perf_counter()
                dist.send(small, peer)
                dist.recv(small, peer)
                times.append(time.perf_counter() - t)
            latency = sorted(times)[len(times) // 2] / 2
            t = time.perf_counter()
            dist.send(big, peer)
            dist.recv(ack, peer)
            seconds = max(1e-9, time.perf_counter() - t - 2 * latency)
            mine = (latency, big.numel() / seconds)
        elif group.rank == peer:
            for _ in range(rounds):
                dist.recv(small, r)
                dist.send(small, r)
            dist.recv(big, r)
            dist.send(ack, r)
        dist.barrier()
    return mine


def _rank_facts(group: StageGroup, profile, knobs, facts, link: tuple[float, float]):
    from ..profiles.cost import tier_bandwidth
    from .stageplan import RankFacts

    compute, how = profile.matvec_bps(), "decode-shaped matvec, measured"
    if facts.decode_compute and facts.total_bytes:
        compute, how = (
            facts.bytes_per_token / float(facts.decode_compute["seconds"]),
            ("this set's resident decode, measured by bench"),
        )
    elif not compute:
        compute, how = profile.device_memory_bps, "device memory copy"
    return RankFacts(
        group.rank,
        group.launch.host,
        int(knobs.value("device_cache_bytes")),
        int(knobs.value("host_cache_bytes")),
        compute,
        tier_bandwidth(profile, "host")[0],
        tier_bandwidth(profile, "storage")[0],
        how,
        link[0],
        link[1],
        profile.compute_device,
    )


def stage_inputs(manifest: Manifest, facts, hidden_bytes: int) -> dict:
    """What the planner needs of the model: per-layer bytes (experts included) and per-token bytes, rank 0's own
    units."""
    n = len(manifest.layers)
    dense = [0] * n
    experts = [0] * n
    for u in manifest.units:
        if u.kind == "layer":
            dense[u.index] += u.tensor_bytes
        elif u.kind == "expert":
            experts[u.index] += u.tensor_bytes
    routed = sum(experts)
    share = 1.0
    if routed and facts.active_bytes is not None:
        share = max(0.0, min(1.0, (facts.active_bytes - (facts.total_bytes - routed)) / routed))
    first = sum(u.tensor_bytes for u in manifest.units if u.kind not in ("layer", "expert"))
    other = sum(u.tensor_bytes for u in manifest.units if u.kind not in ("layer", "expert", *FIRST_ONLY_KINDS))
    return {
        "layer_bytes": [d + e for d, e in zip(dense, experts)],
        "layer_token_bytes": [d + int(e * share) for d, e in zip(dense, experts)],
        "first_bytes": first,
        "other_bytes": other,
        "hidden_bytes": hidden_bytes,
    }


def open_stages(
    launch, directory, manifest: Manifest, profile, knobs, facts, engine_config, log=None, overrides: dict | None = None
):
    """This rank's StreamingModel of the pipeline LAUNCH describes: the group joined (formed once per process), rank 0's
    load announced (OVERRIDES: the knob keywords it was called with, which the other ranks load with too), the set and
    versions compared, the links probed, the plan made (on rank 0, from every rank's measurements) and this rank's share
    opened."""
    from transformers import AutoConfig

    from ..dtypes import ITEMSIZE
    from ..stream.model import StreamingModel
    from .stageplan import describe_rank, plan_stages

    log = log or (lambda m: None)
    if manifest.vision:
        raise StageError(
            "a vision-language set runs in one process: its tower and the picture's tokens live on rank 0 only; launch "
            "it without torchrun"
        )
    group = group_for(launch, int(knobs.value("stage_timeout_s")), profile.compute_device)
    if group.rank == 0:
        # the other ranks wait in run_later_stage
        group.broadcast({"op": "load", "overrides": _portable(overrides or {})})
    try:
        _check_same(group, group.exchange(_identity(manifest)))
    except StageError as e:
        _refuse_together(group, e)
    text = AutoConfig.from_pretrained(directory).get_text_config(decoder=True)
    hidden_bytes = int(text.hidden_size) * ITEMSIZE[engine_config.compute_dtype]
    link = probe_links(group, hidden_bytes)
    ranks = group.exchange(_rank_facts(group, profile, knobs, facts, link))
    plan = None
    if group.rank == 0:
        try:
            plan = plan_stages(
                ranks, override=str(knobs.value("stages")), **stage_inputs(manifest, facts, hidden_bytes)
            )
        except RocketError as e:  # a --stages that does not fit: every rank stops on it, rank 0 says it
            plan = e
    plan = group.broadcast(plan)
    if isinstance(plan, RocketError):
        _refuse_together(group, plan)
    if group.rank == 0:
        for f in ranks:
            log(describe_rank(f))
        log(f"{plan.describe()}; {plan.formula}")
    start, stop = plan.ranges[group.rank]
    if group.backend == "nccl":  # several ranks on one host: each on its own GPU
        engine_config = dataclasses.replace(engine_config, device=str(group.device))
    streamed = StreamingModel(directory, engine_config, local_manifest(manifest, start, stop, group.rank == 0))
    try:
        base, first_layer, last_layer = cut_stack(streamed.model, manifest.stack, start, stop)
        streamed.stage = Stage(group, plan, streamed, base, first_layer, last_layer)
    except BaseException:
        streamed.close()
        raise
    group.exchange(None)  # every rank's share loaded before rank 0's first pass (else its wait counts as link time)
    return streamed


def share_cores(group: StageGroup, profile, log=None) -> None:
    """Ranks on one host computing on its CPU split its cores: each computes with cores // ranks threads, as torchrun's
    own default (OMP_NUM_THREADS=1 for several processes a node) has it. Otherwise the idle rank's OpenMP threads spin
    on the cores its partner needs (docs/DISTRIBUTED.md has the measurements). OMP_NUM_THREADS wins."""
    if profile.compute_device.startswith("cuda") or "OMP_NUM_THREADS" in os.environ:
        return
    here = sum(1 for host, _ in group.places if host == group.launch.host)
    if here <= 1:
        return
    threads = max(1, int(profile.cpu_cores or os.cpu_count() or 1) // here)
    if torch.get_num_threads() > threads:
        torch.set_num_threads(threads)
        if group.rank == 0 and log is not None:
            log(
                f"{here} ranks share this host's {profile.cpu_cores} cores: each computes with {threads} thread(s) "
                f"(OMP_NUM_THREADS overrides)"
            )


def shared_memory_profile(profile, group: StageGroup, log=None):
    """PROFILE with the memory it sees divided among the ranks of its host that draw on the same memory (the same host
    and memory cgroup, computing on the CPU), so the budgets derived from it add up to what the host has."""
    mine = (group.launch.host, memory_cgroup())
    sharing = sum(1 for other in group.places if other == mine) if not profile.compute_device.startswith("cuda") else 1
    if sharing <= 1:
        return profile
    if group.rank == 0 and log is not None:
        log(
            f"{sharing} ranks share this host's memory (the same memory cgroup): each derives its budgets from "
            f"1/{sharing} "
            "of the memory available (give each rank its own cgroup, or --device-cache-bytes, to size them otherwise)"
        )
    return dataclasses.replace(profile, ram_available=profile.ram_available // sharing)


def _portable(overrides: dict) -> dict:
    """Knob keywords as plain values every rank can parse (sizes and numbers as text)."""
    return {k: v if isinstance(v, (bool, int, float, str)) or v is None else str(v) for k, v in overrides.items()}


def join(launch, flags: dict | None = None) -> StageGroup:
    """Form the group at a command's start, on every rank alike, so no rank waits for another's sharding or
    measuring to join (those run after, while the heartbeats say every rank is alive)."""
    from ..profiles.knobs.running import DEFAULT_STAGE_TIMEOUT_S
    from ..profiles.knobs.table import KNOBS_BY_NAME

    flags = flags or {}
    spec = KNOBS_BY_NAME["stage_timeout_s"]
    raw = flags.get("stage_timeout_s") or os.environ.get(spec.env)
    timeout = (
        int(spec.parse(raw, spec.flag if flags.get("stage_timeout_s") else spec.env))
        if raw
        else DEFAULT_STAGE_TIMEOUT_S
    )
    return group_for(launch, timeout)


def group_for(launch, timeout_s: float, device: str = "cpu") -> StageGroup:
    """The process's one StageGroup, formed on first use; rank 0 tells the others to end when it exits (atexit)."""
    global _GROUP
    if _GROUP is None or _GROUP.closed:
        _GROUP = StageGroup(launch, timeout_s, device)
        if _GROUP.rank == 0:
            import atexit

            atexit.register(_GROUP.end)
    return _GROUP


def plan_for_doctor(launch, profile, facts, knobs, flags: dict | None = None) -> dict:
    """`doctor --model` under torchrun: every rank's measurements and links, and the plan rank 0 would make, from the
    model's facts alone (layers of equal size: no shard set is read). Returns the plan's document on every rank."""
    from ..dtypes import ITEMSIZE
    from ..profiles import resolve_knobs
    from .stageplan import describe_rank, plan_stages

    group = StageGroup(launch, int(knobs.value("stage_timeout_s")), profile.compute_device)
    try:
        shared = shared_memory_profile(profile, group)
        if shared is not profile:  # ranks on one host: each plans with its share of the memory
            profile, knobs = shared, resolve_knobs(shared, facts, flags=flags or {})
        # the hidden size from a layer's bytes (about 12 h^2 weights a layer), in the compute dtype: only the links use
        # it
        itemsize = ITEMSIZE.get(str(knobs.value("compute_dtype")), 2)
        per_weight = ITEMSIZE.get(facts.dtype, 2)
        hidden_bytes = int((max(1, facts.layer_bytes) / (12 * per_weight)) ** 0.5) * itemsize
        link = probe_links(group, hidden_bytes)
        ranks = group.exchange(_rank_facts(group, profile, knobs, facts, link))
        n = max(1, facts.num_layers)
        share = facts.bytes_per_token / facts.total_bytes if facts.total_bytes else 1.0
        layer = (facts.total_bytes - facts.non_layer_bytes) // n
        plan = plan_stages(
            ranks,
            [layer] * n,
            [int(layer * share)] * n,
            facts.non_layer_bytes,
            0,
            hidden_bytes,
            override=str(knobs.value("stages")),
        )
        done = {
            "plan": plan.to_dict(),
            "text": plan.describe(),
            "formula": plan.formula,
            "ranks": [describe_rank(f) for f in ranks],
            "hidden_bytes": hidden_bytes,
        }
        group.close(orderly=True)  # every rank got here: leave together
        return done
    finally:
        group.close()
