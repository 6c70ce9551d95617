"""Prefix caching: reuse the KV cache of a prompt's leading token blocks from an earlier request.

A prompt is cut into blocks of `block_tokens` tokens, and each block boundary gets a cumulative hash
(the hash of every token before it). After a generation, the KV cache is cropped to the last block
boundary it covers, compacted and stored with the hashes of its boundaries. A later prompt that shares
the first k blocks (and has at least one token after them) gets a copy of that checkpoint cropped to
exactly k * block_tokens tokens, and transformers' generate computes only the tokens after it.

Restoring a KV checkpoint changes no result: the keys and values of a position depend only on the tokens
before it, so a cropped cache holds exactly what a fresh prefill of those tokens would compute.

Whether it pays: when every weight is resident, a prefill's cost grows with its length and reuse
saves that compute. When layers stream from the host tier or storage, a prefill is one streaming pass
whatever its length (the bytes moved dominate), so reuse saves little; `auto` turns it on only when
the plan keeps every unit on the device.

Works with transformers' DynamicCache (4.5x and 5.x): full-attention layers always, sliding-window layers
while the sequence still fits their window (after that they have dropped tokens and cannot be cropped back).
A cache that keeps recurrent or convolution states (Mamba, linear attention) cannot be cropped at all: in mode
"extend" (reuse.py decides per model) a checkpoint is the whole cache a generation left, reused only by a prompt
that extends its tokens exactly, the next turn of that conversation. An int4 KV cache (stream/kvcache.py) keeps its
first tokens in int4 and the rest in full precision, and where that boundary lies depends on the length: in mode
"exact" a checkpoint is the cache as it stood at exactly its length (a copy taken once the prompt is prefilled, and
the cache a generation left), never cropped from a longer one, reused by a prompt that extends its tokens. That gives
a whole prefill's reply while the new tokens reach no new int4 group; past one, the reused positions were computed
reading their window in full precision where a whole prefill reads int4: a rounding difference. A cache
storing another float dtype crops as a DynamicCache does. Any other cache is not kept (`supported()`).
"""

from __future__ import annotations

import copy
import hashlib
import threading
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field

from .cachekinds import crop, holds_every_token, nbytes, seq_length, supported

BLOCK_TOKENS = 16


def decide(setting: str, plan, manifest) -> tuple[bool, str]:
    """(on, reason) for the prefix_cache knob's value auto/on/off and the model's residency plan."""
    streamed = [u.name for u in manifest.units if plan.tier.get(u.name) != "device"]
    if setting == "off":
        return False, "off (prefix_cache knob)"
    if setting == "on":
        if streamed:
            return True, (
                f"on (prefix_cache knob), though {len(streamed)} of {len(manifest.units)} units stream each "
                f"pass, "
                "so a prefill costs about one streaming pass whatever is reused"
            )
        return True, "on (prefix_cache knob)"
    if streamed:
        return False, (
            f"off: auto, and {len(streamed)} of {len(manifest.units)} units stream from the host tier or "
            f"storage; "
            "a prefill is one streaming pass whatever its length, so reuse does not pay (--prefix-cache on "
            "forces it)"
        )
    return True, "on: auto, and every weight is resident, so a reused prefix skips its prefill compute"


MODES = ("blocks", "extend", "exact")


def block_hashes(ids: list[int], block_tokens: int, blocks: int | None = None) -> list[bytes]:
    """Cumulative hash at each block boundary: hashes[i] covers ids[: (i + 1) * block_tokens]."""
    n = len(ids) // block_tokens if blocks is None else min(blocks, len(ids) // block_tokens)
    out, h = [], b""
    for i in range(n):
        block = array("q", ids[i * block_tokens : (i + 1) * block_tokens]).tobytes()
        h = hashlib.blake2b(h + block, digest_size=16).digest()
        out.append(h)
    return out


@dataclass
class Hit:
    cache: object  # a private copy, cropped to `tokens`, for generate to extend
    tokens: int  # prompt tokens whose KV (or state) it holds
    feed_from: int = 0  # prompt tokens generate is given from: 0, or `tokens` where it cannot count a cache's tokens


