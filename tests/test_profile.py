"""HardwareProfile: measured once, cached by fingerprint and filesystem, degrading to "unavailable" with a reason."""

from __future__ import annotations

import json
import os
import sys
import types
from pathlib import Path

import pytest

from rocketllm_cli.profiles import HardwareProfile, cache_dir, hardware
from rocketllm_cli.profiles.probe import machine as facts
from rocketllm_cli.profiles.probe.filesystems import filesystem_of
from rocketllm_cli.profiles.probe.storage import probe_bytes
from rocketllm_cli.profiles.report import document as report
from rocketllm_cli.profiles.report import markdown


@pytest.fixture(autouse=True)
def small_probe(monkeypatch):
    monkeypatch.setenv("ROCKETLLM_PROBE_BYTES", "32MiB")


@pytest.fixture
def profile() -> HardwareProfile:
    """The session's profile (measured by the first test that asks, cached for the rest)."""
    return HardwareProfile.load()


def _profile_files(fingerprint: str) -> dict[str, int]:
    where = cache_dir() / "profiles" / fingerprint
    return {p.name: p.stat().st_mtime_ns for p in where.glob("*.json")}


def test_measured_profile_has_every_figure_with_its_method(profile):
    assert profile.compute_device == "cpu" or profile.compute_device.startswith(("cuda", "xpu", "mps"))
    assert profile.ram_total >= profile.ram_available > 0 and profile.cpu_cores >= 1
    for name in (
        "host_memory",
        "device_memory",
        "page_cache_read",
        "storage_read",
        "storage_read_direct",
        "h2d_pinned",
    ):
        m = profile.measurements[name]
        assert m.method, name
        if m.available:
            assert m.value > 0 and m.bytes_moved > 0 and m.seconds > 0, name
        else:
            assert m.value is None and m.reason, name
    assert profile.host_memory_bps and profile.page_cache_read_bps
    for name in (
        "compute_dtype",
        "pin_memory",
        "non_blocking",
        "sdpa",
        "direct_io",
        "fadvise_dontneed",
        "storage_kind",
    ):
        assert profile.capabilities[name].reason, name
    assert profile.compute_dtype in ("bf16", "fp16", "fp32")
    assert profile.capability("storage_kind") in ("nvme", "ssd", "rotational", "network", "tmpfs", "overlay", "unknown")


def test_cpu_device_means_host_ram_and_no_host_to_device_copies(profile):
    if profile.compute_device != "cpu":
        pytest.skip("CPU-only semantics")
    assert profile.vram_total is None and profile.vram_free is None and profile.h2d_bps is None
    assert profile.device_memory_bps == profile.host_memory_bps
    assert "page cache" in profile.tier_meaning() and "process RAM" in profile.tier_meaning()
    assert profile.capability("pin_memory") is False
    dtype = profile.capabilities["compute_dtype"]
    isa = profile.facts["cpu"]["isa"]
    assert (dtype.value == "bf16") == any(f in isa for f in ("avx512_bf16", "amx_bf16", "bf16"))


def test_second_load_reads_the_cache_and_measures_nothing(profile, monkeypatch):
    before = _profile_files(profile.fingerprint)
    assert "host.json" in before and any(name.startswith("fs-") for name in before)

    def forbidden(*args, **kwargs):
        raise AssertionError("a cached load must not measure")

    monkeypatch.setattr(hardware, "_measure_host", forbidden)
    monkeypatch.setattr(hardware, "_measure_filesystem", forbidden)
    again = HardwareProfile.load()
    assert again.from_cache
    assert again.measurements == profile.measurements and again.measured_at == profile.measured_at
    assert _profile_files(profile.fingerprint) == before  # nothing rewritten


