"""Which forward passes run every product on the native kernels, and what such a pass gets: the free cores for the
kernels' pool, torch one thread (threads.py native_pass), and the pool's workers held awake from its start.

A decode step is such a pass; so is a prompt shorter than the rows from which a product is multiplied densely by
torch's GEMM (packed/nativeprobe.py): every product of it runs on the kernels too, and torch's own ops on a few
positions gain nothing from a second thread. In such a prompt the pool's worker had slept through torch's attention
(~0.5 ms) and was woken for the next product on a vCPU the hypervisor had halted: 1.6-3.5 ms, ~14 times in a
16-token SmolLM2 prompt of ~95 ms of products. Held, the workers spin between products (50 ms at most after the last
one, or until a pass that is not native begins), so no product waits for a wake.
"""

from __future__ import annotations

import torch

from ..threads import COMPUTE_THREADS


class NativePasses:
    """The native-pass decision for one model: begin(tokens, positions) before each pass."""

    def __init__(self, device: torch.device, packing: str, plan=None) -> None:
        """DEVICE and PACKING: the model's (GGUF blocks on a CPU run their products on the kernels); PLAN: its
        residency plan. A model that streams units waits on reads within its passes, where a spinning worker would
        take a core the reads' threads need: its workers are not held."""
        kernels = None
        if device.type == "cpu" and packing == "blocks":
            from ..native import kernels as native_kernels

            kernels = native_kernels()
        self.kernels = kernels
        self.products = kernels is not None  # whether this model's products run on the native kernels
        self.resident = plan is None or set(plan.tier.values()) <= {"device"}  # every unit in memory
        self._held = False

    def begin(self, tokens: int, positions: int | None) -> None:
        """A pass of TOKENS positions, POSITIONS a row (1: a decode step), is about to run."""
        native = self.products and (positions == 1 or (positions is not None and tokens < _dense_rows()))
        COMPUTE_THREADS.poll(native_decode=native)
        hold = native and self.resident and COMPUTE_THREADS.native_pass
        if hold or self._held:  # a pass that is not native releases them: torch's threads want the cores
            self.kernels.hold_pool(int(hold))
            self._held = hold


def _dense_rows() -> int:
    """The rows from which a product is multiplied densely instead, as this process knows it now; where the probe
    found no crossover up to the most rows it tries, those (a longer prompt keeps torch's threads for its attention)."""
    from ..packed.nativeprobe import native_dense_plan
    from ..packed.probe import DENSE_ROWS

    return native_dense_plan(torch.device("cpu"))[0] or max(DENSE_ROWS)


NO_NATIVE_PASSES = NativePasses(torch.device("meta"), "")  # before a model has decided (a pass hook's early call)
