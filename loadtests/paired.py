"""Paired measurement of two servers on one shared machine: both kept running, the one
not being measured frozen (SIGSTOP), short slices alternated, a ratio per pair.

Why: on these VMs a system's speed drifts by tens of percent between minutes (plain vLLM
ran one load at 2.6k and 4.6k output tok/s in one run), and a comparison that starts
one system, measures it, stops it and starts the other puts a minute or two of start-up
between the two halves of each pair. Here both start once; each slice is a few seconds,
and the two slices of a pair are back to back, so the drift inside a pair is small and
many pairs fit in a few minutes. The idle system is frozen, not merely idle: our idle
app on Ray still uses ~0.13 of a core (Serve's controller, GCS, Ray's agents; measured
in loadtests/README.md, "Paired slices"), which would be charged to the other system's
slice; frozen, it takes none (the report says how much
CPU each frozen side used during the other's slices, which checks that it was frozen).

:class:`Freezer` stops and continues a set of processes; :func:`slice_schedule` orders
the slices; :func:`pair_stats` turns the slices' figures into per-pair ratios, their median
and a bootstrap interval.
"""

from __future__ import annotations

import os
import random
import signal
import statistics
import time
from typing import Callable, Iterable, Iterator, Optional, Sequence


class Freezer:
    """SIGSTOP / SIGCONT of the processes ``pids()`` names (asked anew at each
    :meth:`freeze`: a session starts processes as it goes). :meth:`thaw` continues exactly
    the processes the last freeze stopped. A process that is gone is skipped."""

    def __init__(self, name: str, pids: Callable[[], Iterable[int]]):
        self.name = name
        self._pids = pids
        self._stopped: list[int] = []

    @property
    def frozen(self) -> bool:
        return bool(self._stopped)

    def freeze(self, timeout_s: float = 2.0) -> int:
        """Stop every process, and wait (up to ``timeout_s``) until each one is stopped:
        the signal takes effect asynchronously. The number stopped."""
        self.thaw()
        stopped = []
        for pid in sorted(set(self._pids())):
            if pid == os.getpid():
                raise ValueError(f"{self.name}: refusing to stop this process ({pid})")
            try:
                os.kill(pid, signal.SIGSTOP)
            except ProcessLookupError:
                continue
            stopped.append(pid)
        self._stopped = stopped
        deadline = time.monotonic() + timeout_s
        waiting = list(stopped)
        while waiting and time.monotonic() < deadline:
            waiting = [pid for pid in waiting if not _is_stopped(pid)]
            if waiting:
                time.sleep(0.001)
        return len(stopped)

    def thaw(self) -> None:
        stopped, self._stopped = self._stopped, []
        for pid in stopped:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass


def slice_schedule(pairs: int, concurrencies: Sequence[int], a: str, b: str) -> Iterator[tuple[int, int, str]]:
    """``(pair, concurrency, system)`` of every slice: for each pair (1..``pairs``) and
    concurrency, one slice of ``a`` and one of ``b`` back to back, the order flipped from
    one such two to the next (so neither system always goes first after a level change)."""
    k = 0
    for pair in range(1, pairs + 1):
        for c in concurrencies:
            for name in (a, b) if k % 2 == 0 else (b, a):
                yield pair, c, name
            k += 1


def _is_stopped(pid: int) -> bool:
    """Whether ``pid`` is stopped (or gone): its state in /proc/PID/stat is ``T``."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return True
    return stat[stat.rindex(b")") + 2 : stat.rindex(b")") + 3] in (b"T", b"t")


def descendants(exclude_pgids: Sequence[int] = ()) -> list[int]:
    """Every descendant of this process, except those in the process groups
    ``exclude_pgids`` (e.g. another server started in its own session)."""
    import psutil

    out = []
    for p in psutil.Process().children(recursive=True):
        try:
            if os.getpgid(p.pid) in exclude_pgids:
                continue
        except ProcessLookupError:
            continue
        out.append(p.pid)
    return out


def process_group(pgid: int) -> list[int]:
    """Every process of the process group ``pgid``."""
    import psutil

    out = []
    for p in psutil.process_iter():
        try:
            if os.getpgid(p.pid) == pgid:
                out.append(p.pid)
        except (ProcessLookupError, psutil.Error):
            continue
    return out


def bootstrap_median_interval(
    values: Sequence[float], *, confidence: float = 0.9, resamples: int = 2000, seed: int = 0
) -> tuple[float, float]:
    """A percentile-bootstrap interval of the median of ``values`` (resampled with
    replacement, ``resamples`` times, seeded): the ``(1 - confidence) / 2`` and
    ``(1 + confidence) / 2`` quantiles of the resampled medians."""
    if not values:
        raise ValueError("no values")
    if not 0 < confidence < 1:
        raise ValueError("confidence must be in (0, 1)")
    rng = random.Random(seed)
    n = len(values)
    medians = sorted(statistics.median(rng.choices(values, k=n)) for _ in range(resamples))
    lo = medians[int((1 - confidence) / 2 * (resamples - 1))]
    hi = medians[int(round((1 + confidence) / 2 * (resamples - 1)))]
    return lo, hi


def pair_stats(
    slices: Sequence[dict], *, a: str, b: str, key: str, confidence: float = 0.9, seed: int = 0
) -> dict:
    """Per concurrency, the ratio a/b of ``key`` in each pair (slices with the same
    ``concurrency`` and ``pair``, one of each system), its median, a bootstrap interval of
    that median, the share of pairs above 1, and each system's median of ``key``. A pair
    missing either side or a value is left out (and counted)."""
    by_level: dict[int, dict[int, dict[str, float]]] = {}
    for s in slices:
        by_level.setdefault(s["concurrency"], {}).setdefault(s["pair"], {})[s["system"]] = s.get(key)
    out: dict[str, dict] = {}
    for c in sorted(by_level):
        ratios, va, vb, incomplete = [], [], [], 0
        for pair in sorted(by_level[c]):
            x, y = by_level[c][pair].get(a), by_level[c][pair].get(b)
            if not x or not y:
                incomplete += 1
                continue
            ratios.append(x / y)
            va.append(x)
            vb.append(y)
        row: dict[str, Optional[object]] = {
            "pairs": len(ratios), "incomplete_pairs": incomplete, "ratios": [round(r, 4) for r in ratios],
        }
        if ratios:
            lo, hi = bootstrap_median_interval(ratios, confidence=confidence, seed=seed)
            row.update(
                median_ratio=statistics.median(ratios), interval=[lo, hi], confidence=confidence,
                share_above_1=sum(r > 1 for r in ratios) / len(ratios),
                **{f"{a}_median": statistics.median(va), f"{b}_median": statistics.median(vb)},
            )
        out[f"c{c}"] = row
    return out
