"""Knobs: each derived value recomputes from its printed formula and inputs; overrides win flag/kwarg > env >
derived."""

from __future__ import annotations

import ast
import json
import math
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from rocketllm_cli.app import app
from rocketllm_cli.errors import KnobError
from rocketllm_cli.profiles import (
    Capability,
    HardwareProfile,
    Measurement,
    ModelFacts,
    resolve_knobs,
)
from rocketllm_cli.profiles.knobs.resolve import Knob
from rocketllm_cli.profiles.knobs.table import KNOB_SPECS

GiB = 1024**3
MiB = 1024**2
NAMESPACE = {"min": min, "max": max, "floor": math.floor, "ceil": math.ceil}
HEADER = re.compile(r"^(?P<name>[a-z_]+)\s+(?P<display>\S+(?: \S+)?)  (?P<source>\w+)(?P<over> \[OVERRIDDEN\])?$")
INPUT = re.compile(r"(\w+)=('[^']*'|True|False|None|-?\d+(?:\.\d+)?(?:e[+-]?\d+)?)")


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    monkeypatch.setenv("ROCKETLLM_PROBE_BYTES", "32MiB")
    for spec in KNOB_SPECS:
        monkeypatch.delenv(spec.env, raising=False)


def recompute(formula: str, inputs: dict) -> object:
    """Independent of the library: plain eval with the four functions formulas may use."""
    return eval(formula, dict(NAMESPACE), dict(inputs))  # noqa: S307 - test of our own formulas


def synthetic(
    device: str = "cpu",
    ram_total: int = 64 * GiB,
    ram_available: int = 60 * GiB,
    vram_free: int | None = None,
    storage_bps: float | None = 2e9,
    memory_bps: float = 20e9,
    kind: str = "nvme",
) -> HardwareProfile:
    def m(name, value):
        return (
            Measurement(name, value, "synthetic", 1, 1.0)
            if value
            else Measurement.unavailable(name, "synthetic", "not measured")
        )

    gpu = device != "cpu"
    return HardwareProfile(
        "synthetic",
        device,
        8,
        ram_total,
        ram_available,
        80 * GiB if gpu else None,
        (vram_free or 70 * GiB) if gpu else None,
        measurements={
            "host_memory": m("host_memory", memory_bps),
            "device_memory": m("device_memory", memory_bps),
            "storage_read": m("storage_read", storage_bps),
            "storage_read_direct": m("storage_read_direct", storage_bps and storage_bps * 0.8),
            "h2d_pinned": m("h2d_pinned", 25e9 if gpu else None),
            "matvec_bf16": m("matvec_bf16", memory_bps * 0.7),
        },
        capabilities={
            "compute_dtype": Capability("compute_dtype", "bf16", None, "synthetic"),
            "direct_io": Capability("direct_io", False),
            "storage_kind": Capability("storage_kind", kind),
        },
    )


def assert_recomputes(knobs) -> None:
    for knob in knobs.values():
        if not knob.overridden:
            assert recompute(knob.formula, knob.inputs) == knob.value, knob.name


def invoke(*args, env=None):
    return CliRunner().invoke(app, list(args), env=env)


# -- formulas ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("with_model", [False, True])
def test_printed_json_inputs_recompute_every_derived_value(tiny_checkpoint, with_model):
    args = ["profile", "--json"] + (["--model", str(tiny_checkpoint)] if with_model else [])
    result = invoke(*args)
    assert result.exit_code == 0, result.output
    knobs = json.loads(result.stdout)["knobs"]
    assert list(knobs) == [spec.name for spec in KNOB_SPECS]
    for name, knob in knobs.items():
        assert knob["source"] in ("measured", "derived", "default") and not knob["overridden"]
        assert recompute(knob["formula"], knob["inputs"]) == knob["value"], name


def test_printed_text_inputs_recompute_every_displayed_value(tiny_checkpoint):
    result = invoke("profile", "--model", str(tiny_checkpoint))
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    seen = set()
    for i, line in enumerate(lines):
        header = HEADER.match(line)
        if not header:
            continue
        formula = lines[i + 1].removeprefix("    = ")
        inputs = {}
        if lines[i + 2].startswith("    with "):
            inputs = {k: ast.literal_eval(v) for k, v in INPUT.findall(lines[i + 2])}
        value = recompute(formula, inputs)
        assert Knob(header["name"], value, formula).display() == header["display"], line
        seen.add(header["name"])
    assert seen == {spec.name for spec in KNOB_SPECS}
    assert "tiers: " in result.stdout


