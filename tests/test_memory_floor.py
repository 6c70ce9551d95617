"""What the process holds beside the weights is counted, and a memory below what the settings need is refused in one
line.

The runtime (measured once per machine, less what this process holds already), the activations of a pass per token
of context, the streaming buffers and the KV cache all come out of the budgets the weights get; the floor is their
least, and `check_floor` refuses a memory below it before any weight is read, saying the floor, what there is and
what to do. Synthetic profiles and facts only: no model loads here except the last test's tiny one.
"""

from __future__ import annotations

import os

import pytest
from test_knobs import GiB, MiB, assert_recomputes, synthetic

from rocketllm_cli.checkpoint.manifest import Manifest
from rocketllm_cli.checkpoint.unitrecords import TensorRecord, UnitRecord
from rocketllm_cli.errors import ParameterError
from rocketllm_cli.profiles import Measurement, ModelFacts, resolve_knobs
from rocketllm_cli.profiles.knobs.derivation import FLOOR_CONTEXT, MIN_CONTEXT
from rocketllm_cli.profiles.knobs.expression import evaluate
from rocketllm_cli.profiles.knobs.memory import memory_floor
from rocketllm_cli.profiles.knobs.shape import PassShape, pass_shape
from rocketllm_cli.profiles.probe.runtime import process_memory
from rocketllm_cli.stream.residency import check_floor, make_plan, resident_bytes, row_tables

RUNTIME = 300 * MiB
# The random 2.5 B Llama of the larger-than-RAM runs: 32 layers of 37.28 MiB (Q4_0 blocks), a bf16 embedding of
# 240 MiB looked up by rows, a Q4_0 head of 67.5 MiB; fp32 K and V of 8 heads of 80 per layer; hidden 2560, FFN 6912.
LAYER, EMBED, HEAD = 39_086_080, 251_658_240, 70_778_880
SHAPE = PassShape(hidden=2560, intermediate=6912)
FACTS = ModelFacts(
    "rand2.5b",
    32 * LAYER + EMBED + HEAD + 10_240,
    32,
    LAYER,
    EMBED,
    EMBED + HEAD + 10_240,
    163_840,
    2048,
    "bf16",
    kv_values_per_token=40_960,
    kv_growing_layers=32,
    kv_head_dim=80,
)


def capped(limit: int = int(1.2 * GiB), held: int = 200 * MiB, runtime: int | None = RUNTIME):
    """A CPU inside a memory cgroup of LIMIT whose process holds HELD already, the runtime measured at RUNTIME."""
    profile = synthetic(ram_total=limit, ram_available=limit - held)
    profile.ram_bound, profile.process_rss = "cgroup", held
    profile.capabilities.pop("compute_dtype")  # fp32, as a CPU without native bf16 computes
    if runtime is not None:
        profile.measurements["runtime_rss"] = Measurement("runtime_rss", float(runtime), "synthetic", unit="B")
    return profile


def knobs_of(profile, facts=FACTS, shape=SHAPE, run_tokens=None, **kwargs):
    return resolve_knobs(profile, facts, kwargs=kwargs, env={}, run_tokens=run_tokens, shape=shape)


# -- the runtime --------------------------------------------------------------------------------------------------


def test_runtime_is_what_the_measured_runtime_adds_to_this_process():
    knob = knobs_of(capped(held=200 * MiB))["runtime_bytes"]
    assert knob.value == RUNTIME - 200 * MiB and knob.source == "measured"
    assert evaluate(knob.formula, knob.inputs) == knob.value
    # imported already: memory_available excludes it
    assert knobs_of(capped(held=400 * MiB)).value("runtime_bytes") == 0
    unmeasured = knobs_of(capped(runtime=None))["runtime_bytes"]
    assert unmeasured.value == 0 and unmeasured.source == "default" and "profile --refresh" in unmeasured.note


def test_every_budget_subtracts_the_runtime():
    with_runtime, without = knobs_of(capped()), knobs_of(capped(runtime=None))
    assert_recomputes(with_runtime)
    added = with_runtime.value("runtime_bytes")
    total = lambda k: sum(k.value(n) for n in ("device_cache_bytes", "host_cache_bytes", "kv_cache_bytes"))  # noqa: E731
    assert total(without) - total(with_runtime) >= added > 0
    for name in ("device_cache_bytes", "host_cache_bytes", "max_context"):
        assert "runtime_bytes" in with_runtime[name].formula and with_runtime[name].inputs["runtime_bytes"] == added


