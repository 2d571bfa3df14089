"""A worker's KV buffers from host memory whose pages were touched once, at start.

Every KV buffer of the torch engine on a CPU (a sequence's cache layers, the buffer a
fetched prefix is decoded into) is tens of MiB of fresh memory from malloc. What malloc
hands out was often handed back to the kernel, or never touched: each 4 KiB page then
faults on its first write. On the VMs here a fault costs 3 µs on a quiet machine and
50-140 µs on a busy one (a prefix decode of 119 blocks took 386 ms with 7,740 faults,
against 3-16 ms with none; ``loadtests/README.md``, "A KV arena"). Which decodes fault
depends on what malloc happened to keep, so the same turn is fast or slow by chance.

:class:`HostArena` is one anonymous mapping of ``capacity`` bytes, populated by the
kernel once (``MAP_POPULATE``) in a background thread, and never given back. Buffers are
carved from it (best fit, 4 KiB aligned) and return to it when the last tensor over them
is freed: their pages stay mapped, so a buffer from the arena never faults. When it has
no room for a buffer, the buffer comes from malloc as before (counted as a fallback).

The arena is per process (one engine per worker process; :func:`install`), because a
cache layer allocates its buffers where no engine is at hand (``kv_buffer._empty``).
"""

from __future__ import annotations

import bisect
import collections
import logging
import mmap
import threading
import time
import weakref
from typing import Optional

import numpy as np

logger = logging.getLogger("ray.serve")

ALIGN = 4096
_PAGE = mmap.PAGESIZE


def _round_up(n: int, to: int = ALIGN) -> int:
    return (int(n) + to - 1) // to * to


class HostArena:
    """Host memory for KV buffers, mapped and populated once (see the module's text).

    Thread-safe: buffers are taken on the engine's threads and returned by finalizers,
    which run on whatever thread frees the last tensor over a buffer (also inside the
    garbage collector, also while :meth:`take` holds the lock). So a return only appends
    to a queue, and the next :meth:`take` (or :meth:`stats`) folds it into the free list.
    """

    def __init__(self, capacity_bytes: int, populate: bool = True):
        if capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be > 0, got {capacity_bytes}")
        self.capacity = _round_up(capacity_bytes)
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
        started = time.perf_counter()
        if populate and hasattr(mmap, "MAP_POPULATE"):
            # The kernel faults every page in here, with the GIL released (CPython's
            # mmap() call), far faster than a write to each page from Python.
            self._map = mmap.mmap(-1, self.capacity, flags=flags | mmap.MAP_POPULATE)
            self._buf = np.frombuffer(self._map, dtype=np.uint8)
        else:
            self._map = mmap.mmap(-1, self.capacity, flags=flags)
            self._buf = np.frombuffer(self._map, dtype=np.uint8)
            if populate:
                for start in range(0, self.capacity, 16 << 20):
                    self._buf[start : start + (16 << 20) : _PAGE] = 0
        self.populate_seconds = time.perf_counter() - started
        self._view = memoryview(self._map)
        self._lock = threading.Lock()
        self._free_offsets: list[int] = [0]  # sorted
        self._free_sizes: list[int] = [self.capacity]  # the size of each free range
        self._returned: collections.deque[tuple[int, int]] = collections.deque()
        self._used = 0
        self.taken = 0
        self.fallbacks = 0

    def address_range(self) -> tuple[int, int]:
        """First and one-past-last address of the arena's memory."""
        start = self._buf.ctypes.data
        return start, start + self.capacity

    def take(self, nbytes: int) -> Optional[np.ndarray]:
        """A ``uint8`` array of ``nbytes`` over arena memory, or None when no free range
        holds it. The memory returns to the arena when the array is freed, and every
        numpy view and tensor over it (``torch.from_numpy``) keeps it alive: its base is a
        memoryview of its own range, not an array, so numpy's views name it as their base
        instead of skipping to the arena's mapping."""
        nbytes = int(nbytes)
        if nbytes <= 0:
            raise ValueError(f"nbytes must be > 0, got {nbytes}")
        size = _round_up(nbytes)
        with self._lock:
            self._fold_returned()
            best = -1
            for i, free in enumerate(self._free_sizes):
                if free >= size and (best < 0 or free < self._free_sizes[best]):
                    best = i
                    if free == size:
                        break
            if best < 0:
                self.fallbacks += 1
                return None
            offset = self._free_offsets[best]
            if self._free_sizes[best] == size:
                del self._free_offsets[best]
                del self._free_sizes[best]
            else:
                self._free_offsets[best] += size
                self._free_sizes[best] -= size
            self._used += size
            self.taken += 1
        out = np.frombuffer(self._view[offset : offset + nbytes], dtype=np.uint8)
        weakref.finalize(out, self._returned.append, (offset, size))
        return out

    def _fold_returned(self) -> None:
        """Merge the returned ranges into the free list (lock held)."""
        while self._returned:
            offset, size = self._returned.popleft()
            self._used -= size
            i = bisect.bisect_left(self._free_offsets, offset)
            # Coalesce with the free range before and the one after, where they touch.
            if i > 0 and self._free_offsets[i - 1] + self._free_sizes[i - 1] == offset:
                i -= 1
                self._free_sizes[i] += size
            else:
                self._free_offsets.insert(i, offset)
                self._free_sizes.insert(i, size)
            j = i + 1
            if j < len(self._free_offsets) and self._free_offsets[i] + self._free_sizes[i] == self._free_offsets[j]:
                self._free_sizes[i] += self._free_sizes[j]
                del self._free_offsets[j]
                del self._free_sizes[j]

    def free_ranges(self) -> list[tuple[int, int]]:
        """(offset, size) of each free range, in address order (for tests and stats)."""
        with self._lock:
            self._fold_returned()
            return list(zip(self._free_offsets, self._free_sizes))

    def stats(self) -> dict:
        with self._lock:
            self._fold_returned()
            return {
                "capacity_bytes": self.capacity,
                "used_bytes": self._used,
                "free_ranges": len(self._free_offsets),
                "taken": self.taken,
                "fallbacks": self.fallbacks,
            }


