"""Corruption at load: a damaged shard set is refused before any text is generated, with a message that says to
re-run `rocketllm shard`, and following that advice restores a set that verifies and generates what it did.

Checked on every load: the manifest's types and consistency, each unit file's size, and each unit file's own
safetensors header against the manifest (a few KB per unit). Checked by `shard --verify`: every byte (sha256).
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path

import pytest
import torch
from cli_contract import one_error_line
from typer.testing import CliRunner

from rocketllm_cli.app import app
from rocketllm_cli.checkpoint.manifest import MANIFEST, RESHARD, Manifest
from rocketllm_cli.errors import ShardError
from rocketllm_cli.shard import checks, sharder
from rocketllm_cli.stream.engineconfig import EngineConfig
from rocketllm_cli.stream.model import StreamingModel
from rocketllm_cli.synthetic import config_for, write_checkpoint

PROMPT = [1, 5, 9, 42, 7]


@pytest.fixture(autouse=True)
def small_probe(monkeypatch):
    monkeypatch.setenv("ROCKETLLM_PROBE_BYTES", "32MiB")


def invoke(*args, env=None):
    return CliRunner().invoke(app, [str(a) for a in args], env=env)


def tokens(directory: Path) -> list[int]:
    with StreamingModel(directory, EngineConfig(device_cache_bytes=0, prefetch_depth=0)) as model:
        return model.generate(input_ids=torch.tensor([PROMPT]), max_new_tokens=6, do_sample=False)[
            0, len(PROMPT) :
        ].tolist()


@pytest.fixture(scope="module")
def model_and_set(tiny_checkpoint, tmp_path_factory):
    """A private copy of the tiny model (tests may change it), its shard set, and the set's tokens."""
    root = tmp_path_factory.mktemp("load")
    model = shutil.copytree(tiny_checkpoint, root / "model")
    good = root / "good"
    sharder.shard(model, out=good, log=lambda m: None)
    return model, good, tokens(good)


# -- every damage is refused on load ------------------------------------------------------------------------------


def test_any_truncation_of_any_unit_is_refused_on_load(model_and_set, tmp_path):
    _, good, _ = model_and_set
    work = shutil.copytree(good, tmp_path / "set")
    for unit in Manifest.load(good).units:
        path = work / unit.file
        original = path.read_bytes()
        first = unit.tensors[0].offset
        for cut in (0, 7, 8, first // 2, first, first + 1, unit.bytes - 1):
            path.write_bytes(original[:cut])
            with pytest.raises(ShardError) as caught:
                Manifest.load(work)
            message = str(caught.value)
            assert unit.file in message and message.endswith(RESHARD) and "\n" not in message, message
        path.write_bytes(original)
    Manifest.load(work)


def test_any_flipped_bit_is_caught_by_verify_and_never_crashes_a_load(model_and_set, tmp_path):
    """A flipped bit in a header is refused on load; one in tensor data loads (sizes and headers agree) and
    only --verify, which hashes every byte, reports it."""
    _, good, _ = model_and_set
    work = shutil.copytree(good, tmp_path / "set")
    units = Manifest.load(good).units
    rng = random.Random(7)
    refused_on_load = 0
    for _ in range(60):
        unit = rng.choice(units)
        path = work / unit.file
        original = path.read_bytes()
        data_start = min(t.offset for t in unit.tensors)
        offset = rng.randrange(0, data_start) if rng.random() < 0.5 else rng.randrange(data_start, unit.bytes)
        damaged = bytearray(original)
        damaged[offset] ^= 1 << rng.randrange(8)
        path.write_bytes(bytes(damaged))
        try:
            Manifest.load(work)
        except ShardError as exc:
            refused_on_load += 1
            assert offset < data_start and unit.file in str(exc) and str(exc).endswith(RESHARD), exc
            with pytest.raises(ShardError):  # --verify loads first, so it refuses with the same line
                checks.verify(work)
        else:
            assert checks.verify(work) == [f"{unit.file}: checksum mismatch (contents changed)"], (unit.file, offset)
        path.write_bytes(original)
    assert 0 < refused_on_load < 60 and checks.verify(work) == []


@pytest.mark.parametrize("damage", ["truncated unit", "bad JSON", "offset moved", "unit removed", "manifest missing"])
def test_generate_refuses_a_damaged_set_in_one_line(damage, model_and_set, tmp_path):
    _, good, _ = model_and_set
    work = shutil.copytree(good, tmp_path / "set")
    damage_set(work, damage)
    cache = tmp_path / "cache"
    line = one_error_line(invoke("generate", work, "Hello", "--raw", "-n", "3", env={"ROCKETLLM_CACHE": str(cache)}))
    assert line.endswith(RESHARD), line
    assert not (cache / "shards").exists()  # nothing sharded from the damaged set itself


def damage_set(work: Path, damage: str) -> None:
    manifest = json.loads((work / MANIFEST).read_text())
    if damage == "truncated unit":
        os.truncate(work / manifest["units"][2]["file"], 5000)
    elif damage == "bad JSON":
        (work / MANIFEST).write_text(json.dumps(manifest)[:-40])
    elif damage == "offset moved":  # in bounds and aligned: before the header check this loaded and gave other text
        manifest["units"][2]["tensors"][0]["offset"] += 64
        (work / MANIFEST).write_text(json.dumps(manifest))
    elif damage == "unit removed":
        del manifest["units"][-1]
        (work / MANIFEST).write_text(json.dumps(manifest))
    elif damage == "manifest missing":
        (work / MANIFEST).unlink()
    elif damage == "flipped byte":
        unit = manifest["units"][3]
        path = work / unit["file"]
        data = bytearray(path.read_bytes())
        data[unit["tensors"][0]["offset"] + 10] ^= 0x40
        path.write_bytes(bytes(data))
    else:
        raise ValueError(damage)


# -- following the advice repairs it --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "damage", ["truncated unit", "bad JSON", "offset moved", "unit removed", "manifest missing", "flipped byte"]
)
def test_rerunning_shard_on_the_source_repairs_a_damaged_set(damage, model_and_set, tmp_path):
    """The advice in every message works: `rocketllm shard SOURCE --out DIR` (with --verify for changed bytes,
    which no size or header check can see) writes the set again, which verifies and generates the same tokens."""
    model, good, expected = model_and_set
    work = shutil.copytree(good, tmp_path / "set")
    damage_set(work, damage)
    extra = ["--verify"] if damage == "flipped byte" else []
    result = invoke("shard", model, "--out", work, "--json", *extra)
    assert result.exit_code == 0, result.stderr
    assert "sharding it again" in result.stderr or "sharding again" in result.stderr, result.stderr
    doc = json.loads(result.stdout)
    assert doc["reused"] is False and (doc["verified"] is True or not extra)
    assert checks.verify(work) == [] and tokens(work) == expected
    assert [u.sha256 for u in Manifest.load(work).units] == [u.sha256 for u in Manifest.load(good).units]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["set"]  # no partial, old or lock directory left


