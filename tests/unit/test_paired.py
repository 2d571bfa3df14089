"""loadtests/paired.py: the pairs' statistics (exact values on hand-made slices) and the
freezer, on real child processes of this test."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from loadtests.paired import (  # noqa: E402
    Freezer,
    bootstrap_median_interval,
    descendants,
    pair_stats,
    process_group,
)

psutil = pytest.importorskip("psutil")


def _slice(system, c, pair, tput):
    return {"system": system, "concurrency": c, "pair": pair, "output_throughput": tput}


def test_pair_stats_ratio_per_pair_and_medians():
    slices = [
        _slice("ours", 8, 1, 90.0), _slice("vllm", 8, 1, 100.0),  # 0.9
        _slice("vllm", 8, 2, 50.0), _slice("ours", 8, 2, 60.0),  # 1.2: order does not matter
        _slice("ours", 8, 3, 70.0), _slice("vllm", 8, 3, 100.0),  # 0.7
        _slice("ours", 8, 4, 80.0),  # no vLLM slice: left out, counted
        _slice("ours", 1, 1, 10.0), _slice("vllm", 1, 1, 0.0),  # a zero: left out
    ]
    stats = pair_stats(slices, a="ours", b="vllm", key="output_throughput")
    c8 = stats["c8"]
    assert c8["pairs"] == 3 and c8["incomplete_pairs"] == 1
    assert c8["ratios"] == [0.9, 1.2, 0.7]
    assert c8["median_ratio"] == pytest.approx(0.9)
    assert c8["share_above_1"] == pytest.approx(1 / 3)
    assert c8["ours_median"] == 70.0 and c8["vllm_median"] == 100.0
    lo, hi = c8["interval"]
    assert 0.7 <= lo <= 0.9 <= hi <= 1.2
    assert stats["c1"] == {"pairs": 0, "incomplete_pairs": 1, "ratios": []}


def test_bootstrap_interval_of_the_median():
    assert bootstrap_median_interval([2.0] * 7) == (2.0, 2.0)
    values = [0.8, 0.85, 0.9, 0.92, 0.95, 1.0, 1.3]
    lo, hi = bootstrap_median_interval(values, seed=1)
    assert (lo, hi) == bootstrap_median_interval(values, seed=1)  # seeded
    # Neither end is the extreme a resampled median can reach (0.8, 1.3): at 90 % the
    # interval leaves out what fewer than 1 in 20 resamples give.
    assert (lo, hi) == (0.85, 1.0)
    assert bootstrap_median_interval(values, confidence=0.5, seed=1) == (0.9, 0.95)
    assert bootstrap_median_interval(values, confidence=0.99, seed=1) == (0.8, 1.3)
    with pytest.raises(ValueError):
        bootstrap_median_interval([])
    with pytest.raises(ValueError):
        bootstrap_median_interval([1.0], confidence=1.0)


def _spinner(**kw) -> subprocess.Popen:
    # Counts as fast as it can: a frozen one takes no CPU.
    return subprocess.Popen([sys.executable, "-c", "while True: pass"], **kw)


def _cpu(p: subprocess.Popen) -> float:
    t = psutil.Process(p.pid).cpu_times()
    return t.user + t.system


def _status(p: subprocess.Popen) -> str:
    return psutil.Process(p.pid).status()


def test_freezer_stops_and_continues_the_processes_it_names():
    a, b = _spinner(), _spinner()
    try:
        freezer = Freezer("test", lambda: [a.pid])
        assert freezer.freeze() == 1 and freezer.frozen
        time.sleep(0.2)
        assert _status(a) == psutil.STATUS_STOPPED
        assert _status(b) != psutil.STATUS_STOPPED
        used = _cpu(a)
        time.sleep(0.5)
        assert _cpu(a) == used  # no CPU while frozen
        freezer.thaw()
        assert not freezer.frozen
        deadline = time.monotonic() + 5
        while _cpu(a) == used and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _cpu(a) > used and _status(a) != psutil.STATUS_STOPPED
    finally:
        for p in (a, b):
            p.kill()
            p.wait()


def test_freezer_skips_a_process_gone_and_refuses_this_one():
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    alive = _spinner()
    try:
        freezer = Freezer("test", lambda: [gone.pid, alive.pid])
        assert freezer.freeze() == 1
        alive.kill()  # killed while stopped: thaw must not fail on it
        alive.wait()
        freezer.thaw()
    finally:
        if alive.poll() is None:
            alive.kill()
    with pytest.raises(ValueError):
        Freezer("self", lambda: [os.getpid()]).freeze()


def test_descendants_leave_out_another_process_group():
    mine, theirs = _spinner(), _spinner(start_new_session=True)
    try:
        found = descendants([theirs.pid])
        assert mine.pid in found and theirs.pid not in found
        assert theirs.pid in descendants()
        assert process_group(theirs.pid) == [theirs.pid]
    finally:
        for p in (mine, theirs):
            p.kill()
            p.wait()
