"""The llama.cpp baseline: llama-cpp-python on the GGUF file itself, its weights computed on as stored (quantized).

Measured like every other row (timing.py): the fixed prompt of --prompt-tokens tokens, greedy decoding, 1 + warm-up
+ --tokens tokens, the warm-up left out; each step is timed from one yielded token to the next, as the streamer does.
The file is mapped (use_mmap, llama.cpp's default), so its weights sit in the page cache as our host tier's do on a
CPU; n_threads is the profile's usable cores; every layer goes to the GPU when the compute device is one, none on a CPU.
llama-cpp-python is not a dependency: without it the row is a skip with the install command.
"""

from __future__ import annotations

import time
from itertools import pairwise
from pathlib import Path

from .timing import WARMUP, fixed_prompt, ms_summary

NOT_INSTALLED = "llama-cpp-python is not installed (pip install llama-cpp-python)"
CONTEXT_SLACK = 16  # tokens of n_ctx beyond prompt + generated ones


def gguf_file(model: str | None, manifest) -> tuple[Path | None, str]:
    """The GGUF file MODEL is, or (None, why not) for a checkpoint, a shard set or a synthetic model."""
    from ..shard.manifest import MANIFEST

    path = Path(model).expanduser() if model else None
    if path is not None and path.is_file() and path.suffix == ".gguf":
        return path, ""
    if path is not None and path.is_dir() and not (path / MANIFEST).is_file() and not (path / "config.json").is_file():
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:  # a directory holding one GGUF is that GGUF (shard/source.py reads it so too)
            return ggufs[0], ""
    if manifest.source.get("kind") == "gguf":
        return None, f"MODEL is a shard set of {manifest.source.get('name')}.gguf: pass the .gguf file to measure llama.cpp"
    return None, "the model has no GGUF file (llama.cpp runs GGUF files; MODEL was not sharded from one)"


def run_llamacpp(gguf: Path | None, no_gguf: str, regime: str, tokens: int, prompt_tokens: int, profile, log) -> dict:
    """One baseline row: measured, or skipped with the reason (never an exception)."""
    row = {"name": "llamacpp", "regime": regime, "status": "skipped", "reason": ""}
    try:
        import llama_cpp
    except ImportError:
        row["reason"] = NOT_INSTALLED
        return row
    except Exception as exc:  # noqa: BLE001 - installed but broken (a missing shared library): say which
        row["reason"] = " ".join(f"llama-cpp-python not importable ({type(exc).__name__}: {exc})".split())[:300]
        return row
    if gguf is None:
        row["reason"] = no_gguf
        return row
    threads = int(profile.cpu_cores)
    gpu_layers = 0 if profile.compute_device == "cpu" else -1
    try:
        llm = llama_cpp.Llama(model_path=str(gguf), n_ctx=prompt_tokens + 1 + WARMUP + tokens + CONTEXT_SLACK, n_threads=threads,
                              n_threads_batch=threads, n_gpu_layers=gpu_layers, use_mmap=True, verbose=False)
        try:
            ttft_s, gaps_s, witnessed = _timed(llm, fixed_prompt(_Tokenizer(llm), prompt_tokens), tokens)
        finally:
            if hasattr(llm, "close"):  # older releases free the model only when it is collected
                llm.close()
    except Exception as exc:  # noqa: BLE001 - a baseline failing is a finding, not our error
        row["reason"] = " ".join(f"{type(exc).__name__}: {exc}".split())[:300]
        return row
    where = "no GPU layers" if gpu_layers == 0 else "every layer on the GPU"
    log(f"{regime}: llama.cpp {getattr(llama_cpp, '__version__', '?')} on {gguf.name}, {threads} threads, {where}")
    row.update(status="measured", ttft_ms=round(1000 * ttft_s, 1), ms_per_token=ms_summary(gaps_s),
               storage_witnessed_per_token=witnessed, bytes_per_token=None,
               llamacpp={"version": getattr(llama_cpp, "__version__", None), "n_threads": threads, "n_gpu_layers": gpu_layers,
                         "use_mmap": True, "gguf": gguf.name, "gguf_bytes": gguf.stat().st_size})
    return row


class _Tokenizer:
    """The one call fixed_prompt makes of a tokenizer, answered by llama.cpp's own (the GGUF's vocabulary)."""

    def __init__(self, llm) -> None:
        self.llm = llm

    def __call__(self, text: str, add_special_tokens: bool = False):
        from types import SimpleNamespace

        return SimpleNamespace(input_ids=self.llm.tokenize(text.encode("utf-8"), add_bos=add_special_tokens))


def _timed(llm, prompt: list[int], tokens: int) -> tuple[float, list[float], int | None]:
    """(time to first token, gaps between the measured tokens, storage bytes read per measured token)."""
    from ..stream.ledger import storage_read_bytes

    new = 1 + WARMUP + tokens
    times, marks = [], []
    start = time.perf_counter()
    steps = llm.generate(prompt, top_k=1, temp=0.0, repeat_penalty=1.0, reset=True)  # greedy; never stops at EOS itself
    for _ in steps:
        times.append(time.perf_counter())
        marks.append(storage_read_bytes())
        if len(times) == new:
            break
    steps.close()
    if len(times) < new:
        raise RuntimeError(f"llama.cpp stopped after {len(times)} tokens; expected {new}")
    gaps = [b - a for a, b in pairwise(times)][WARMUP:]
    first, last = marks[WARMUP], marks[-1]
    witnessed = (last - first) // len(gaps) if first is not None and last is not None else None
    return times[0] - start, gaps, witnessed
