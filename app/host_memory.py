"""Growing a torch worker's malloc heap ahead of use.

A torch engine's KV buffers (an imported prefix with room for its suffix, a prefill's
cache) are fresh allocations of tens of MiB. With ``serve_runtime.keep_freed_memory``
glibc keeps what is freed (``app/builder.py:MEMORY_ENV``), so a buffer is cheap when one
as large was freed before; but every buffer larger than any before grows the heap, and
each new 4 KiB page faults on first touch. A session whose context grows turn after turn
meets that on many of its turns: in ``loadtests.multiturn`` the decode of a fetched prefix
took 4-8 ms without faults and 43-330 ms with them (3.3k-7.7k faults, 31-43 µs each on
this VM at the time; ~3 µs on a quiet one).

:func:`prefault_heap` touches ``max_bytes`` of new heap pages once, at start, and frees
them: they stay in the heap, mapped, and later buffers are carved from them. That needs
all threads on one malloc arena (``MALLOC_ARENA_MAX=1``, ``app/builder.py:ONE_ARENA_ENV``):
glibc otherwise gives threads arenas of their own, whose freed memory serves only them (a
40 or 80 MiB buffer allocated twice, each time on a new thread, faulted in every page both
times; on one arena the second time faulted none). The engine decodes fetched prefixes on
``asyncio.to_thread``'s threads and allocates caches on its loop thread.

Off by default (``serve_runtime.prefault_heap_bytes: 0``): with 512 MiB the worker's loads
of a prefix from Redis (L3) took 3-4x as long in every run: the data plane's ``MGET`` was
what slowed, with no more page faults in its thread. On this VM memory that sat idle is
slow to read again (the host's doing, it seems), which a larger resident set may make
worse (loadtests/README.md, "Redis's reply buffers, and memory that sat idle").
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import resource
import time
from typing import Callable, Optional

from app.object_store import AVAILABLE_SHARE, Prefault, available_memory

logger = logging.getLogger("ray.serve")

_CHUNK = 64 << 20

# Per thread on Linux; elsewhere (macOS has no RUSAGE_THREAD) the whole process's.
_RUSAGE_WHO = getattr(resource, "RUSAGE_THREAD", resource.RUSAGE_SELF)


def minor_faults() -> int:
    """Minor page faults of the calling thread so far (for the DEBUG timings of a KV
    read and of a prefix's decode: a fresh page costs ~3 µs on the VMs here)."""
    return resource.getrusage(_RUSAGE_WHO).ru_minflt


def process_minor_faults() -> int:
    """Minor page faults of the whole process so far: a forward pass's pages are also
    first written by the intra-op (OpenMP) threads, which the calling thread's count
    misses. Other threads' faults in the same span count too."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def heap_keeps_freed_memory(max_bytes: int, env=os.environ) -> bool:
    """Whether this process's glibc settings keep ``max_bytes`` freed in the one heap all
    threads allocate from (else a prefault would be handed back, or serve one thread)."""
    try:
        return (
            env.get("MALLOC_ARENA_MAX") == "1"
            and int(env.get("MALLOC_MMAP_THRESHOLD_", "0")) > _CHUNK
            and int(env.get("MALLOC_TRIM_THRESHOLD_", "0")) > max_bytes
        )
    except ValueError:
        return False


def prefault_heap(
    max_bytes: int,
    *,
    who: str = "",
    progress: Optional[Callable[[int], None]] = None,
) -> int:
    """Grow the malloc heap by ``max_bytes`` (at most a quarter of the memory available)
    with every page touched, then free it. Returns the bytes touched (0 when this process's
    malloc would not keep them, see :func:`heap_keeps_freed_memory`); ``progress`` gets
    the running total after each 64 MiB. Never raises."""
    if max_bytes <= 0:
        return 0
    if not heap_keeps_freed_memory(max_bytes):
        logger.info("heap: not prefaulted, malloc would not keep it (MALLOC_ARENA_MAX=1 and the "
                    "thresholds of serve_runtime.keep_freed_memory are not all set)")
        return 0
    available = available_memory()
    budget = max_bytes if available is None else min(max_bytes, available // AVAILABLE_SHARE)
    started = time.perf_counter()
    held: list[int] = []
    done = 0
    try:
        # glibc itself, not numpy (which asks for transparent huge pages on big arrays:
        # the kernel then compacts memory on the fault, 3 s for 512 MiB here) nor torch.
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
        libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, (ctypes.c_size_t,)
        libc.free.argtypes = (ctypes.c_void_p,)
        libc.memset.restype, libc.memset.argtypes = ctypes.c_void_p, (ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t)
        try:
            while done < budget:
                size = min(_CHUNK, budget - done)
                addr = libc.malloc(size)
                if not addr:
                    logger.warning("heap: prefault stopped after %d MiB: malloc failed", done >> 20)
                    break
                held.append(addr)
                libc.memset(addr, 0, size)  # every page written: mapped from now on
                done += size
                if progress is not None:
                    progress(done)
        finally:
            for addr in held:
                libc.free(addr)  # into the heap, which keeps it
    except Exception:  # noqa: BLE001 - an optimisation only
        logger.warning("heap: prefault failed after %d MiB", done >> 20, exc_info=True)
    if done:
        logger.info("heap: prefaulted %d MiB for %s in %.2fs", done >> 20, who or "this process",
                    time.perf_counter() - started)
    return done


class HeapPrefault(Prefault):
    """:func:`prefault_heap` in a daemon thread, at full speed: the worker waits for it
    (``finished``) before it reports ready. Beside traffic it slowed what it should speed
    up: a 7-block prefix decode took 17-40 ms while it ran (on one arena, the heap's growth
    waits for the faults under way), 1-2 ms otherwise."""

    THREAD_NAME = "heap-prefault"
    GAUGE = ("llm_heap_prefaulted_bytes", "Bytes of malloc heap this replica touched ahead of use.")

    def _work(self, max_bytes: int) -> None:
        prefault_heap(max_bytes, who=self._who, progress=self._progress)
