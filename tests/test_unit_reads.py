"""A streamed set's own units read cold decide the read method, the reads in flight and the read-ahead depth;
the answer is kept per set beside the profile (`profile --refresh` removes it: test_profile.py)."""

from __future__ import annotations

import json
import os
from dataclasses import replace

import pytest

from rocketllm_cli.checkpoint.manifest import Manifest
from rocketllm_cli.checkpoint.modelfacts import facts_from_manifest
from rocketllm_cli.profiles import HardwareProfile, resolve_knobs
from rocketllm_cli.profiles.cache import profile_dir
from rocketllm_cli.profiles.probe import unitreads
from rocketllm_cli.profiles.probe.unitreads import IN_FLIGHTS, UnitReadRow, UnitReads
from rocketllm_cli.shard.sharder import shard


@pytest.fixture(scope="module")
def tiny_set(tiny_factory, tmp_path_factory):
    manifest, directory, _ = shard(
        tiny_factory("llama"), out=tmp_path_factory.mktemp("unit-reads") / "set", log=lambda m: None
    )
    return manifest, directory


@pytest.fixture
def profile() -> HardwareProfile:
    return HardwareProfile.load()


def _reads(rows: list[tuple[bool, int, float, float]], cpu_shared: int = 1) -> UnitReads:
    return UnitReads(2 << 20, 30, cpu_shared, [UnitReadRow(d, k, 100 << 20, s, c) for d, k, s, c in rows])


