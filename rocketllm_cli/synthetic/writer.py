"""write_checkpoint: a Hugging Face model directory of random weights, streamed one chunk at a time."""

from __future__ import annotations

import copy
import json
import math
import os
import random
import struct
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from ..compat import set_config_dtype
from .archs import ARCHS, TINY_SHAPE
from .tensors import TensorSpec, chunk_count, make_chunk, saved_tensors, tensor_values
from .tokenizer import VOCAB_SIZE, build_tokenizer

LAYOUTS = ("single", "sharded", "bin")
DEFAULT_STD = 0.3  # at hidden 64; tiny models then give varied greedy output (0.02 collapses most onto one token)
DEFAULT_MAX_FILE_BYTES = 2_000_000_000
BIN_MAX_BYTES = 1 << 30  # pytorch_model.bin is built in memory: tiny models only
_ST_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64"}
_WORKERS = min(4, os.cpu_count() or 1)  # each chunk has its own generator, so threads make chunks in parallel
_BY_MODEL_TYPE = {spec.model_type: spec for spec in ARCHS.values()}


def write_checkpoint(
    config,
    dest: Path,
    *,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    layout: str = "single",
    max_file_bytes: int | None = None,
    tokenizer: bool = True,
    std: float = DEFAULT_STD,
) -> Path:
    """Write config.json, generation_config.json, random weights and (optionally) the byte tokenizer into `dest`.

    layout "single": model.safetensors, or in-order model-0000k-of-0000n files + index past max_file_bytes.
    layout "sharded": at least 3 files + index, scrambled the way that breaks loaders: group k of the stack
    goes to file n-k (file 00001 holds the last layers), the layer at each cut has its tensors dealt
    alternately to both files, and each file stores its tensors in shuffled order.
    layout "bin": pytorch_model.bin via torch.save (tiny models only).
    Values depend only on the config, seed, std and tensor name: every layout of one seed holds the same weights.
    Replaces any weights already in `dest`.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; expected one of {', '.join(LAYOUTS)}")
    if dtype not in _ST_DTYPES:
        raise ValueError(f"unsupported dtype {dtype}; expected one of {', '.join(map(str, _ST_DTYPES))}")
    if tokenizer and config.vocab_size < VOCAB_SIZE:
        raise ValueError(f"vocab_size {config.vocab_size} is smaller than the tokenizer's {VOCAB_SIZE}")
    config = copy.deepcopy(config)
    set_config_dtype(config, dtype)
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    for old in [*dest.glob("*.safetensors"), *dest.glob("*.safetensors.index.json"), *dest.glob("pytorch_model*.bin")]:
        old.unlink()

    specs = saved_tensors(config)
    values = value_rules(config, dtype=dtype, seed=seed, std=std)
    itemsize = torch.empty((), dtype=dtype).element_size()
    if layout == "bin":
        total = sum(spec.numel for spec in specs) * itemsize
        if total > BIN_MAX_BYTES:
            raise ValueError(f"layout 'bin' builds the state dict in memory; {total} bytes is too big, use safetensors")
        torch.save({spec.name: tensor_values(spec, **values) for spec in specs}, dest / "pytorch_model.bin")
    else:
        max_bytes = max_file_bytes or DEFAULT_MAX_FILE_BYTES
        files = plan_files(specs, itemsize, layout=layout, max_file_bytes=max_bytes, seed=seed)
        for file_name, members in files.items():
            write_safetensors(dest / file_name, members, values)
        if len(files) > 1:
            weight_map = {spec.name: file_name for file_name, members in files.items() for spec in members}
            total = sum(spec.numel for spec in specs) * itemsize
            index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
            (dest / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")

    from transformers import GenerationConfig

    config.save_pretrained(dest)
    GenerationConfig.from_model_config(config).save_pretrained(dest)
    if tokenizer:
        build_tokenizer().save_pretrained(dest)
    return dest


def value_rules(config, *, dtype: torch.dtype, seed: int, std: float) -> dict:
    """Keyword arguments of make_chunk for `config`.

    `std` is the matrix std at hidden size 64, scaled by sqrt(64 / hidden) so wide models keep activations
    of the same scale; families that multiply embeddings by sqrt(hidden) get embeddings that much smaller,
    else their tied head echoes the last token.
    """
    arch = _BY_MODEL_TYPE.get(config.model_type)
    hidden = config.hidden_size
    std = std * math.sqrt(TINY_SHAPE["hidden"] / hidden)
    return {
        "dtype": dtype,
        "seed": seed,
        "std": std,
        "norm_value": arch.norm_init if arch else 1.0,
        "embedding_std": std / math.sqrt(hidden) if arch and arch.embed_scaled else None,
    }


def plan_files(
    specs: list[TensorSpec], itemsize: int, *, layout: str, max_file_bytes: int, seed: int = 0
) -> dict[str, list[TensorSpec]]:
    """File name -> its tensors in the order they are stored."""
    sizes = [spec.numel * itemsize for spec in specs]
    total = sum(sizes)
    count = math.ceil(total / max_file_bytes)
    if layout == "sharded":
        count = max(3, count)
    count = max(1, min(count, len(specs)))
    if count == 1:
        return {"model.safetensors": list(specs)}

    # Group of each tensor by the midpoint of its bytes: contiguous groups of about equal size.
    groups, offset = [], 0
    for size in sizes:
        groups.append(min(count - 1, int((offset + size / 2) * count / total)))
        offset += size
    if layout == "sharded":
        _deal_cut_layers(specs, groups)
        groups = [count - 1 - g for g in groups]  # file 00001 holds the end of the stack
    names = [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]
    files: dict[str, list[TensorSpec]] = {name: [] for name in names}
    for spec, group in zip(specs, groups):
        files[names[group]].append(spec)
    if layout == "sharded":
        rng = random.Random(seed)
        for members in files.values():
            rng.shuffle(members)
    return {name: members for name, members in files.items() if members}


def _deal_cut_layers(specs: list[TensorSpec], groups: list[int]) -> None:
    # The decoder layer at each cut between groups g and g+1 gets its tensors dealt g, g+1, g, ...
    cuts = [
        (groups[i - 1], groups[i], specs[i].layer if specs[i].layer is not None else specs[i - 1].layer)
        for i in range(1, len(specs))
        if groups[i] != groups[i - 1]
    ]
    for low, high, layer in cuts:
        members = [j for j, spec in enumerate(specs) if layer is not None and spec.layer == layer]
        for k, j in enumerate(members if len(members) > 1 else []):
            groups[j] = (low, high)[k % 2]


def write_safetensors(path: Path, specs: list[TensorSpec], values: dict) -> None:
    """Stream a safetensors file: header computed from shapes, then each tensor's chunks in order.

    Written to a temporary name and renamed, so an interrupted write leaves no loadable file.
    """
    dtype = values["dtype"]
    itemsize = torch.empty((), dtype=dtype).element_size()
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for spec in specs:
        size = spec.numel * itemsize
        header[spec.name] = {
            "dtype": _ST_DTYPES[dtype],
            "shape": list(spec.shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # data starts 8-byte aligned, as safetensors writes it
    partial = path.with_name(path.name + ".partial")
    jobs = ((spec, index) for spec in specs for index in range(chunk_count(spec)))
    with open(partial, "wb") as out, ThreadPoolExecutor(_WORKERS) as pool:
        out.write(struct.pack("<Q", len(raw)))
        out.write(raw)
        pending: deque = deque()  # chunks in file order; a bounded window keeps memory at a few chunks
        for spec, index in jobs:
            pending.append(pool.submit(make_chunk, spec, index, **values))
            if len(pending) > 2 * _WORKERS:
                out.write(pending.popleft().result().view(torch.uint8).numpy().data)
        while pending:
            out.write(pending.popleft().result().view(torch.uint8).numpy().data)
    os.replace(partial, path)