def test_refresh_measures_again(profile, monkeypatch):
    where = cache_dir() / "profiles" / profile.fingerprint
    host_doc = json.loads((where / "host.json").read_text())
    calls = []

    def fake_host(log):
        calls.append("host")
        return {**host_doc, "measured_at": "refreshed"}

    monkeypatch.setattr(hardware, "_measure_host", fake_host)
    kernels = where / "kernels.json"
    saved = kernels.read_bytes() if kernels.exists() else None
    kernels.write_text("{}")
    reads = where / "unit-reads.json"
    saved_reads = reads.read_bytes() if reads.exists() else None
    reads.write_text("{}")
    refreshed = HardwareProfile.load(refresh=True)
    assert calls == ["host"] and refreshed.measured_at["host"] == "refreshed" and not refreshed.from_cache
    assert not kernels.exists()  # the low-bit kernel probe runs again too
    assert not reads.exists()  # and each streamed set's own reads (probe/unitreads.py)
    if saved is not None:
        kernels.write_bytes(saved)
    if saved_reads is not None:
        reads.write_bytes(saved_reads)
    (where / "host.json").write_text(json.dumps(host_doc))  # leave the real measurement for other tests


def test_free_memory_is_live_not_cached(profile, monkeypatch):
    monkeypatch.setattr(hardware, "memory_bound", lambda: (profile.ram_total, 12345, "machine"))
    assert HardwareProfile.load().ram_available == 12345


def test_corrupt_cache_file_is_remeasured(profile, monkeypatch):
    where = cache_dir() / "profiles" / profile.fingerprint
    good = (where / "host.json").read_text()
    (where / "host.json").write_text("{not json")
    monkeypatch.setattr(hardware, "_measure_host", lambda log: json.loads(good))
    assert not HardwareProfile.load().from_cache
    assert json.loads((where / "host.json").read_text())["compute_device"] == profile.compute_device


def test_storage_is_measured_per_filesystem(profile, tmp_path):
    shm = Path("/dev/shm")
    if not shm.is_dir() or filesystem_of(shm).fstype != "tmpfs":
        pytest.skip("no tmpfs at /dev/shm")
    ram_disk = HardwareProfile.load(storage_path=shm)
    assert ram_disk.capability("storage_kind") == "tmpfs"
    assert ram_disk.storage["key"] != profile.storage["key"]
    assert ram_disk.measurements["host_memory"] == profile.measurements["host_memory"]  # host part shared
    assert not list(shm.glob(".rocketllm-probe-*")) and not list(cache_dir().glob(".rocketllm-probe-*"))


def test_probe_file_lives_beside_the_weights_only_when_it_must(profile, tmp_path):
    model_dir = tmp_path / "weights"
    model_dir.mkdir()
    HardwareProfile.load(storage_path=model_dir / "model.gguf")
    assert list(model_dir.iterdir()) == []  # same filesystem as the cache: the probe went there, and is gone


def test_round_trip_through_dict(profile):
    doc = json.loads(json.dumps(profile.to_dict()))
    assert HardwareProfile.from_dict(doc) == profile


def test_fingerprint_is_stable_and_holds_no_private_facts():
    first, second = facts.fingerprint_facts(), facts.fingerprint_facts()
    assert facts.fingerprint(first) == facts.fingerprint(second)
    text = json.dumps(first)
    import socket

    assert socket.gethostname() not in text or len(socket.gethostname()) < 3
    # isa_ceiling only where torch or oneDNN is capped (ATEN_CPU_CAPABILITY, ONEDNN_MAX_CPU_ISA): another machine to us
    assert set(first) - {"isa_ceiling"} == {
        "cpu_model",
        "cpu_cores",
        "ram_total_gib",
        "gpus",
        "pci_accelerators",
        "os",
        "torch",
    }


