"""L2: the host-memory tier of one data-plane actor. Pure logic: no Ray, no Redis.

A byte-bounded map from key to bytes. When usage passes the high watermark, entries are
evicted (least recently used, or least frequently used with ties broken by recency) until
usage is at or below the low watermark: evicting in one sweep down to a lower mark, rather
than one entry per put, keeps the cost of choosing victims (a sort for LFU) amortised over
many puts.

Write-behind: entries put with ``dirty=True`` are not yet in L3 (Redis). The tier never
drops a dirty entry silently: every eviction is returned to the caller as an
:class:`Evicted` with its value and dirty flag, so the caller can write it to L3 first.
Pinned entries are never evicted (a caller pins what it is in the middle of using).

Values are stored as given, without a copy: ``bytes``, or read-only ``memoryview`` slices
of one larger buffer (the data plane keeps the blocks of one transfer as views into the
one array that carried them, which saves a copy per block). A buffer stays alive while
any of its views is stored, so the tier tracks each shared buffer's live bytes, and when
they fall below half of the buffer it copies the remaining views out (``bytes``) and lets
the buffer go: memory held is at most twice ``used_bytes``, and each byte is copied this
way at most once.

A caller can name the buffer a value belongs to (``put(..., group=obj)``, ``obj.nbytes``
its size) when the value is not a view of it: the data plane's blocks in Ray's object
store are separate arrays inside one stored object (see ``deployment._Resident``). The
same accounting applies: the group stays alive while any of its values is stored, and a
mostly dead group is copied out. :meth:`MemoryTier.group_of` says which group a stored
value belongs to.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from dataclasses import dataclass
from typing import Iterable, Literal, Optional

Policy = Literal["lru", "lfu"]


@dataclass(frozen=True, slots=True)
class Evicted:
    key: str
    value: bytes
    # True: the value never reached L3; the caller must write it there or count it lost.
    dirty: bool
    # The group the value was put with (``MemoryTier.put``), if any: to put it back as it was.
    group: object = None


@dataclass(slots=True)
class _Entry:
    value: bytes | memoryview
    freq: int
    last_use: int
    pinned: bool
    group: object = None  # the buffer (or named group) the value lives in, if shared


@dataclass(slots=True)
class _Shared:
    """A buffer that several stored memoryviews point into."""

    obj: object
    size: int
    live: int
    keys: set[str]


def _shared_base(value, group=None) -> Optional[object]:
    if group is not None:
        return group
    return value.obj if isinstance(value, memoryview) else None


def _size_of(base) -> int:
    size = getattr(base, "nbytes", None)
    return int(size) if isinstance(size, int) else memoryview(base).nbytes


class MemoryTier:
    """Byte-bounded LRU/LFU map with watermarks and a write-behind dirty set."""

    def __init__(
        self,
        capacity_bytes: int,
        *,
        high_watermark: float = 0.85,
        low_watermark: float = 0.70,
        policy: Policy = "lru",
    ):
        if capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be positive, got {capacity_bytes}")
        if not 0 < low_watermark < high_watermark <= 1:
            raise ValueError(
                f"need 0 < low_watermark ({low_watermark}) < high_watermark "
                f"({high_watermark}) <= 1"
            )
        if policy not in ("lru", "lfu"):
            raise ValueError(f"policy must be 'lru' or 'lfu', got {policy!r}")
        self.capacity_bytes = capacity_bytes
        self.policy: Policy = policy
        self._high_bytes = int(capacity_bytes * high_watermark)
        self._low_bytes = int(capacity_bytes * low_watermark)
        # Insertion order is recency order (move_to_end on every use): LRU victims are
        # at the front, and LFU uses ``last_use`` to break frequency ties.
        self._entries: OrderedDict[str, _Entry] = OrderedDict()
        self._tick = itertools.count()
        self._used = 0
        self._dirty: set[str] = set()
        self._shared: dict[int, _Shared] = {}  # id(buffer) -> its views in this tier
        self.num_evictions = 0
        self.num_compactions = 0

    # -- reads ---------------------------------------------------------------------

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def used_bytes(self) -> int:
        return self._used

    @property
    def dirty(self) -> frozenset[str]:
        """Keys whose values are not yet written to L3 (a copy)."""
        return frozenset(self._dirty)

    @property
    def num_dirty(self) -> int:
        """How many keys are not yet written to L3, without :attr:`dirty`'s copy."""
        return len(self._dirty)

    def get(self, key: str) -> Optional[bytes]:
        """The value, counted as a use (recency and frequency); None on a miss."""
        entry = self._entries.get(key)
        if entry is None:
            return None
        self._touch(key, entry)
        return entry.value

    def peek(self, key: str) -> Optional[bytes]:
        """The value without counting a use."""
        entry = self._entries.get(key)
        return None if entry is None else entry.value

    def group_of(self, key: str) -> Optional[object]:
        """What ``key``'s value lives in: the group it was put with, or the buffer a
        memoryview value views; None for a ``bytes`` value (also once copied out)."""
        entry = self._entries.get(key)
        return None if entry is None else entry.group

    def size_of(self, key: str) -> Optional[int]:
        entry = self._entries.get(key)
        return None if entry is None else len(entry.value)

    def keys(self) -> list[str]:
        """Keys from least to most recently used."""
        return list(self._entries)

    def dirty_items(self) -> list[tuple[str, bytes]]:
        return [(k, self._entries[k].value) for k in self._dirty]

    @property
    def held_bytes(self) -> int:
        """Memory the stored values keep alive: ``used_bytes`` plus the dead parts of
        shared buffers (at most ``used_bytes`` again)."""
        shared_live = sum(s.live for s in self._shared.values())
        return self._used - shared_live + sum(s.size for s in self._shared.values())

    # -- writes --------------------------------------------------------------------

    def put(
        self,
        key: str,
        value: bytes | memoryview,
        *,
        dirty: bool = False,
        pinned: bool = False,
        group: object = None,
    ) -> list[Evicted]:
        """Insert or replace ``key``; returns what had to be evicted to make room.

        Replacing keeps the entry's use count (it is the same key, used again). A
        replacement that is clean does not clear a pending dirty flag: the older write
        still has to reach L3 unless the caller says otherwise via :meth:`mark_clean`.
        A value larger than the whole tier is not stored; it comes back as evicted.
        ``value`` is kept as it is (``bytes`` or a read-only memoryview; anything else is
        copied into ``bytes``). ``group``: the buffer the value lives in when it is not
        ``value.obj`` (an object with ``nbytes``), accounted like a shared buffer.
        """
        if not isinstance(value, (bytes, memoryview)) or (
            isinstance(value, memoryview) and not value.readonly
        ):
            value, group = bytes(value), None
        old = self._entries.get(key)
        if len(value) > self._high_bytes:
            # Cannot fit even alone: hand it straight back, and drop any older copy.
            evicted = []
            if old is not None:
                self._remove(key)
            evicted.append(Evicted(key, value, dirty or key in self._dirty, group))
            self._dirty.discard(key)
            self.num_evictions += 1
            return evicted
        base = _shared_base(value, group)
        if old is not None:
            self._used -= len(old.value)
            self._release(key, old)
            old.value, old.group = value, base
            old.pinned = pinned or old.pinned
            self._touch(key, old)
        else:
            self._entries[key] = _Entry(value, 1, next(self._tick), pinned, base)
        self._used += len(value)
        self._hold(key, value, base)
        if dirty:
            self._dirty.add(key)
        return self._evict_if_needed()

    def mark_clean(self, key: str, value: Optional[bytes] = None) -> None:
        """``key`` has been written to L3. With ``value``, only if that is still the
        stored value (a newer put in between stays dirty)."""
        entry = self._entries.get(key)
        if entry is None or (value is not None and entry.value is not value):
            return
        self._dirty.discard(key)

    def pin(self, key: str, pinned: bool = True) -> None:
        entry = self._entries.get(key)
        if entry is not None:
            entry.pinned = pinned

    def delete(self, key: str) -> Optional[bytes]:
        """Remove ``key`` (dirty or not: the caller deletes on purpose)."""
        if key not in self._entries:
            return None
        value = self._entries[key].value
        self._remove(key)
        return value

    def delete_many(self, keys: Iterable[str]) -> int:
        return sum(self.delete(k) is not None for k in list(keys))

    def clear(self) -> list[Evicted]:
        """Drop everything; dirty entries come back so the caller can write them."""
        out = [Evicted(k, e.value, k in self._dirty, e.group) for k, e in self._entries.items()]
        self._entries.clear()
        self._dirty.clear()
        self._shared.clear()
        self._used = 0
        return out

    # -- internals -----------------------------------------------------------------

    def _touch(self, key: str, entry: _Entry) -> None:
        entry.freq += 1
        entry.last_use = next(self._tick)
        self._entries.move_to_end(key)

    def _remove(self, key: str) -> None:
        entry = self._entries.pop(key)
        self._used -= len(entry.value)
        self._dirty.discard(key)
        self._release(key, entry)

    def _hold(self, key: str, value, base) -> None:
        if base is None:
            return
        shared = self._shared.get(id(base))
        if shared is None:
            shared = self._shared[id(base)] = _Shared(base, _size_of(base), 0, set())
        shared.live += len(value)
        shared.keys.add(key)

    def _release(self, key: str, entry: _Entry) -> None:
        """``key`` no longer holds ``entry``'s value; compact the buffer it pointed into
        if that buffer is now mostly dead."""
        base, value = entry.group, entry.value
        if base is None:
            return
        shared = self._shared.get(id(base))
        if shared is None or key not in shared.keys:
            return
        shared.keys.discard(key)
        shared.live -= len(value)
        if not shared.keys:
            del self._shared[id(base)]
        elif 2 * shared.live < shared.size:
            del self._shared[id(base)]
            self.num_compactions += 1
            for k in shared.keys:
                other = self._entries[k]
                other.value = bytes(other.value)  # a dirty write in flight stays dirty
                other.group = None

    def _victims(self) -> Iterable[str]:
        if self.policy == "lru":
            return [k for k, e in self._entries.items() if not e.pinned]
        # LFU: fewest uses first; equal counts, least recently used first.
        candidates = [(e.freq, e.last_use, k) for k, e in self._entries.items() if not e.pinned]
        candidates.sort()
        return [k for _, _, k in candidates]

    def _evict_if_needed(self) -> list[Evicted]:
        if self._used <= self._high_bytes:
            return []
        evicted: list[Evicted] = []
        for key in self._victims():
            if self._used <= self._low_bytes:
                break
            entry = self._entries[key]
            evicted.append(Evicted(key, entry.value, key in self._dirty, entry.group))
            self._remove(key)
            self.num_evictions += 1
        return evicted
