"""Which passes compute every product on the native kernels (a decode step, a prompt short of the dense crossover),
what they get (torch one thread, the pool's workers held awake), and that a held pool still computes the same."""

from __future__ import annotations

import os

import pytest
import torch

from rocketllm_cli.stream import nativepass
from rocketllm_cli.threads import COMPUTE_THREADS


class _Kernels:
    def __init__(self):
        self.holds = []

    def hold_pool(self, on):
        self.holds.append(on)


@pytest.fixture
def passes(monkeypatch):
    """A model's NativePasses with a recording stand-in for the kernels, a crossover of 32 rows, and the thread
    follower's decision recorded rather than applied."""
    seen = []

    def poll(native_decode=False):
        seen.append(native_decode)
        COMPUTE_THREADS.native_pass = native_decode

    monkeypatch.setattr(COMPUTE_THREADS, "poll", poll)
    monkeypatch.setattr(COMPUTE_THREADS, "native_pass", False)
    monkeypatch.setattr(nativepass, "_dense_rows", lambda: 32)
    made = nativepass.NativePasses(torch.device("meta"), "blocks")
    made.kernels, made.products = _Kernels(), True
    return made, seen


def test_a_decode_and_a_short_prompt_are_native_and_hold_the_pool_a_long_prompt_releases_it(passes):
    made, seen = passes
    made.begin(16, 16)  # a 16-token prompt: every product under the crossover
    made.begin(1, 1)  # decode steps
    made.begin(1, 1)
    made.begin(4, 1)  # four rows decoding at once
    made.begin(40, 40)  # a prompt past the crossover: torch multiplies its products, and wants its threads
    made.begin(40, 40)
    made.begin(1, 1)
    assert seen == [True, True, True, True, False, False, True]
    assert made.kernels.holds == [1, 1, 1, 1, 0, 1]  # released once, held again by the next native pass


def test_without_the_thread_follower_nothing_is_held(passes, monkeypatch):
    made, seen = passes
    monkeypatch.setattr(COMPUTE_THREADS, "poll", lambda native_decode=False: seen.append(native_decode))
    made.begin(1, 1)  # OMP_NUM_THREADS or a caller's own count: torch keeps its threads, so the pool must not spin
    assert seen == [True] and made.kernels.holds == []


def test_a_model_that_streams_units_gets_native_passes_without_a_held_pool(passes):
    from types import SimpleNamespace

    made, seen = passes
    streams = nativepass.NativePasses(
        torch.device("meta"), "blocks", SimpleNamespace(tier={"a": "device", "b": "host"})
    )
    streams.kernels, streams.products = made.kernels, True
    assert not streams.resident and made.resident
    streams.begin(1, 1)  # its passes wait on reads: a spinning worker would take a core their threads need
    assert seen == [True] and made.kernels.holds == []


def test_a_model_off_the_native_kernels_is_never_native():
    for device, packing in ((torch.device("cpu"), "int4"), (torch.device("meta"), "blocks")):
        made = nativepass.NativePasses(device, packing)
        assert not made.products and made.kernels is None
    assert not nativepass.NO_NATIVE_PASSES.products


def test_a_held_pool_computes_the_same_and_lets_go(nk):
    from rocketllm_cli.checkpoint.ggmlblocks import dequantize_blocks
    from rocketllm_cli.native.sample import sample_blocks

    blocks = sample_blocks("Q4_0", 256, 512, seed=1)
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(2))
    want = nk.matmul(blocks, "Q4_0", x, threads=2)
    nk.hold_pool(1)
    try:
        for _ in range(3):  # the workers spin between calls
            assert torch.equal(nk.matmul(blocks, "Q4_0", x, threads=2), want)
    finally:
        nk.hold_pool(0)
    assert torch.equal(nk.matmul(blocks, "Q4_0", x, threads=2), want)
    assert torch.allclose(want, x @ dequantize_blocks(blocks, "Q4_0").T, rtol=1e-4, atol=1e-4)
    pid = os.fork()  # a forked child's pool is its own: holding it starts no thread of the parent's
    if pid == 0:
        ok = False
        try:
            nk.hold_pool(1)
            ok = torch.equal(nk.matmul(blocks, "Q4_0", x, threads=2), want)
            nk.hold_pool(0)
        finally:
            os._exit(0 if ok else 1)
    assert os.waitpid(pid, 0)[1] == 0
