"""The torch engine's L1 prefix cache on the tiny checkpoint with an in-memory store: the
next turn on the same engine reads its prefix from L1 (no store load) and generates the
same tokens as a full recompute; a store that holds more than L1 wins; without a
connector there is no L1."""

import pytest
import pytest_asyncio

from deployments.compute.engines.kv import block_hashes
from deployments.compute.engines.torch_engine import TorchEngine
from deployments.router.placement import block_key, unpack_keys
from tests.fixtures.kv import DictKVConnector
from tests.integration.test_torch_engine_kv import (
    BLOCK,
    PROMPTS,
    collect,
    encode,
    make_request,
    run_and_export,
)


@pytest_asyncio.fixture
async def store():
    return DictKVConnector(block_size=BLOCK)


async def _engine(path, store, l1_bytes):
    eng = TorchEngine(str(path), max_num_seqs=4, num_threads=2, kv_connector=store, model_id="tiny",
                      block_size=BLOCK, prefix_cache_bytes=l1_bytes)
    await eng.start()
    return eng


@pytest_asyncio.fixture
async def engine(tiny_model_path, store):
    eng = await _engine(tiny_model_path, store, 64 << 20)
    yield eng
    await eng.shutdown()


@pytest_asyncio.fixture
async def plain(tiny_model_path):
    eng = TorchEngine(str(tiny_model_path), max_num_seqs=4, num_threads=2)
    await eng.start()
    yield eng
    await eng.shutdown()


@pytest.mark.asyncio
async def test_next_turn_reads_its_prefix_from_l1(engine, plain, store):
    turn1 = encode(engine, PROMPTS[1])
    out1 = await run_and_export(engine, make_request("t1", turn1, max_tokens=10))
    # L1 holds what was exported, and reports the placement keys of those blocks.
    exported = block_hashes("tiny", "default", turn1 + out1[:-1], BLOCK)
    assert unpack_keys(engine.prefix_cache_keys()) == {block_key(h) for h in exported}
    turn2 = turn1 + out1 + encode(engine, " and then what happened to the worker")[1:]
    loads_before = len(store.loads)
    before = engine.kv_stats()
    out2 = await run_and_export(engine, make_request("t2", turn2, max_tokens=10))
    after = engine.kv_stats()
    hit = (len(turn1) + len(out1) - 1) // BLOCK * BLOCK
    assert after.l1_hit_tokens - before.l1_hit_tokens == hit
    assert after.prefix_hit_tokens - before.prefix_hit_tokens == hit
    assert len(store.loads) == loads_before  # nothing fetched from the store
    assert out2 == await collect(plain, make_request("r2", turn2, max_tokens=10))


@pytest.mark.asyncio
async def test_a_slow_l1_is_recomputed_like_any_tier(engine, store, monkeypatch):
    """L1 goes through the same fetch-or-recompute decision: its import (a host copy and
    the copy to the device) is measured, and a prefix that imports slower than it
    prefills is recomputed (with a re-measuring import now and then)."""
    import time as _time

    ids = encode(engine, PROMPTS[0])
    out = await run_and_export(engine, make_request("l1-prime", ids, max_tokens=4))
    l1_get = engine._l1.get

    def slow_get(*args, **kwargs):
        _time.sleep(1.0)
        return l1_get(*args, **kwargs)

    monkeypatch.setattr(engine._l1, "get", slow_get)
    turn2 = ids + out
    before = engine.kv_stats()
    first = await collect(engine, make_request("l1-measured", turn2, max_tokens=4))
    mid = engine.kv_stats()
    assert mid.l1_hit_tokens > before.l1_hit_tokens and engine.import_bytes_per_s("L1") is not None
    assert await collect(engine, make_request("l1-skipped", turn2, max_tokens=4)) == first
    after = engine.kv_stats()
    assert after.l1_hit_tokens == mid.l1_hit_tokens and after.fetch_skipped == mid.fetch_skipped + 1
    assert after.prefix_hit_tokens == mid.prefix_hit_tokens


@pytest.mark.asyncio
async def test_a_longer_stored_prefix_beats_l1_and_lands_in_l1(tiny_model_path, store, plain):
    turn1 = encode(plain, PROMPTS[1])
    # Another replica ran turn 1 (its blocks are in the store, not in this one's L1).
    other = await _engine(tiny_model_path, store, 64 << 20)
    mine = await _engine(tiny_model_path, store, 64 << 20)
    try:
        out1 = await run_and_export(other, make_request("t1", turn1, max_tokens=10))
        turn2 = turn1 + out1 + encode(plain, " and then")[1:]
        out2 = await run_and_export(mine, make_request("t2", turn2, max_tokens=6))
        stats = mine.kv_stats()
        assert stats.prefix_hit_tokens > 0 and stats.l1_hit_tokens == 0
        assert store.loads  # fetched from the store...
        hashes = block_hashes("tiny", "default", turn2[:-1], BLOCK)
        assert mine._l1.longest_prefix(hashes) == len(hashes)  # ...and kept in L1
        assert out2 == await collect(plain, make_request("r2", turn2, max_tokens=6))
    finally:
        await other.shutdown()
        await mine.shutdown()


def test_no_l1_without_a_connector_or_with_zero_bytes(tiny_model_path):
    assert TorchEngine(str(tiny_model_path), prefix_cache_bytes=1 << 20)._l1 is None
    eng = TorchEngine(str(tiny_model_path), kv_connector=DictKVConnector(block_size=16), prefix_cache_bytes=0)
    assert eng._l1 is None and eng.prefix_cache_keys() == b""
