"""A cache directory nothing can be written in (a read-only disk, a directory of another user): each command
says so in one line naming the directory and ROCKETLLM_CACHE, and what only reads the cache still works.

The directory is made read-only for real: mode bits for a normal user, a read-only bind mount for root (whom
mode bits do not stop). Where neither is possible the tests skip, saying why; the message mapping is also
checked on its own, without a read-only directory."""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from typer.testing import CliRunner

from rocketllm_cli.app import app
from rocketllm_cli.cachehome import unwritable
from rocketllm_cli.errors import describe
from rocketllm_cli.profiles import HardwareProfile, cache_dir, hardware


def invoke(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


def _make_read_only(directory: Path):
    """Make `directory` read-only; returns the undo, or skips when this process cannot."""
    if os.geteuid() != 0:
        modes = {p: p.stat().st_mode for p in [directory, *directory.rglob("*")] if p.is_dir()}
        for p in modes:
            p.chmod(0o555)
        return lambda: [p.chmod(m) for p, m in modes.items()]
    mounted = subprocess.run(["mount", "--bind", str(directory), str(directory)], capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"root here cannot bind-mount a read-only directory ({mounted.stderr.strip() or 'mount failed'})")
    ro = subprocess.run(["mount", "-o", "remount,bind,ro", str(directory)], capture_output=True, text=True)
    undo = lambda: subprocess.run(["umount", str(directory)], check=False)  # noqa: E731
    if ro.returncode != 0:
        undo()
        pytest.skip(f"root here cannot remount read-only ({ro.stderr.strip() or 'mount failed'})")
    return undo


@pytest.fixture
def stored_profile() -> tuple[dict, dict]:
    """The session's measured profile documents (host and the cache's filesystem), to stand in for measuring;
    asked for before readonly_cache, which moves ROCKETLLM_CACHE."""
    profile = HardwareProfile.load()
    where = cache_dir() / "profiles" / profile.fingerprint
    host = json.loads((where / "host.json").read_text())
    # the filesystem's document: the one beside host.json with measurements (the others are per-set and per-build
    # records: kernel rates, unit reads, decode times, the native kernels' paths)
    docs = (json.loads(p.read_text()) for p in sorted(where.glob("*.json")) if p.name != "host.json")
    disk = next(doc for doc in docs if isinstance(doc, dict) and "measurements" in doc)
    return host, disk


@pytest.fixture
def readonly_cache(tmp_path, monkeypatch, tiny_checkpoint):
    """A cache holding one shard set and no profile, then made read-only; ROCKETLLM_CACHE points at it."""
    root = tmp_path / "cache"
    result = invoke("shard", tiny_checkpoint, "--out", root / "shards" / "tiny-set")
    assert result.exit_code == 0, result.stderr
    undo = _make_read_only(root)
    monkeypatch.setenv("ROCKETLLM_CACHE", str(root))
    yield root
    undo()


def test_nothing_can_be_written_there(readonly_cache):
    why = unwritable(readonly_cache / "shards")
    assert why is not None and ("Read-only" in why or "Permission" in why)


def test_doctor_measures_and_says_the_profile_was_not_cached(stored_profile, readonly_cache, monkeypatch):
    host, disk = stored_profile
    monkeypatch.setattr(hardware, "_measure_host", lambda log: dict(host))
    monkeypatch.setattr(hardware, "_measure_filesystem", lambda fs, log, own: {**disk, "cacheable": True})
    result = invoke("doctor")
    assert result.exit_code == 0, result.stderr
    assert "profile cached" not in result.stderr
    warning = next(line for line in result.stderr.splitlines() if "not cached" in line)
    assert str(readonly_cache / "profiles") in warning and "ROCKETLLM_CACHE" in warning
    assert not (readonly_cache / "profiles").exists()


def test_shard_into_it_is_refused_in_one_line_naming_it(readonly_cache, tiny_factory):
    before = sorted(p.name for p in (readonly_cache / "shards").iterdir())
    result = invoke("shard", tiny_factory("llama", seed=3))
    assert result.exit_code == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) >= 1 and lines[-1].startswith("error: cannot write shards in ")
    assert str(readonly_cache / "shards") in lines[-1] and "ROCKETLLM_CACHE" in lines[-1] and "--out" in lines[-1]
    assert "disk space" not in result.stderr and "Traceback" not in result.stderr
    assert sorted(p.name for p in (readonly_cache / "shards").iterdir()) == before


def test_cache_rm_there_names_the_directory_and_keeps_the_set(readonly_cache):
    result = invoke("cache", "rm", "-y", "tiny-set")
    assert result.exit_code == 1
    line = result.stderr.strip().splitlines()[-1]
    assert line.startswith("error: cannot write ") and f"the cache directory {readonly_cache} is not writable" in line
    assert "ROCKETLLM_CACHE" in line and "internal error" not in line
    assert (readonly_cache / "shards" / "tiny-set" / "manifest.json").is_file()


def test_what_only_reads_it_still_works(readonly_cache):
    listed = invoke("cache", "ls")
    assert listed.exit_code == 0 and "tiny-set" in listed.stdout
    ps = invoke("ps")
    assert ps.exit_code == 0 and "no warm models" in ps.stdout + ps.stderr
    generated = invoke("generate", readonly_cache / "shards" / "tiny-set", "--raw", "hello", "-n", 2, "--keep-alive", 0)
    assert generated.exit_code == 0, generated.stderr


def test_generate_asked_to_keep_warm_loads_here_and_says_why(readonly_cache):
    result = invoke("generate", readonly_cache / "shards" / "tiny-set", "--raw", "hello", "-n", 2, "--keep-alive", "5m")
    assert result.exit_code == 0, result.stderr
    note = next(line for line in result.stderr.splitlines() if "cannot hold warm models" in line)
    assert note.startswith(f"note: {readonly_cache / 'run'} cannot hold warm models (") and "ROCKETLLM_CACHE" in note
    assert (
        note.endswith("so the model loads in this process (no warm server)") and not (readonly_cache / "run").exists()
    )


def test_a_failed_write_in_the_cache_names_it_and_the_variable(tmp_path, monkeypatch):
    monkeypatch.setenv("ROCKETLLM_CACHE", str(tmp_path))
    for code in (errno.EROFS, errno.EACCES):
        message, exit_code = describe(OSError(code, os.strerror(code), str(tmp_path / "profiles" / "x.json")))
        assert exit_code == 1 and message.startswith(f"cannot write {tmp_path / 'profiles' / 'x.json'}")
        assert f"the cache directory {tmp_path} is not writable" in message and "ROCKETLLM_CACHE" in message
    elsewhere = describe(OSError(errno.EROFS, os.strerror(errno.EROFS), "/elsewhere/file"))[0]
    assert elsewhere == "read-only file system: /elsewhere/file"


def test_unwritable_names_why(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    assert unwritable(tmp_path / "fine") is None and (tmp_path / "fine").is_dir()
    assert unwritable(blocker / "below") == os.strerror(errno.ENOTDIR)
    shutil.rmtree(tmp_path / "fine")
