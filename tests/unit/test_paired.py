"""loadtests/paired.py: the pairs' statistics (exact values on hand-made slices), the
slices' order, and the freezer on real child processes of this test; then the paired runs
of ``compare_vllm`` and ``ray_background`` with stand-in servers (busy child processes)."""

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
    slice_schedule,
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


def test_slice_schedule_flips_the_order_every_two_slices():
    assert list(slice_schedule(2, [1, 8, 32], "a", "b")) == [
        (1, 1, "a"), (1, 1, "b"), (1, 8, "b"), (1, 8, "a"), (1, 32, "a"), (1, 32, "b"),
        (2, 1, "b"), (2, 1, "a"), (2, 8, "a"), (2, 8, "b"), (2, 32, "b"), (2, 32, "a"),
    ]
    assert list(slice_schedule(0, [1], "a", "b")) == []


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
        assert _status(a) == psutil.STATUS_STOPPED  # freeze() returns once it took effect
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


class _Spinning:
    """A stand-in server: ``start`` starts a busy child (in its own session for the
    ``vllm`` one, as ``VLLMServer`` does; a child of this process for ``ours``, as Ray's
    processes are)."""

    def __init__(self, port: int, own_session: bool):
        self.port, self.own_session, self.proc = port, own_session, None
        self.stops = 0
        self.stopped_at_stop = None  # whether it was still frozen when stop() came

    def start(self, timeout_s):
        self.proc = _spinner(start_new_session=self.own_session)
        return 0.1

    def stop(self):
        self.stops += 1
        if self.proc is not None and self.proc.poll() is None:
            # A real server's SIGTERM waits while it is frozen: paired() must thaw first.
            self.stopped_at_stop = _status(self.proc) == psutil.STATUS_STOPPED
            self.proc.kill()
            self.proc.wait()


@pytest.fixture
def keep_sigterm():
    # paired() turns SIGTERM into KeyboardInterrupt for its run, as the tool wants.
    import signal

    before = signal.getsignal(signal.SIGTERM)
    yield
    signal.signal(signal.SIGTERM, before)


def test_paired_measures_each_system_with_the_other_frozen_then_stops_both(keep_sigterm):
    from types import SimpleNamespace

    from loadtests.compare_vllm import paired

    ours, vllm = _Spinning(8001, own_session=False), _Spinning(8002, own_session=True)
    seen = []

    def measure(url, name, pair, c, args, label="", vllm_pgid=None):
        other = vllm if name == "ours" else ours
        me = ours if name == "ours" else vllm
        assert vllm_pgid == vllm.proc.pid
        seen.append((name, pair, c, url, _status(me.proc) != psutil.STATUS_STOPPED,
                     _status(other.proc) == psutil.STATUS_STOPPED))
        return {"system": name, "concurrency": c, "output_throughput": 100.0 if name == "vllm" else 90.0,
                "cpu_seconds_by_role": {}, "cpu_ms_per_1k_output_tokens": {}}

    args = SimpleNamespace(paired=2, concurrency=[1, 8], start_timeout_s=10, settle_s=0.0)
    slices, startups, frozen = paired(
        ours, vllm, args, lambda msg: None, measure_fn=measure, ours_pids=lambda: [ours.proc.pid]
    )
    # Each slice: its own system running, the other stopped; the order flips every pair
    # of slices; the URL is the system's own port.
    assert [(n, p, c) for n, p, c, *_ in seen] == [
        ("ours", 1, 1), ("vllm", 1, 1), ("vllm", 1, 8), ("ours", 1, 8),
        ("ours", 2, 1), ("vllm", 2, 1), ("vllm", 2, 8), ("ours", 2, 8),
    ]
    assert all(running and other_stopped for *_, running, other_stopped in seen)
    assert {n: u for n, _, _, u, *_ in seen} == {"ours": "http://127.0.0.1:8001", "vllm": "http://127.0.0.1:8002"}
    assert [s["pair"] for s in slices] == [1, 1, 1, 1, 2, 2, 2, 2]
    assert frozen == {"ours": [1], "vllm": [1]}
    assert [s["system"] for s in startups] == ["vllm", "ours"]
    assert ours.stops == 1 and vllm.stops == 1 and ours.proc.poll() is not None and vllm.proc.poll() is not None
    assert ours.stopped_at_stop is False and vllm.stopped_at_stop is False  # thawed first
    assert pair_stats(slices, a="ours", b="vllm", key="output_throughput")["c8"]["median_ratio"] == pytest.approx(0.9)


