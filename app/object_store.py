"""Prefaulting this process's mapping of Ray's object store.

Every process that reads or writes objects in Ray's shared-memory object store maps the
store's file (``plasmaXXXXXX`` on ``/dev/shm``) once, and each 4 KiB page of that mapping
faults the first time the process touches it. On the VMs here that costs 2-4 µs a page:
a 16 MiB ``ray.put`` into pages this process had not touched took 16 ms, into touched
ones 2.6 ms. The data plane's L2 lives in the object store and keeps growing into pages
nobody touched yet, so without this its puts, its promotions from Redis and a worker's
reads of those blocks pay the faults on every new block.

:func:`prefault_object_store` populates this process's page tables for the first
``max_bytes`` of the mapping (where the store's allocator places objects first) in a few
``madvise(MADV_POPULATE_WRITE)`` calls (Linux 5.14+): 0.2-0.7 s of CPU per GiB once, at
start, in a thread of its own (:class:`Prefault`) at half a core while the replica serves.
It never changes what the pages hold. It does allocate the store's pages that no process
had touched yet, i.e. the node's ``object_store_memory`` (which Ray reserves for the
store) is taken up front, up to ``max_bytes`` and at most a quarter of the memory
available at the time, as Ray's own ``preallocate_plasma_memory`` takes all of it. Only
for a store on tmpfs or hugetlbfs: a store Ray put on disk (when ``/dev/shm`` is too
small) is left alone, and so are the files it falls back to when the store is full.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import logging
import os
import sys
import threading
import time
from dataclasses import dataclass
from typing import Callable, Optional

logger = logging.getLogger("ray.serve")

MADV_POPULATE_WRITE = 23  # linux/mman.h, 5.14+
_CHUNK = 64 << 20  # one madvise call holds the process's mmap lock for ~15-45 ms
# A replica's prefault runs beside its traffic (it starts when the replica does, often
# while others are busy taking over): at most half of one core.
BACKGROUND_DUTY = 0.5
_ALIGN = 2 << 20  # madvise wants whole (huge) pages
AVAILABLE_SHARE = 4  # never more than 1/4 of the memory available (machine or cgroup)
_MEMORY_FILESYSTEMS = ("tmpfs", "hugetlbfs")
# Bigger than Ray inlines into the owner's memory (100 KiB): this one lands in the store.
_MAP_PROBE_BYTES = 256 << 10


@dataclass(frozen=True)
class Mapping:
    start: int
    end: int
    path: str


def plasma_mappings(maps_text: str) -> list[Mapping]:
    """The shared mappings of object-store files in ``/proc/<pid>/maps`` text, in address
    order."""
    out = []
    for line in maps_text.splitlines():
        parts = line.split(maxsplit=5)
        if len(parts) < 6 or "s" not in parts[1]:
            continue
        path = parts[5].removesuffix(" (deleted)").strip()
        if not os.path.basename(path).startswith("plasma"):
            continue
        start, end = (int(x, 16) for x in parts[0].split("-"))
        out.append(Mapping(start, end, path))
    return sorted(out, key=lambda m: m.start)


def filesystem_of(path: str, mounts_text: str) -> Optional[str]:
    """The filesystem type of the mount that holds ``path`` (longest mount point that is a
    prefix of it), from ``/proc/<pid>/mounts`` text."""
    best, fs = -1, None
    for line in mounts_text.splitlines():
        parts = line.split()
        if len(parts) < 3:
            continue
        point = parts[1].replace("\\040", " ")
        inside = path == point or path.startswith(point.rstrip("/") + "/")
        if inside and len(point) > best:
            best, fs = len(point), parts[2]
    return fs


def store_mapping(mappings: list[Mapping], mounts_text: str) -> Optional[Mapping]:
    """The object store's primary arena among ``mappings``: the largest one on a memory
    filesystem (the files Ray falls back to when the store is full are on disk), or None."""
    in_memory = [m for m in mappings if filesystem_of(m.path, mounts_text) in _MEMORY_FILESYSTEMS]
    return max(in_memory, key=lambda m: m.end - m.start, default=None)


def memory_available(meminfo_text: str) -> Optional[int]:
    """``MemAvailable`` of ``/proc/meminfo`` text, in bytes (None if absent)."""
    for line in meminfo_text.splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return None


def cgroup_available(max_text: str, current_text: str) -> Optional[int]:
    """Memory left under a cgroup v2 limit (``memory.max`` minus ``memory.current``), or
    None when unlimited or unreadable: in a container (a KubeRay pod) the limit, not the
    machine's MemAvailable, is what the store's pages count against."""
    try:
        limit = max_text.strip()
        if limit == "max":
            return None
        return max(0, int(limit) - int(current_text.strip()))
    except ValueError:
        return None


def available_memory() -> Optional[int]:
    """The least of MemAvailable and what this process's cgroup (v2) limit leaves."""
    figures = []
    try:
        figures.append(memory_available(_read("/proc/meminfo")))
    except OSError:
        pass
    try:
        figures.append(cgroup_available(_read("/sys/fs/cgroup/memory.max"), _read("/sys/fs/cgroup/memory.current")))
    except OSError:
        pass
    known = [f for f in figures if f is not None]
    return min(known) if known else None


