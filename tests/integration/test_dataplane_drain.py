"""What only a DataPlane replica's memory holds during a sessions-Redis outage (turns,
creates and deletes of sessions) outlives that replica.

* Stopped (DataPlane.drain, what Serve's graceful stop calls): it writes back to Redis
  what Redis takes, hands the rest to the replica that owns those sessions next
  (``adopt``), and names in an ERROR line what neither could keep.
* Crashed (no drain): each change was acknowledged only once that next owner held a copy
  (``back_up``, ``dataplane.outage_backup_timeout_s``), which serves the session and writes
  it back; Redis's tombstone of a deleted session refuses a stale copy. The holder
  changes a copy only once its owner is gone (else a 503: a fork otherwise).
* A session that expires during the outage stays a 404 on the replica that knew it.

Two DataPlane instances in this process on a real redis-server of the test's own (it is
stopped and started). Between them stands ``_Handle``, this file's stand-in for the Serve
handle of the pool: it answers ``adopt`` and ``back_up`` with the other instance and
records the routing keywords. Through real Serve replicas the same paths run in
``tests/integration/test_dataplane.py`` (``test_a_replica_stopped_during_an_outage_hands_its_turns_over``,
``test_a_replica_killed_during_an_outage_loses_no_acknowledged_turn``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import pytest
import redis.asyncio as aioredis

from app.errors import ServiceUnavailableError
from app.local_redis import LocalRedis
from deployments.dataplane import keys
from deployments.dataplane.blocks import BlockHeader, encode_block, pack_blocks
from deployments.dataplane.deployment import DataPlane
from deployments.dataplane.redis_store import RedisUnavailable
from tests.fixtures.dataplane import standalone_dataplane
from tests.fixtures.logs import messages_containing, serve_log_captured
from tests.fixtures.polling import eventually
from tests.fixtures.redis import SESSION_TOMBSTONE

pytestmark = pytest.mark.integration

TENANT = "drain"


def dataplane(url: str, *, reconnect_interval_s: float = 0.1, sync_interval_ms: int = 60_000, backup_timeout_s: float = 0) -> DataPlane:
    return standalone_dataplane(
        url,
        redis={"socket_timeout_s": 0.5, "connect_timeout_s": 0.5, "reconnect_interval_s": reconnect_interval_s},
        num_replicas=2,
        l2_capacity_bytes=1 << 22,
        sync_interval_ms=sync_interval_ms,
        drain_timeout_s=5,
        outage_backup_timeout_s=backup_timeout_s,
    )


class _Method:
    def __init__(self, target, calls: list, name: str):
        self._target, self._calls, self._name = target, calls, name

    def remote(self, *args, **kwargs):
        self._calls.append(kwargs)
        return getattr(self._target, self._name)(*args, **kwargs)


class _Handle:
    """The pool's handle as a replica sees it: every ``adopt`` and ``back_up`` reaches
    ``peer`` (``calls``, ``backups``: their keywords); with ``unreachable`` set, a
    ``back_up`` never arrives."""

    def __init__(self, peer: DataPlane):
        self.calls: list[dict] = []
        self.backups: list[dict] = []
        self.unreachable = False
        self.adopt = _Method(peer, self.calls, "adopt")
        self.back_up = _Method(self, self.backups, "_back_up")
        self._peer = peer

    async def _back_up(self, *args, **kwargs):
        if self.unreachable:
            await asyncio.sleep(3600)
        return await self._peer.back_up(*args, **kwargs)


class _Pool:
    """``a``, the replica being stopped (its handle reaches ``b``, or nothing), and ``b``,
    on a Redis of their own (``server``; ``stored()`` reads it, reconnecting after a
    restart)."""

    def __init__(self, server: LocalRedis, a: DataPlane, b: DataPlane):
        self.server, self.a, self.b = server, a, b
        # The replicas ``b`` finds alive (DataPlane._replica_alive, a Ray actor lookup in
        # a replica): ``a`` until the test says it crashed.
        self.alive = {"replica-a"}

    async def stored(self, session: str) -> dict:
        client = aioredis.Redis.from_url(self.server.url)
        try:
            return await client.hgetall(keys.session_key(TENANT, session))
        finally:
            await client.aclose()


@contextlib.asynccontextmanager
async def pool(*, a_reconnect_interval_s: float = 0.1, b_reconnect_interval_s: float = 0.1, peer: bool = True, backups: bool = False):
    """``backups``: ``a`` copies its outage changes to ``b`` (``back_up``) before it
    acknowledges them; off, the drain's hand-over alone is under test."""
    backup_timeout_s = 0.5 if backups else 0
    with LocalRedis() as server:
        b = dataplane(server.url, reconnect_interval_s=b_reconnect_interval_s)
        a = dataplane(server.url, reconnect_interval_s=a_reconnect_interval_s, backup_timeout_s=backup_timeout_s)
        await a.start()
        await b.start()
        a._peers = _Handle(b) if peer else None
        a._replica_key = lambda: "replica-a"
        p = _Pool(server, a, b)

        async def alive(replica: str) -> bool:
            return replica in p.alive

        b._replica_alive = alive
        try:
            yield p
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
        assert await p.stored(sid("b")) == SESSION_TOMBSTONE


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


