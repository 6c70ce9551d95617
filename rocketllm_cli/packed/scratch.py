"""One reusable byte buffer per device that dequantized weights are written into just before a layer runs.

It grows when a larger weight needs it and is never allocated per call, so a streamed model that dequantizes
every layer holds one layer's float weight (plus its unpacking staging) however many layers it has.
A view taken from it is valid until the next take: use it for one layer's computation, then let it go.
"""

from __future__ import annotations

import torch

from ..sizes import round_up

ALIGN = 64  # bytes: each region taken starts at a multiple of this, so any dtype can view it


class Scratch:
    """take(device, (numel, dtype), ...) -> one view per request, all inside one buffer for that device."""

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}
        self.grown = 0  # how many times a buffer was (re)allocated: a test checks it stays put

    def take(self, device, *requests: tuple[int, torch.dtype]) -> list[torch.Tensor]:
        """Flat tensors of the requested sizes and dtypes, side by side in this device's buffer."""
        offsets, end = [], 0
        for numel, dtype in requests:
            offsets.append(end)
            end += round_up(numel * dtype.itemsize, ALIGN)
        key = str(torch.device(device))
        buffer = self._buffers.get(key)
        if buffer is None or buffer.numel() < end:
            self._buffers.pop(key, None)  # let the old one go before the new one is made
            buffer = self._buffers[key] = torch.empty(end, dtype=torch.uint8, device=device)
            self.grown += 1
        return [buffer[at : at + numel * dtype.itemsize].view(dtype) for at, (numel, dtype) in zip(offsets, requests)]

    def nbytes(self, device) -> int:
        """Bytes held for `device` (0 before the first take)."""
        buffer = self._buffers.get(str(torch.device(device)))
        return 0 if buffer is None else buffer.numel()


SCRATCH = Scratch()  # the process's default: one model runs at a time, on one thread
