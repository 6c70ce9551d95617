"""AutoModel: one call from a model path, GGUF file, hub id or shard directory to a streaming model."""

from __future__ import annotations

import os
from pathlib import Path

from .manifest import MANIFEST, Manifest
from .model import EngineConfig, StreamingModel


def ensure_shards(model: str | os.PathLike, out: Path | None = None, dtype: str = "auto", progress=None, log=None) -> tuple[Manifest, Path]:
    """A complete shard set for MODEL: the directory itself if it is one, else shard it (or reuse)."""
    path = Path(str(model)).expanduser()
    if path.is_dir() and (path / MANIFEST).is_file():
        return Manifest.load(path), path
    from .sharder import shard

    manifest, directory, _ = shard(model, out=out, dtype=dtype, progress=progress, log=log or (lambda m: None))
    return manifest, directory


def engine_config(profile, knobs, manifest: Manifest) -> tuple[EngineConfig, list[str]]:
    """Turn resolved knobs into the engine's config; returns it and the decisions worth logging once."""
    notes = []
    compute = knobs.value("compute_dtype")
    if knobs["compute_dtype"].source == "derived" and compute != manifest.dtype:
        # Run in the dtype the shards hold unless the device cannot: conversion would cost a copy per use.
        if manifest.dtype == "fp32" or manifest.dtype == compute or (manifest.dtype == "bf16" and compute == "bf16"):
            compute = manifest.dtype
        elif manifest.dtype == "fp16" and profile.compute_device != "cpu":
            compute = "fp16"
    if compute != manifest.dtype:
        notes.append(f"shards hold {manifest.dtype}, computing in {compute}: each streamed use converts (reshard with --dtype {compute} to avoid it)")
    config = EngineConfig(
        device=profile.compute_device,
        compute_dtype=compute,
        device_cache_bytes=int(knobs.value("device_cache_bytes")),
        host_cache_bytes=int(knobs.value("host_cache_bytes")),
        prefetch_depth=int(knobs.value("prefetch_depth")),
        io_workers=int(knobs.value("io_workers")),
        direct_io=bool(knobs.value("direct_io")),
        pin_memory=bool(knobs.value("pin_memory")),
    )
    return config, notes


class AutoModel:
    """`AutoModel.from_pretrained(path_or_id_or_gguf, **knob_overrides)` -> a StreamingModel."""

    @staticmethod
    def from_pretrained(model: str | os.PathLike, *, out: Path | None = None, shard_dtype: str = "auto", flags: dict | None = None,
                        refresh_profile: bool = False, progress=None, log=None, **knob_overrides) -> StreamingModel:
        from transformers import AutoConfig

        from ..profiles import HardwareProfile, resolve_knobs
        from .facts import facts_from_manifest

        manifest, directory = ensure_shards(model, out=out, dtype=shard_dtype, progress=progress, log=log)
        profile = HardwareProfile.load(storage_path=directory, refresh=refresh_profile)
        facts = facts_from_manifest(manifest, AutoConfig.from_pretrained(directory))
        knobs = resolve_knobs(profile, facts, flags=flags or {}, kwargs=knob_overrides)
        config, notes = engine_config(profile, knobs, manifest)
        for note in notes:
            (log or (lambda m: None))(note)
        streamed = StreamingModel(directory, config, manifest)
        streamed.knobs = knobs
        streamed.profile = profile
        streamed.facts = facts
        return streamed
