"""A decoder layer's own work measured on tiny models of an architecture (stream/layerprobe.py: a real measurement,
the engine's products and attention bound as on a GGUF set), kept beside the profile (profiles/probe/layercost.py),
and added per layer to a projection where bench has measured no set of this machine yet."""

from __future__ import annotations

from dataclasses import replace

import pytest
from test_kernel_rates import KERNELS, MiB, cpu_profile, gguf_facts
from torch import nn

from rocketllm_cli.profiles import project
from rocketllm_cli.profiles.probe import decodecompute, layercost, machine
from rocketllm_cli.profiles.probe.machine import fingerprint, fingerprint_facts
from rocketllm_cli.stream import layerprobe


def this_machine():
    return cpu_profile(fingerprint(fingerprint_facts()))


def test_a_layer_and_a_token_of_the_architecture_are_measured_on_tiny_models():
    found = layerprobe.measure("llama", "fp32")
    assert found["seconds"] > 0 and found["token_seconds"] > 0, found
    # a whole decoder layer's Python and small ops take tens of µs at least, a tiny model's token under a second
    assert 1e-5 < found["seconds"] < 0.05 and found["token_seconds"] < 1.0, found
    assert set(layerprobe.measure("no-such-architecture", "fp32")) == {"reason"}


def test_the_tiny_model_computes_on_the_native_kernels_as_a_gguf_set_does(nk):
    import torch

    from rocketllm_cli.stream.packedbind import _PackedForward

    model = layerprobe._tiny_model("llama", 1, torch.float32)
    head = model.get_output_embeddings()
    assert layerprobe._as_engine(model, "int16")
    linears = [m for m in model.modules() if isinstance(m, nn.Linear) and m is not head]
    assert linears and all(isinstance(m, _PackedForward) for m in linears)  # q, k, v, o, gate, up, down
    assert all(m.packed_weight.path == "native" and m.packed_weight.mode == "int16" for m in linears)
    assert not isinstance(head, _PackedForward)  # the head is the set's own product, counted apart
    assert model.config._attn_implementation == "rocketllm_decode"  # decode_attention's formula for int16
    ids = torch.arange(3, 11).unsqueeze(0)
    assert layerprobe._decode(model, ids, 3) > 0  # it decodes


