"""What a bound weight leaves behind once its layer has run: nothing but the placeholder, unless the weights persist."""

from __future__ import annotations

import torch

from rocketllm_cli.shard.sharder import shard
from rocketllm_cli.stream.engineconfig import EngineConfig
from rocketllm_cli.stream.model import StreamingModel

PROMPT = torch.tensor([[1, 40, 57, 60, 71]])


def _run(directory, manifest, **cfg) -> StreamingModel:
    model = StreamingModel(directory, EngineConfig(**cfg), manifest)
    with torch.inference_mode():
        model.generate(
            PROMPT, attention_mask=torch.ones_like(PROMPT), max_new_tokens=3, do_sample=False, pad_token_id=3
        )
    return model


def test_converted_copies_are_released_after_each_use(tiny_factory, tmp_path):
    # bf16 shards computed in fp32: every streamed use converts, and no layer may keep its fp32 copy afterwards
    manifest, directory, _ = shard(
        tiny_factory("llama", dtype=torch.bfloat16), out=tmp_path / "bf16", log=lambda m: None
    )
    model = _run(directory, manifest, compute_dtype="fp32", device_cache_bytes=0, host_cache_bytes=0)
    try:
        streamed = [u.name for u in manifest.units if model.plan.tier[u.name] == "storage"]
        assert streamed, "the plan must stream something for this test to mean anything"
        held = [
            (unit, b.attr)
            for unit in streamed
            for group in model.bindings[unit].values()
            for b in group
            if b._param is not None
        ]
        assert held == []
        for unit in streamed:
            for group in model.bindings[unit].values():
                for b in group:
                    bound = (b.module._buffers if b.is_buffer else b.module._parameters)[b.attr]
                    assert bound is b.placeholder  # after the pass, the placeholder is back
    finally:
        model.close()


def test_persistent_views_keep_their_parameter(tiny_factory, tmp_path):
    # host tier on a CPU: the same mapped views every token, so the Parameter is made once and reused
    manifest, directory, _ = shard(tiny_factory("llama"), out=tmp_path / "fp32", log=lambda m: None)
    model = _run(directory, manifest, compute_dtype="fp32", device_cache_bytes=0, host_cache_bytes=1 << 40)
    try:
        hosted = [u.name for u in manifest.layers if model.plan.tier[u.name] == "host"]
        assert hosted
        kept = [
            b._param for unit in hosted for group in model.bindings[unit].values() for b in group if not b.is_buffer
        ]
        assert kept and all(p is not None for p in kept)
    finally:
        model.close()
