"""Every knob formula over the edges of its inputs: a measurement of zero, one that is tiny or huge, a machine or a
model
at either end of the scale. No formula divides by a measurement that can be zero, and each value still recomputes from
what it prints (a small model on a fast GPU once projected 0.0 s/token and default_max_tokens divided by it)."""

from __future__ import annotations

import itertools
import math

import pytest

from rocketllm_cli.profiles import Capability, HardwareProfile, Measurement, ModelFacts, resolve_knobs

GiB = 1024**3
NAMESPACE = {"min": min, "max": max, "floor": math.floor, "ceil": math.ceil}
MEASURED = (
    "host_memory",
    "device_memory",
    "page_cache_read",
    "storage_read",
    "storage_read_direct",
    "h2d_pinned",
    "h2d_pageable",
    "matvec_bf16",
    "matvec_fp16",
    "matvec_fp32",
    "matmul_fp16",
)
BANDWIDTHS = {"zero": 0.0, "tiny": 0.4, "slow": 1e6, "huge": 1e16}  # B/s; "tiny" rounds to 0 when printed whole
# RAM total, free
MACHINES = {"tiny": (256 * 1024**2, 1), "small": (2 * GiB, 1 * GiB), "huge": (1 << 50, (1 << 50) - 1)}
MODELS = {
    "none": None,
    "one-layer": ModelFacts.from_size(1e3, 4),
    "135M": ModelFacts.from_size(135e6, 16),
    "405B": ModelFacts.from_size(405e9, 4),
}


def profile(device: str, bandwidth: float, ram: tuple[int, int], vram_free: int | None = None) -> HardwareProfile:
    gpu = device != "cpu"
    measurements = {name: Measurement(name, bandwidth, "synthetic edge", int(bandwidth), 1.0) for name in MEASURED}
    return HardwareProfile(
        "edges",
        device,
        1,
        ram[0],
        ram[1],
        (vram_free or 0) + GiB if gpu else None,
        vram_free if gpu else None,
        measurements=measurements,
        capabilities={
            "compute_dtype": Capability("compute_dtype", "bf16" if gpu else "fp32", None, "synthetic"),
            "direct_io": Capability("direct_io", bandwidth > 1),
            "storage_kind": Capability("storage_kind", "nvme"),
        },
    )


def recomputes(knobs) -> None:
    for knob in knobs.values():
        if not knob.overridden:
            assert eval(knob.formula, dict(NAMESPACE), dict(knob.inputs)) == knob.value, knob.name  # noqa: S307


@pytest.mark.parametrize("device", ["cpu", "cuda:0"])
@pytest.mark.parametrize("bandwidth", BANDWIDTHS, ids=str)
def test_every_formula_survives_the_edges_of_its_inputs(device, bandwidth):
    for (machine, ram), (name, model) in itertools.product(MACHINES.items(), MODELS.items()):
        vram = {"tiny": 1, "small": GiB, "huge": 1 << 47}[machine]
        p = profile(device, BANDWIDTHS[bandwidth], ram, vram)
        for run_tokens in (None, 1, 10**9):
            try:
                knobs = resolve_knobs(p, model, env={}, run_tokens=run_tokens)
            except Exception as error:  # noqa: BLE001 - the test names the case that broke
                pytest.fail(
                    f"{device}, {bandwidth} bandwidth, {machine} machine, model {name}, run_tokens {run_tokens}: "
                    f"{type(error).__name__}: {error}"
                )
            recomputes(knobs)
            v = knobs.values_dict()
            assert isinstance(v["default_max_tokens"], int) and v["default_max_tokens"] >= 0
            assert v["prefetch_depth"] >= 1 and v["io_workers"] >= 1 and v["device_cache_bytes"] >= 0


def test_a_small_model_on_a_fast_device_gets_the_longest_default_reply():
    """The projection of a 1k-parameter model at 10 PB/s is ~1e-13 s/token: the reply default is its maximum, and the
    printed seconds are not rounded to zero."""
    knobs = resolve_knobs(profile("cuda:0", 1e16, MACHINES["huge"], 1 << 40), MODELS["one-layer"], env={})
    knob = knobs["default_max_tokens"]
    assert knob.inputs["seconds_per_token"] > 0
    assert knob.value == min(knob.inputs["max_tokens"], knob.inputs["max_context"])
