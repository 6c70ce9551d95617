"""The streaming buffers a unit is read into: page-aligned host memory (pinned where a CUDA device copies from it),
its device copy and the events that order the copy and the compute reading it."""

from __future__ import annotations

import mmap
from dataclasses import dataclass, field

import torch

from ..sizes import ALIGN


@dataclass
class Slot:
    host: torch.Tensor  # uint8, page-aligned (pinned on CUDA)
    device: torch.Tensor | None = None  # uint8 on the compute device (CUDA only)
    ready: object = None  # CUDA event: copy into `device` finished
    free_after: object = None  # CUDA event: compute finished reading `device`
    views: dict = field(default_factory=dict)  # unit -> its tensors as views of this buffer (units read unconverted)


def aligned_buffer(nbytes: int, pin: bool) -> torch.Tensor:
    if pin:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    mm = mmap.mmap(-1, max(nbytes, ALIGN))  # anonymous mappings are page-aligned, as O_DIRECT needs
    return torch.frombuffer(mm, dtype=torch.uint8)[:nbytes]
