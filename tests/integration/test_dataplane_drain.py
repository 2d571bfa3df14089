"""A DataPlane replica that is being stopped (DataPlane.drain, what Serve's graceful stop
calls) leaves nothing that only its memory holds: it writes back to Redis what Redis takes,
hands the rest (a sessions outage's turns and deletes) to the replica that owns those
sessions next, and names in an ERROR line what neither could keep.

Two DataPlane instances in this process on a real redis-server of the test's own (it is
stopped and started). Between them stands ``_Handle``, this file's stand-in for the Serve
handle of the pool: it answers ``adopt`` with the other instance and records the routing
keywords. Through real Serve replicas the same path runs in
``tests/integration/test_dataplane.py::test_a_replica_stopped_during_an_outage_hands_its_turns_over``.
"""

from __future__ import annotations

import contextlib
import logging

import pytest
import redis.asyncio as aioredis

from app.config import AppConfig
from app.errors import ServiceUnavailableError
from app.local_redis import LocalRedis
from deployments.dataplane import keys
from deployments.dataplane.blocks import BlockHeader, encode_block, pack_blocks
from deployments.dataplane.deployment import DataPlane
from deployments.dataplane.redis_store import RedisUnavailable
from tests.fixtures.logs import messages_containing, serve_log_captured
from tests.fixtures.polling import eventually

pytestmark = pytest.mark.integration

TENANT = "drain"


def dataplane(url: str, *, reconnect_interval_s: float = 0.1, sync_interval_ms: int = 60_000) -> DataPlane:
    config = AppConfig.model_validate({
        "dataplane": {
            "num_replicas": 2,
            "l2_capacity_bytes": 1 << 22,
            "sync_interval_ms": sync_interval_ms,
            "drain_timeout_s": 5,
            "redis": {
                "url": url, "password_env": None, "socket_timeout_s": 0.5, "connect_timeout_s": 0.5,
                "reconnect_interval_s": reconnect_interval_s,
            },
        }
    })
    return DataPlane(config.model_dump(mode="json"), enable_metrics=False, object_store=False)


class _Method:
    def __init__(self, target: DataPlane, calls: list):
        self._target, self._calls = target, calls

    def remote(self, *args, **kwargs):
        self._calls.append(kwargs)
        return self._target.adopt(*args, **kwargs)


class _Handle:
    """The pool's handle as the stopping replica sees it: every ``adopt`` reaches ``peer``."""

    def __init__(self, peer: DataPlane):
        self.calls: list[dict] = []
        self.adopt = _Method(peer, self.calls)


class _Pool:
    """``a``, the replica being stopped (its handle reaches ``b``, or nothing), and ``b``,
    on a Redis of their own (``server``; ``stored()`` reads it, reconnecting after a
    restart)."""

    def __init__(self, server: LocalRedis, a: DataPlane, b: DataPlane):
        self.server, self.a, self.b = server, a, b

    async def stored(self, session: str) -> dict:
        client = aioredis.Redis.from_url(self.server.url)
        try:
            return await client.hgetall(keys.session_key(TENANT, session))
        finally:
            await client.aclose()


@contextlib.asynccontextmanager
async def pool(*, a_reconnect_interval_s: float = 0.1, peer: bool = True):
    with LocalRedis() as server:
        b = dataplane(server.url)
        a = dataplane(server.url, reconnect_interval_s=a_reconnect_interval_s)
        await a.start()
        await b.start()
        a._peers = _Handle(b) if peer else None
        a._replica_key = lambda: "replica-a"
        try:
            yield _Pool(server, a, b)
        finally:
            if not server.running:
                server.start()
            await b.drain()
            if not a._drain_started:
                await a.drain()


def sid(c: str) -> str:
    return "sess_" + c * 32