def test_every_method_and_count_in_flight_reads_every_sampled_byte(tiny_set):
    manifest, directory = tiny_set
    units = unitreads.sample_units(manifest)
    assert len(units) >= 2 and {u.kind for u in units} == {"layer"}  # what streams on every token
    reads = unitreads.measure(directory, units, cpu_shared=1, direct_ok=hasattr(os, "O_DIRECT"))
    methods = (True, False) if hasattr(os, "O_DIRECT") else (False,)
    assert [(r.direct, r.in_flight) for r in reads.rows] == [(d, k) for d in methods for k in IN_FLIGHTS]
    assert all(r.bytes == sum(u.bytes for u in units) and r.seconds > 0 and r.cpu_seconds >= 0 for r in reads.rows)
    assert reads.units == len(units) and reads.unit_bytes == sorted(u.bytes for u in units)[len(units) // 2]
    assert UnitReads.from_dict(json.loads(json.dumps(reads.to_dict()))) == reads


def test_the_cheapest_wins_counting_cpu_where_reads_share_it_and_fewer_in_flight_break_near_ties():
    reads = _reads(
        [
            (True, 1, 1.00, 0.01),
            (True, 2, 0.80, 0.01),
            (True, 4, 0.78, 0.01),  # x4 within 5% of x2
            (False, 1, 0.70, 0.50),
            (False, 2, 0.60, 0.40),
        ]
    )
    assert reads.best(True).in_flight == 2  # 0.79 is within 5% of 0.81: the fewer reads in flight
    assert reads.best(False).in_flight == 2
    assert reads.best().direct  # buffered is faster by the clock but costs 0.4 s of the cores compute needs
    rows = [(r.direct, r.in_flight, r.seconds, r.cpu_seconds) for r in reads.rows]
    assert not _reads(rows, cpu_shared=0).best().direct  # a GPU computes elsewhere: the clock alone decides


def test_the_read_knobs_follow_the_sets_own_reads(tiny_set, profile):
    manifest, directory = tiny_set
    from transformers import AutoConfig

    facts = facts_from_manifest(manifest, AutoConfig.from_pretrained(directory))
    reads = _reads(
        [
            (True, 1, 1.0, 0.0),
            (True, 2, 0.5, 0.0),
            (True, 4, 0.49, 0.0),
            (True, 8, 0.3, 0.0),
            (False, 1, 2.0, 0.5),
            (False, 2, 1.9, 0.5),
            (False, 4, 0.9, 0.5),
            (False, 8, 1.2, 0.5),
        ]
    )
    knobs = resolve_knobs(profile, replace(facts, unit_reads=reads.to_dict()), env={})
    assert knobs["direct_io"].value is True and knobs["direct_io"].source == "measured"
    assert knobs["io_workers"].value == 8 and knobs["io_workers"].source == "measured"
    # reads ahead as many as in flight
    assert knobs["prefetch_depth"].value >= 8 or "buffer" in knobs["prefetch_depth"].note
    by_hand = resolve_knobs(profile, replace(facts, unit_reads=reads.to_dict()), kwargs={"direct_io": False}, env={})
    assert by_hand["io_workers"].value == 4  # buffered's own cheapest count
    plain = resolve_knobs(profile, facts, env={})
    assert plain["io_workers"].source != "measured" and "unit_" not in plain["direct_io"].formula


def test_a_projection_streams_at_the_sets_own_reads_as_the_knobs_choose_them(tiny_set, profile):
    """Where the set's units were read cold, the storage tier's seconds are its bytes at the rate of the read the
    knobs choose (method and count in flight), not the storage probe's file: what the engine will read at."""
    from transformers import AutoConfig

    from rocketllm_cli.profiles import project

    manifest, directory = tiny_set
    facts = facts_from_manifest(manifest, AutoConfig.from_pretrained(directory))
    reads = _reads([(True, 1, 0.5, 0.0), (True, 2, 0.45, 0.0), (False, 1, 0.4, 0.3), (False, 2, 0.3, 0.3)])
    assert reads.chosen() is reads.best(True) and reads.chosen().in_flight == 2  # buffered's CPU time loses
    tiers = {"device": 0, "host": 0, "storage": facts.total_bytes}
    own = project(profile, replace(facts, unit_reads=reads.to_dict()), tiers).tiers["storage"]
    assert own.bandwidth_bps == pytest.approx((100 << 20) / 0.45)
    assert own.seconds == pytest.approx(facts.total_bytes / own.bandwidth_bps)
    assert "own units read cold, O_DIRECT x2" in own.bandwidth
    probe = project(profile, facts, tiers).tiers["storage"]  # not measured for the set: the storage probe's figure
    assert probe.bandwidth_bps == profile.storage_read_bps and "own units" not in probe.bandwidth
    knobs = resolve_knobs(profile, replace(facts, unit_reads=reads.to_dict()), env={})
    assert knobs["direct_io"].value is True and knobs["io_workers"].value == 2  # the read the projection costs


def test_a_set_streamed_from_storage_is_measured_once_and_kept_per_set(tiny_set, monkeypatch):
    from rocketllm_cli.auto import AutoModel

    manifest, directory = tiny_set
    calls = []
    real = unitreads.measure
    monkeypatch.setattr(unitreads, "measure", lambda *a, **k: calls.append(1) or real(*a, **k))
    with AutoModel.from_pretrained(directory, device_cache_bytes=0, host_cache_bytes=0) as first:
        assert first.facts.unit_reads is not None and first.knobs["io_workers"].source == "measured"
        workers = first.knobs["io_workers"].value
    with AutoModel.from_pretrained(directory, device_cache_bytes=0, host_cache_bytes=0) as second:
        assert second.knobs["io_workers"].value == workers
    assert calls == [1]  # the second load read the stored answer
    with AutoModel.from_pretrained(directory) as resident:  # nothing read from storage: nothing measured
        assert resident.facts.unit_reads is None
    assert calls == [1]
    stored = profile_dir(HardwareProfile.load().fingerprint) / unitreads.FILE
    # refresh: test_profile
    assert unitreads.set_key(directory, Manifest.load(directory)) in json.loads(stored.read_text())


def test_a_cache_that_cannot_be_written_still_gets_this_process_its_answer(tiny_set, profile, monkeypatch, tmp_path):
    from rocketllm_cli import cachehome
    from rocketllm_cli.profiles import cache

    manifest, directory = tiny_set
    monkeypatch.setattr(cache, "profile_dir", lambda fp: tmp_path / "nowhere")  # nothing stored there yet

    def refuse(path, doc):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(cachehome, "write_json", refuse)
    reads = unitreads.load_or_measure(profile, directory, manifest)
    assert reads is not None and reads.rows and not (tmp_path / "nowhere").exists()