def prefault_budget(max_bytes: int, mapping_bytes: int, available: Optional[int]) -> int:
    """How much to prefault: ``max_bytes``, at most the mapping, and at most a quarter of
    the memory the machine has available (pages not yet allocated get allocated, so a
    small machine must not hand a large share of what is left to the store at start);
    whole 2 MiB units."""
    budget = min(max_bytes, mapping_bytes)
    if available is not None:
        budget = min(budget, available // AVAILABLE_SHARE)
    return max(0, budget) // _ALIGN * _ALIGN


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


def _map_store() -> None:
    """Make this process map the store (a worker maps it at its first object there)."""
    import numpy as np
    import ray

    ref = ray.put(np.zeros(_MAP_PROBE_BYTES, dtype=np.uint8))
    del ref


class Prefault:
    """:func:`prefault_object_store` running in a daemon thread, so that a replica serves
    meanwhile (the store's allocator fills the low addresses first, which the prefault
    reaches first), at most half of one core. ``bytes_done`` grows as it goes. Subclasses
    prefault something else (``_work``) under their own thread and gauge names."""

    THREAD_NAME = "object-store-prefault"
    GAUGE = ("llm_object_store_prefaulted_bytes", "Bytes of the node's object store this replica has mapped ahead of use.")

    def __init__(self, max_bytes: int, who: str = ""):
        self.bytes_done = 0
        self.finished = threading.Event()
        self._who = who
        self._gauge = None
        self._thread = threading.Thread(target=self._run, args=(max_bytes,), name=self.THREAD_NAME, daemon=True)
        self._thread.start()

    def _work(self, max_bytes: int) -> None:
        prefault_object_store(max_bytes, who=self._who, progress=self._progress, duty=BACKGROUND_DUTY)

    def _run(self, max_bytes: int) -> None:
        try:
            self._work(max_bytes)
        finally:
            self.finished.set()

    def _progress(self, done: int) -> None:
        self.bytes_done = done
        try:
            if self._gauge is None:
                from ray.util import metrics

                self._gauge = metrics.Gauge(*self.GAUGE, tag_keys=("component",))
            self._gauge.set(done, tags={"component": self._who or "process"})
        except Exception:  # noqa: BLE001 - a metric only
            logger.debug("%s: metric not set", self.THREAD_NAME, exc_info=True)


def prefault_object_store(
    max_bytes: int,
    *,
    who: str = "",
    progress: Optional[Callable[[int], None]] = None,
    duty: float = 1.0,
) -> int:
    """Populate this process's page tables for the first ``max_bytes`` of its mapping of
    the node's object store. Returns the bytes populated (0 where unsupported: not Linux,
    kernel before 5.14, Ray not running, a store on disk); ``progress`` gets the running
    total after each chunk. ``duty`` < 1 sleeps between chunks so that the work takes at
    most that share of one core (and the process's mmap lock). Never raises."""
    if max_bytes <= 0 or not sys.platform.startswith("linux"):
        return 0
    started = time.perf_counter()
    try:
        import ray

        if not ray.is_initialized():
            return 0
        mappings = plasma_mappings(_read("/proc/self/maps"))
        if not mappings:
            _map_store()
            mappings = plasma_mappings(_read("/proc/self/maps"))
        if not mappings:
            logger.info("object store: no mapping of it found in this process; not prefaulted")
            return 0
        mounts = _read("/proc/self/mounts")
        store = store_mapping(mappings, mounts)
        if store is None:
            logger.info("object store file %s is not in memory (%s): not prefaulted",
                        mappings[0].path, filesystem_of(mappings[0].path, mounts))
            return 0
        libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
        budget = prefault_budget(max_bytes, store.end - store.start, available_memory())
        if budget < max_bytes:
            logger.info(
                "object store: prefaulting %d MiB, not %d: the mapping's size or a quarter of the available memory",
                budget >> 20, max_bytes >> 20,
            )
        end = store.start + budget
        done = 0
        for addr in range(store.start, end, _CHUNK):
            length = min(_CHUNK, end - addr)
            chunk_started = time.perf_counter()
            if libc.madvise(addr, length, MADV_POPULATE_WRITE) != 0:
                err = ctypes.get_errno()
                if err == errno.EINVAL and done == 0:
                    logger.info("object store: this kernel has no MADV_POPULATE_WRITE (Linux 5.14+); not prefaulted")
                else:
                    logger.warning("object store: prefault stopped after %d MiB: %s", done >> 20, os.strerror(err))
                break
            done += length
            if progress is not None:
                progress(done)
            if duty < 1.0 and addr + length < end:
                # Yield the core (and the process's mmap lock) between chunks.
                time.sleep((time.perf_counter() - chunk_started) * (1.0 / duty - 1.0))
    except Exception:  # noqa: BLE001 - an optimisation only
        logger.warning("object store: prefault failed", exc_info=True)
        return 0
    if done:
        logger.info(
            "object store: prefaulted %d MiB of %s's mapping of %s (%d MiB) in %.2fs",
            done >> 20, who or "this process", store.path, (store.end - store.start) >> 20,
            time.perf_counter() - started,
        )
    return done