@settings(max_examples=60, deadline=None)
@given(
    ram=st.integers(2 * GiB, 2048 * GiB),
    free=st.floats(0.05, 1.0),
    params=st.sampled_from([135e6, 1e9, 8e9, 70e9, 405e9]),
    bits=st.sampled_from([4, 8, 16]),
    storage=st.one_of(st.none(), st.floats(1e8, 2e10)),
    gpu=st.booleans(),
    kind=st.sampled_from(["nvme", "ssd", "rotational", "network", "tmpfs", "overlay", "unknown"]),
)
def test_derivations_recompute_and_respect_memory(ram, free, params, bits, storage, gpu, kind):
    profile = synthetic("cuda:0" if gpu else "cpu", ram, int(ram * free), storage_bps=storage, kind=kind)
    model = ModelFacts.from_size(params, bits)
    knobs = resolve_knobs(profile, model, env={})
    assert_recomputes(knobs)
    v = knobs.values_dict()
    assert (
        0 <= v["device_cache_bytes"] <= model.total_bytes
        and 0 <= v["host_cache_bytes"] <= model.total_bytes - v["device_cache_bytes"]
    )
    assert 1 <= v["prefetch_depth"] <= 4 and v["io_workers"] >= 1 and 0 <= v["max_context"] <= model.max_positions
    # the context admitted fits what the weights and buffers leave (0 when nothing is left: every prompt refused);
    # the buffers hold a layer where the device cache holds the largest unit (as device_cache_bytes sized them), and
    # one more the largest unit where it does not
    if 0 < model.layer_bytes < model.largest_unit_bytes:
        resident_rest = min(v["device_cache_bytes"], model.total_bytes) >= model.largest_unit_bytes
        buffers = (v["prefetch_depth"] + 2) * model.layer_bytes + (
            0 if resident_rest else model.largest_unit_bytes - model.layer_bytes
        )
    else:
        buffers = (v["prefetch_depth"] + 2) * model.largest_unit_bytes
    left = (
        (profile.ram_available if not gpu else profile.vram_free)
        - v["reserve_bytes"]
        - v["device_cache_bytes"]
        - buffers
        - (0 if gpu else v["host_cache_bytes"] + v["runtime_bytes"])
    )
    assert v["max_context"] * model.kv_bytes_per_token <= max(0, left)
    if not gpu:  # device and host tiers share the same RAM
        assert v["device_cache_bytes"] + v["host_cache_bytes"] <= max(
            0, profile.ram_available - v["reserve_bytes"] - v["kv_cache_bytes"]
        )
    assert v["pin_memory"] is gpu
    assert_recomputes(resolve_knobs(profile, None, env={}))


def test_a_memory_cgroup_reserves_a_tenth_of_its_limit_and_gives_the_rest_to_the_weights():
    """Inside a memory cgroup the OS lives outside the limit: a tenth of it is kept free, not the quarter a small
    machine keeps, and the bytes freed go to the device tier."""
    import dataclasses

    machine = synthetic(ram_total=int(1.2 * GiB), ram_available=800 * MiB)
    group = dataclasses.replace(machine, ram_bound="cgroup")
    model = ModelFacts.from_size(2.8e9, 4)
    on_machine, in_group = resolve_knobs(machine, model, env={}), resolve_knobs(group, model, env={})
    assert on_machine.value("reserve_bytes") == int(0.25 * 1.2 * GiB)
    assert in_group.value("reserve_bytes") == int(0.10 * 1.2 * GiB) and "cgroup" in in_group["reserve_bytes"].note
    assert_recomputes(in_group)
    assert in_group.value("device_cache_bytes") > on_machine.value("device_cache_bytes")
    assert in_group.value("device_cache_bytes") + in_group.value("reserve_bytes") <= group.ram_available


