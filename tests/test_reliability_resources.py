"""Resource exhaustion: a disk too small up front, a disk that fills during `shard` (a real per-file size limit,
and, where a private tmpfs can be mounted, a real ENOSPC), and a memory budget smaller than one layer.

A prompt longer than the context is refused in tests/test_cli_generate.py
(test_prompt_longer_than_the_context_is_refused).
"""

from __future__ import annotations

import json
import resource
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from rocketllm_cli.app import app
from rocketllm_cli.checkpoint.manifest import Manifest
from rocketllm_cli.shard import checks, sharder
from rocketllm_cli.sizes import format_bytes

FIXTURES = Path(__file__).parent / "fixtures"
RESUME = "then re-run `rocketllm shard` to resume (finished units are kept)"


@pytest.fixture(autouse=True)
def small_probe(monkeypatch):
    monkeypatch.setenv("ROCKETLLM_PROBE_BYTES", "32MiB")


def invoke(*args, env=None):
    return CliRunner().invoke(app, [str(a) for a in args], env=env)


def one_line(stderr: str, stdout: str = "") -> str:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), stderr
    assert "internal error" not in lines[0] and "Traceback" not in stderr and stdout == ""
    return lines[0]


@pytest.fixture(scope="module")
def twelve(tiny_factory) -> Path:
    return tiny_factory("llama", num_hidden_layers=12)


@pytest.fixture(scope="module")
def need(twelve, tmp_path_factory) -> int:
    """Tensor bytes of the 12-layer model's shard set."""
    out = tmp_path_factory.mktemp("need") / "set"
    sharder.shard(twelve, out=out, log=lambda m: None)
    return Manifest.load(out).total_bytes


def fake_free(monkeypatch, free: int) -> None:
    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda path: real(path)._replace(free=free))


def test_too_little_space_is_refused_up_front_with_nothing_written(twelve, need, tmp_path, monkeypatch):
    fake_free(monkeypatch, need)  # the tensors would fit, the headroom would not
    for out_args in (["--out", tmp_path / "out"], []):
        result = invoke("shard", twelve, *out_args, env={"ROCKETLLM_CACHE": str(tmp_path / "cache")})
        assert result.exit_code == 1
        line = one_line(result.stderr, result.stdout)
        assert line.startswith(
            f"error: not enough disk space for shards: need {format_bytes(need)} plus 64.00 MiB headroom, "
            f"{format_bytes(need)} free at "
        ), line
        assert line.endswith(
            "; free space, or put the shards on another disk (`rocketllm shard --out DIR`, or ROCKETLLM_CACHE=DIR for "
            "every command)"
        )
        assert [str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_file()] == []  # no partial, no lock


def test_the_space_check_counts_units_already_written(twelve, need, tmp_path, monkeypatch):
    """A resume needs room only for what is left: an interrupted run's finished units are not counted twice."""
    real_write = sharder._write_unit
    written: list[int] = []

    def stop_after_eight(directory, file, plan, tensors, mapping, formats=None, fused=None):
        if len(written) == 8:
            raise KeyboardInterrupt
        record = real_write(directory, file, plan, tensors, mapping, formats, fused)
        written.append(record.tensor_bytes)
        return record

    monkeypatch.setattr(sharder, "_write_unit", stop_after_eight)
    assert invoke("shard", twelve, "--out", tmp_path / "out").exit_code == 130
    monkeypatch.setattr(sharder, "_write_unit", real_write)
    left = need - sum(written)
    fake_free(monkeypatch, left + checks.HEADROOM - 1)
    line = one_line(invoke("shard", twelve, "--out", tmp_path / "out").stderr)
    assert f"need {format_bytes(left)} plus" in line
    fake_free(monkeypatch, left + checks.HEADROOM)
    result = invoke("shard", twelve, "--out", tmp_path / "out", "--verify")
    assert result.exit_code == 0, result.stderr


def _limit_file_size(limit: int):
    def apply() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))  # Python ignores SIGXFSZ: writes fail with EFBIG

    return apply


