"""The router's mirror of the data plane's chain roots (deployments/dataplane/root_index.py):
when it may say "no stored chain starts here" (fresh, synced, not overflowing) and how it
syncs (incremental with a clock-skew margin, paged, full reads that drop pruned roots but
keep the roots added meanwhile). A fake ``fetch`` over a dict stands in for Redis's
ZRANGEBYSCORE; the Redis side is tested in tests/integration/test_dataplane.py."""

import asyncio

import pytest

from deployments.dataplane import root_index as ri
from deployments.dataplane.root_index import RootIndex


class _Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


class _Zsets:
    """tenant -> {root: score}, read as ZRANGEBYSCORE since +inf LIMIT 0 limit."""

    def __init__(self):
        self.sets: dict[str, dict[str, float]] = {}
        self.calls: list[tuple[str, float, int]] = []
        self.fail = False

    async def fetch(self, tenant, since, limit):
        self.calls.append((tenant, since, limit))
        if self.fail:
            raise ConnectionError("redis down")
        rows = sorted(((r, s) for r, s in self.sets.get(tenant, {}).items() if s >= since), key=lambda x: (x[1], x[0]))
        return rows[:limit]


def _index(zsets, clock, **kw):
    return RootIndex(zsets.fetch, sync_interval_s=0.25, clock=clock, **kw)


async def test_says_no_only_when_fresh_and_synced():
    zsets, clock = _Zsets(), _Clock()
    zsets.sets["t"] = {"r1": 5.0}
    index = _index(zsets, clock)
    # A tenant seen for the first time: look up (and sync it from now on).
    assert index.may_hold("t", "nope") is True
    await index.sync_once()
    assert index.may_hold("t", "r1") is True
    assert index.may_hold("t", "nope") is False
    # Another tenant's roots are not this one's.
    assert index.may_hold("u", "r1") is True  # unknown tenant: look up
    await index.sync_once()
    assert index.may_hold("u", "r1") is False
    # Stale (no sync for longer than stale_after_s): every request looks up again.
    clock.now += index.stale_after_s + 0.1
    assert index.may_hold("t", "nope") is True
    await index.sync_once()
    assert index.may_hold("t", "nope") is False


async def test_a_failed_sync_leaves_the_mirror_to_go_stale():
    zsets, clock = _Zsets(), _Clock()
    index = _index(zsets, clock)
    index.may_hold("t", "x")
    await index.sync_once()
    assert index.may_hold("t", "x") is False
    zsets.fail = True
    with pytest.raises(ConnectionError):
        await index.sync_once()
    assert index.may_hold("t", "x") is False  # still fresh for a moment
    clock.now += index.stale_after_s + 0.1
    assert index.may_hold("t", "x") is True


async def test_incremental_sync_reads_from_the_newest_score_less_the_skew():
    zsets, clock = _Zsets(), _Clock()
    zsets.sets["t"] = {"a": 100.0, "b": 200.0}
    index = _index(zsets, clock)
    index.may_hold("t", "a")
    await index.sync_once()
    assert zsets.calls[-1][1] == float("-inf")  # the first read is a full one
    # Stored by a replica whose clock runs 5 s behind: still inside the margin.
    zsets.sets["t"]["c"] = 195.0
    clock.now += 1
    await index.sync_once()
    assert zsets.calls[-1][1] == 200.0 - ri.CLOCK_SKEW_S
    assert index.may_hold("t", "c") is True and index.may_hold("t", "zzz") is False


async def test_full_sync_drops_pruned_roots_and_keeps_local_adds():
    zsets, clock = _Zsets(), _Clock()
    zsets.sets["t"] = {"old": 1.0, "kept": 2.0}
    index = _index(zsets, clock, full_sync_interval_s=60)
    index.may_hold("t", "x")
    await index.sync_once()
    assert index.may_hold("t", "old") is True
    del zsets.sets["t"]["old"]  # pruned in Redis (past the L3 TTL)
    clock.now += 10
    await index.sync_once()  # incremental: cannot see a removal
    assert index.may_hold("t", "old") is True
    clock.now += 60
    index.add("t", "mine")  # a request this router served just exported it
    await index.sync_once()  # full
    assert index.may_hold("t", "old") is False
    assert index.may_hold("t", "kept") is True
    assert index.may_hold("t", "mine") is True  # too young to be published yet: kept
    # At the next full read it must come from Redis like any other.
    clock.now += 60
    await index.sync_once()
    assert index.may_hold("t", "mine") is False


async def test_pages_through_a_large_set(monkeypatch):
    monkeypatch.setattr(ri, "PAGE", 3)
    zsets, clock = _Zsets(), _Clock()
    zsets.sets["t"] = {f"r{i}": float(i) for i in range(10)}
    index = _index(zsets, clock)
    index.may_hold("t", "x")
    await index.sync_once()
    assert all(index.may_hold("t", f"r{i}") for i in range(10))
    assert index.may_hold("t", "r10") is False
    assert len(zsets.calls) > 3


async def test_overflow_makes_the_tenant_always_look_up():
    zsets, clock = _Zsets(), _Clock()
    zsets.sets["t"] = {f"r{i}": float(i) for i in range(5)}
    index = _index(zsets, clock, max_roots=4)
    index.may_hold("t", "x")
    await index.sync_once()
    assert index.may_hold("t", "x") is True and index.num_roots == 0
    # A few new entries: an incremental read cannot tell that the set fits again.
    zsets.sets["t"]["new"] = 9.0
    clock.now += 1
    await index.sync_once()
    assert index.may_hold("t", "x") is True and index.num_roots == 0
    # Shrunk below the bound (pruned): the next full read trusts it again.
    zsets.sets["t"] = {"r0": 0.0}
    clock.now += index.full_sync_interval_s
    await index.sync_once()
    assert index.may_hold("t", "x") is False and index.may_hold("t", "r0") is True


async def test_run_syncs_until_stopped_and_reports_each_attempt():
    zsets, clock = _Zsets(), _Clock()
    seen = []
    index = RootIndex(zsets.fetch, sync_interval_s=0.01, clock=clock, on_sync=lambda i, ok: seen.append(ok))
    index.may_hold("t", "x")
    index.start()
    await asyncio.sleep(0.05)
    zsets.fail = True
    await asyncio.sleep(0.05)
    await index.stop()
    assert True in seen and False in seen
    assert index.syncs >= 1 and index.sync_failures >= 1


async def test_an_idle_tenant_is_forgotten_and_synced_afresh_when_it_returns():
    zsets, clock = _Zsets(), _Clock()
    zsets.sets["t"] = {"r": 1.0}
    index = _index(zsets, clock, forget_after_s=600)
    index.may_hold("t", "x")
    await index.sync_once()
    assert index.may_hold("t", "x") is False
    clock.now += 601
    await index.sync_once()  # no request for 10 minutes: no more reads for it
    calls = len(zsets.calls)
    await index.sync_once()
    assert len(zsets.calls) == calls and index.num_roots == 0
    assert index.may_hold("t", "x") is True  # unknown again: looks up until synced
    await index.sync_once()
    assert index.may_hold("t", "x") is False and index.may_hold("t", "r") is True