_arena: Optional[HostArena] = None
_install_lock = threading.Lock()


def current() -> Optional[HostArena]:
    """This process's arena, once it is populated (None before, or when there is none)."""
    return _arena


def install(capacity_bytes: int, *, background: bool = True) -> None:
    """Give this process an arena of ``capacity_bytes`` (0: none), unless it has one at
    least that large. Populating it takes ~0.1-0.3 s per 256 MiB here, so by default it
    runs in a daemon thread, and buffers come from malloc until it is done."""
    if capacity_bytes <= 0:
        return

    def build() -> None:
        global _arena
        with _install_lock:
            if _arena is not None and _arena.capacity >= capacity_bytes:
                return
            try:
                arena = HostArena(capacity_bytes)
            except (OSError, ValueError) as e:  # no memory for it: buffers stay on malloc
                logger.warning("kv arena: could not map %d bytes (%s); KV buffers come from malloc", capacity_bytes, e)
                return
            # A replaced (smaller) arena stays alive for as long as tensors over it do.
            _arena = arena
        logger.info(
            "kv arena: %d MiB of host memory for KV buffers, populated in %.0f ms",
            arena.capacity >> 20, 1000 * arena.populate_seconds,
        )

    if background:
        threading.Thread(target=build, name="kv-arena-populate", daemon=True).start()
    else:
        build()


def host_bytes(nbytes: int) -> np.ndarray:
    """An uninitialised ``uint8`` buffer of ``nbytes``: from this process's arena when it
    has one with room, else from malloc (numpy)."""
    arena = _arena
    out = arena.take(nbytes) if arena is not None and nbytes > 0 else None
    return out if out is not None else np.empty(nbytes, np.uint8)


def uninstall() -> None:
    """Drop this process's arena (tests); tensors already over it keep its memory alive."""
    global _arena
    with _install_lock:
        _arena = None