def test_a_gpus_budgets_leave_the_runtime_to_host_ram():
    profile = synthetic("cuda:0")
    profile.measurements["runtime_rss"] = Measurement("runtime_rss", float(RUNTIME), "synthetic", unit="B")
    knobs = knobs_of(profile)
    assert (
        "runtime_bytes" not in knobs["device_cache_bytes"].inputs and "runtime_bytes" not in knobs["max_context"].inputs
    )
    assert knobs["host_cache_bytes"].inputs["runtime_bytes"] == knobs.value("runtime_bytes") > 0


def test_process_memory_reads_what_the_process_holds_and_maps(tmp_path):
    status = tmp_path / "status"
    status.write_text(
        "Name:\tpython\nVmRSS:\t 900 kB\nRssAnon:\t 600 kB\nRssFile:\t 200 kB\nRssShmem:\t 100 kB\nVmSwap:\t 50 kB\n"
    )
    assert process_memory(str(status)) == 900 * 1024  # its libraries' pages too: evicted, they are read back
    assert process_memory(str(tmp_path / "missing")) == 0
    if os.path.exists("/proc/self/status"):
        assert process_memory() > 0


# -- activations and the context ------------------------------------------------------------------------------------


def test_pass_shape_from_a_config_counts_a_mixture_of_experts_routed_width():
    assert pass_shape({"hidden_size": 2560, "intermediate_size": 6912}) == SHAPE
    assert SHAPE.activation_bytes_per_token == (4 * 6912 + 6 * 2560) * 4
    moe = pass_shape(
        {"hidden_size": 1024, "intermediate_size": 512, "moe_intermediate_size": 768, "num_experts_per_tok": 8}
    )
    assert moe.intermediate == 8 * 768
    assert pass_shape({"num_attention_heads": 4}) is None