async def crash(dp: DataPlane) -> None:
    """What a killed replica does: nothing more (no drain; its memory is gone)."""
    dp._drain_started = True
    for t in dp._tasks:
        t.cancel()
    await dp._store.close()


async def test_a_replica_that_crashes_in_an_outage_loses_no_acknowledged_change():
    """Each change ``a`` acknowledged during the outage was first copied to ``b``, the
    sessions' next owner: ``a`` dies without a drain, and ``b`` serves what it
    acknowledged (a turn, a new session, a delete) and writes it back."""
    async with pool(backups=True) as p:
        a, b = p.a, p.b
        await a.create_session(TENANT, session_id=sid("g"), ttl_s=600)
        await a.append_turn(TENANT, sid("g"), 0, [{"role": "user", "content": "before"}], 1)
        await a.create_session(TENANT, session_id=sid("h"), ttl_s=600)
        # Copies only while Redis is down: nothing was sent for the changes above.
        assert a._peers.backups == []
        p.server.stop()
        await a.append_turn(TENANT, sid("g"), 1, [{"role": "user", "content": "during"}], 1, turn_id="t2")
        await a.create_session(TENANT, session_id=sid("i"), ttl_s=600)
        assert await a.delete_session(TENANT, sid("h")) is True
        assert [c["shard_key"] for c in a._peers.backups] == [sid("g"), sid("i"), sid("h")]
        assert {c["exclude_replica"] for c in a._peers.backups} == {"replica-a"}
        assert (await b.status())["backup_sessions"] == 3
        await crash(a)
        p.alive.discard("replica-a")

        # The client's retry of its last turn (its answer lost with a) is that turn's
        # success again, and the conversation goes on on b.
        again = await b.append_turn(TENANT, sid("g"), 1, [{"role": "user", "content": "during"}], 1, turn_id="t2")
        assert again.version == 2 and [m["content"] for m in again.messages] == ["before", "during"]
        await b.append_turn(TENANT, sid("g"), 2, [{"role": "user", "content": "on b"}], 1)
        assert (await b.get_session(TENANT, sid("i"))).version == 0
        assert await b.get_session(TENANT, sid("h")) is None

        p.server.start()
        await eventually(lambda: _synced(b))
        stored = await p.stored(sid("g"))
        assert int(stored[b"version"]) == 3 and b"on b" in stored[b"messages"]
        assert int((await p.stored(sid("i")))[b"version"]) == 0
        assert await p.stored(sid("h")) == SESSION_TOMBSTONE
        # Written back, a copy b only read is not b's to keep (the next read is Redis's);
        # the session it took turns on after a died is its own.
        status = await b.status()
        assert status["backup_sessions"] == 0
        assert (TENANT, sid("i")) not in b._sessions
        assert b._sessions[(TENANT, sid("g"))].version == 3