def test_paired_thaws_and_stops_both_when_a_slice_fails(keep_sigterm):
    from types import SimpleNamespace

    from loadtests.compare_vllm import paired

    ours, vllm = _Spinning(8001, own_session=False), _Spinning(8002, own_session=True)
    procs = []

    def measure(url, name, *a, **kw):
        procs.extend([ours.proc, vllm.proc])
        raise RuntimeError("the load failed")

    args = SimpleNamespace(paired=1, concurrency=[1], start_timeout_s=10, settle_s=0.0)
    with pytest.raises(RuntimeError):
        paired(ours, vllm, args, lambda msg: None, measure_fn=measure, ours_pids=lambda: [ours.proc.pid])
    assert procs and ours.stops == 1 and vllm.stops == 1
    assert all(p.poll() is not None for p in procs)
    assert ours.stopped_at_stop is False and vllm.stopped_at_stop is False  # thawed first


def test_ray_background_paired_runs_vllm_with_ray_frozen_then_running(keep_sigterm):
    from types import SimpleNamespace

    from loadtests.ray_background import paired

    class Beside:
        """Stand-in for VLLMBesideRay: a "Ray" child of this process and a vLLM server in
        its own session."""

        def __init__(self):
            self.ray = _Spinning(0, own_session=False)
            self.vllm = _Spinning(8124, own_session=True)

        def start(self, timeout_s):
            self.ray.start(timeout_s)
            self.vllm.start(timeout_s)
            return 0.1

        def stop(self):
            self.vllm.stop()
            self.ray.stop()

    beside = Beside()
    seen = []

    def measure(url, name, pair, c, args, label="", vllm_pgid=None):
        assert vllm_pgid == beside.vllm.proc.pid and url == "http://127.0.0.1:8124"
        seen.append((name, pair, c, _status(beside.ray.proc) == psutil.STATUS_STOPPED,
                     _status(beside.vllm.proc) == psutil.STATUS_STOPPED))
        return {"system": name, "concurrency": c, "output_throughput": 1.0,
                "cpu_seconds_by_role": {"Ray GCS": 0.5, "plain vllm: vllm API server": 2.0, "other": 1.0}}

    args = SimpleNamespace(paired=2, concurrency=[1, 32], start_timeout_s=10, settle_s=0.0)
    slices = paired(beside, "http://127.0.0.1:8124", args, measure_fn=measure, ray_pids=lambda: [beside.ray.proc.pid])
    assert [(n, p, c) for n, p, c, *_ in seen] == [
        ("beside_ray", 1, 1), ("alone", 1, 1), ("alone", 1, 32), ("beside_ray", 1, 32),
        ("beside_ray", 2, 1), ("alone", 2, 1), ("alone", 2, 32), ("beside_ray", 2, 32),
    ]
    # Ray frozen exactly in the "alone" slices; vLLM never.
    assert all(ray_stopped == (n == "alone") and not vllm_stopped for n, _, _, ray_stopped, vllm_stopped in seen)
    assert [s["ray_cpu_s"] for s in slices] == [0.5] * 8  # Ray's roles only
    assert beside.ray.stopped_at_stop is False and beside.vllm.stopped_at_stop is False
    assert beside.ray.stops == 1 and beside.vllm.stops == 1
