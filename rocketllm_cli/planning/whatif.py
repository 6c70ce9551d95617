"""What-if hardware for `rocketllm plan`: another machine's profile (its `doctor --json`), or this one's with more or
less memory or another disk, so a plan can be made for a machine before it is bought or borrowed.

Only what is given changes; every other figure stays measured. Nothing is invented: a GPU cannot be added to a
profile measured without one (its copies and compute were never measured), so --vram needs a GPU machine's profile.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from ..errors import UsageError
from ..profiles.hardware import HardwareProfile
from ..profiles.records import Capability, Measurement
from ..sizes import format_bytes, format_rate

STORAGE_READS = ("storage_read", "storage_read_direct")


def profile_from_file(path: Path) -> HardwareProfile:
    """A HardwareProfile from `rocketllm doctor --json` of any machine (or a HardwareProfile.to_dict() document)."""
    path = Path(path).expanduser()
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise UsageError(f"--profile {path.name}: cannot read it ({exc.strerror or exc})") from None
    except ValueError:
        raise UsageError(f"--profile {path.name}: not JSON; give the output of `rocketllm doctor --json`") from None
    try:
        if isinstance(doc, dict) and isinstance(doc.get("measurements"), list):
            return _from_doctor(doc)
        if isinstance(doc, dict) and {"fingerprint", "compute_device", "measurements"} <= set(doc):
            return HardwareProfile.from_dict(doc)
    except (KeyError, TypeError, ValueError, AttributeError):
        pass
    raise UsageError(
        f"--profile {path.name}: not a `rocketllm doctor --json` document (no measurements, memory or accelerators)"
    )


def _from_doctor(doc: dict) -> HardwareProfile:
    accel, memory, profile = doc["accelerators"], doc["memory"], doc.get("profile") or {}
    caps = {
        c["name"]: Capability(c["name"], c.get("value"), c.get("fallback_taken"), c.get("reason", ""))
        for c in doc.get("capabilities", [])
    }
    found = {m["name"]: Measurement.from_dict(m) for m in doc["measurements"]}
    return HardwareProfile(
        fingerprint=str(profile.get("fingerprint", "from-file")),
        compute_device=str(accel["compute_device"]),
        cpu_cores=int(doc["cpu"].get("cores_used") or 1),
        ram_total=int(memory["ram_total"]),
        ram_available=int(memory["ram_available"]),
        vram_total=accel.get("vram_total"),
        vram_free=accel.get("vram_free"),
        facts={"cpu": doc["cpu"]},
        measurements=found,
        capabilities=caps,
        storage=dict(doc.get("storage") or {}),
        measured_at=dict(profile.get("measured_at") or {}),
        from_cache=True,
    )


def what_if(
    profile: HardwareProfile, ram: int | None = None, vram: int | None = None, disk_bps: float | None = None
) -> tuple[HardwareProfile, list[str]]:
    """PROFILE with the given RAM, VRAM or disk read speed, and one line per change saying what was assumed.

    Free memory keeps the share it has now (other programs are assumed to take what they take here, in proportion)."""
    notes = []
    if ram is not None:
        share = profile.ram_available / profile.ram_total if profile.ram_total else 1.0
        profile = replace(profile, ram_total=ram, ram_available=int(ram * share), ram_bound="machine")
        notes.append(
            f"RAM {format_bytes(ram)} (--ram), {share:.0%} of it free as here: {format_bytes(profile.ram_available)}"
        )
    if vram is not None:
        if profile.vram_total is None:
            raise UsageError(
                f"--vram: this profile computes on {profile.compute_device}, and a GPU's copies and "
                f"compute were never "
                "measured there; plan with --profile FILE from `rocketllm doctor --json` on a GPU machine"
            )
        share = (profile.vram_free or 0) / profile.vram_total if profile.vram_total else 1.0
        profile = replace(profile, vram_total=vram, vram_free=int(vram * share))
        notes.append(
            f"VRAM {format_bytes(vram)} (--vram), {share:.0%} of it free as here: {format_bytes(profile.vram_free)}"
        )
    if disk_bps is not None:
        found = dict(profile.measurements)
        for name in STORAGE_READS:
            found[name] = Measurement(name, float(disk_bps), "what-if: --disk-bw", int(disk_bps), 1.0)
        profile = replace(profile, measurements=found)
        notes.append(f"storage reads {format_rate(disk_bps)} (--disk-bw), buffered and O_DIRECT alike")
    return profile, notes


def capped(profile: HardwareProfile, memory: int, reserve: int) -> HardwareProfile:
    """PROFILE as a run allowed MEMORY bytes sees it: its free memory (RAM, and VRAM on a GPU) at most that plus the
    reserve the knobs keep, so the budgets they derive add up to at most MEMORY."""
    profile = replace(profile, ram_available=min(profile.ram_available, memory + reserve))
    if profile.vram_free is not None:
        profile = replace(profile, vram_free=min(profile.vram_free, memory))
    return profile