def test_a_write_that_fails_mid_shard_is_one_line_and_resumes(twelve, need, tmp_path):
    """RLIMIT_FSIZE makes the kernel refuse the first unit file larger than 100 KB (after the 86 KB embedding),
    exactly where a full disk would: one line naming what is still needed and what is free, no set at --out,
    the finished units kept; without the limit the same command resumes from them."""
    out = tmp_path / "out"
    command = [sys.executable, "-m", "rocketllm_cli", "shard", str(twelve), "--out", str(out)]
    done = subprocess.run(command, preexec_fn=_limit_file_size(100_000), capture_output=True, text=True, timeout=300)
    assert done.returncode == 1, done.stderr
    line = one_line(done.stderr, done.stdout)
    assert (
        line.startswith("error: cannot write shards (File too large): need ")
        and " free at " in line
        and line.endswith(RESUME)
    ), line
    assert f"need {format_bytes(need - 320 * 64 * 4)} more" in line  # all but the embedding, which was written
    assert not out.exists()
    partial = tmp_path / ".out.partial"
    # the failed .tmp is gone
    assert sorted(p.name for p in partial.iterdir()) == ["0000-embed.safetensors", "journal.jsonl"]

    line = one_line(invoke("generate", out, "Hello", "--raw", "-n", "2").stderr)
    assert "model path not found" in line
    line = one_line(invoke("generate", partial, "Hello", "--raw", "-n", "2").stderr)
    assert "unit files without manifest.json" in line and line.endswith("re-run `rocketllm shard` on the source model")

    result = invoke("shard", twelve, "--out", out, "--verify", "--json")
    assert result.exit_code == 0, result.stderr
    assert json.loads(result.stdout)["verified"] is True and not partial.exists()


def _can_mount_tmpfs(where: Path) -> bool:
    if not shutil.which("unshare"):
        return False
    probe = subprocess.run(
        ["unshare", "-rm", "sh", "-c", f"mount -t tmpfs -o size=1m tmpfs {where}"], capture_output=True
    )
    return probe.returncode == 0


def test_a_disk_that_fills_during_shard(twelve, need, tmp_path):
    """A real ENOSPC: a private 80 MiB tmpfs that another file fills after four units. Skipped where unprivileged
    mount namespaces are not allowed."""
    disk = tmp_path / "disk"
    disk.mkdir()
    if not _can_mount_tmpfs(disk):
        pytest.skip("cannot mount a private tmpfs here (unshare -rm not permitted)")
    script = (
        f"mount -t tmpfs -o size=80m tmpfs {disk} && exec {sys.executable} {FIXTURES / 'kill_fill_disk.py'} "
        f"{twelve} {disk / 'out'} {disk / 'ballast'} 4"
    )
    done = subprocess.run(["unshare", "-rm", "sh", "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    doc = json.loads(done.stdout)
    full = doc["full"]
    assert full["code"] == 1 and not full["out_exists"], full
    line = one_line(full["stderr"], full["stdout"])
    assert line.startswith("error: cannot write shards (No space left on device): need ") and line.endswith(RESUME), (
        line
    )
    assert f"free at {disk}" in line
    assert full["partial"] is not None and not any(name.endswith(".tmp") for name in full["partial"])
    assert doc["generate"]["code"] == 1 and "model path not found" in one_line(doc["generate"]["stderr"])
    resumed = doc["resumed"]
    assert resumed["code"] == 0, resumed["stderr"]
    assert json.loads(resumed["stdout"])["verified"] is True
    assert len(resumed["rewritten"]) <= 15 - 4  # the four units finished before the disk filled were kept


# -- memory --------------------------------------------------------------------------------------------------------


def test_a_budget_smaller_than_one_layer_is_refused_naming_the_minimum(twelve, monkeypatch):
    from rocketllm_cli.profiles import HardwareProfile, cache_dir

    monkeypatch.setenv("ROCKETLLM_PROBE_BYTES", "32MiB")
    HardwareProfile.load(storage_path=twelve)  # measured once, as any earlier run leaves it
    before = set((cache_dir() / "shards").glob("*")) if (cache_dir() / "shards").exists() else set()
    result = invoke("generate", twelve, "Hello", "--raw", "-n", "2", "--reserve-bytes", "1TB")
    assert result.exit_code == 1, result.stdout
    assert "need at least" in one_line(result.stderr, result.stdout)
    after = set((cache_dir() / "shards").glob("*")) if (cache_dir() / "shards").exists() else set()
    assert after == before  # refused from the source's headers, before any sharding