async def test_a_stale_copy_never_brings_a_deleted_session_back():
    """Both replicas write back after an outage, in either order. ``b`` holds a copy of
    a session that ``a`` then deletes, during the outage with the copy of the delete
    lost (``h``), and after it while ``b`` has not yet noticed Redis is back (``j``):
    ``b``'s late write-back of its copies must not recreate either."""
    async with pool(backups=True, b_reconnect_interval_s=60) as p:
        a, b = p.a, p.b
        await a.create_session(TENANT, session_id=sid("j"), ttl_s=600)
        p.server.stop()
        await eventually(lambda: _degraded(a))
        await a.create_session(TENANT, session_id=sid("h"), ttl_s=600)  # only in memory
        await a.append_turn(TENANT, sid("j"), 0, [{"role": "user", "content": "during"}], 1)
        assert (await b.status())["backup_sessions"] == 2
        a._peers.unreachable = True
        assert await a.delete_session(TENANT, sid("h")) is True  # b's copy of h is stale now
        assert (await b.status())["backup_sessions"] == 2

        p.server.start()
        await eventually(lambda: _synced(a))
        assert await p.stored(sid("h")) == SESSION_TOMBSTONE  # no record, still a tombstone
        assert await a.delete_session(TENANT, sid("j")) is True  # Redis up: a plain delete
        assert await p.stored(sid("j")) == SESSION_TOMBSTONE

        assert (await b.status())["degraded"] is True  # b's loop has not retried yet
        await b._resync("sessions")  # what its reconnect loop does when it does
        assert await p.stored(sid("h")) == SESSION_TOMBSTONE
        assert await p.stored(sid("j")) == SESSION_TOMBSTONE
        assert await b.get_session(TENANT, sid("h")) is None
        assert await b.get_session(TENANT, sid("j")) is None
        assert (await b.status())["backup_sessions"] == 0


async def test_an_outage_change_is_acknowledged_when_no_copy_arrives_in_time(caplog):
    """Availability first: the next owner unreachable, ``a`` waits
    ``outage_backup_timeout_s`` and acknowledges anyway, with one WARNING line."""
    async with pool(backups=True) as p:
        a, b = p.a, p.b
        await a.create_session(TENANT, session_id=sid("k"), ttl_s=600)
        p.server.stop()
        a._peers.unreachable = True
        with serve_log_captured(caplog, logging.INFO):
            rec = await a.append_turn(TENANT, sid("k"), 0, [{"role": "user", "content": "kept here"}], 1)
            await a.append_turn(TENANT, sid("k"), 1, [{"role": "user", "content": "and here"}], 1)
        assert rec.version == 1
        assert (await b.status())["backup_sessions"] == 0
        assert len(messages_containing(caplog, "no other replica took a copy of session")) == 1
        p.server.start()
        await eventually(lambda: _synced(a))
        assert int((await p.stored(sid("k")))[b"version"]) == 2


async def test_a_delete_the_replica_cannot_judge_during_an_outage_is_a_503_that_changes_nothing():
    async with pool() as p:
        a, b = p.a, p.b
        await a.create_session(TENANT, session_id=sid("l"), ttl_s=600)
        p.server.stop()
        await eventually(lambda: _degraded(b))
        with pytest.raises(ServiceUnavailableError) as unknown:
            await b.delete_session(TENANT, sid("l"))
        assert unknown.value.headers.get("Retry-After") and "cannot be deleted now" in str(unknown.value)
        assert (await b.status())["unsynced_sessions"] == 0
        p.server.start()
        await eventually(lambda: _synced(b))
        assert int((await p.stored(sid("l")))[b"version"]) == 0  # not deleted behind the 503
        assert await b.delete_session(TENANT, sid("l")) is True


async def test_a_copy_takes_no_change_while_its_owner_lives(caplog):
    """A turn or a delete that reaches the copy's holder while the session's owner lives
    (the owner was full, or a router had not yet seen it) would fork the session, and
    the write-back would then drop one side's acknowledged turns: it is a 503 that
    changes nothing, while reads are served from the copy. Once the owner is gone the
    holder takes the copy over, with one WARNING line."""
    async with pool(backups=True) as p:
        a, b = p.a, p.b
        await a.create_session(TENANT, session_id=sid("m"), ttl_s=600)
        p.server.stop()
        await a.append_turn(TENANT, sid("m"), 0, [{"role": "user", "content": "on a"}], 1)
        assert (await b.get_session(TENANT, sid("m"))).version == 1
        with pytest.raises(ServiceUnavailableError) as busy:
            await b.append_turn(TENANT, sid("m"), 1, [{"role": "user", "content": "fork"}], 1)
        assert busy.value.headers.get("Retry-After") and "cannot be changed on this server now" in str(busy.value)
        with pytest.raises(ServiceUnavailableError):
            await b.delete_session(TENANT, sid("m"))
        kept = await b.get_session(TENANT, sid("m"))
        assert kept.version == 1 and [m["content"] for m in kept.messages] == ["on a"]
        assert (await b.status())["backup_sessions"] == 1
        # The owner goes on; its copy on b follows.
        await a.append_turn(TENANT, sid("m"), 1, [{"role": "user", "content": "a again"}], 1)
        assert (await b.get_session(TENANT, sid("m"))).version == 2

        await crash(a)
        p.alive.discard("replica-a")
        with serve_log_captured(caplog, logging.INFO):
            rec = await b.append_turn(TENANT, sid("m"), 2, [{"role": "user", "content": "on b"}], 1)
        assert rec.version == 3 and [m["content"] for m in rec.messages] == ["on a", "a again", "on b"]
        assert len(messages_containing(caplog, f"session {sid('m')} is served from the copy held here")) == 1
        assert (await b.status())["backup_sessions"] == 0
        p.server.start()
        await eventually(lambda: _synced(b))
        stored = await p.stored(sid("m"))
        assert int(stored[b"version"]) == 3 and b"fork" not in stored[b"messages"]


