"""A Redis that answers but refuses writes: over its ``maxmemory`` with ``noeviction``
(OOM), or a read-only replica after a failover (READONLY). Nothing may be half-written,
reads go on, and once the server takes writes again what waited is written.

RedisStore alone and one DataPlane instance in this process, each on a real redis-server
of the test's own; the whole application's answers are in test_redis_outage.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest
import redis

from app.config import RedisConfig
from app.errors import ServiceUnavailableError
from app.local_redis import LocalRedis, _free_port
from deployments.dataplane import keys
from deployments.dataplane.blocks import BlockHeader, encode_block
from deployments.dataplane.redis_store import RedisRefused, RedisStore, RedisUnavailable
from deployments.dataplane.types import SessionRecord
from tests.fixtures.dataplane import started_dataplane
from tests.fixtures.polling import eventually

pytestmark = pytest.mark.integration

TENANT = "ref"
SID = "sess_" + "r" * 32
TURN = [{"role": "user", "content": "héllo"}, {"role": "assistant", "content": "1e309 [{}]"}]

# How to make the server refuse writes, what it then says, and how to end it.
MODES = {
    "oom": (("CONFIG", "SET", "maxmemory", "1"), "maxmemory", ("CONFIG", "SET", "maxmemory", "0")),
    # A replica of a primary that is not there: it keeps its data and refuses writes.
    "readonly": (("REPLICAOF", "127.0.0.1", "PORT"), "read only", ("REPLICAOF", "NO", "ONE")),
}


def _command(client: redis.Redis, args: tuple) -> None:
    client.execute_command(*[str(_free_port()) if a == "PORT" else a for a in args])


@contextlib.contextmanager
def refusing(client: redis.Redis, mode: str):
    start, _, end = MODES[mode]
    _command(client, start)
    try:
        yield
    finally:
        _command(client, end)


@contextlib.asynccontextmanager
async def dataplane(reconnect_interval_s: float, **dataplane):
    """One started DataPlane on a redis-server of its own, with a client on that server."""
    async with started_dataplane(redis={"reconnect_interval_s": reconnect_interval_s}, **dataplane) as (dp, server):
        client = redis.Redis.from_url(server.url)
        try:
            yield dp, client
        finally:
            client.close()


def _block(i: int) -> bytes:
    return encode_block(BlockHeader("float32", (1, 2, 1, 4, 8)), bytes([i]) * 256)


@pytest.mark.parametrize("mode", sorted(MODES))
async def test_the_store_takes_nothing_it_refuses_and_still_reads(mode):
    """RedisStore alone: every write is RedisRefused (a 503) carrying what the server
    said, none of it lands, a read without the expiry refresh works, and writes work
    again once the server takes them."""
    with LocalRedis() as server:
        store = RedisStore.from_config(RedisConfig(url=server.url, password_env=None), kv_ttl_s=60)
        client = redis.Redis.from_url(server.url)
        try:
            now = time.time()
            assert await store.create_session(SessionRecord(SID, TENANT, created=now, expires_at=now + 300, ttl_s=300))
            assert (await store.append(TENANT, SID, 0, TURN, 7, turn_id="t1")).version == 1
            key = keys.session_key(TENANT, SID)
            before = client.hgetall(key)
            with refusing(client, mode):
                said = MODES[mode][1]
                other = SessionRecord("sess_" + "o" * 32, TENANT, created=now, expires_at=now + 300, ttl_s=300)
                calls = {
                    "create": store.create_session(other),
                    "append": store.append(TENANT, SID, 1, TURN, 7, turn_id="t2"),
                    "read with its expiry refreshed": store.get_session(TENANT, SID),
                    "block write": store.put_blocks(TENANT, ["h0"], [_block(0)]),
                    "probe": store.probe_write("sessions", keys.probe_key("x")),
                }
                for what, call in calls.items():
                    with pytest.raises(RedisRefused) as refused:
                        await call
                    assert said in refused.value.reply, (what, refused.value.reply)
                    assert refused.value.status_code == 503
                # Nothing of it landed, not even half of a script or a pipeline.
                assert client.hgetall(key) == before
                assert not client.exists(keys.session_key(TENANT, other.id))
                assert not client.exists(keys.block_key(TENANT, "h0"), keys.block_index_key(TENANT, "h0"))
                read = await store.get_session(TENANT, SID, touch=False)
                assert (read.version, read.messages, read.num_tokens, read.last_turn_id) == (1, TURN, 7, "t1")
            await store.probe_write("sessions", keys.probe_key("x"))
            assert (await store.append(TENANT, SID, 1, TURN, 7, turn_id="t2")).version == 2
            assert (await store.get_session(TENANT, SID)).messages == TURN + TURN
        finally:
            client.close()
            await store.close()


@pytest.mark.parametrize("mode", sorted(MODES))
async def test_the_data_plane_answers_503_keeps_blocks_and_catches_up(mode):
    async with dataplane(0.2, l2_capacity_bytes=1 << 22, sync_interval_ms=50) as (dp, client):
        await dp.create_session(TENANT, session_id=SID)
        assert (await dp.append_turn(TENANT, SID, 0, TURN, 7, turn_id="t1")).version == 1
        key = keys.session_key(TENANT, SID)
        before = client.hgetall(key)
        members = client.smembers(keys.session_blocks_key(TENANT, SID))
        with refusing(client, mode):
            # Every replica notices by its write probe, with no request of its own.
            async def noticed():
                return (await dp.status())["refusing_writes"] == ["kv", "sessions"]

            await eventually(noticed, 10)
            with pytest.raises(ServiceUnavailableError, match="not accepting writes"):
                await dp.append_turn(TENANT, SID, 1, TURN, 7, turn_id="t2")
            with pytest.raises(ServiceUnavailableError, match="not accepting writes"):
                await dp.create_session(TENANT, session_id="sess_" + "n" * 32)
            assert client.hgetall(key) == before
            got = await dp.get_session(TENANT, SID)  # read without refreshing its expiry
            assert (got.version, got.messages, got.writes_refused) == (1, TURN, True)
            # A worker's export of the turn: kept in L2, written once Redis takes it.
            hashes = ["h0", "h1"]
            assert await dp.put_blocks(TENANT, hashes, [_block(0), _block(1)], SID, shard_key="h0") == 2
            await asyncio.sleep(0.3)  # several write-behind periods: they wait in L2
            assert not client.exists(*[keys.block_key(TENANT, h) for h in hashes])
            status = await dp.status()
            assert status["unsynced_blocks"] == 2 and status["degraded"] is False
            assert client.smembers(keys.session_blocks_key(TENANT, SID)) == members

        async def caught_up():
            status = await dp.status()
            return not status["refusing_writes"] and status["unsynced_blocks"] == 0

        await eventually(caught_up, 10)
        assert [client.get(keys.block_key(TENANT, h)) for h in hashes] == [_block(0), _block(1)]
        # Listed under the session, so that its delete erases them from Redis.
        assert {keys.split_session_block_member(m.decode())[1] for m in client.smembers(
            keys.session_blocks_key(TENANT, SID))} >= set(hashes)
        assert (await dp.get_session(TENANT, SID)).writes_refused is False
        assert (await dp.append_turn(TENANT, SID, 1, TURN, 7, turn_id="t2")).version == 2
        assert await dp.delete_session(TENANT, SID) is True
        assert not client.exists(*[keys.block_key(TENANT, h) for h in hashes])


async def test_a_read_finds_the_refusal_itself_and_still_answers():
    """Before any probe (a long reconnect interval): a session read's expiry refresh is
    refused, the read answers anyway (its record marked), and the replica now reports
    the refusal; once the server takes writes again, the next read is not marked."""
    async with dataplane(300) as (dp, client):
        await dp.create_session(TENANT, session_id=SID)
        assert (await dp.append_turn(TENANT, SID, 0, TURN, 7)).version == 1
        with refusing(client, "oom"):
            assert (await dp.status())["refusing_writes"] == []
            got = await dp.get_session(TENANT, SID)
            assert (got.version, got.messages, got.writes_refused) == (1, TURN, True)
            assert (await dp.status())["refusing_writes"] == ["kv", "sessions"]
        # It takes writes again before any probe noticed: a read's refresh is taken, and
        # its record is not marked (a turn on it goes ahead), while the status waits
        # for the probe, which also writes back what waited.
        got = await dp.get_session(TENANT, SID)
        assert (got.version, got.writes_refused) == (1, False)
        assert (await dp.status())["refusing_writes"] == ["kv", "sessions"]


async def test_a_server_busy_with_a_script_is_unavailable_until_it_is_killed():
    """A script past the server's time limit makes it answer BUSY to everything but
    SCRIPT KILL: the store reports it unreachable (the data plane degrades, as for an
    outage) instead of raising the reply, and works again once the script is killed."""
    import threading

    with LocalRedis() as server:
        store = RedisStore.from_config(RedisConfig(url=server.url, password_env=None), kv_ttl_s=60)
        client = redis.Redis.from_url(server.url)
        spinner = redis.Redis.from_url(server.url)
        try:
            now = time.time()
            assert await store.create_session(SessionRecord(SID, TENANT, created=now, expires_at=now + 300, ttl_s=300))
            client.config_set("busy-reply-threshold", 50)  # ms before BUSY replies (default 5 s)
            spin = threading.Thread(target=lambda: _quietly(spinner.eval, "while true do end", 0), daemon=True)
            spin.start()
            time.sleep(0.3)
            for call in (store.ping("sessions"), store.append(TENANT, SID, 0, TURN, 7), store.get_blocks_packed(TENANT, ["h0"])):
                with pytest.raises(RedisUnavailable, match="^BUSY"):
                    await call
            client.script_kill()
            spin.join(10)
            assert await store.ping("sessions")
            assert (await store.append(TENANT, SID, 0, TURN, 7)).version == 1
        finally:
            spinner.close()
            client.close()
            await store.close()


def _quietly(fn, *args) -> None:
    try:
        fn(*args)
    except redis.ResponseError:  # the killed script's own reply
        pass