def test_the_default_location_repairs_itself_and_says_so(model_and_set, tmp_path):
    """`generate SOURCE` finds its set by the source's fingerprint; a damaged one is written again, with a log line."""
    model, _, expected = model_and_set
    env = {"ROCKETLLM_CACHE": str(tmp_path / "cache")}
    first = invoke("shard", model, "--json", env=env)
    directory = Path(json.loads(first.stdout)["directory"])
    os.truncate(directory / Manifest.load(directory).units[1].file, 100)
    result = invoke("generate", model, "Hello", "--raw", "-n", "3", env=env)
    assert result.exit_code == 0, result.stderr
    assert "(truncated or changed); sharding it again" in result.stderr
    assert checks.verify(directory) == [] and tokens(directory) == expected


def test_a_damaged_set_of_another_model_is_left_alone(model_and_set, tiny_factory, tmp_path):
    _, good, _ = model_and_set
    work = shutil.copytree(good, tmp_path / "set")
    damage_set(work, "truncated unit")
    before = sorted((p.name, p.stat().st_size) for p in work.iterdir())
    line = one_error_line(invoke("shard", tiny_factory("llama", seed=1), "--out", work))
    assert "damaged shard set that is not of this model" in line
    assert sorted((p.name, p.stat().st_size) for p in work.iterdir()) == before


def test_verify_on_a_shard_directory_names_the_file_and_how_to_repair(model_and_set, tmp_path):
    _, good, _ = model_and_set
    work = shutil.copytree(good, tmp_path / "set")
    damage_set(work, "flipped byte")
    result = invoke("shard", work, "--verify")
    assert result.exit_code == 1 and "verify: FAILED" in result.stdout
    line = result.stderr.strip()
    assert line == (
        f"error: 1 shard file does not match the manifest ({Manifest.load(work).units[3].file}: checksum "
        f"mismatch "
        "(contents changed)); re-run `rocketllm shard` on the source model with --verify to write them "
        "again"
    ), line


# -- the source changes after sharding -----------------------------------------------------------------------------


def test_a_changed_source_never_uses_stale_shards(tmp_path):
    """The default location is keyed by the source's fingerprint (file names, sizes, mtimes, config), so changed
    weights get new shards; an --out set of the old weights is refused rather than reused."""
    model = write_checkpoint(config_for("llama"), tmp_path / "model", seed=0)
    env = {"ROCKETLLM_CACHE": str(tmp_path / "cache")}

    def generated() -> str:
        result = invoke("generate", model, "Hello", "--raw", "-n", "6", env=env)
        assert result.exit_code == 0, result.stderr
        return result.stdout

    old = generated()
    assert invoke("shard", model, "--out", tmp_path / "out", env=env).exit_code == 0
    write_checkpoint(config_for("llama"), model, seed=1)  # new weights, same names and sizes
    new = generated()
    assert new != old
    fresh = write_checkpoint(config_for("llama"), tmp_path / "fresh", seed=1)
    result = invoke("generate", fresh, "Hello", "--raw", "-n", "6", env=env)
    assert result.stdout == new  # what the new weights generate, not the stale shards
    # old, new (and the fresh copy): never overwritten in place
    assert len(list((tmp_path / "cache" / "shards").iterdir())) == 3

    os.utime(model / "model.safetensors")  # touched, not changed: a new fingerprint, so sharded again, same text
    assert generated() == new and len(list((tmp_path / "cache" / "shards").iterdir())) == 4

    line = one_error_line(invoke("shard", model, "--out", tmp_path / "out", env=env))
    assert "holds shards of another source or dtype" in line
