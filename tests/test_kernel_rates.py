"""The cost model's compute term for a GGUF set: each block product at the speed the native kernels measured for its
type and shape on this machine (profiles/probe/kernelrates.py), and per layer what bench measured beyond the products
for other sets here (profiles/probe/decodecompute.py layer_overhead): the accounting, on synthetic figures, and the
probe's own bookkeeping (measured once, kept, never measured for another machine's profile)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from rocketllm_cli.checkpoint.modelfacts import ModelFacts
from rocketllm_cli.profiles import HardwareProfile, project
from rocketllm_cli.profiles.probe import decodecompute, kernelrates
from rocketllm_cli.profiles.records import Capability, Measurement

MiB = 1024**2


def cpu_profile(fingerprint: str = "synthetic-kernels") -> HardwareProfile:
    found = {
        name: Measurement(name, bps, "synthetic", int(bps), 1.0)
        for name, bps in {
            "device_memory": 20e9,
            "page_cache_read": 10e9,
            "storage_read": 2e9,
            "matvec_fp32": 10e9,
            "matvec_bf16": 20e9,
        }.items()
    }
    return HardwareProfile(
        fingerprint,
        "cpu",
        2,
        16 << 30,
        12 << 30,
        measurements=found,
        capabilities={"compute_dtype": Capability("compute_dtype", "fp32", None, "synthetic")},
    )


def gguf_facts() -> ModelFacts:
    blocks = {"Q4_K": {"4096x4096": 90 * MiB}, "Q6_K": {"4096x14336": 10 * MiB}}  # 100 MiB of blocks
    return ModelFacts(
        "synthetic", 101 * MiB, 4, 25 * MiB, 25 * MiB, 1 * MiB, 1024, 4096, "fp32", gguf_blocks=True, block_bytes=blocks
    )


KERNELS = {
    "mode": "exact",
    "isa": "avx2",
    "threads": 2,
    "rates": {"Q4_K": {"4096x4096": 9e9}, "Q6_K": {"4096x14336": 5e9}},
}


def test_each_block_product_at_its_own_measured_speed_and_the_rest_at_the_matvec():
    profile, facts = cpu_profile(), replace(gguf_facts(), kernel_rates=KERNELS)
    p = project(profile, facts, {"device": facts.total_bytes})
    want = 90 * MiB / 9e9 + 10 * MiB / 5e9 + 1 * MiB / 10e9  # the 1 MiB of floats at the fp32 matvec
    assert p.compute_seconds == pytest.approx(want)
    assert "Q4_K 9.00 GB/s over 90.0 MiB" in p.compute_bandwidth and "the other 1.0 MiB" in p.compute_bandwidth
    # no set benched here yet: the layers' own work is missing from it, and the projection says it is a floor
    assert "not measured on this machine yet" in p.compute_bandwidth and "a floor" in p.compute_bandwidth
    # not measured: the matvec floor
    floor = project(profile, gguf_facts(), {"device": facts.total_bytes}).compute_seconds
    assert floor == pytest.approx(101 * MiB / 10e9)


def test_per_layer_work_measured_for_other_sets_is_added_per_layer():
    facts = replace(gguf_facts(), kernel_rates=KERNELS, layer_overhead={"seconds": 0.0005, "sets": ["a", "b"]})
    p = project(cpu_profile(), facts, {"device": facts.total_bytes})
    assert p.compute_seconds == pytest.approx(90 * MiB / 9e9 + 10 * MiB / 5e9 + 1 * MiB / 10e9 + 4 * 0.0005)
    assert "4 layers x 0.500 ms" in p.compute_bandwidth and "(a, b)" in p.compute_bandwidth
    assert "not measured on this machine yet" not in p.compute_bandwidth
    measured = replace(facts, decode_compute={"seconds": 0.042})  # the set's own decode, measured: it alone counts
    assert project(cpu_profile(), measured, {"device": facts.total_bytes}).compute_seconds == pytest.approx(0.042)


def test_a_mixture_of_experts_reads_its_active_share_of_each_product():
    facts = replace(gguf_facts(), active_bytes=int(101 * MiB / 2))
    shapes = kernelrates.block_shapes_of(facts)
    assert shapes["Q4_K"]["4096x4096"] == pytest.approx(45 * MiB, rel=1e-3)


def test_the_overhead_per_layer_is_the_median_of_what_bench_measured_beyond_the_floor(tmp_path, monkeypatch):
    monkeypatch.setenv("ROCKETLLM_CACHE", str(tmp_path))
    profile = cpu_profile()
    monkeypatch.setattr(decodecompute, "compute_floor", lambda p, f, dtype, kernel="exact": 0.010)
    for name, ms, layers, arch in (("a", 14.0, 8, "llama"), ("b", 30.0, 40, "llama"), ("c", 12.0, 2, "gemma3")):
        # (ms - 10) / layers: 0.5, 0.5, 1.0 ms
        manifest = type("M", (), {"units": [], "total_bytes": layers, "source": {"name": name}})()
        monkeypatch.setattr(decodecompute, "_key", lambda d, m, dtype, kernel="exact", n=name: f"{n}-{dtype}-{kernel}")
        decodecompute.record(
            profile,
            tmp_path / name,
            manifest,
            "fp32",
            {"median": ms, "p10": ms},
            2,
            replace(gguf_facts(), name=name, num_layers=layers, architecture=arch),
        )
    found = decodecompute.layer_overhead(profile, "fp32")
    assert found["seconds"] == pytest.approx(0.0005) and sorted(found["sets"]) == ["a", "b", "c"]
    assert found["architecture"] == "any"
    gemma = decodecompute.layer_overhead(profile, "fp32", "gemma3")  # its own architecture's layers, where measured
    assert gemma["seconds"] == pytest.approx(0.001) and gemma["sets"] == ["c"] and gemma["architecture"] == "gemma3"
    assert decodecompute.layer_overhead(profile, "fp32", "qwen3")["architecture"] == "any"  # none of it: every set
    assert decodecompute.layer_overhead(profile, "bf16") is None  # another compute dtype: no measurement stands in
    attached = decodecompute.with_layer_overhead(profile, gguf_facts(), "fp32")
    assert attached.layer_overhead["seconds"] == pytest.approx(0.0005)
    own = replace(gguf_facts(), decode_compute={"seconds": 0.02})
    assert decodecompute.with_layer_overhead(profile, own, "fp32") is own
    # a run on the int8 kernels is a figure of its own: it replaces none of the exact ones, nor stands in for them
    monkeypatch.setattr(decodecompute, "_key", lambda d, m, dtype, kernel="exact": f"a-{dtype}-{kernel}")
    manifest = type("M", (), {"units": [], "total_bytes": 8, "source": {"name": "a"}})()
    facts_a = replace(gguf_facts(), name="a", num_layers=8, architecture="llama")
    decodecompute.record(profile, tmp_path / "a", manifest, "fp32", {"median": 11.0, "p10": 11.0}, 2, facts_a, "int8")
    assert decodecompute.lookup(profile, tmp_path / "a", manifest, "fp32")["seconds"] == pytest.approx(0.014)
    assert decodecompute.lookup(profile, tmp_path / "a", manifest, "fp32", "int8")["seconds"] == pytest.approx(0.011)
    assert decodecompute.layer_overhead(profile, "fp32")["seconds"] == pytest.approx(0.0005)
    int8 = decodecompute.layer_overhead(profile, "fp32", kernel="int8")
    assert int8["seconds"] == pytest.approx(0.000125) and int8["sets"] == ["a"]


def test_rates_are_measured_once_and_kept_beside_the_profile(nk, tmp_path, monkeypatch):
    from rocketllm_cli.profiles.probe import machine
    from rocketllm_cli.profiles.probe.machine import fingerprint, fingerprint_facts

    monkeypatch.setenv("ROCKETLLM_CACHE", str(tmp_path))
    monkeypatch.setattr(kernelrates.KEPT, "memo", {})
    monkeypatch.setattr(machine, "others_cpu_share", lambda before, after: 0.0)  # an idle machine: kept
    profile = cpu_profile(fingerprint(fingerprint_facts()))  # this machine's
    blocks = {"Q8_0": {"256x512": 256 * 544}, "Q4_K": {"128x1024": 128 * 576}, "IQ2_XXS": {"64x256": 64 * 66}}
    found = kernelrates.rates(profile, blocks, "exact")
    assert found["isa"] == nk.isa and set(found["rates"]) == {"Q8_0", "Q4_K", "IQ2_XXS"}
    # a grid type has no kernel: it is timed on the torch decoder the engine then runs, far slower
    assert found["paths"] == {"Q8_0": "native", "Q4_K": "native", "IQ2_XXS": "torch decoder"}
    assert all(bps > 0 for shapes in found["rates"].values() for bps in shapes.values())
    assert (tmp_path / "profiles" / profile.fingerprint / kernelrates.FILE).is_file()

    def no_measuring(*args):
        raise AssertionError("measured again")

    monkeypatch.setattr(kernelrates, "measure_native", no_measuring)
    monkeypatch.setattr(kernelrates.KEPT, "memo", {})
    assert kernelrates.rates(profile, blocks, "exact") == found  # read back from the file
    other = cpu_profile("another-machine")  # plan --profile FILE: nothing of it can be measured here
    assert kernelrates.rates(other, blocks, "exact") is None
    facts = replace(gguf_facts(), block_bytes={"Q8_0": {"256x512": 256 * 544}})
    assert kernelrates.with_kernel_rates(other, facts) is facts
    assert kernelrates.with_kernel_rates(profile, facts).kernel_rates["rates"]["Q8_0"] == found["rates"]["Q8_0"]


def test_a_pass_of_several_positions_adds_its_products_measured_at_that_row_count(nk, tmp_path, monkeypatch):
    """A verified draft or a batch computes M positions a pass: each block product is timed here at M rows too (kept
    under its own key), and the pass's compute grows by the products' time at M less their time at one."""
    from rocketllm_cli.profiles.probe.machine import fingerprint, fingerprint_facts

    monkeypatch.setenv("ROCKETLLM_CACHE", str(tmp_path))
    monkeypatch.setattr(kernelrates.KEPT, "memo", {})
    profile = cpu_profile(fingerprint(fingerprint_facts()))
    blocks = {"Q8_0": {"256x512": 256 * 544}, "Q4_K": {"128x1024": 128 * 576}}
    facts = replace(gguf_facts(), total_bytes=sum(b for s in blocks.values() for b in s.values()), block_bytes=blocks)
    one, four = kernelrates.rates(profile, blocks, "exact"), kernelrates.rates(profile, blocks, "exact", rows=4)
    assert one["rows"] == 1 and four["rows"] == 4
    stored = kernelrates.KEPT.load(profile)
    assert sum(k.endswith("-m4") for k in stored) == 2 and len(stored) == 4  # one key per shape and row count

    extra, how = kernelrates.pass_extra_seconds(profile, facts, "exact", 4)
    seconds = {
        rows: sum(b / doc["rates"][t][shape] for t, shapes in blocks.items() for shape, b in shapes.items())
        for rows, doc in ((1, one), (4, four))
    }
    assert extra == pytest.approx(max(0.0, seconds[4] - seconds[1]))
    assert "a pass of 4 positions" in how
    assert kernelrates.pass_extra_seconds(profile, facts, "exact", 1) is None  # one position: nothing beyond
    assert kernelrates.pass_extra_seconds(cpu_profile("another-machine"), facts, "exact", 4) is None


def test_a_rows_projection_adds_the_extra_compute_of_its_positions(monkeypatch):
    """planning/projection.py: a row whose pass computes M positions adds pass_extra_s to its compute term, and its
    tokens/s recomputes from the formula and inputs it prints; without a measurement it says the pass is costed as
    one."""
    from rocketllm_cli.planning.projection import projection
    from rocketllm_cli.profiles.knobs.expression import evaluate

    facts = replace(gguf_facts(), kernel_rates=KERNELS)
    profile = cpu_profile()
    tiers = {"device": 0, "host": 0, "storage": facts.total_bytes}
    monkeypatch.setattr(kernelrates, "pass_extra_seconds", lambda p, f, mode, m: (0.004 * m, "synthetic"))
    tps, formula, inputs, note = projection(profile, facts, tiers, "fp32", 1, 2.5, positions=5)
    assert inputs["pass_extra_s"] == pytest.approx(0.02) and "pass_extra_s" in formula
    assert inputs["tokens_per_pass"] == 2.5 and tps == pytest.approx(evaluate(formula, inputs))
    compute = project(profile, facts, tiers).compute_seconds
    io = facts.total_bytes / 2e9
    assert tps == pytest.approx(2.5 / max(io, compute + 0.02), rel=1e-4)
    single = projection(profile, facts, tiers, "fp32", 1, 2.5, positions=1)
    assert "pass_extra_s" not in single[2] and single[0] >= tps

    monkeypatch.setattr(kernelrates, "pass_extra_seconds", lambda *a: None)
    _, formula, inputs, note = projection(profile, facts, tiers, "fp32", 1, 2.5, positions=5)
    assert "pass_extra_s" not in inputs and "costed as one" in note


def test_rates_measured_on_a_busy_machine_serve_this_process_and_are_measured_again_by_the_next(
    nk, tmp_path, monkeypatch
):
    """Other processes on a quarter of the CPUs or more while the products are timed: the rates are low, so they are
    not written for later processes to project from."""
    from rocketllm_cli.profiles.probe import machine
    from rocketllm_cli.profiles.probe.machine import fingerprint, fingerprint_facts

    monkeypatch.setenv("ROCKETLLM_CACHE", str(tmp_path))
    monkeypatch.setattr(kernelrates.KEPT, "memo", {})
    profile = cpu_profile(fingerprint(fingerprint_facts()))
    blocks = {"Q8_0": {"256x512": 256 * 544}}
    stored = tmp_path / "profiles" / profile.fingerprint / kernelrates.FILE
    monkeypatch.setattr(machine, "others_cpu_share", lambda before, after: 0.6)
    busy = kernelrates.rates(profile, blocks, "exact")
    assert busy["rates"]["Q8_0"]["256x512"] > 0 and not stored.exists()
    assert kernelrates.rates(profile, blocks, "exact") == busy  # this process: measured once
    monkeypatch.setattr(kernelrates.KEPT, "memo", {})  # the next process
    monkeypatch.setattr(machine, "others_cpu_share", lambda before, after: 0.05)
    kernelrates.rates(profile, blocks, "exact")
    assert stored.is_file()


def test_a_table_a_token_only_looks_rows_up_in_is_no_product():
    """An untied input embedding (a file with its own head) is held by a tier but multiplied by nothing: a token reads
    one row of it. Left out of the products, on the kernels and at the matvec alike; named from the module tree (a
    set's embed unit no head is tied to) or, before sharding, from the checkpoint's own tensor names."""
    from rocketllm_cli.checkpoint.units import lookup_tables, named_lookup_tables

    profile = cpu_profile()
    table = 20 * MiB  # kept as its blocks, so not among the products' block shapes either
    facts = replace(gguf_facts(), total_bytes=121 * MiB, lookup_bytes=table, kernel_rates=KERNELS)
    p = project(profile, facts, {"device": facts.total_bytes})
    assert p.compute_seconds == pytest.approx(90 * MiB / 9e9 + 10 * MiB / 5e9 + 1 * MiB / 10e9)
    assert "20.0 MiB embedding table is looked up by rows" in p.compute_bandwidth
    floor = replace(facts, kernel_rates=None)  # no kernels measured: the matvec floor leaves it out too
    assert project(profile, floor, {"device": facts.total_bytes}).compute_seconds == pytest.approx(101 * MiB / 10e9)

    units = [("embed", ["model.embed_tokens.weight"]), ("norm", ["model.norm.weight"]), ("lm_head", ["lm_head.weight"])]
    assert lookup_tables(units, {}) == {"model.embed_tokens.weight"}
    assert lookup_tables(units[:2], {"lm_head.weight": "model.embed_tokens.weight"}) == set()  # tied: the head's
    assert named_lookup_tables(["model.embed_tokens.weight", "lm_head.weight"]) == {"model.embed_tokens.weight"}
    assert named_lookup_tables(["model.embed_tokens.weight", "model.norm.weight"]) == set()  # no head of its own
