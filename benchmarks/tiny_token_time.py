"""Per-token time of the tiny synthetic Llama, resident and streamed: the cost of the binding machinery itself.

    PYTHONPATH=. python benchmarks/tiny_token_time.py [--tokens 64] [--repeats 5]

The tiny model computes almost nothing, so what it measures is the hooks, the binds and transformers' own
overhead per token; run it before and after a change to the binding path and compare the medians.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from rocketllm_cli.shard.sharder import shard
from rocketllm_cli.stream.engineconfig import EngineConfig
from rocketllm_cli.stream.model import StreamingModel
from rocketllm_cli.synthetic import config_for, write_checkpoint

REGIMES = {
    "resident": {"device_cache_bytes": 1 << 40, "host_cache_bytes": 0},
    "host": {"device_cache_bytes": 0, "host_cache_bytes": 1 << 40},
    "storage": {"device_cache_bytes": 0, "host_cache_bytes": 0},
}
PROMPT = torch.tensor([[1, 40, 57, 60, 71]])


def per_token_ms(model, tokens: int, repeats: int) -> list[float]:
    """Milliseconds per generated token, one value per repeat (after one warm-up run)."""
    out = []
    for i in range(repeats + 1):
        started = time.perf_counter()
        with torch.inference_mode():
            model.generate(
                PROMPT,
                attention_mask=torch.ones_like(PROMPT),
                max_new_tokens=tokens,
                min_new_tokens=tokens,
                do_sample=False,
                pad_token_id=3,
            )
        if i:
            out.append((time.perf_counter() - started) * 1000 / tokens)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        source = write_checkpoint(config_for("llama"), Path(tmp) / "llama")
        manifest, directory, _ = shard(source, out=Path(tmp) / "shards", log=lambda m: None)
        for regime, budgets in REGIMES.items():
            with StreamingModel(directory, EngineConfig(prefetch_depth=0, **budgets), manifest) as model:
                times = per_token_ms(model, args.tokens, args.repeats)
            print(
                f"{regime:9s} median {statistics.median(times):6.2f} ms/token  (min {min(times):.2f}, max "
                f"{max(times):.2f})"
            )


if __name__ == "__main__":
    main()