def test_cache_dir_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("ROCKETLLM_CACHE", str(tmp_path / "explicit"))
    assert cache_dir() == tmp_path / "explicit" and cache_dir().is_dir()
    monkeypatch.delenv("ROCKETLLM_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "rocketllm"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_dir() == tmp_path / "home" / ".cache" / "rocketllm"


def test_cpu_flags_come_from_proc_cpuinfo_and_fall_back_to_py_cpuinfo(monkeypatch):
    """/proc/cpuinfo is read directly (py-cpuinfo reads it through a subprocess: a second of a first run); py-cpuinfo
    answers where that file has no flags, and its absence or failure is said."""
    if Path("/proc/cpuinfo").exists() and os.uname().machine == "x86_64":
        monkeypatch.setitem(sys.modules, "cpuinfo", None)  # not asked: the file answers
        flags, source = facts.cpu_flags()
        assert source.startswith("/proc/cpuinfo") and ("sse4_2" in flags or "avx" in flags)
    monkeypatch.setattr(facts, "cpuinfo_flags", lambda: None)  # a platform without the file
    monkeypatch.setitem(sys.modules, "cpuinfo", None)
    _, source = facts.cpu_flags()
    assert source == "unavailable: no /proc/cpuinfo flags and py-cpuinfo missing"
    broken = types.ModuleType("cpuinfo")
    broken.get_cpu_info = lambda: (_ for _ in ()).throw(RuntimeError("odd platform"))
    monkeypatch.setitem(sys.modules, "cpuinfo", broken)
    _, source = facts.cpu_flags()
    assert "py-cpuinfo failed (RuntimeError)" in source
    working = types.ModuleType("cpuinfo")
    working.get_cpu_info = lambda: {"flags": ["avx2", "fma"]}
    monkeypatch.setitem(sys.modules, "cpuinfo", working)
    flags, source = facts.cpu_flags()
    assert source.startswith("py-cpuinfo") and "avx2" in flags


def test_probe_without_gpu_nvml_or_cpuinfo_reports_unavailable_with_reasons(monkeypatch, tmp_path):
    monkeypatch.setenv("ROCKETLLM_CACHE", str(tmp_path / "cache"))
    monkeypatch.setitem(sys.modules, "pynvml", None)
    monkeypatch.setitem(sys.modules, "cpuinfo", None)
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    bare = HardwareProfile.load(refresh=True)
    assert bare.compute_device in ("cpu", "mps", "xpu:0")
    assert bare.facts["gpus_reason"] == "nvidia-ml-py (pynvml) not installed"
    assert bare.facts["cpu"]["isa_source"].startswith(("/proc/cpuinfo", "unavailable"))
    text = markdown.render(report.build(bare, None, None))
    assert "none: " in text and "nvidia-ml-py (pynvml) not installed" in text
    if bare.compute_device == "cpu":
        assert bare.measurements["h2d_pinned"].reason and "| h2d_pinned | unavailable: " in text


def test_a_device_that_claims_cuda_but_fails_degrades_instead_of_crashing(monkeypatch, tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a real CUDA device is present")
    monkeypatch.setenv("ROCKETLLM_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    broken = HardwareProfile.load(refresh=True)
    assert broken.compute_device == "cuda:0"
    assert not broken.measurements["device_memory"].available and broken.measurements["device_memory"].reason
    assert not broken.measurements["h2d_pinned"].available
    assert broken.compute_dtype == "fp32" and broken.capabilities["compute_dtype"].fallback_taken == "fp32"
    assert "unavailable: " in markdown.render(report.build(broken, None, None))


def test_contention_while_measuring_is_recorded_and_reported(profile):
    assert facts.others_cpu_share((10.0, 1.0, 100.0), (12.0, 2.0, 101.0)) == pytest.approx(
        min(1.0, 1.0 / (os.cpu_count() or 1))
    )
    assert facts.others_cpu_share(None, (1.0, 1.0, 1.0)) is None
    busy = HardwareProfile.from_dict(
        {**profile.to_dict(), "measured_at": {**profile.measured_at, "host_others_cpu_share": 0.6}}
    )
    doc = report.build(busy, None, None)
    assert any("60%" in w and "--refresh" in w for w in doc["profile"]["warnings"])
    assert "- warning: other processes used 60%" in markdown.render(doc)


def test_an_isa_ceiling_hides_the_flags_kernels_are_told_not_to_use(monkeypatch):
    """ATEN_CPU_CAPABILITY / ONEDNN_MAX_CPU_ISA cap what torch's kernels use: the decisions see the capped ISA,
    and the capped machine gets its own profile fingerprint."""
    from rocketllm_cli.profiles.probe.capabilities import compute_dtype

    monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    full_flags, _ = facts.cpu_flags()
    plain = facts.fingerprint(facts.fingerprint_facts())
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    flags, source = facts.cpu_flags()
    assert not [f for f in flags if f.startswith(("avx512", "amx"))]
    assert set(flags) <= set(full_flags)
    assert compute_dtype("cpu", flags, {}).value == "fp32"
    assert facts.fingerprint(facts.fingerprint_facts()) != plain
    if any(f.startswith(("avx512", "amx")) for f in full_flags):
        assert "left out by ATEN_CPU_CAPABILITY=avx2 and ONEDNN_MAX_CPU_ISA=AVX2" in source
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx512")  # not a ceiling this table knows: nothing is hidden by it
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX512_CORE")
    flags, _ = facts.cpu_flags()
    assert "avx512_bf16" not in flags and not [f for f in flags if f.startswith("amx")]
    assert [f for f in flags if f not in ("avx512_bf16", "avx512_fp16")] == [
        f for f in full_flags if f not in ("avx512_bf16", "avx512_fp16") and not f.startswith("amx")
    ]


def test_a_probe_file_written_ahead_is_the_one_measured_then_deleted(tmp_path, monkeypatch):
    from rocketllm_cli.profiles.probe import probefile, storage

    size = storage.probe_bytes()
    probefile.write_ahead([tmp_path], size)  # a first run: beside its imports
    probefile._ahead[0][2].join()
    written = list(tmp_path.glob(".rocketllm-probe-*"))
    assert len(written) == 1 and written[0].stat().st_size == size
    monkeypatch.setattr(probefile, "_write_probe", lambda *args: pytest.fail("the probe file was written again"))
    found, _, cacheable = storage.measure_storage(filesystem_of(tmp_path), size, directories=[tmp_path])
    assert cacheable and found["page_cache_read"].available and found["page_cache_read"].bytes_moved == size
    assert not list(tmp_path.glob(".rocketllm-probe-*")) and not probefile._ahead


def test_a_probe_file_written_ahead_is_taken_however_its_directory_was_spelled(tmp_path, monkeypatch):
    from rocketllm_cli.profiles.probe import probefile, storage

    (tmp_path / "models").mkdir()
    spelled = tmp_path / "models" / ".." / "models"  # `generate ../models/m.gguf`; the set's manifest resolves it
    probefile.write_ahead([spelled], storage.probe_bytes())
    monkeypatch.setattr(probefile, "_write_probe", lambda *args: pytest.fail("the probe file was written again"))
    found, _, cacheable = storage.measure_storage(
        filesystem_of(tmp_path), storage.probe_bytes(), directories=[tmp_path / "models"]
    )
    assert cacheable and found["page_cache_read"].available and not probefile._ahead
    assert not list((tmp_path / "models").glob(".rocketllm-probe-*"))


def test_a_probe_file_no_measurement_takes_is_deleted_at_exit(tmp_path):
    from rocketllm_cli.profiles.probe import probefile, storage

    probefile.write_ahead([tmp_path], storage.probe_bytes())
    try:
        probefile._discard_ahead()  # atexit's: a write under way stops, a written file goes
        assert not list(tmp_path.glob(".rocketllm-probe-*")) and not probefile._ahead
        with pytest.raises(OSError, match="stopped"):  # and no probe file is written after it
            probefile._write_probe(tmp_path / "late", storage.probe_bytes())
    finally:
        probefile._stop_ahead.clear()  # the rest of the session measures as a process that is not leaving
    probefile._write_probe(tmp_path / "again", 1 << 20)
    assert (tmp_path / "again").stat().st_size == 1 << 20


def test_the_probe_file_is_written_ahead_only_where_the_filesystem_is_not_profiled(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(hardware, "write_ahead", lambda directories, size: calls.append(directories))
    HardwareProfile.load(storage_path=tmp_path)  # this filesystem profiled (or read from the session's cache)
    HardwareProfile.write_storage_probe_ahead(tmp_path / "model.gguf")
    assert calls == []
    HardwareProfile.write_storage_probe_ahead(tmp_path / "model.gguf", refresh=True)
    assert len(calls) == 1 and calls[0][-1] == filesystem_of(tmp_path).directory
    big = tmp_path / "big.gguf"  # a model file large enough to be read in place: nothing is written ahead for it
    big.write_bytes(os.urandom(probe_bytes()))
    HardwareProfile.write_storage_probe_ahead(big, refresh=True)
    assert len(calls) == 1


def _weights_file(path: Path, size: int) -> bytes:
    data = os.urandom(size + 12345)  # not a multiple of the alignment: the probe reads the aligned first SIZE bytes
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())  # written back, as a model downloaded before is: its clean pages can be evicted
    return data


def test_the_weights_own_file_is_read_in_place_of_a_probe_file_and_left_as_it_was(tmp_path, monkeypatch):
    from rocketllm_cli.profiles.probe import probefile, storage

    size = storage.probe_bytes()
    fs = filesystem_of(tmp_path)
    plain, _, _ = storage.measure_storage(fs, size, directories=[tmp_path])
    if not plain["storage_read"].available:
        pytest.skip(f"no cold read can be forced on this filesystem: {plain['storage_read'].reason}")
    model = tmp_path / "model.gguf"
    data = _weights_file(model, 2 * size)
    monkeypatch.setattr(probefile, "_write_probe", lambda *args: pytest.fail("a probe file was written"))
    found, decided, cacheable = storage.measure_storage(
        fs, size, directories=[tmp_path], own=storage.own_file(model, size)
    )
    assert cacheable and "the weights file" in found["page_cache_read"].method
    assert found["page_cache_read"].bytes_moved == size and found["storage_read"].bytes_moved == size
    assert found["storage_read"].available and "eviction verified" in found["storage_read"].method
    assert decided["fadvise_dontneed"].value is True
    assert model.read_bytes() == data and sorted(p.name for p in tmp_path.iterdir()) == ["model.gguf"]


def test_a_weights_file_whose_cold_read_cannot_be_forced_gives_way_to_a_probe_file(tmp_path, monkeypatch):
    from rocketllm_cli.profiles.probe import probefile, storage

    size = storage.probe_bytes()
    model = tmp_path / "model.gguf"
    data = _weights_file(model, size)
    written = []
    real_write = probefile._write_probe
    monkeypatch.setattr(probefile, "_write_probe", lambda path, n: (written.append(n), real_write(path, n)))
    monkeypatch.setattr(storage, "evict_file", lambda *args: "pages not written back")  # dirty: DONTNEED keeps them
    found, _, cacheable = storage.measure_storage(
        filesystem_of(tmp_path), size, directories=[tmp_path], own=storage.own_file(model, size)
    )
    assert written == [size] and "a just-written file" in found["page_cache_read"].method
    assert cacheable and not found["storage_read"].available
    assert model.read_bytes() == data and not list(tmp_path.glob(".rocketllm-probe-*"))


def test_the_own_file_is_the_weights_file_or_a_sets_largest_and_large_enough(tmp_path):
    from rocketllm_cli.profiles.probe import storage

    size = storage.probe_bytes()
    assert storage.own_file(tmp_path / "missing.gguf", size) is None
    (tmp_path / "small.gguf").write_bytes(b"x" * (size - 4096))
    assert storage.own_file(tmp_path / "small.gguf", size) is None  # a tiny file's read says little of the disk
    assert storage.own_file(tmp_path, size) is None
    (tmp_path / "unit-0001.bin").write_bytes(b"y" * size)
    (tmp_path / "manifest.json").write_text("{}")
    assert storage.own_file(tmp_path, size) == tmp_path / "unit-0001.bin"
    assert storage.own_file(tmp_path / "unit-0001.bin", size) == tmp_path / "unit-0001.bin"
