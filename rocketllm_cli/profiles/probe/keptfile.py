"""A small JSON file of figures measured on this machine, kept beside its profile: read once per process, written
atomically, and kept in this process only where the cache is read-only or the figures were measured on a busy
machine (the next process measures them again). kernelrates.py and layercost.py keep theirs in one each."""

from __future__ import annotations


class KeptFile:
    """The figures in profile_dir(fingerprint) / NAME, per profile fingerprint, as read or written in this process."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.memo: dict[str, dict] = {}

    def where(self, profile):
        from ..cache import profile_dir

        return profile_dir(profile.fingerprint) / self.name

    def load(self, profile) -> dict:
        """A copy of the figures kept for PROFILE's machine (read from the file once per process)."""
        from ...cachehome import read_json

        if profile.fingerprint not in self.memo:  # a plan asks for every row: the file is read once
            stored = read_json(self.where(profile)) or {}
            stored.pop("cache_format", None)
            self.memo[profile.fingerprint] = stored
        return dict(self.memo[profile.fingerprint])

    def save(self, profile, stored: dict, keep: bool = True) -> None:
        """STORED for this process, and in the file unless not KEEP."""
        from ...cachehome import write_json

        self.memo[profile.fingerprint] = dict(stored)
        if not keep:
            return
        try:
            write_json(self.where(profile), stored)
        except OSError:
            pass  # a read-only cache: measured again by the next process