@dataclass
class _Entry:
    ids: list[int]
    cache: object
    nbytes: int
    hashes: list[bytes] = field(default_factory=list)
    feed_from: int = 0  # Hit.feed_from of this entry (mode "extend": its length when its layers are all stateful)


@dataclass
class PrefixStats:
    lookups: int = 0
    hits: int = 0
    reused_tokens: int = 0
    stored: int = 0
    evicted: int = 0


class PrefixCache:
    """KV checkpoints keyed on token blocks, least recently used dropped first beyond `max_bytes`.

    MODE "blocks" crops checkpoints to block boundaries and restores any block prefix; "extend" keeps whole caches
    that cannot be cropped and restores one only for a prompt that extends its tokens exactly; "exact" does the same
    for caches that must be kept as they stood at their length (int4 KV), and takes a copy once the prompt is in
    (`keep`) besides the cache a generation leaves."""

    def __init__(self, max_bytes: int, block_tokens: int = BLOCK_TOKENS, mode: str = "blocks") -> None:
        if block_tokens < 1:
            raise ValueError("block_tokens must be at least 1")
        if mode not in MODES:
            raise ValueError(f"unknown prefix cache mode {mode!r}; expected one of {', '.join(MODES)}")
        self.mode = mode
        self.max_bytes = int(max_bytes)
        self.block_tokens = block_tokens
        self._entries: OrderedDict[int, _Entry] = OrderedDict()  # LRU order, oldest first
        self._index: dict[bytes, tuple[int, int]] = {}  # boundary hash -> (entry id, boundary length)
        self._next = 0
        self._lock = threading.Lock()
        self.bytes = 0
        self.stats = PrefixStats()
        self.disabled_reason = ""  # set when the model's cache turns out not to be croppable

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, ids: list[int]) -> Hit | None:
        """The longest cached block prefix of `ids` (in mode "extend": kept cache whose tokens `ids` starts with)
        leaving at least one token to compute, as a private copy."""
        with self._lock:
            self.stats.lookups += 1
            if self.disabled_reason:
                return None
            if self.mode in ("extend", "exact"):
                return self._lookup_extended(ids)
            usable = (len(ids) - 1) // self.block_tokens
            for i, h in reversed(list(enumerate(block_hashes(ids, self.block_tokens, usable)))):
                found = self._index.get(h)
                if found is None:
                    continue
                entry_id, length = found
                entry = self._entries.get(entry_id)
                if entry is None or entry.ids[:length] != ids[:length]:  # evicted, or a hash collision
                    continue
                self._entries.move_to_end(entry_id)
                snapshot = copy.deepcopy(entry.cache)
                if seq_length(snapshot) > length:
                    crop(snapshot, length)
                self.stats.hits += 1
                self.stats.reused_tokens += length
                return Hit(snapshot, length)
            return None

    def store(self, ids: list[int], cache) -> int:
        """Keep `cache` (which holds the KV of `ids`, and is handed over) cropped to its last block boundary; in mode
        "extend", whole (it holds every id but the last, which generate sampled and never fed).

        Returns the tokens stored (0 when nothing was: too short, already cached, too large or unsupported)."""
        with self._lock:
            if self.disabled_reason:
                return 0
            if self.mode == "extend":
                return self._store_whole(ids, cache)
            if self.mode == "exact":
                return self._keep_exact(list(ids[:-1]), cache)
            ok, why = supported(cache)
            if not ok:
                self.disabled_reason = why
                return 0
            if not holds_every_token(cache):
                return 0  # a conversation longer than a sliding window: this one cannot be kept
            have = min(len(ids), seq_length(cache))
            length = (have // self.block_tokens) * self.block_tokens
            if length == 0:
                return 0
            ids = list(ids[:length])
            hashes = block_hashes(ids, self.block_tokens)
            known = self._index.get(hashes[-1])
            if known is not None and known[0] in self._entries and self._entries[known[0]].ids[:length] == ids:
                self._entries.move_to_end(known[0])  # this exact prefix is held already
                return 0
            crop(cache, length)
            size = nbytes(cache)
            if size > self.max_bytes:
                return 0
            entry_id, self._next = self._next, self._next + 1
            self._entries[entry_id] = _Entry(ids, cache, size, hashes)
            self.bytes += size
            for i, h in enumerate(hashes):
                self._index[h] = (entry_id, (i + 1) * self.block_tokens)
            self.stats.stored += 1
            self._drop_unreferenced()
            while self.bytes > self.max_bytes and self._entries:
                self._evict(next(iter(self._entries)))
            return length

    @property
    def takes_snapshots(self) -> bool:
        """Whether a generation should hand over a copy of its cache once the prompt is in (`keep`): mode "exact"."""
        return self.mode == "exact"

    def keep(self, ids: list[int], cache) -> int:
        """Mode "exact": keep CACHE (handed over), which holds exactly the KV of IDS, as it stood at that length.

        Returns the tokens kept (0 when nothing was: another mode, not exactly IDS, held already or too large)."""
        with self._lock:
            if self.disabled_reason or self.mode != "exact":
                return 0
            return self._keep_exact(list(ids), cache)

    def _keep_exact(self, ids: list[int], cache) -> int:
        """A cache kept at exactly its length: it must hold these very tokens, and no crop may have made its window
        hold int4 values (a rollback deeper than the kept full-precision block)."""
        if not ids or seq_length(cache) != len(ids) or not getattr(cache, "exact", True):
            return 0
        # the full-precision block a rollback needs: a kept prefix is never rolled back
        if hasattr(cache, "forget_past"):
            cache.forget_past()
        return self._insert(ids, cache, 0)

    def _insert(self, ids: list[int], cache, feed_from: int) -> int:
        """Keep CACHE whole under IDS (modes "extend" and "exact"); an entry of the same tokens is refreshed instead."""
        held = next((entry_id for entry_id, e in self._entries.items() if e.ids == ids), None)
        if held is not None:
            self._entries.move_to_end(held)
            return 0
        size = nbytes(cache)
        if size > self.max_bytes:
            return 0
        entry_id, self._next = self._next, self._next + 1
        self._entries[entry_id] = _Entry(ids, cache, size, feed_from=feed_from)
        self.bytes += size
        self.stats.stored += 1
        while self.bytes > self.max_bytes and self._entries:
            self._evict(next(iter(self._entries)))
        return len(ids)

    def _lookup_extended(self, ids: list[int]) -> Hit | None:
        """The longest kept cache whose tokens `ids` starts with, leaving at least one token to compute."""
        found = max(
            ((n, e) for e in self._entries.items() if (n := len(e[1].ids)) < len(ids) and ids[:n] == e[1].ids),
            default=None,
            key=lambda pair: pair[0],
        )
        if found is None:
            return None
        length, (entry_id, entry) = found
        self._entries.move_to_end(entry_id)
        self.stats.hits += 1
        self.stats.reused_tokens += length
        return Hit(copy.deepcopy(entry.cache), length, entry.feed_from)

    def _store_whole(self, ids: list[int], cache) -> int:
        """Keep CACHE whole: it holds the state after every id but the last, which generate sampled and never fed."""
        from .cachekinds import linear_only

        ids, whole_prompt = list(ids[:-1]), not linear_only(cache)
        if not ids or (whole_prompt and seq_length(cache) != len(ids)):
            return 0  # a cache that does not hold exactly these tokens is not kept
        return self._insert(ids, cache, 0 if whole_prompt else len(ids))

    def to_dict(self) -> dict:
        return {
            "mode": self.mode,
            "entries": len(self._entries),
            "bytes": self.bytes,
            "max_bytes": self.max_bytes,
            "block_tokens": self.block_tokens,
            "lookups": self.stats.lookups,
            "hits": self.stats.hits,
            "reused_tokens": self.stats.reused_tokens,
            "stored": self.stats.stored,
            "evicted": self.stats.evicted,
            "disabled_reason": self.disabled_reason,
        }

    def _evict(self, entry_id: int) -> None:
        entry = self._entries.pop(entry_id)
        self.bytes -= entry.nbytes
        self.stats.evicted += 1
        for h in entry.hashes:
            if self._index.get(h, (None,))[0] == entry_id:
                del self._index[h]

    def _drop_unreferenced(self) -> None:
        """An entry whose every boundary now points to a newer, longer one is no longer reachable."""
        live = {entry_id for entry_id, _ in self._index.values()}
        for entry_id in [e for e in self._entries if e not in live]:
            entry = self._entries.pop(entry_id)
            self.bytes -= entry.nbytes
