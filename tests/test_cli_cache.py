"""rocketllm cache: ls shows every set in the cache as it is on disk, a load updates its last use, rm deletes
only what it is asked to inside the cache (never one being sharded, never without asking), path says where."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cli_contract import one_error_line
from typer.testing import CliRunner

from rocketllm_cli.app import app
from rocketllm_cli.shard import sharder
from rocketllm_cli.sizes import format_bytes


def invoke(*args):
    return CliRunner().invoke(app, ["cache", *map(str, args)])


def ls() -> dict:
    result = invoke("ls", "--json")
    assert result.exit_code == 0, result.stderr
    return json.loads(result.stdout)


def sets_by_name() -> dict[str, dict]:
    return {s["name"]: s for s in ls()["sets"]}


def allocated(path: Path) -> int:
    return sum(p.lstat().st_blocks * 512 for p in path.rglob("*") if p.is_file())


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    """A cache of this test's own, so no test sees another's sets."""
    monkeypatch.setenv("ROCKETLLM_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture
def one_set(cache, tiny_checkpoint) -> Path:
    _, directory, _ = sharder.shard(tiny_checkpoint, log=lambda m: None)  # no out=: into the cache
    assert directory.parent == cache / "shards"
    return directory


class _StopAfter:
    """A progress bar that interrupts sharding after N units, leaving a real .<name>.partial behind."""

    def __init__(self, units: int):
        self.left = units

    def __call__(self, *_, **__):
        return self

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def advance(self, nbytes, units=0):
        self.left -= units
        if self.left == 0:
            raise KeyboardInterrupt


def interrupted_set(checkpoint: Path, units: int = 2, dtype: str = "auto") -> str:
    with pytest.raises(KeyboardInterrupt):
        sharder.shard(checkpoint, dtype=dtype, progress=_StopAfter(units), log=lambda m: None)
    (partial,) = (p for p in (Path(os.environ["ROCKETLLM_CACHE"]) / "shards").glob(".*.partial"))
    return partial.name[1 : -len(".partial")]


def test_ls_shows_each_set_as_it_is_on_disk(one_set, tiny_checkpoint):
    from rocketllm_cli.cachehome import write_json
    from rocketllm_cli.checkpoint.manifest import Manifest
    from rocketllm_cli.profiles.cache import profile_dir

    manifest = Manifest.load(one_set)
    _, bf16, _ = sharder.shard(tiny_checkpoint, dtype="bf16", log=lambda m: None)
    write_json(profile_dir("machine-a") / "host.json", {"measured": True})
    doc = ls()
    got = {s["name"]: s for s in doc["sets"]}
    assert set(got) == {one_set.name, bf16.name}
    row = got[one_set.name]
    assert (row["model"], row["source_kind"], row["dtype"], row["state"]) == (
        manifest.source["name"],
        "safetensors",
        "fp32",
        "complete",
    )
    assert (row["units"], row["layers"], row["bytes"]) == (
        len(manifest.units),
        len(manifest.layers),
        allocated(one_set),
    )
    assert got[bf16.name]["dtype"] == "bf16" and got[bf16.name]["bytes"] < row["bytes"]  # half the bytes per weight
    assert doc["total_bytes"] == allocated(one_set) + allocated(bf16)
    assert doc["profiles"]["count"] == 1 and doc["profiles"]["bytes"] > 0

    text = invoke("ls").stdout
    line = next(l for l in text.splitlines() if l.startswith(one_set.name))
    assert (
        manifest.source["name"] in line
        and "fp32" in line
        and format_bytes(row["bytes"]) in line
        and line.endswith("complete")
    )
    assert (
        f"total: 2 shard sets, {format_bytes(doc['total_bytes'])}" in text
        and "profiles: 1 measured (1 machine)" in text
    )


def test_a_damaged_set_is_listed_as_damaged(one_set):
    unit = sorted(one_set.glob("*-layer.001.safetensors"))[0]
    with open(unit, "r+b") as f:
        f.truncate(unit.stat().st_size - 8)
    row = sets_by_name()[one_set.name]
    assert row["state"] == "damaged" and unit.name in row["problem"] and row["model"] is not None


@pytest.fixture(scope="session")
def measured_profiles() -> Path:
    """The session cache's profile of this machine, measured once, for tests that load a model."""
    from rocketllm_cli.profiles import HardwareProfile
    from rocketllm_cli.profiles.cache import profile_dir

    HardwareProfile.load()
    return profile_dir("-").parent


def test_a_load_updates_last_used_only_for_sets_in_the_cache(measured_profiles, one_set, tiny_checkpoint, tmp_path):
    from rocketllm_cli.auto import AutoModel

    shutil.copytree(measured_profiles, one_set.parent.parent / "profiles")
    days_ago = time.time() - 3 * 86400
    os.utime(one_set, (days_ago, days_ago))
    assert "3 days ago" in next(l for l in invoke("ls").stdout.splitlines() if l.startswith(one_set.name))
    AutoModel.from_pretrained(tiny_checkpoint)  # finds the cached set and loads it
    assert abs(one_set.stat().st_mtime - time.time()) < 60
    assert "just now" in next(l for l in invoke("ls").stdout.splitlines() if l.startswith(one_set.name))

    mine = tmp_path / "mine"
    sharder.shard(tiny_checkpoint, out=mine, log=lambda m: None)
    os.utime(mine, (days_ago, days_ago))
    AutoModel.from_pretrained(mine)
    assert mine.stat().st_mtime == pytest.approx(days_ago)  # a user's --out directory is left as it was


