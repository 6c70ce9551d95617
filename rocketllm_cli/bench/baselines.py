"""Baselines measured beside RocketLLM, on the same checkpoint, prompt, token count and budget.

transformers - plain AutoModelForCausalLM, every weight resident (regime resident)
accelerate   - transformers + accelerate disk offload, device_map {"": "disk"} (budget 0, as our host/storage regimes)
naive        - per-layer loop: safe_open + set_module_tensor_to_device for each tensor before a module runs (storage)
airllm       - AirLLM 4.0.0's AutoModel with device="cpu" (storage)
llamacpp     - llama-cpp-python on the GGUF file itself, quantized as stored (resident; llamacpp.py)

In the storage regime every baseline's weight files are dropped from the page cache
(POSIX_FADV_DONTNEED) at the start of each forward pass, as our engine does after each read,
so each one really reads from storage. A baseline that cannot run returns a skip with the reason.
"""

from __future__ import annotations

import contextlib
import gc
import os
import sys
from pathlib import Path

import torch

from .naive import pin_cpu
from .timing import fixed_prompt, ms_summary, timed_run

REGIMES_OF = {
    "transformers": ("resident",),
    "accelerate": ("host", "storage"),
    "naive": ("storage",),
    "airllm": ("storage",),
    "llamacpp": ("resident", "auto"),
}
ON_GGUF = ("llamacpp",)  # baselines that run the GGUF file, not the Hugging Face copy
BASELINES = tuple(REGIMES_OF)


class Skip(Exception):
    """A baseline that cannot run here; the message is the reason printed in its row."""


def run_baseline(
    name: str, regime: str, hf_dir: Path | None, dtype: torch.dtype, tokens: int, prompt_tokens: int, work: Path, log
) -> dict:
    """One baseline row: measured, or skipped with the reason (never an exception)."""
    row = {"name": name, "regime": regime, "status": "skipped", "reason": ""}
    try:
        if hf_dir is None:
            raise Skip("no Hugging Face checkpoint to load")
        with contextlib.redirect_stdout(sys.stderr):  # some baselines print progress; stdout is for results
            stats = _RUNNERS[name](hf_dir, regime, dtype, tokens, prompt_tokens, work, log)
    except Skip as exc:
        row["reason"] = str(exc)
        return row
    except Exception as exc:  # noqa: BLE001 - a baseline failing is a finding, not our error
        row["reason"] = " ".join(f"{type(exc).__name__}: {exc}".split())[:300]
        return row
    finally:
        gc.collect()
    row.update(
        status="measured",
        ttft_ms=round(1000 * stats.ttft_s, 1),
        ms_per_token=ms_summary(stats.token_gaps_s),
        storage_witnessed_per_token=stats.storage_witnessed_per_token,
        bytes_per_token=None,
    )
    return row


def _tokenizer(hf_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(hf_dir)


def _weight_files(hf_dir: Path) -> list[Path]:
    return sorted(hf_dir.glob("*.safetensors"))


class ColdFiles:
    """A forward pre-hook on the whole model that evicts `files` from the page cache before every pass."""

    def __init__(self, files: list[Path]) -> None:
        self.files = [f for f in files if f.is_file()]

    def __call__(self, *args) -> None:
        for path in self.files:
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def _run_transformers(hf_dir, regime, dtype, tokens, prompt_tokens, work, log):
    from transformers import AutoModelForCausalLM

    from ..compat import dtype_kwargs

    model = AutoModelForCausalLM.from_pretrained(hf_dir, **dtype_kwargs(dtype)).eval()
    return timed_run(model, fixed_prompt(_tokenizer(hf_dir), prompt_tokens), tokens)


def _run_accelerate(hf_dir, regime, dtype, tokens, prompt_tokens, work, log):
    import shutil

    from transformers import AutoModelForCausalLM

    from ..compat import dtype_kwargs

    offload = work / "accelerate-offload"
    shutil.rmtree(offload, ignore_errors=True)
    offload.mkdir(parents=True)
    try:
        # Budget 0 on the compute device: everything offloaded to disk, as in our host and storage regimes.
        model = AutoModelForCausalLM.from_pretrained(
            hf_dir, **dtype_kwargs(dtype), device_map={"": "disk"}, offload_folder=str(offload)
        ).eval()
        pin_cpu(model)
        if regime == "storage":
            model.register_forward_pre_hook(ColdFiles(_weight_files(hf_dir) + sorted(offload.rglob("*.dat"))))
        return timed_run(model, fixed_prompt(_tokenizer(hf_dir), prompt_tokens), tokens)
    finally:
        shutil.rmtree(offload, ignore_errors=True)


def _run_naive(hf_dir, regime, dtype, tokens, prompt_tokens, work, log):
    from .naive import NaiveStreamer

    files = _weight_files(hf_dir)
    if not files:
        raise Skip("the checkpoint has no .safetensors files (the naive loop uses safe_open)")
    streamer = NaiveStreamer(hf_dir, dtype)
    streamer.model.register_forward_pre_hook(ColdFiles(files))
    return timed_run(streamer.model, fixed_prompt(_tokenizer(hf_dir), prompt_tokens), tokens)


def _run_airllm(hf_dir, regime, dtype, tokens, prompt_tokens, work, log):
    try:
        import airllm
    except Exception as exc:  # noqa: BLE001 - ImportError, or a dependency failing at import
        raise Skip(
            f"airllm not importable ({type(exc).__name__}: {exc}); pip install -e '.[bench]' in the rocketllm "
            f"source directory"
        ) from None
    split = work / "airllm" / hf_dir.name
    model = airllm.AutoModel.from_pretrained(
        str(hf_dir), device="cpu", dtype=dtype, layer_shards_saving_path=str(split)
    )
    model.model.register_forward_pre_hook(ColdFiles(sorted(split.rglob("*.safetensors"))))
    return timed_run(model, fixed_prompt(model.tokenizer, prompt_tokens), tokens)


_RUNNERS = {
    "transformers": _run_transformers,
    "accelerate": _run_accelerate,
    "naive": _run_naive,
    "airllm": _run_airllm,
}