def test_a_one_shot_runs_context_holds_its_tokens_kv_and_activations():
    knobs = knobs_of(capped(), run_tokens=55)
    per_token = 40_960 * (4 + 4 / 32) + SHAPE.activation_bytes_per_token
    assert knobs.value("kv_cache_bytes") == int(-(-(56 * per_token) // 1))
    assert 55 <= knobs.value("max_context") and evaluate(
        knobs["max_context"].formula, knobs["max_context"].inputs
    ) == knobs.value("max_context")


def test_a_servers_context_shrinks_under_a_small_limit_and_keeps_2048_tokens_where_memory_allows():
    per_token = 163_840 + SHAPE.activation_bytes_per_token
    small = knobs_of(capped())
    tokens = small.value("kv_cache_bytes") // per_token
    assert FLOOR_CONTEXT <= tokens < MIN_CONTEXT
    assert small.value("device_cache_bytes") > 8 * LAYER  # the weights keep a share of the memory
    roomy = synthetic(ram_total=64 * GiB, ram_available=60 * GiB)
    roomy.capabilities.pop("compute_dtype")
    roomy = knobs_of(roomy)
    assert roomy.value("kv_cache_bytes") == MIN_CONTEXT * per_token and roomy.value("max_context") == 2048
    assert knobs_of(capped(), shape=None).value("kv_cache_bytes") % 163_840 == 0  # shape unknown: K and V alone


def test_the_budgets_and_the_context_never_add_up_to_more_than_the_memory():
    for limit in (1 * GiB, int(1.2 * GiB), int(1.6 * GiB), 4 * GiB):
        for run_tokens in (None, 55):
            profile = capped(limit)
            v = knobs_of(profile, run_tokens=run_tokens).values_dict()
            buffers = (v["prefetch_depth"] + 2) * LAYER
            held = v["reserve_bytes"] + v["runtime_bytes"] + v["device_cache_bytes"] + v["host_cache_bytes"] + buffers
            context = v["max_context"] * (40_960 * (4 + 4 / 32) + SHAPE.activation_bytes_per_token)
            assert held + context <= profile.ram_available, (limit, run_tokens)


# -- the floor and its refusal --------------------------------------------------------------------------------------


def test_the_floor_is_the_runtime_reserve_least_buffers_and_least_context():
    profile = capped()
    floor = memory_floor(profile, FACTS, knobs_of(profile), shape=SHAPE)
    v = knobs_of(profile).values_dict()
    context = FLOOR_CONTEXT * (40_960 * (4 + 4 / 32) + SHAPE.activation_bytes_per_token)
    expected = max(RUNTIME, 200 * MiB) + v["reserve_bytes"] + 2 * LAYER + (EMBED - LAYER) + context
    assert evaluate(floor.formula, floor.inputs) == pytest.approx(expected, abs=1)
    one_shot = memory_floor(profile, FACTS, knobs_of(profile, run_tokens=40), run_tokens=40, shape=SHAPE)
    assert evaluate(one_shot.formula, one_shot.inputs) < evaluate(floor.formula, floor.inputs)  # 40 tokens, not 256
    assert "this run's own tokens" in one_shot.note
    check_floor(profile, floor)  # 1.2 GiB holds it: nothing raised


def test_a_limit_below_the_floor_is_refused_in_one_line_naming_the_floor_the_limit_and_what_to_do():
    profile = capped(600 * MiB, held=250 * MiB)
    knobs = knobs_of(profile)
    floor = memory_floor(profile, FACTS, knobs, shape=SHAPE)
    need = evaluate(floor.formula, floor.inputs)
    with pytest.raises(ParameterError) as caught:
        check_floor(profile, floor)
    message = str(caught.value)
    assert "\n" not in message and message.startswith(
        "not enough memory to run this model: it needs a memory limit of at least "
    )
    assert ", this one is 600.00 MiB: the process would need at least " in message
    assert "runtime 300.00 MiB" in message and "streaming buffers" in message and "a context of 256 tokens" in message
    assert ") and 600.00 MiB is free to it; raise the limit to " in message and message.endswith(
        " or more, or lower reserve_bytes"
    )
    # the limit it names holds the floor, with the reserve that grows with it
    named = message.split("raise the limit to ")[1].split(" or more")[0]
    from rocketllm_cli.sizes import parse_bytes

    raised = capped(parse_bytes(named.replace(" ", "")) + MiB, held=250 * MiB)
    check_floor(raised, memory_floor(raised, FACTS, knobs_of(raised), shape=SHAPE))
    assert need > 600 * MiB


def test_a_machine_without_a_cgroup_is_told_to_free_memory():
    profile = synthetic(ram_total=8 * GiB, ram_available=300 * MiB)
    profile.measurements["runtime_rss"] = Measurement("runtime_rss", float(RUNTIME), "synthetic", unit="B")
    with pytest.raises(ParameterError) as caught:
        check_floor(profile, memory_floor(profile, FACTS, knobs_of(profile), shape=SHAPE))
    assert "free; free memory or run it on a machine with more" in str(caught.value)


# -- the plan: held bytes, tables looked up by rows -----------------------------------------------------------------


def _unit(name: str, kind: str, nbytes: int, dtype: str = "U8", index: int = -1) -> UnitRecord:
    tensor = TensorRecord(f"{name}.weight", f"{name}.weight", dtype, [nbytes], 4096, nbytes)
    return UnitRecord(name, kind, name, f"{name}.safetensors", nbytes + 4096, "0" * 64, [tensor], index)


def _manifest(tied: bool = False) -> Manifest:
    units = [
        _unit("embed", "embed", 240 * MiB, "BF16"),
        *(_unit(f"layer.{i:03d}", "layer", 37 * MiB, index=i) for i in range(8)),
        _unit("norm", "norm", 10_240, "F32"),
        _unit("lm_head", "lm_head", 68 * MiB),
    ]
    aliases = {"lm_head.weight": "embed.weight"} if tied else {}
    return Manifest(
        source={"name": "t"},
        model_type="llama",
        architecture="LlamaForCausalLM",
        dtype="bf16",
        stack="model.layers",
        units=units,
        aliases=aliases,
    )


def test_a_unit_is_placed_by_what_it_holds_resident_in_the_compute_dtype():
    embed = _manifest().units[0]
    assert (
        resident_bytes(embed, None) == 240 * MiB
        and resident_bytes(embed, 4) == 480 * MiB
        and resident_bytes(embed, 2) == 240 * MiB
    )
    layer = _manifest().units[1]
    assert resident_bytes(layer, 4) == layer.tensor_bytes  # packed bytes are not converted


def test_an_embedding_looked_up_by_rows_goes_after_the_layers_on_a_cpu():
    manifest = _manifest()
    assert row_tables(manifest, "cpu") == {"embed"} and row_tables(manifest, "cuda") == set()
    assert row_tables(_manifest(tied=True), "cpu") == set()  # the head reads it whole every token
    budget = 68 * MiB + 10_240 + 8 * 37 * MiB  # the head, the norm and every layer; not the table too
    plan = make_plan(manifest, budget, 0, device="cpu", compute_itemsize=4)
    assert plan.tier["embed"] == "storage" and all(plan.tier[f"layer.{i:03d}"] == "device" for i in range(8))
    assert "embed (looked up by rows) after the layers" in plan.formula
    first = make_plan(manifest, budget, 0)  # as before: the table first, two layers streamed
    assert first.tier["embed"] == "device" and sum(t == "storage" for t in first.tier.values()) > 0
    converted = make_plan(manifest, budget + 480 * MiB, 0, device="cpu", compute_itemsize=4)
    assert converted.tier["embed"] == "device"  # room left for it in fp32: kept
    short = make_plan(manifest, budget + 479 * MiB, 0, device="cpu", compute_itemsize=4)
    assert short.tier["embed"] == "storage"  # 240 MiB stored, but 480 in fp32


def test_a_table_looked_up_by_rows_is_never_read_ahead_nor_given_a_buffer(tiny_factory):
    """The tiny Llama with its own head: its embedding streams by rows, so the store's schedule and buffers leave it
    out."""
    import torch

    from rocketllm_cli.stream.engineconfig import EngineConfig
    from rocketllm_cli.stream.model import StreamingModel

    path = tiny_factory("llama", tie_word_embeddings=False)
    from rocketllm_cli.shard.sharder import shard

    manifest, directory, _ = shard(path, log=lambda m: None)
    config = EngineConfig(compute_dtype="fp32", device_cache_bytes=0, host_cache_bytes=0, prefetch_depth=2)
    with StreamingModel(directory, config) as model, torch.inference_mode():
        assert "embed" not in model.store.schedule and "lm_head" in model.store.schedule
        head = next(u for u in manifest.units if u.name == "lm_head").bytes
        assert model.store.large_bytes in (0, -(-head // 4096) * 4096)
        model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=2, do_sample=False, pad_token_id=0)
        assert model.ledger.reads.get("embed", 0) == 0  # rows only, never the whole table


def test_the_heap_gives_large_blocks_back_once_and_leaves_a_users_setting(monkeypatch):
    from rocketllm_cli import heap

    monkeypatch.setattr(heap, "_done", None)
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")
    assert "set by the user" in heap.return_large_blocks()
    monkeypatch.setattr(heap, "_done", None)
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_")
    said = heap.return_large_blocks()
    assert said == heap.return_large_blocks() and said  # decided once per process


def test_a_vocabularys_logits_stay_on_the_heap_between_decode_steps():
    """A decode step's logits (Gemma 3: 262,144 fp32, 1 MiB) were each a fresh mapping whose pages faulted in anew;
    with the threshold raised to twice the block, taking one again faults nothing in."""
    import subprocess
    import sys

    code = """if True:
        import resource, torch
        from rocketllm_cli import heap
        def faults(n=50):
            faults_at_start = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            for _ in range(n):
                torch.empty(262144).fill_(1.0)
            return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults_at_start
        heap.return_large_blocks()
        faults(5)
        print(faults())
        print(heap.return_large_blocks(4 * 262144), heap.return_large_blocks(4 * 1000))
        faults(5)
        print(faults())
    """
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_MMAP_THRESHOLD_"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True).stdout
    mapped, said, kept = out.splitlines()
    assert said.count("blocks of 2 MiB and more") == 2, said  # raised for the vocabulary, not lowered after
    assert int(mapped) >= 50 * 200, mapped  # at 1 MiB each step mapped its 256 pages afresh
    assert int(kept) < int(mapped) // 4, (mapped, kept)  # at 2 MiB the block stays on the heap (a trimmed top aside)


def test_the_runtime_measured_before_a_first_run_shards_is_collected_once(monkeypatch):
    """start() measures this process after the runtime's imports; measure_runtime() hands that out once, then
    measures a fresh interpreter: both the memory of the same imports."""
    from rocketllm_cli.profiles.probe import runtime

    monkeypatch.setattr(runtime, "_taken", None)
    runtime.start()
    taken = runtime._taken
    assert taken is not None and taken.value == pytest.approx(process_memory(), rel=0.05)
    assert runtime.measure_runtime() is taken and runtime._taken is None
    fresh = runtime.measure_runtime()  # nothing taken here: a fresh interpreter
    assert fresh.available and fresh.value > 50 * 2**20 and fresh.method == taken.method == runtime.METHOD, fresh