def test_rm_with_yes_removes_the_named_set_only(one_set, tiny_checkpoint):
    _, other, _ = sharder.shard(tiny_checkpoint, dtype="bf16", log=lambda m: None)
    size = sets_by_name()[one_set.name]["bytes"]
    result = invoke("rm", one_set.name, "-y")
    assert result.exit_code == 0, result.stderr
    assert (
        f"removed {one_set.name} ({format_bytes(size)})" in result.stdout
        and f"freed {format_bytes(size)}" in result.stdout
    )
    assert not one_set.exists() and (other / "manifest.json").is_file()
    size = allocated(other)
    result = invoke("rm", other.name, "-y", "--json")
    assert json.loads(result.stdout) == {"removed": [{"name": other.name, "bytes": size}], "freed_bytes": size}
    assert sets_by_name() == {}


def test_rm_asks_first_and_refuses_off_a_terminal_without_yes(one_set):
    message = one_error_line(invoke("rm", one_set.name), code=2)
    assert "-y" in message and "terminal" in message
    assert (one_set / "manifest.json").is_file()


@pytest.mark.parametrize("answer, removed", [("n", False), ("y", True)])
def test_rm_on_a_terminal_removes_only_after_yes(one_set, answer, removed):
    import pty

    leader, follower = pty.openpty()  # stdin a real terminal; the answer waits in its input queue
    try:
        os.write(leader, f"{answer}\n".encode())
        done = subprocess.run(
            [sys.executable, "-m", "rocketllm_cli", "cache", "rm", one_set.name],
            stdin=follower,
            capture_output=True,
            text=True,
            timeout=60,
        )
    finally:
        os.close(leader)
        os.close(follower)
    assert done.returncode == 0, done.stderr
    assert "Remove 1 shard set" in done.stderr and one_set.name in done.stderr
    assert one_set.exists() != removed


def test_rm_of_an_unknown_or_path_like_name_is_one_line_and_removes_nothing(one_set, cache):
    assert "`rocketllm cache ls`" in one_error_line(invoke("rm", "no-such-set", "-y"))
    victim = cache / "victim"
    victim.mkdir()
    for name in ("../victim", "..", ".", f"{one_set.name}/config.json", f".{one_set.name}.partial"):
        assert "not a path" in one_error_line(invoke("rm", name, "-y")), name
    assert victim.is_dir() and (one_set / "config.json").is_file()


def test_rm_refuses_a_set_another_process_is_sharding(one_set):
    lock = one_set.parent / f".{one_set.name}.lock"
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import fcntl, sys; f = open(sys.argv[1], 'a'); fcntl.flock(f, fcntl.LOCK_EX); print('held', flush=True); "
            "sys.stdin.read()",
            str(lock),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        assert "being sharded" in one_error_line(invoke("rm", one_set.name, "-y"))
        assert (one_set / "manifest.json").is_file()
    finally:
        holder.stdin.close()
        holder.wait(timeout=30)
    assert invoke("rm", one_set.name, "-y").exit_code == 0 and not one_set.exists()


def test_an_interrupted_set_is_listed_as_partial_and_removed_with_its_leftovers(cache, tiny_checkpoint):
    name = interrupted_set(tiny_checkpoint, units=2)
    row = sets_by_name()[name]
    assert (row["state"], row["units"], row["layers"], row["dtype"]) == ("partial", 2, 1, "fp32")
    assert row["model"] == tiny_checkpoint.name and row["bytes"] == allocated(cache / "shards" / f".{name}.partial")
    assert invoke("rm", name, "-y").exit_code == 0
    assert not (cache / "shards" / f".{name}.partial").exists() and sets_by_name() == {}


def test_rm_all_removes_every_set_and_leftover_and_nothing_else(one_set, tiny_checkpoint, cache):
    from rocketllm_cli.cachehome import write_json
    from rocketllm_cli.profiles.cache import profile_dir

    interrupted_set(tiny_checkpoint, units=3, dtype="bf16")
    shutil.copytree(one_set, one_set.parent / f".{one_set.name}.old")  # what an interrupted replacement leaves
    write_json(profile_dir("machine-a") / "host.json", {"measured": True})
    rows = sets_by_name()
    assert sorted(r["state"] for r in rows.values()) == ["complete", "partial"]
    assert rows[one_set.name]["leftovers"] == [f".{one_set.name}.old"] and "complete +old" in invoke("ls").stdout
    result = invoke("rm", "--all", "-y", "--json")
    assert result.exit_code == 0, result.stderr
    assert json.loads(result.stdout)["freed_bytes"] == sum(r["bytes"] for r in rows.values())
    assert [p for p in (cache / "shards").iterdir() if p.is_dir()] == [] and ls()["total_bytes"] == 0
    assert (profile_dir("machine-a") / "host.json").is_file()
    assert "nothing to remove" in invoke("rm", "--all", "-y").stdout


def test_rm_needs_names_or_all(one_set):
    one_error_line(invoke("rm", "-y"), code=2)
    one_error_line(invoke("rm", one_set.name, "--all", "-y"), code=2)
    assert one_set.exists()


def test_path_says_where_the_cache_is_and_why(cache, tmp_path, monkeypatch):
    result = invoke("path")
    assert result.stdout == f"{cache}\n" and "ROCKETLLM_CACHE" in result.stderr
    monkeypatch.delenv("ROCKETLLM_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert json.loads(invoke("path", "--json").stdout) == {
        "path": str(tmp_path / "xdg" / "rocketllm"),
        "from": "default",
    }


@pytest.mark.parametrize("args", [[], ["ls"], ["rm"], ["path"]])
def test_help_has_examples(args):
    result = invoke(*args, "--help")
    assert result.exit_code == 0 and "Example" in result.stdout and "rocketllm cache" in result.stdout