@pytest.mark.parametrize("kv", ["auto", "int4"])
def test_a_one_shot_run_sizes_the_kv_cache_for_its_tokens_and_the_weights_get_the_rest(kv):
    """generate that keeps no server, and bench, know the tokens a run holds (llama.cpp's n_ctx for the same run): the
    KV cache is sized for them, max_context still admits them, and what a context nobody asked for held goes to the
    weights. A run the memory or the model cannot hold so is sized as any request is (its refusal has the numbers)."""
    import dataclasses

    group = dataclasses.replace(synthetic(ram_total=int(1.2 * GiB), ram_available=1000 * MiB), ram_bound="cgroup")
    model = ModelFacts.from_size(2.8e9, 4)
    chosen = {"kv_cache_dtype": kv}
    anyone = resolve_knobs(group, model, env={}, kwargs=chosen)
    for tokens in (1, 42, 1000):
        run = resolve_knobs(group, model, env={}, kwargs=chosen, run_tokens=tokens)
        assert_recomputes(run)
        assert (
            "this run's tokens" in run["kv_cache_bytes"].note and run["kv_cache_bytes"].inputs["run_tokens"] == tokens
        )
        assert tokens <= run.value("max_context") < anyone.value("max_context")
        saved = anyone.value("kv_cache_bytes") - run.value("kv_cache_bytes")
        assert saved > 0 and run.value("device_cache_bytes") - anyone.value("device_cache_bytes") >= saved // 2
        assert (
            run.value("device_cache_bytes") + run.value("kv_cache_bytes") + run.value("reserve_bytes")
            <= group.ram_available
        )
    for past in (model.max_positions + 1, 10**9):  # longer than the model's context, or than the memory holds
        assert resolve_knobs(group, model, env={}, kwargs=chosen, run_tokens=past).to_dict() == anyone.to_dict()
    given = resolve_knobs(group, model, env={}, kwargs={**chosen, "max_context": 500}, run_tokens=42)
    assert given.value("kv_cache_bytes") == resolve_knobs(
        group, model, env={}, kwargs={**chosen, "max_context": 500}
    ).value("kv_cache_bytes")


def test_gpu_derivations_use_vram_and_pinned_staging():
    profile = synthetic("cuda:0", vram_free=40 * GiB)
    model = ModelFacts.from_size(70e9, 4)
    knobs = resolve_knobs(profile, model, env={})
    assert knobs["device_cache_bytes"].inputs["vram_free"] == 40 * GiB
    assert knobs.value("device_cache_bytes") < 40 * GiB
    assert knobs.value("host_cache_bytes") == min(
        model.total_bytes - knobs.value("device_cache_bytes"),
        profile.ram_available
        - knobs.value("reserve_bytes")
        - (knobs.value("prefetch_depth") + 2) * model.largest_unit_bytes,
    )


def test_without_a_model_the_forms_are_model_free_and_say_what_is_missing():
    knobs = resolve_knobs(synthetic(), None, env={})
    assert knobs.value("max_context") is None and "missing" in knobs["max_context"].note
    for name in ("device_cache_bytes", "host_cache_bytes", "kv_cache_bytes"):
        assert "missing" in knobs[name].note and knobs.value(name) >= 0
    assert_recomputes(knobs)


def test_the_kernel_is_int16_for_a_gguf_sets_blocks_on_a_cpu_and_exact_elsewhere():
    """int16 where the native kernels compute on GGUF blocks (a CPU); exact for a set without blocks (its bench
    records keep their key) and on a GPU; the formula recomputes from the printed inputs, and a flag still wins."""
    from dataclasses import replace

    floats, blocks = ModelFacts.from_size(8e9, 16), replace(ModelFacts.from_size(8e9, 4), gguf_blocks=True)
    cpu, gpu = synthetic(), synthetic("cuda:0", vram_free=40 * GiB)
    assert resolve_knobs(cpu, blocks, env={}).value("kernel") == "int16"
    assert resolve_knobs(cpu, floats, env={}).value("kernel") == "exact"
    assert resolve_knobs(gpu, blocks, env={}).value("kernel") == "exact"
    no_model = resolve_knobs(cpu, None, env={})
    assert no_model.value("kernel") == "int16" and no_model["kernel"].inputs == {"device_kind": "cpu"}
    assert resolve_knobs(cpu, blocks, flags={"kernel": "exact"}, env={}).value("kernel") == "exact"
    for knobs in (resolve_knobs(cpu, blocks, env={}), resolve_knobs(gpu, floats, env={}), no_model):
        assert_recomputes(knobs)


def test_unmeasured_storage_falls_back_to_a_stated_default():
    knobs = resolve_knobs(synthetic(storage_bps=None), ModelFacts.from_size(8e9, 16), env={})
    assert knobs["prefetch_depth"].source == "default" and "unmeasured" in knobs["prefetch_depth"].note


# -- precedence ------------------------------------------------------------------------------------