async def test_a_copy_is_written_back_before_its_holder_changes_it_with_redis_up():
    """A copy that reaches a holder which finds Redis up is written back by a task of
    its own; a change that reaches the holder first writes the copy back itself, then
    goes to Redis like any other: the client's version is the copy's, not Redis's old
    one (a 409) and not a 503."""
    async with pool(backups=True) as p:
        a, b = p.a, p.b
        await a.create_session(TENANT, session_id=sid("n"), ttl_s=600)
        # What a sends b for a turn it takes while it alone finds Redis down.
        copy = await a.get_session(TENANT, sid("n"))
        copy.messages.append({"role": "user", "content": "during"})
        copy.version, copy.num_tokens = 1, 1
        await b.back_up(TENANT, sid("n"), record=copy, shard_key=sid("n"), exclude_replica="replica-a")
        assert (await b.status())["backup_sessions"] == 1  # its write-back task has not run
        rec = await b.append_turn(TENANT, sid("n"), 1, [{"role": "user", "content": "after"}], 1)
        assert rec.version == 2 and [m["content"] for m in rec.messages] == ["during", "after"]
        stored = await p.stored(sid("n"))
        assert int(stored[b"version"]) == 2 and b"during" in stored[b"messages"]
        assert (await b.status())["backup_sessions"] == 0


async def test_a_session_that_expires_during_an_outage_stays_a_404():
    """The replica knows the session and finds it expired: every read and turn is a 404
    (not a 404 once and then a 503, as if it had never heard of it), and nothing of it
    is written back."""
    from app.errors import NotFoundError

    async with pool() as p:
        a = p.a
        await a.create_session(TENANT, session_id=sid("o"), ttl_s=1)
        p.server.stop()
        await eventually(lambda: _degraded(a))
        await asyncio.sleep(1.2)
        for _ in range(2):
            assert await a.get_session(TENANT, sid("o")) is None
            with pytest.raises(NotFoundError):
                await a.append_turn(TENANT, sid("o"), 0, [{"role": "user", "content": "late"}], 1)
        assert (await a.status())["unsynced_sessions"] == 0
        p.server.start()
        await eventually(lambda: _synced(a))
        assert await p.stored(sid("o")) == {}
        assert await a.get_session(TENANT, sid("o")) is None


async def test_an_outage_is_one_log_line_and_one_gauge_change_each_way(caplog):
    """However many calls fail and reconnects are tried meanwhile: one WARNING when Redis
    goes, one INFO when it is back, and ``llm_dataplane_degraded{server}`` set to 1, then
    0, once each."""
    with LocalRedis() as server:
        dp = dataplane(server.url)
        gauge: list[tuple] = []
        real_set = dp._m.set

        def recording_set(name, value, tags=None):
            if name == "degraded":
                gauge.append((name, value, tags))
            real_set(name, value, tags)

        dp._m.set = recording_set
        await dp.start()
        gauge.clear()  # start() sets it to 0 for each server
        try:
            with serve_log_captured(caplog, logging.INFO):
                await dp.create_session(TENANT, session_id=sid("q"), ttl_s=600)
                server.stop()
                for i in range(4):  # each kept in memory; the reconnect loop retries every 0.1 s
                    await dp.append_turn(TENANT, sid("q"), i, [{"role": "user", "content": str(i)}], 1)
                    await asyncio.sleep(0.15)
                server.start()
                await eventually(lambda: _synced(dp))
            assert len(messages_containing(caplog, "DataPlane: Redis unreachable")) == 1
            assert len(messages_containing(caplog, "DataPlane: Redis reachable again")) == 1
            assert [(v, t) for _, v, t in gauge] == [
                (1, {"server": "sessions"}), (1, {"server": "kv"}), (0, {"server": "sessions"}), (0, {"server": "kv"}),
            ]
        finally:
            await dp.drain()
