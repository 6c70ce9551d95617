"""KL(REF || MODEL) per scored token between two models' log-probabilities over a text, with the log-probabilities
of the first run kept on disk (a scratch directory that must hold them) while the second is scored."""

from __future__ import annotations

import math
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from ..errors import RocketError
from ..sizes import format_bytes

SCRATCH_MARGIN = 64 << 20  # bytes a scratch directory keeps free beyond the file


class Divergence:
    """KL(reference || model) at every scored position, in nats: the sum over the vocabulary of
    p_ref * (log p_ref - log p_model), both log-softmaxes in fp32 (a token the reference gives probability 0 adds 0).

    Memory bound: the model is scored first and `keep` writes its log-probabilities, ROWS positions at a time as
    `score` makes them, to a scratch file (fp32, scored positions x vocabulary: 4 * (n - 1) * V bytes on disk, 1 GiB for
    Gemma's 262,144 tokens x 1,000 positions); while the reference is scored, `compare` reads the model's same rows back
    in the same order. Memory holds at most ROWS positions of each model's distributions and the temporaries of one step
    (about 4 * ROWS * V floats: 256 MiB at V = 262,144) beside the forward pass's own logits of one window, never all
    positions of either model; what stays for the whole text is one float per position."""

    def __init__(self, path: Path, names: tuple[str, str]) -> None:
        self.path, self.names = path, names
        self.width: int | None = None  # the model's vocabulary, from its first rows
        self.kept = self.compared = 0
        self.values: list[float] = []
        self.why_not: str | None = None  # why no KL is given (the reference scores another vocabulary)
        self._file = open(path, "wb")
        self._reading = False

    def keep(self, logp) -> None:
        """The model's rows, to the scratch file."""
        self.width = logp.shape[-1]
        self._file.write(logp.detach().cpu().contiguous().numpy())
        self.kept += logp.shape[0]

    def compare(self, logp) -> None:
        """The reference's rows against the model's same rows, read back."""
        import torch

        if self.why_not is not None:
            return
        if logp.shape[-1] != self.width:
            self.why_not = (
                f"{self.names[0]} scores {self.width} tokens, --reference {self.names[1]} {logp.shape[-1]} "
                "(a padded vocabulary)"
            )
            return
        if not self._reading:
            self._file.close()
            self._file = open(self.path, "rb")
            self._reading = True
        stored = torch.empty(tuple(logp.shape), dtype=torch.float32)
        if self._file.readinto(stored.numpy()) != stored.numel() * 4:
            raise RocketError(f"the scratch file {self.path} ends before position {self.compared + logp.shape[0]}")
        stored = stored.to(logp.device)
        p = logp.exp()
        torch.sub(logp, stored, out=stored)  # log p_ref - log p_model, in place
        stored.mul_(p).masked_fill_(p == 0, 0.0)  # 0 * log 0 is 0, not nan
        self.values += stored.sum(dim=-1).double().tolist()
        self.compared += logp.shape[0]

    def summary(self) -> dict | None:
        """Mean, 99th percentile and max per scored position; None when the vocabularies differ."""
        from .timing import percentile

        if self.why_not is not None:
            return None
        if self.compared != self.kept or not self.values:
            raise RocketError(f"KL divergence: the reference scored {self.compared} positions, the model {self.kept}")
        values = sorted(self.values)
        return {
            "mean": round(math.fsum(values) / len(values), 8),
            "p99": round(percentile(values, 99), 8),
            "max": round(values[-1], 8),
        }

    def close(self) -> None:
        self._file.close()


@contextmanager
def divergence(positions: int, vocabulary: int, names: tuple[str, str], log=None) -> Iterator[Divergence]:
    """A Divergence whose scratch file lives in a temporary directory, removed on the way out however it is left
    (an error, Ctrl-C)."""
    directory = scratch_directory(positions, vocabulary)
    if log is not None:
        log(
            f"KL divergence: {names[0]}'s log-probabilities wait in {directory} until the reference is scored "
            f"({format_bytes(4 * positions * vocabulary)}, removed after)"
        )
    with tempfile.TemporaryDirectory(prefix="perplexity-kl-", dir=directory) as scratch:
        meter = Divergence(Path(scratch) / "model-logprobs.f32", names)
        try:
            yield meter
        finally:
            meter.close()


def scratch_directory(positions: int, vocabulary: int) -> Path:
    """Where the model's log-probabilities wait: the cache directory, else the system's temporary directory (often in
    memory, so second), the first writable one with room for the file and SCRATCH_MARGIN."""
    from ..cachehome import cache_root, unwritable

    needed, tried = 4 * positions * vocabulary, []
    for directory in dict.fromkeys((cache_root(), Path(tempfile.gettempdir()))):
        why = unwritable(directory)
        if why is None:
            free = shutil.disk_usage(directory).free
            if free >= needed + SCRATCH_MARGIN:
                return directory
            why = f"{format_bytes(free)} free"
        tried.append(f"{directory} ({why})")
    raise RocketError(
        f"KL divergence needs {format_bytes(needed)} of scratch space for the model's log-probabilities "
        f"({positions} positions x {vocabulary} tokens, fp32): {'; '.join(tried)}; set ROCKETLLM_CACHE "
        f"or "
        "TMPDIR to a directory with room"
    )