def test_flag_beats_env_beats_derived():
    profile, model = synthetic(), ModelFacts.from_size(8e9, 16)
    derived = resolve_knobs(profile, model, env={})
    env = {"ROCKETLLM_PREFETCH_DEPTH": "3", "ROCKETLLM_IO_WORKERS": "5"}
    knobs = resolve_knobs(profile, model, flags={"io_workers": "2"}, env=env)
    assert (knobs.value("io_workers"), knobs["io_workers"].source) == (2, "flag")
    assert (knobs.value("prefetch_depth"), knobs["prefetch_depth"].source) == (3, "env")
    assert knobs["reserve_bytes"].source == "derived" and knobs["io_workers"].overridden
    assert knobs["io_workers"].derived_value == derived.value("io_workers")
    kw = resolve_knobs(profile, model, kwargs={"prefetch_depth": 1}, env=env)
    assert (kw.value("prefetch_depth"), kw["prefetch_depth"].source) == (1, "kwarg")


def test_overrides_flow_into_the_knobs_derived_from_them():
    profile, model = synthetic(), ModelFacts.from_size(405e9, 4)
    base = resolve_knobs(profile, model, env={})
    more = resolve_knobs(profile, model, flags={"reserve_bytes": "20GiB"}, env={})
    for name in ("kv_cache_bytes", "device_cache_bytes", "host_cache_bytes"):
        assert more[name].inputs["reserve_bytes"] == 20 * GiB
    assert more.value("device_cache_bytes") < base.value("device_cache_bytes")
    ctx = resolve_knobs(profile, model, env={"ROCKETLLM_MAX_CONTEXT": "1000"})
    assert ctx.value("kv_cache_bytes") == 1000 * model.kv_bytes_per_token
    assert_recomputes(more)
    assert_recomputes(ctx)


def test_env_defaults_to_os_environ(monkeypatch):
    monkeypatch.setenv("ROCKETLLM_COMPUTE_DTYPE", "float32")
    knobs = resolve_knobs(synthetic(), None)
    assert (knobs.value("compute_dtype"), knobs["compute_dtype"].source) == ("fp32", "env")


def test_profile_marks_overrides_in_text_and_json(monkeypatch):
    monkeypatch.setenv("ROCKETLLM_PREFETCH_DEPTH", "3")
    result = invoke("profile", "--io-workers", "2", "--dtype", "fp32")
    assert result.exit_code == 0, result.output
    marked = {line.split()[0] for line in result.stdout.splitlines() if line.endswith("[OVERRIDDEN]")}
    assert marked == {"io_workers", "prefetch_depth", "compute_dtype"}
    doc = json.loads(invoke("profile", "--io-workers", "2", "--json").stdout)["knobs"]
    assert doc["io_workers"]["source"] == "flag" and doc["prefetch_depth"]["source"] == "env"
    assert {n for n, k in doc.items() if k["overridden"]} == {"io_workers", "prefetch_depth"}


# -- bad values ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name, raw",
    [
        ("reserve_bytes", "lots"),
        ("io_workers", "0"),
        ("compute_dtype", "fp8"),
        ("direct_io", "maybe"),
        ("prefix_cache", "sometimes"),
        ("max_context", "-1"),
    ],
)
def test_bad_values_raise_one_line_naming_the_knob(name, raw):
    for call in (
        lambda: resolve_knobs(synthetic(), None, flags={name: raw}, env={}),
        lambda: resolve_knobs(synthetic(), None, env={f"ROCKETLLM_{name.upper()}": raw}),
    ):
        with pytest.raises(KnobError) as err:
            call()
        message = str(err.value)
        assert name in message and "expected" in message and "\n" not in message


def test_unknown_keyword_is_refused():
    with pytest.raises(KnobError, match="unknown knob"):
        resolve_knobs(synthetic(), None, kwargs={"prefetch": 2}, env={})


@pytest.mark.parametrize(
    "args, env",
    [
        (["--reserve-bytes", "2XB"], {}),
        (["--prefetch-depth", "-1"], {}),
        ([], {"ROCKETLLM_DIRECT_IO": "perhaps"}),
        ([], {"ROCKETLLM_HOST_CACHE_BYTES": "lots"}),
    ],
)
def test_bad_override_on_the_cli_exits_1_with_one_line(args, env):
    result = invoke("profile", *args, env=env)
    assert result.exit_code == 1
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: bad value") and "Traceback" not in result.stderr
