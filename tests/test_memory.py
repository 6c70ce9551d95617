"""Peak memory of sharding and of streaming a checkpoint much larger than one layer (~1 GB, built here)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rocketllm_cli.checkpoint.manifest import Manifest
from rocketllm_cli.synthetic import config_for, write_checkpoint

PROBE = Path(__file__).parent / "fixtures" / "rss_probe.py"
MB = 1 << 20


@pytest.fixture(scope="module")
def big(tmp_path_factory):
    """A ~1 GB bf16 Llama (about 500M parameters): many layers, each far smaller than the whole."""
    root = tmp_path_factory.mktemp("big")
    source = write_checkpoint(config_for("llama", "500M"), root / "source", dtype=torch.bfloat16, layout="sharded")
    return source, root / "shards"


def _probe(*args: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parent.parent)}
    done = subprocess.run([sys.executable, str(PROBE), *args], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_shard_then_stream_peak_memory(big):
    source, shards = big
    weights = sum(f.stat().st_size for f in source.glob("*.safetensors"))
    assert weights > 900 * MB

    sharding = _probe("shard", str(source), str(shards))
    manifest = Manifest.load(shards)
    largest = max(u.tensor_bytes for u in manifest.units)
    layer = max(u.tensor_bytes for u in manifest.layers)
    assert largest < weights / 8, "the fixture must be much larger than any one unit"
    # The sharder holds one unit (plus one tensor in flight), never the checkpoint.
    added = sharding["peak"] - sharding["baseline"]
    assert added < 2 * largest + 64 * MB, (
        f"sharding added {added / MB:.0f} MB; largest unit {largest / MB:.0f} MB, "
        f"checkpoint {weights / MB:.0f} MB; {sharding}"
    )

    depth = 2
    streaming = _probe("generate", str(source), str(shards), str(depth))
    # Nothing resident: the bound the engine promises is its streaming buffers plus a fixed allowance.
    bound = (depth + 2) * largest + 600 * MB
    # Sampled RSS, not ru_maxrss: Linux carries the parent's (pytest's) high-water mark into a child across exec.
    assert streaming["peak"] < bound, f"peak {streaming['peak'] / MB:.0f} MB >= bound {bound / MB:.0f} MB; {streaming}"
    served = streaming["per_token_served"]
    assert served["device"] == 0 and served["host"] == 0
    # Every unit came from storage each token, except the untied embedding table, whose lookup reads one row.
    embed = next(u for u in manifest.units if u.kind == "embed")
    assert not manifest.aliases
    assert (
        served["storage"] == manifest.total_bytes - embed.tensor_bytes + embed.tensor_bytes // embed.tensors[0].shape[0]
    )
    assert streaming["peak"] - streaming["baseline"] < manifest.total_bytes / 2, (layer, largest)
