"""Checkpoints bench needs: synthetic models written once into the cache, and a plain Hugging Face copy for baselines.

synthetic_checkpoint("llama:1B")       -> <cache>/synthetic/llama-1B-seed0   (bf16, streamed, reused)
hf_checkpoint(model, manifest)         -> a directory transformers loads, or a reason there is none
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

from ..errors import UsageError

SEED = 0
DONE = ".complete"  # written last: a directory without it is an interrupted write, redone


def synthetic_dir(spec: str) -> Path:
    from ..profiles import cache_dir

    safe = re.sub(r"[^A-Za-z0-9._-]+", "-", spec.strip())
    return cache_dir() / "synthetic" / f"{safe}-seed{SEED}"


def synthetic_config(spec: str):
    """The transformers config for 'arch:SIZE'; a bad spec is a usage error naming what is accepted."""
    from ..synthetic import ARCHS, config_from_spec

    arch, sep, size = spec.partition(":")
    if not sep or not size.strip():
        raise UsageError(
            f"bad --synthetic {spec!r}: expected ARCH:SIZE such as llama:1B (architectures: {', '.join(ARCHS)})"
        )
    try:
        return config_from_spec(spec)
    except ValueError as exc:
        raise UsageError(f"bad --synthetic {spec!r}: {exc}") from None


def synthetic_checkpoint(spec: str, log=lambda m: None) -> Path:
    """A bf16 random-weight checkpoint of `spec`, written once (streamed, ~one chunk in memory) and reused."""
    import torch

    from ..synthetic import count_params, write_checkpoint

    config = synthetic_config(spec)
    dest = synthetic_dir(spec)
    if (dest / DONE).is_file():
        return dest
    params = count_params(config)
    log(
        f"writing synthetic {spec} ({params / 1e9:.2f}B parameters, {2 * params / 1e9:.1f} GB bf16) once into the "
        f"bench cache"
    )
    write_checkpoint(config, dest, dtype=torch.bfloat16, seed=SEED, layout="single")
    (dest / DONE).write_text(spec + "\n")
    return dest


def hf_checkpoint(model: str, manifest, log=lambda m: None) -> tuple[Path | None, str]:
    """A Hugging Face directory with the same weights as the shards, for the baselines; (None, why) when there is
    none."""
    from ..checkpoint.manifest import MANIFEST
    from ..profiles import cache_dir

    path = Path(model).expanduser()
    if path.is_dir() and (path / MANIFEST).is_file():
        return None, "MODEL is a shard directory: pass the source checkpoint to measure baselines"
    if path.is_dir() and (path / "config.json").is_file():
        return path, ""
    if path.is_file() and path.suffix == ".gguf":
        dest = cache_dir() / "bench" / "hf" / f"{path.stem}-{manifest.source.get('fingerprint', 'x')}-{manifest.dtype}"
        if not (dest / DONE).is_file():
            _save_gguf_copy(path, dest, manifest.dtype, log)
        return dest, ""
    return None, "baselines need a local checkpoint directory or .gguf file"


def _save_gguf_copy(path: Path, dest: Path, dtype: str, log) -> None:
    """Dequantize the GGUF once and save it as safetensors, as the baselines' common source."""
    from transformers import AutoModelForCausalLM

    from ..compat import dtype_kwargs
    from ..shard.tokenizers import save_gguf_tokenizer

    log(f"saving a {dtype} safetensors copy of {path.name} for the baselines (once)")
    from ..dtypes import torch_dtype

    partial = dest.with_name("." + dest.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, **dtype_kwargs(torch_dtype(dtype)))
    # The weights are already dequantized in memory; only the GGUF marker stops save_pretrained.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(partial)
    save_gguf_tokenizer(path, partial)
    del model
    (partial / DONE).write_text(path.name + "\n")
    shutil.rmtree(dest, ignore_errors=True)
    partial.rename(dest)