def test_measured_once_kept_and_not_for_another_machine(tmp_path, monkeypatch):
    monkeypatch.setenv("ROCKETLLM_CACHE", str(tmp_path))
    monkeypatch.setattr(layercost.KEPT, "memo", {})
    monkeypatch.setattr(machine, "others_cpu_share", lambda before, after: 0.0)  # an idle machine: kept
    calls = []

    def measure(architecture, dtype, kernel="", shape=None):
        calls.append((architecture, dtype, kernel))
        return {"seconds": 0.0003, "token_seconds": 0.0005}

    profile = this_machine()
    assert layercost.layer_cost(profile, "llama", "fp32", "int16") is None  # nothing kept, nothing to measure with
    found = layercost.layer_cost(profile, "llama", "fp32", "int16", measure)
    assert found == {
        "seconds": 0.0003,
        "token_seconds": 0.0005,
        "architecture": "llama",
        "sets": [],
        "source": "probe",
    }
    assert (tmp_path / "profiles" / profile.fingerprint / layercost.FILE).is_file()
    monkeypatch.setattr(layercost.KEPT, "memo", {})
    assert layercost.layer_cost(profile, "llama", "fp32", "int16") == found  # read back from the file
    assert calls == [("llama", "fp32", "int16")]
    layercost.layer_cost(profile, "llama", "fp32", "", measure)  # the torch path is a measurement of its own
    assert calls[-1] == ("llama", "fp32", "")
    shape = {"hidden_size": 576, "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64}
    layercost.layer_cost(profile, "llama", "fp32", "int16", measure, shape)  # a set of other widths: its own too
    assert calls[-1] == ("llama", "fp32", "int16") and len(calls) == 3
    layercost.layer_cost(profile, "llama", "fp32", "int16", measure, dict(reversed(shape.items())))
    assert len(calls) == 3  # the same widths, however ordered: kept
    other = cpu_profile("another-machine")  # plan --profile FILE: nothing of it can be measured here
    assert layercost.layer_cost(other, "llama", "fp32", "", measure) is None
    assert layercost.layer_cost(profile, "", "fp32", "", measure) is None  # no architecture named


def test_a_failure_is_kept_with_its_reason_and_a_busy_machine_keeps_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("ROCKETLLM_CACHE", str(tmp_path))
    monkeypatch.setattr(layercost.KEPT, "memo", {})
    monkeypatch.setattr(machine, "others_cpu_share", lambda before, after: 0.0)
    profile = this_machine()
    failing = lambda a, d, k="", s=None: {"reason": "ValueError: no tiny form"}  # noqa: E731
    assert layercost.layer_cost(profile, "mamba2", "fp32", "", failing) is None
    assert "no tiny form" in str(layercost.KEPT.load(profile))  # not tried again

    monkeypatch.setattr(layercost.KEPT, "memo", {})
    monkeypatch.setattr(machine, "others_cpu_share", lambda before, after: 0.6)  # others held the cores
    busy = lambda a, d, k="", s=None: {"seconds": 0.002, "token_seconds": 0.001}  # noqa: E731
    assert layercost.layer_cost(profile, "gemma3", "fp32", "", busy)["seconds"] == 0.002  # this process uses it
    monkeypatch.setattr(layercost.KEPT, "memo", {})
    assert not any("gemma3" in key for key in layercost.KEPT.load(profile))  # the file did not keep it


def test_a_projection_adds_the_probes_layers_and_token_where_bench_measured_no_set(tmp_path, monkeypatch):
    monkeypatch.setenv("ROCKETLLM_CACHE", str(tmp_path))
    probed = {"seconds": 0.0003, "token_seconds": 0.0005, "architecture": "llama", "sets": [], "source": "probe"}
    seen = []

    def layer_cost(profile, architecture, dtype, kernel="", measure=None, shape=None):
        seen.append((architecture, dtype, kernel, measure, shape))
        return probed

    monkeypatch.setattr(layercost, "layer_cost", layer_cost)
    shape = {"hidden_size": 576, "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64}
    facts = replace(gguf_facts(), kernel_rates=KERNELS, architecture="llama", layer_shape=shape)
    attached = decodecompute.with_layer_overhead(cpu_profile(), facts, "bf16", "int16", measure=layerprobe.measure)
    assert attached.layer_overhead == probed
    # a GGUF set's blocks compute in fp32 on a CPU, on its kernel's mode, at its widths; the layer above's measure is
    # handed down
    assert seen == [("llama", "fp32", "int16", layerprobe.measure, shape)]
    p = project(cpu_profile(), attached, {"device": facts.total_bytes})
    products = 90 * MiB / 9e9 + 10 * MiB / 5e9 + 1 * MiB / 10e9
    assert p.compute_seconds == pytest.approx(products + 4 * 0.0003 + 0.0005)
    assert "4 layers x 0.300 ms" in p.compute_bandwidth and "0.500 ms a token outside the layers" in p.compute_bandwidth
    assert "models of the set's widths" in p.compute_bandwidth and "a floor" not in p.compute_bandwidth
    exact = decodecompute.with_layer_overhead(cpu_profile(), facts, "fp32", "torch")
    assert exact.layer_overhead == probed and seen[-1] == ("llama", "fp32", "", None, shape)  # torch's path: no mode


def test_bench_projects_with_the_probe_and_keeps_the_products_as_the_limit(monkeypatch):
    from rocketllm_cli.bench import accounting

    probed = {"seconds": 0.001, "token_seconds": 0.002, "architecture": "llama", "sets": [], "source": "probe"}
    monkeypatch.setattr(layercost, "layer_cost", lambda profile, a, d, k="", measure=None, shape=None: probed)
    # bench's own records never stand in: the projection is what was known before the run
    monkeypatch.setattr(decodecompute, "layer_overhead", lambda *a, **k: pytest.fail("bench records were read"))
    facts = replace(gguf_facts(), kernel_rates=KERNELS, architecture="llama")
    tiers = {"device": facts.total_bytes}
    proj = accounting.projection(cpu_profile(), facts, tiers, "int16", "fp32")
    products = 90 * MiB / 9e9 + 10 * MiB / 5e9 + 1 * MiB / 10e9
    assert proj["products_seconds"] == pytest.approx(products)
    assert proj["compute_seconds"] == pytest.approx(products + 4 * 0.001 + 0.002)
    floor, basis = accounting.compute_floor("resident", {}, proj)
    assert floor == pytest.approx(products) and "products" in basis
    bare = accounting.projection(cpu_profile(), facts, tiers, "int16")  # no compute dtype: the products alone
    assert bare["compute_seconds"] == pytest.approx(products)


def test_serve_derives_its_default_reply_from_the_measured_speed(tmp_path, monkeypatch):
    """AutoModel.from_pretrained(measured_speed=True), as serve opens a model: the knobs resolve on the set's speed as
    this machine measured it (bench's record, else kernel rates and the probe's layer work), so default_max_tokens is
    what a minute of real tokens holds, not a minute at the products' floor."""
    from types import SimpleNamespace

    from rocketllm_cli.profiles import resolve_knobs

    probed = {"seconds": 0.004, "token_seconds": 0.002, "architecture": "llama", "sets": [], "source": "probe"}
    monkeypatch.setattr(layercost, "layer_cost", lambda profile, a, d, k="", measure=None, shape=None: probed)
    monkeypatch.setattr(decodecompute, "lookup", lambda *a, **k: None)
    knobs = SimpleNamespace(value={"compute_dtype": "fp32", "kernel": "int16"}.get)
    facts = replace(gguf_facts(), kernel_rates=KERNELS, architecture="llama")
    profile = cpu_profile()
    measured = layerprobe.with_measured_speed(profile, facts, tmp_path, None, knobs)
    assert measured.layer_overhead == probed
    floor = resolve_knobs(profile, facts)["default_max_tokens"]
    real = resolve_knobs(profile, measured)["default_max_tokens"]
    products = 90 * MiB / 9e9 + 10 * MiB / 5e9 + 1 * MiB / 10e9
    assert real.inputs["seconds_per_token"] == pytest.approx(products + 4 * 0.004 + 0.002, rel=1e-4)
    assert real.value < floor.value  # fewer tokens fit a minute at the speed a run really has
    monkeypatch.setattr(decodecompute, "lookup", lambda *a, **k: {"seconds": 0.05})  # bench measured the set
    recorded = layerprobe.with_measured_speed(profile, facts, tmp_path, None, knobs)
    assert recorded.decode_compute == {"seconds": 0.05}
    assert resolve_knobs(profile, recorded)["default_max_tokens"].inputs["seconds_per_token"] == pytest.approx(0.05)


def test_the_probes_models_take_the_sets_widths_and_a_wide_one_is_capped():
    import torch

    shape = {"hidden_size": 576, "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64}
    config = layerprobe._tiny_model("llama", 2, torch.float32, {**shape, "vocab_size": 49152}).config
    assert {k: getattr(config, k) for k in shape} == shape  # its attention as the set's
    # the rest tiny: the MLP and the vocabulary (the set's vocabulary is a model of its own, at tiny width)
    assert config.intermediate_size == layerprobe.TINY["intermediate_size"] and config.vocab_size == 512
    wide = layerprobe._widths({**shape, "hidden_size": 8192, "num_attention_heads": 64, "head_dim": 128})
    assert wide["hidden_size"] == layerprobe.MAX_HIDDEN and wide["num_attention_heads"] == 64
    # capped at a multiple of the heads and of a block's 32: 2,560 wide with 20 heads gives 960
    assert layerprobe._widths({"hidden_size": 2560, "num_attention_heads": 20})["hidden_size"] == 960
    assert layerprobe._widths(None) == {} and layerprobe._widths({"hidden_size": 0}) == {}


def test_the_probes_own_products_are_taken_off_all_but_each_calls_fixed_cost(monkeypatch):
    """A decode's seconds less what its Linears spent beyond the fixed cost of a call: the set's products are counted
    apart (kernel rates), the fixed cost of a call into them is not. A clock that advances only where told."""
    from types import SimpleNamespace

    now = [0.0]
    monkeypatch.setattr(layerprobe, "time", SimpleNamespace(perf_counter=lambda: now[0]))

    class Product(nn.Linear):
        def forward(self, x):
            now[0] += 5.0  # a product: 5 s, of which the fixed cost below is 0.5
            return x

    model = nn.Sequential(Product(4, 4), Product(4, 4))
    clock = layerprobe._Clock()
    clock.time_products(model)
    clock.fixed = 0.5

    def decode():
        now[0] += 1.0  # the layer's own work
        model(None)
        now[0] += 1.0
        return now[0] - started

    started = now[0]
    # 12 s in all: 2 of the layer's own, 2 x 5 of products, of which 2 x 0.5 of fixed costs stay
    assert clock.less_products(decode) == pytest.approx(2.0 + 2 * 0.5)


def test_a_sets_vocabulary_adds_its_logits_work_to_the_token_outside_the_layers(monkeypatch):
    """Layers from the set's widths (one layer and two, vocabulary 512); what the set's vocabulary adds to a token from
    two one-layer models at tiny width, 512 entries and the set's. Decodes timed as a function of the model here."""
    built = []
    real = layerprobe._tiny_model

    def tiny_model(architecture, layers, dtype, shape=None, vocab=0):
        model = real(architecture, layers, dtype, shape, vocab)
        built.append((layers, model.config.hidden_size, model.config.vocab_size))
        return model

    def decode(model, ids, tokens):  # a token: 2 ms + 1 ms a layer, + 2 ms with a 65,536-entry vocabulary
        config = model.config
        return tokens * 0.001 * (2 + config.num_hidden_layers + 2 * (config.vocab_size == 65536))

    monkeypatch.setattr(layerprobe, "_tiny_model", tiny_model)
    monkeypatch.setattr(layerprobe, "_decode", decode)
    shape = {"hidden_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32}
    found = layerprobe.measure("llama", "fp32", "", {**shape, "vocab_size": 65536})
    assert built == [(1, 128, 512), (2, 128, 512), (1, 64, 512), (1, 64, 65536)]
    assert found["seconds"] == pytest.approx(0.001) and found["token_seconds"] == pytest.approx(0.002 + 0.002)
    built.clear()
    found = layerprobe.measure("llama", "fp32", "", shape)  # no vocabulary given: the layers' models alone
    assert built == [(1, 128, 512), (2, 128, 512)] and found["token_seconds"] == pytest.approx(0.002)


def test_widths_an_architecture_refuses_fall_back_to_its_tiny_ones():
    import torch

    bad = {"hidden_size": 100, "num_attention_heads": 7}  # not a multiple of the heads: Llama's config refuses it
    with pytest.raises(Exception):
        layerprobe._tiny_model("llama", 1, torch.float32, bad)
    found = layerprobe.measure("llama", "fp32", "", bad)
    assert found.get("seconds", 0) > 0, found  # measured at tiny width rather than not at all