async def test_a_stopping_replica_hands_its_outage_turns_and_deletes_to_the_next_owner():
    async with pool() as p:
        a, b = p.a, p.b
        await a.create_session(TENANT, session_id=sid("a"), ttl_s=600)
        await a.append_turn(TENANT, sid("a"), 0, [{"role": "user", "content": "before"}], 1)
        await a.create_session(TENANT, session_id=sid("b"), ttl_s=600)
        p.server.stop()
        # Acknowledged while Redis is down: they live in a's memory only.
        await a.append_turn(TENANT, sid("a"), 1, [{"role": "user", "content": "during"}], 1, turn_id="t2")
        await a.create_session(TENANT, session_id=sid("c"), ttl_s=600)
        await a.append_turn(TENANT, sid("c"), 0, [{"role": "user", "content": "new one"}], 1)
        assert await a.delete_session(TENANT, sid("b")) is True
        assert (await a.status())["unsynced_sessions"] == 3
        # Before the hand-over b holds nothing of them: it cannot tell whether they
        # exist, so a retry-later, not "no such session".
        with pytest.raises(ServiceUnavailableError) as unknown:
            await b.get_session(TENANT, sid("a"))
        assert unknown.value.headers.get("Retry-After")
        with pytest.raises(ServiceUnavailableError):
            await b.append_turn(TENANT, sid("c"), 1, [{"role": "user", "content": "x"}], 1)

        outcome = await a.drain()
        assert outcome == {"written_back": 0, "handed_off": 3, "lost_sessions": 0, "lost_blocks": 0}
        # Each went to the session's next owner, never back to the sender.
        assert sorted(c["shard_key"] for c in a._peers.calls) == [sid("a"), sid("b"), sid("c")]
        assert {c["exclude_replica"] for c in a._peers.calls} == {"replica-a"}
        # b serves them from memory at once, while Redis is still down...
        rec = await b.get_session(TENANT, sid("a"))
        assert rec.version == 2 and [m["content"] for m in rec.messages] == ["before", "during"]
        assert (await b.get_session(TENANT, sid("c"))).version == 1
        assert await b.get_session(TENANT, sid("b")) is None
        # ...and the same turn made again through b is its success, not a 409.
        again = await b.append_turn(TENANT, sid("a"), 1, [{"role": "user", "content": "during"}], 1, turn_id="t2")
        assert again.version == 2
        status = await b.status()
        assert status["degraded"] is True and status["unsynced_sessions"] == 3

        p.server.start()
        await eventually(lambda: _synced(b))
        stored = await p.stored(sid("a"))
        assert int(stored[b"version"]) == 2 and b"during" in stored[b"messages"] and b"before" in stored[b"messages"]
        assert int((await p.stored(sid("c")))[b"version"]) == 1
        assert await p.stored(sid("b")) == {}


async def _synced(dp: DataPlane) -> bool:
    status = await dp.status()
    return not status["degraded"] and status["unsynced_sessions"] == 0


async def _degraded(dp: DataPlane) -> bool:
    return (await dp.status())["degraded"]


async def test_a_replica_that_takes_over_while_redis_is_up_writes_it_back_at_once():
    """The next owner may reach Redis when the stopping replica cannot (or Redis is back
    by then): it writes the state back in the adopting call."""
    async with pool(a_reconnect_interval_s=60) as p:
        a, b = p.a, p.b
        await a.create_session(TENANT, session_id=sid("d"), ttl_s=600)
        p.server.stop()
        await a.append_turn(TENANT, sid("d"), 0, [{"role": "user", "content": "kept"}], 1)
        await eventually(lambda: _degraded(b))
        p.server.start()
        await eventually(lambda: _synced(b))

        async def unreachable(role):  # a still cannot reach it
            raise RedisUnavailable("simulated: this replica's network to Redis is down")

        a._store.ping = unreachable
        outcome = await a.drain()
        assert outcome["handed_off"] == 1 and outcome["lost_sessions"] == 0
        # Written by the adopting call itself, not later by b's reconnect loop.
        stored = await p.stored(sid("d"))
        assert int(stored[b"version"]) == 1 and b"kept" in stored[b"messages"]
        assert await _synced(b)


async def test_a_stopping_replica_writes_back_what_redis_takes_again_itself():
    """Redis came back, but this replica's reconnect loop has not noticed yet: the drain
    writes the outage's turns and the blocks not yet written behind, and hands nothing on."""
    async with pool(a_reconnect_interval_s=60) as p:
        a = p.a
        await a.create_session(TENANT, session_id=sid("e"), ttl_s=600)
        blocks = [encode_block(BlockHeader("uint8", (300,)), bytes([i]) * 300) for i in range(3)]
        hashes = ["blk0", "blk1", "blk2"]
        assert await a.put_blocks_packed(TENANT, hashes, *pack_blocks(blocks)) == 3
        p.server.stop()
        await a.append_turn(TENANT, sid("e"), 0, [{"role": "user", "content": "kept"}], 1)
        p.server.start()
        assert (await a.status())["degraded"] is True

        outcome = await a.drain()
        assert outcome == {"written_back": 1, "handed_off": 0, "lost_sessions": 0, "lost_blocks": 0}
        assert a._peers.calls == []
        assert int((await p.stored(sid("e")))[b"version"]) == 1
        client = aioredis.Redis.from_url(p.server.url)
        try:
            for h, blk in zip(hashes, blocks):
                assert await client.get(keys.block_key(TENANT, h)) == blk
        finally:
            await client.aclose()


async def test_with_no_replica_to_take_them_the_lost_turns_are_named_in_an_error(caplog):
    async with pool(peer=False) as p:
        a = p.a
        await a.create_session(TENANT, session_id=sid("f"), ttl_s=600)
        p.server.stop()
        await a.append_turn(TENANT, sid("f"), 0, [{"role": "user", "content": "only here"}], 1)
        with serve_log_captured(caplog, logging.INFO):
            outcome = await a.drain()
        assert outcome["lost_sessions"] == 1 and outcome["handed_off"] == 0
        errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
        assert any(sid("f") in r.getMessage() and "lost" in r.getMessage() for r in errors)
        assert messages_containing(caplog, "DataPlane drain: sessions written back 0, handed to other replicas 0, lost 1")
