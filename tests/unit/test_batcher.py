"""Exact batch compositions of the router's DynamicBatcher (plain asyncio, no Ray)."""

import asyncio

import pytest

from deployments.router.batcher import FLUSH_FULL, FLUSH_IDLE, FLUSH_TIMEOUT, DynamicBatcher


class Recorder:
    def __init__(self):
        self.batches: list[tuple[int, list, str]] = []
        self.idle = False

    def dispatch(self, batch_id, items, reason):
        self.batches.append((batch_id, list(items), reason))

    def compositions(self):
        return [(items, reason) for _, items, reason in self.batches]


def make(rec: Recorder, size=3, wait_s=0.05):
    return DynamicBatcher(
        rec.dispatch, max_batch_size=size, batch_wait_timeout_s=wait_s, has_idle_worker=lambda: rec.idle
    )


async def test_idle_worker_dispatches_first_request_at_once():
    rec = Recorder()
    rec.idle = True
    b = make(rec)
    b.submit("a")
    # Synchronous: no await happened, yet the request already left.
    assert rec.compositions() == [(["a"], FLUSH_IDLE)]
    assert b.num_pending == 0


async def test_size_flush_without_waiting():
    rec = Recorder()
    b = make(rec, size=3, wait_s=10)
    for x in "abcd":
        b.submit(x)
    assert rec.compositions() == [(["a", "b", "c"], FLUSH_FULL)]
    assert b.num_pending == 1


async def test_timeout_flush_of_partial_batch():
    rec = Recorder()
    b = make(rec, size=8, wait_s=0.05)
    b.submit("a")
    b.submit("b")
    await asyncio.sleep(0.02)
    assert rec.batches == []
    await asyncio.sleep(0.08)
    assert rec.compositions() == [(["a", "b"], FLUSH_TIMEOUT)]


async def test_timer_starts_with_oldest_item_not_newest():
    rec = Recorder()
    b = make(rec, size=8, wait_s=0.06)
    b.submit("a")
    await asyncio.sleep(0.04)
    b.submit("b")
    await asyncio.sleep(0.04)  # 0.08 after "a", 0.04 after "b"
    assert rec.compositions() == [(["a", "b"], FLUSH_TIMEOUT)]


async def test_notify_idle_flushes_pending_early():
    rec = Recorder()
    b = make(rec, size=8, wait_s=10)
    b.submit("a")
    b.submit("b")
    b.notify_idle()
    assert rec.compositions() == [(["a", "b"], FLUSH_IDLE)]
    b.notify_idle()  # nothing pending: no empty batch
    assert len(rec.batches) == 1


async def test_busy_arrival_waits_even_if_worker_turns_idle_later():
    rec = Recorder()
    b = make(rec, size=8, wait_s=10)
    b.submit("a")  # busy: pending
    rec.idle = True
    b.submit("b")  # something pending: joins the batch instead of overtaking "a"
    assert rec.batches == []
    assert b.num_pending == 2


async def test_batch_size_one_never_waits():
    rec = Recorder()
    b = make(rec, size=1, wait_s=10)
    b.submit("a")
    b.submit("b")
    assert rec.compositions() == [(["a"], FLUSH_IDLE), (["b"], FLUSH_IDLE)]


async def test_zero_wait_flushes_each_arrival():
    rec = Recorder()
    b = make(rec, size=8, wait_s=0)
    b.submit("a")
    b.submit("b")
    assert rec.compositions() == [(["a"], FLUSH_TIMEOUT), (["b"], FLUSH_TIMEOUT)]


async def test_remove_withdraws_item_and_stops_timer():
    rec = Recorder()
    b = make(rec, size=8, wait_s=0.03)
    b.submit("a")
    assert b.remove("a") is True
    assert b.remove("a") is False
    await asyncio.sleep(0.06)
    assert rec.batches == []


async def test_batch_ids_increase():
    rec = Recorder()
    b = make(rec, size=2, wait_s=10)
    for x in "abcd":
        b.submit(x)
    assert [bid for bid, _, _ in rec.batches] == [1, 2]


def test_rejects_bad_parameters():
    with pytest.raises(ValueError):
        DynamicBatcher(lambda *a: None, max_batch_size=0, batch_wait_timeout_s=0, has_idle_worker=lambda: True)
    with pytest.raises(ValueError):
        DynamicBatcher(lambda *a: None, max_batch_size=1, batch_wait_timeout_s=-1, has_idle_worker=lambda: True)
