"""The data plane's bulk block I/O against a real redis-server, without Ray: the raw RESP
client (``deployments/dataplane/resp.py``), the Redis store's block paths on top of it
(restart, outage), and the DataPlane's packed put/get (checks on the way in, views kept
in L2, zero-copy packing)."""

from __future__ import annotations

import asyncio
import logging
import os
import re
import socket
import time

import numpy as np
import pytest
import redis.asyncio as aioredis
from redis import exceptions as rexc

from app.errors import InvalidRequestError
from app.local_redis import LocalRedis
from deployments.dataplane import keys
from deployments.dataplane.blocks import BlockHeader, block_arrays, encode_block, pack_blocks
from deployments.dataplane.connector import resolve_block_refs
from deployments.dataplane.deployment import DataPlane
from deployments.dataplane.redis_store import RedisStore, RedisUnavailable
from deployments.dataplane.resp import RawBlockClient
from tests.fixtures.dataplane import standalone_dataplane
from tests.fixtures.logs import messages_containing, serve_log_captured
from tests.fixtures.polling import eventually
from tests.fixtures.redis import SESSION_TOMBSTONE

pytestmark = pytest.mark.integration


def raw_client(url: str, **kwargs) -> tuple[aioredis.Redis, RawBlockClient]:
    client = aioredis.Redis.from_url(url, **kwargs)
    raw = RawBlockClient.from_redis(client)
    assert raw is not None
    return client, raw


def block(nbytes: int, seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    return encode_block(BlockHeader("uint8", (nbytes,)), rng.integers(0, 256, nbytes, dtype=np.uint8).tobytes())


async def test_mget_packed_matches_redis_py(redis_server):
    client, raw = raw_client(redis_server.url)
    try:
        values = {
            "io:a": os.urandom(1 << 20),  # larger than any socket read
            "io:b": b"",
            "io:c": b"x\r\n$-1\r\n*3\r\n",  # RESP-looking bytes inside a value
            "io:d": os.urandom(70_001),
        }
        await client.mset(values)
        names = ["io:a", "io:missing", "io:b", "io:c", "io:d", "io:a"]
        data, lengths = await raw.mget_packed(names)
        expected = await client.mget(names)
        assert lengths == [None if v is None else len(v) for v in expected]
        assert data.dtype == np.uint8
        assert bytes(data) == b"".join(v for v in expected if v is not None)
        # Many calls at once share the pool and stay in step.
        results = await asyncio.gather(*(raw.mget_packed(["io:d", "io:c"]) for _ in range(20)))
        assert all(bytes(d) == values["io:d"] + values["io:c"] for d, _ in results)
        empty, no_lengths = await raw.mget_packed([])
        assert len(empty) == 0 and no_lengths == []
    finally:
        raw.close()
        await client.aclose()


async def test_a_large_mget_goes_in_pieces_on_one_connection_and_reads_the_same(redis_server, monkeypatch):
    from deployments.dataplane import resp

    client, raw = raw_client(redis_server.url)
    sent: list[int] = []
    real_send = resp._Conn.send

    async def counting_send(self, buffers):
        sent.append(sum(len(b) for b in buffers))
        return await real_send(self, buffers)

    monkeypatch.setattr(resp._Conn, "send", counting_send)
    try:
        values = {f"io:p{i}": os.urandom(100_000 + 997 * i) for i in range(12)}
        values["io:p5"] = b""
        await client.mset(values)
        names = [f"io:p{i}" for i in range(12)]
        names[3:3] = ["io:absent"]  # a nil in the middle of a piece
        expected = await client.mget(names)
        monkeypatch.setattr(resp, "MGET_IN_FLIGHT_BYTES", 250_000)  # ~2 values a piece
        data, lengths = await raw.mget_packed(names)
        assert lengths == [None if v is None else len(v) for v in expected]
        assert bytes(data) == b"".join(v for v in expected if v is not None)
        assert len(sent) >= 5, sent  # pieces, not one MGET
        pieces_alone = len(sent)
        # Concurrent calls share the pool and stay in step.
        results = await asyncio.gather(*(raw.mget_packed(names) for _ in range(4)))
        assert all(bytes(d) == bytes(data) and ls == lengths for d, ls in results)
        # The budget is shared among the MGETs in flight: with 3 others, smaller pieces.
        sent.clear()
        raw._mgets_in_flight = 3
        try:
            assert (await raw.mget_packed(names))[1] == lengths
        finally:
            raw._mgets_in_flight = 0
        assert len(sent) > pieces_alone, (len(sent), pieces_alone)
        # With a budget larger than the whole read, it is one MGET as before.
        monkeypatch.setattr(resp, "MGET_IN_FLIGHT_BYTES", 1 << 30)
        sent.clear()
        data2, lengths2 = await raw.mget_packed(names)
        assert (bytes(data2), lengths2) == (bytes(data), lengths) and len(sent) == 1
    finally:
        raw.close()
        await client.aclose()


async def test_reads_made_at_once_beyond_the_limit_go_one_after_the_other_in_order(redis_server, monkeypatch):
    """With MGET_CALLS_AT_ONCE 1, four reads made at once: each one's MGETs are all
    sent and read before the next read sends its first, in the order the reads were
    made, and each gets its own values."""
    from deployments.dataplane import resp

    monkeypatch.setattr(resp, "MGET_CALLS_AT_ONCE", 1)  # read when the client is made
    client, raw = raw_client(redis_server.url)
    order: list[bytes] = []
    real_send = resp._Conn.send

    async def noting_send(self, buffers):
        order.append(bytes(buffers[0])[:40])
        return await real_send(self, buffers)

    monkeypatch.setattr(resp._Conn, "send", noting_send)
    monkeypatch.setattr(resp, "MGET_IN_FLIGHT_BYTES", 250_000)  # ~2 values a piece
    try:
        groups = [[f"io:q{g}-{i}" for i in range(6)] for g in range(4)]
        await client.mset({k: os.urandom(100_000) for ks in groups for k in ks})
        expected = [await client.mget(ks) for ks in groups]
        results = await asyncio.gather(*(raw.mget_packed(ks) for ks in groups))
        for (data, lengths), want in zip(results, expected):
            assert bytes(data) == b"".join(want) and lengths == [len(v) for v in want]
        reads = [next(g for g in range(4) if f"io:q{g}-".encode() in head) for head in order]
        assert reads == sorted(reads) and len(set(reads)) == 4, reads  # read by read, in order
        assert len(reads) > 4  # each read in pieces
        assert len(raw._idle) == 1  # one connection did it all
    finally:
        raw.close()
        await client.aclose()


async def test_reads_made_at_once_go_side_by_side_on_their_own_connections_up_to_the_limit(redis_server, monkeypatch):
    """Six reads made at once with the default MGET_CALLS_AT_ONCE (4): the first four
    run side by side, each on a connection of its own; the last two start only once one
    of those has ended, in order; each read gets its own values. (One piece outstanding
    per read, MGET_AHEAD: test_pieces_go_ahead_of_the_reply_...)"""
    from deployments.dataplane import resp

    assert resp.MGET_CALLS_AT_ONCE == 4 and resp.MGET_AHEAD == 1
    client, raw = raw_client(redis_server.url)
    sends: list[tuple[int, int]] = []  # (read, connection)
    under_way: list[int] = []  # the client's reads in progress at each send
    ends: list[int] = []  # reads in the order their last piece was read
    real_send = resp._Conn.send

    async def noting_send(self, buffers):
        head = bytes(buffers[0])[:40]
        sends.append((next(g for g in range(6) if f"io:s{g}-".encode() in head), id(self)))
        under_way.append(raw._mgets_in_flight)
        return await real_send(self, buffers)

    monkeypatch.setattr(resp._Conn, "send", noting_send)
    # Values over half the budget: one a piece however many reads are in flight.
    monkeypatch.setattr(resp, "MGET_IN_FLIGHT_BYTES", 250_000)
    try:
        groups = [[f"io:s{g}-{i}" for i in range(5)] for g in range(6)]
        await client.mset({k: os.urandom(130_000 + 1000 * g) for g, ks in enumerate(groups) for k in ks})
        expected = [await client.mget(ks) for ks in groups]

        async def read(g):
            result = await raw.mget_packed(groups[g])
            ends.append(g)
            return result

        results = await asyncio.gather(*(read(g) for g in range(6)))
        for (data, lengths), want in zip(results, expected):
            assert bytes(data) == b"".join(want) and lengths == [len(v) for v in want]
        first_send = {g: next(i for i, (r, _) in enumerate(sends) if r == g) for g in range(6)}
        last_send = {g: max(i for i, (r, _) in enumerate(sends) if r == g) for g in range(6)}
        # The first four were all under way when the first piece went, and never more.
        assert under_way[0] == 4 and max(under_way) == 4, under_way
        # Each on its own connection, and never more than four.
        conns = {g: {c for r, c in sends if r == g} for g in range(6)}
        assert all(len(c) == 1 for c in conns.values()), conns
        assert len({c for r in range(4) for c in conns[r]}) == 4
        assert len({c for cs in conns.values() for c in cs}) == 4 and len(raw._idle) == 4
        # The fifth and sixth started after one of the first four ended, in order.
        assert ends[0] in range(4) and first_send[4] < first_send[5], (ends, first_send)
        assert first_send[4] > min(last_send[g] for g in range(4)), sends
        # Each read in pieces of one value (the budget), whoever else was reading.
        assert all(sum(1 for r, _ in sends if r == g) == 5 for g in range(6)), sends
    finally:
        raw.close()
        await client.aclose()


async def test_pieces_go_ahead_of_the_reply_and_each_value_is_handed_over_as_it_arrives(redis_server, monkeypatch):
    from deployments.dataplane import resp

    client, raw = raw_client(redis_server.url)
    sends_before_first_reply: list[int] = []
    sent = 0
    real_send, real_readline = resp._Conn.send, resp._Conn.readline

    async def counting_send(self, buffers):
        nonlocal sent
        sent += 1
        return await real_send(self, buffers)

    async def noting_readline(self):
        if not sends_before_first_reply:
            sends_before_first_reply.append(sent)
        return await real_readline(self)

    monkeypatch.setattr(resp._Conn, "send", counting_send)
    try:
        values = {f"io:v{i}": os.urandom(50_000 + 101 * i) for i in range(8)}
        await client.mset(values)
        names = list(values)
        names[2:2] = ["io:none"]
        await raw.mget_packed(names)  # the connection, and the client's value size
        monkeypatch.setattr(resp._Conn, "readline", noting_readline)
        monkeypatch.setattr(resp, "MGET_IN_FLIGHT_BYTES", 120_000)  # ~2 values a piece
        # The default: one piece asked for before its reply is read (resp.MGET_AHEAD).
        sent = 0
        await raw.mget_packed(names)
        assert sends_before_first_reply == [1] and sent >= 4, (sends_before_first_reply, sent)
        monkeypatch.setattr(resp, "MGET_AHEAD", 2)
        seen: list[tuple[int, bytes]] = []
        sent = 0
        sends_before_first_reply.clear()
        data, lengths = await raw.mget_packed(names, on_value=lambda i, view: seen.append((i, bytes(view))))
        # With MGET_AHEAD 2, two pieces were asked for before the first reply was read.
        assert sends_before_first_reply == [2] and sent >= 4, (sends_before_first_reply, sent)
        # Each present value, with its index among the keys, in order; the nil skipped.
        assert seen == [(i, values[n]) for i, n in enumerate(names) if n != "io:none"]
        assert bytes(data) == b"".join(values[n] for n in names if n != "io:none")
        assert lengths[2] is None

        # A callback that fails: the whole reply is still read, the first error is
        # raised, and the connection goes back to the pool in step.
        calls: list[int] = []

        def failing(i, view):
            calls.append(i)
            raise ValueError(f"bad value {i}")

        with pytest.raises(ValueError, match="bad value 0"):
            await raw.mget_packed(names, on_value=failing)
        assert calls == [0]  # not called again once one failed
        assert len(raw._idle) == 1
        again, _ = await raw.mget_packed(names)
        assert bytes(again) == bytes(data)
    finally:
        raw.close()
        await client.aclose()


async def test_an_error_reply_with_a_piece_still_due_leaves_the_connection_in_step(monkeypatch):
    from deployments.dataplane import resp

    # MGET renamed away: every piece is answered with an error reply.
    with LocalRedis(extra_args=("--rename-command", "MGET", "")) as server:
        client, raw = raw_client(server.url)
        try:
            await raw.pipeline([("SET", f"io:e{i}", os.urandom(50_000)) for i in range(6)])
            monkeypatch.setattr(resp, "MGET_IN_FLIGHT_BYTES", 120_000)
            raw._value_hint = 50_000
            with pytest.raises(rexc.ResponseError, match="unknown command"):
                await raw.mget_packed([f"io:e{i}" for i in range(6)])
            assert len(raw._idle) == 1
            # The second piece's error reply was read: the next reply is this command's.
            assert await raw.pipeline([("GET", "io:missing"), ("SET", "io:after", "ok")]) == [None, b"OK"]
            assert await client.get("io:after") == b"ok"
        finally:
            raw.close()
            await client.aclose()


async def test_pipeline_sends_views_and_returns_error_replies_in_place(redis_server):
    client, raw = raw_client(redis_server.url)
    try:
        big = np.frombuffer(os.urandom(300_000), dtype=np.uint8)
        view = memoryview(big)[1000:250_000]
        replies = await raw.pipeline([
            ("SET", "io:view", view, "EX", 60),
            ("SET", "io:text", "not a number"),
            ("INCR", "io:text"),
            ("GET", "io:text"),
        ])
        assert replies[0] == b"OK" and replies[1] == b"OK"
        assert isinstance(replies[2], rexc.ResponseError)
        assert replies[3] == b"not a number"
        assert await client.get("io:view") == bytes(view)
        assert 0 < await client.ttl("io:view") <= 60
        # The connection that carried the error reply stays in step.
        await client.sadd("io:set", "m")
        data, lengths = await raw.mget_packed(["io:set", "io:view"])  # nil for a non-string
        assert lengths == [None, len(view)] and bytes(data) == bytes(view)
    finally:
        raw.close()
        await client.aclose()


async def test_password_and_database_are_used():
    with LocalRedis(extra_args=("--requirepass", "s3cret")) as server:
        client, raw = raw_client(server.url.replace("/0", "/3"), password="s3cret")
        try:
            await raw.pipeline([("SET", "io:k", b"v" * 5000)])
            assert await client.get("io:k") == b"v" * 5000  # db 3, as the client
            assert await client.execute_command("DBSIZE") == 1
            data, lengths = await raw.mget_packed(["io:k"])
            assert bytes(data) == b"v" * 5000
        finally:
            raw.close()
            await client.aclose()
        bad_client, bad = raw_client(server.url, password="wrong")
        try:
            with pytest.raises(rexc.AuthenticationError):
                await bad.mget_packed(["io:k"])
        finally:
            bad.close()
            await bad_client.aclose()


async def test_tls_and_unix_urls_fall_back_to_redis_py():
    assert RawBlockClient.from_redis(aioredis.Redis.from_url("rediss://127.0.0.1:1/0")) is None
    assert RawBlockClient.from_redis(aioredis.Redis.from_url("unix:///tmp/nothing.sock")) is None


async def test_a_server_that_closes_during_a_read_fails_it_and_leaves_nothing_behind():
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    port = listener.getsockname()[1]
    loop = asyncio.get_running_loop()
    raw = RawBlockClient("127.0.0.1", port, socket_timeout=5, connect_timeout=1)

    async def half_a_reply_then_close():
        peer, _ = await loop.sock_accept(listener)
        peer.setblocking(False)
        await loop.sock_recv(peer, 1024)  # the MGET
        await loop.sock_sendall(peer, b"*1\r\n$100000\r\n" + b"x" * 5000)
        await asyncio.sleep(0.2)
        peer.close()

    conns = []
    real_connect = raw._connect

    async def noting_connect():
        conn = await real_connect()
        conns.append((conn, conn.sock.fileno()))
        return conn

    raw._connect = noting_connect
    listener.setblocking(False)
    server = asyncio.create_task(half_a_reply_then_close())
    try:
        started = time.monotonic()
        with pytest.raises(rexc.ConnectionError):
            await raw.mget_packed(["k"])
        assert time.monotonic() - started < 3  # the close, not the socket timeout
        assert raw._idle == []
        # The connection is closed and off the loop's readers (its fd may be reused).
        ((conn, fd),) = conns
        assert conn.sock.fileno() == -1 and loop.remove_reader(fd) is False
        await server
    finally:
        raw.close()
        listener.close()


async def test_a_silent_server_times_out():
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    port = listener.getsockname()[1]
    raw = RawBlockClient("127.0.0.1", port, socket_timeout=0.3, connect_timeout=0.3)
    try:
        started = time.monotonic()
        with pytest.raises(rexc.TimeoutError):
            await raw.mget_packed(["k"])
        assert time.monotonic() - started < 2
    finally:
        raw.close()
        listener.close()


async def test_store_survives_a_restart_and_reports_an_outage():
    with LocalRedis() as server:
        client = aioredis.Redis.from_url(server.url, socket_timeout=1, socket_connect_timeout=1)
        store = RedisStore(client, kv_ttl_s=600)
        try:
            blocks = [block(5000, i) for i in range(3)]
            await store.put_blocks("t", ["h0", "h1", "h2"], [memoryview(b) for b in blocks])
            # Payload and index entry for each block (the index holds the length).
            assert await client.get(keys.block_key("t", "h1")) == blocks[1]
            assert int(await client.get(keys.block_index_key("t", "h1"))) == len(blocks[1])
            server.restart()  # every pooled connection is now dead
            data, views = await store.get_blocks_packed("t", ["h0", "h1", "h2", "nope"])
            assert [bytes(v) for v in views[:3]] == blocks and views[3] is None
            assert all(v.readonly for v in views[:3])
            server.stop()
            with pytest.raises(RedisUnavailable):
                await store.get_blocks_packed("t", ["h0"])
            with pytest.raises(RedisUnavailable):
                await store.put_blocks("t", ["h3"], [blocks[0]])
            server.start()
            data, views = await store.get_blocks_packed("t", ["h2"])
            assert bytes(data) == blocks[2]
        finally:
            await store.close()


def dataplane(url: str, sync_interval_ms: int = 60_000, kv_url: str | None = None, **redis_options) -> DataPlane:
    """A DataPlane (no Serve) with sessions on the Redis at ``url`` and blocks there too,
    or on ``kv_url``; by default it writes behind only when the test flushes."""
    kv = {"kv_redis": {"url": kv_url, "password_env": None, **redis_options}} if kv_url else {}
    return standalone_dataplane(
        url, redis=redis_options, l2_capacity_bytes=1 << 24, sync_interval_ms=sync_interval_ms, **kv
    )


async def test_packed_put_checks_blocks_and_reads_come_back_without_copies(redis_server):
    dp = dataplane(redis_server.url)
    try:
        hashes = [f"io{i:04d}" for i in range(6)]
        blocks = [block(20_000, i) for i in range(6)]
        damaged = bytearray(blocks[4])
        damaged[-1] ^= 0xFF
        data, lengths = pack_blocks(blocks[:4] + [bytes(damaged)] + blocks[5:])
        assert await dp.put_blocks_packed("io", hashes, data, lengths) == 5
        stats = await dp.stats()
        assert stats["corrupt_blocks"] == 1 and stats["l2_num_blocks"] == 5
        assert await dp.get_blocks_packed("io", hashes) is None  # block 4 was left out
        assert (await dp.lookup_prefix("io", hashes)).num_blocks == 4

        # L2: the blocks of one put come back as a view of the array L2 keeps (no copy).
        first, lengths = await dp.get_blocks_packed("io", hashes[:4])
        again, _ = await dp.get_blocks_packed("io", hashes[:4])
        assert lengths == [len(b) for b in blocks[:4]] and bytes(first) == b"".join(blocks[:4])
        assert np.shares_memory(first, again)

        # L3: flushed, then read in one MGET straight into one array, which L2 keeps.
        assert (await dp.flush_l2())["written"] == 5
        from_l3, _ = await dp.get_blocks_packed("io", hashes[:4])
        assert bytes(from_l3) == b"".join(blocks[:4])
        from_l2, _ = await dp.get_blocks_packed("io", hashes[:4])
        assert np.shares_memory(from_l3, from_l2)
        assert (await dp.stats())["get_hits_L3"] == 4
        # The list form hands out bytes.
        assert await dp.get_blocks("io", hashes[:2]) == blocks[:2]
        # The workers' form: without Ray there is no object-store copy to refer to, so
        # every block goes inline, and the worker's side reads them back in order.
        segments = await dp.get_block_refs("io", hashes[:4])
        assert [type(src) for src, _ in segments] == [list] and segments[0][1] == [0, 1, 2, 3]
        assert await resolve_block_refs(segments) == blocks[:4]
        assert (await dp.stats())["handoff_bytes_inline"] == sum(len(b) for b in blocks[:4])
        assert await dp.get_block_refs("io", hashes) is None
    finally:
        await dp.drain()


async def test_put_of_a_list_of_block_arrays(redis_server):
    dp = dataplane(redis_server.url)
    try:
        blocks = [block(3000, i) for i in range(3)]
        arrays, lengths = block_arrays(blocks)
        assert await dp.put_blocks_packed("io", ["la", "lb", "lc"], arrays, lengths) == 3
        data, got = await dp.get_blocks_packed("io", ["la", "lb", "lc"])
        assert bytes(data) == b"".join(blocks) and got == lengths
        with pytest.raises(InvalidRequestError):
            await dp.put_blocks_packed("io", ["la", "lb", "lc"], arrays, [lengths[0], lengths[1], 5])
    finally:
        await dp.drain()


async def test_an_l3_read_logs_where_its_time_went_at_debug(redis_server, caplog):
    dp = dataplane(redis_server.url)
    try:
        blocks = [block(50_000, i) for i in range(3)]
        assert await dp.put_blocks_packed("io", ["dA", "dB", "dC"], *pack_blocks(blocks)) == 3
        await dp.flush_l2()
        # Captured after the first put: it starts Ray in this process, whose logging setup
        # replaces the handlers of "ray.serve" (the test passed only after another had
        # started Ray).
        with serve_log_captured(caplog, logging.INFO):
            assert await dp.get_blocks("io", ["dA", "dB"]) == blocks[:2]
        assert not messages_containing(caplog, "read from L3")
        await dp.flush_l2()
        with serve_log_captured(caplog, logging.DEBUG):
            assert await dp.get_blocks("io", ["dA", "dB", "dC"]) == blocks
            assert await dp.get_blocks("io", ["dA", "dB", "dC"]) == blocks  # from L2: no line
        lines = messages_containing(caplog, "read from L3")
        assert len(lines) == 1, lines
        assert re.search(
            rf"blocks=3 bytes={sum(map(len, blocks))} redis_ms=[\d.]+ redis_faults=\d+ "
            r"check_ms=[\d.]+ copy_ms=[\d.]+ copy_faults=\d+$",
            lines[0],
        ), lines[0]
    finally:
        await dp.drain()


async def test_packed_put_with_wrong_lengths_is_a_bad_request(redis_server):
    dp = dataplane(redis_server.url)
    try:
        data, lengths = pack_blocks([block(100, 1), block(100, 2)])
        with pytest.raises(InvalidRequestError):
            await dp.put_blocks_packed("io", ["a", "b"], data, [lengths[0], lengths[1] - 1])
        with pytest.raises(InvalidRequestError):
            await dp.put_blocks_packed("io", ["a"], data, lengths)
        with pytest.raises(InvalidRequestError):
            await dp.put_blocks_packed("io", ["a", "b"], data, [lengths[0] + lengths[1] + 1, -1])
        assert (await dp.stats())["l2_num_blocks"] == 0
    finally:
        await dp.drain()


async def test_kv_blocks_on_their_own_cache_redis_and_sessions_on_the_durable_one(redis_server):
    # dataplane.kv_redis: block payloads and index entries live on a cache server (no
    # persistence, maxmemory, allkeys-lru); sessions and each session's list of its
    # blocks stay on the durable one. An evicted block is a miss, never an error.
    with LocalRedis(cache_max_memory="64mb") as kv_server:
        durable = aioredis.Redis.from_url(redis_server.url)
        cache = aioredis.Redis.from_url(kv_server.url)
        dp = dataplane(redis_server.url, kv_url=kv_server.url)
        try:
            # The server is what the embedded default starts for KV blocks.
            assert (await cache.config_get("appendonly"))["appendonly"] == "no"
            assert (await cache.config_get("maxmemory-policy"))["maxmemory-policy"] == "allkeys-lru"
            assert int((await cache.config_get("maxmemory"))["maxmemory"]) == 64 << 20
            assert (await durable.config_get("appendonly"))["appendonly"] == "yes"

            sid = "sess_" + "c" * 32
            await dp.create_session("kv", session_id=sid, ttl_s=60)
            hashes = [f"kv{i:03d}" for i in range(4)]
            blocks = [block(10_000, 40 + i) for i in range(4)]
            assert await dp.put_blocks_packed("kv", hashes, *pack_blocks(blocks), session_id=sid) == 4
            assert (await dp.flush_l2())["written"] == 4
            for h in hashes:
                assert await cache.get(keys.block_key("kv", h)) == blocks[hashes.index(h)]
                assert await cache.exists(keys.block_index_key("kv", h))
                assert not await durable.exists(keys.block_key("kv", h), keys.block_index_key("kv", h))
            assert await durable.exists(keys.session_key("kv", sid))
            assert not await cache.exists(keys.session_key("kv", sid))
            assert len(await durable.smembers(keys.session_blocks_key("kv", sid))) == 4

            # L2 emptied by the flush: the read comes from the cache server.
            hit = await dp.lookup_prefix("kv", hashes)
            assert (hit.num_blocks, hit.tier) == (4, "L3")
            data, _ = await dp.get_blocks_packed("kv", hashes)
            assert bytes(data) == b"".join(blocks)

            # LRU evicted a payload but not its (small, often read) index entry: the load
            # misses, and drops the entry, so lookups stop offering the block.
            await dp.drop_l2_blocks("kv", hashes)
            await cache.delete(keys.block_key("kv", hashes[2]))
            assert (await dp.lookup_prefix("kv", hashes)).num_blocks == 4  # the index says so
            assert await dp.get_blocks_packed("kv", hashes) is None
            assert not await cache.exists(keys.block_index_key("kv", hashes[2]))
            assert (await dp.lookup_prefix("kv", hashes)).num_blocks == 2

            # The cache lost the blocks (evicted, restarted without persistence): a miss.
            await dp.drop_l2_blocks("kv", hashes)
            await cache.flushall()
            assert (await dp.lookup_prefix("kv", hashes)).num_blocks == 0
            assert await dp.get_blocks_packed("kv", hashes) is None
            assert (await dp.status())["degraded"] is False
            rec = await dp.append_turn("kv", sid, 0, [{"role": "user", "content": "still here"}], 3)
            assert rec.version == 1

            # Deleting the session erases its blocks from the cache server too.
            assert await dp.put_blocks_packed("kv", hashes, *pack_blocks(blocks), session_id=sid) == 4
            assert (await dp.flush_l2())["written"] == 4
            assert await dp.delete_session("kv", sid) is True
            assert not await cache.exists(*[keys.block_key("kv", h) for h in hashes])
            assert not await durable.exists(keys.session_blocks_key("kv", sid))
        finally:
            await dp.drain()
            await durable.aclose()
            await cache.aclose()


async def test_each_redis_server_degrades_alone(redis_server):
    """With blocks on their own server, an outage of one server keeps the other's data
    going to Redis: during a KV outage every acknowledged turn is in the sessions server at
    once (durable, not held in memory), and blocks wait in L2; during a sessions outage
    blocks are still written behind. Each server gets back what it missed, deletions
    included."""
    with LocalRedis() as kv_server:  # AOF: what it held survives its restart here
        durable = aioredis.Redis.from_url(redis_server.url)
        cache = aioredis.Redis.from_url(kv_server.url)
        dp = dataplane(
            redis_server.url, 50, kv_url=kv_server.url, socket_timeout_s=0.5, connect_timeout_s=0.5, reconnect_interval_s=0.2
        )

        async def down(servers):
            return (await dp.status())["degraded_servers"] == servers

        try:
            sid, gone, later = "sess_" + "d" * 32, "sess_" + "e" * 32, "sess_" + "f" * 32
            for s in (sid, gone, later):
                await dp.create_session("deg", session_id=s, ttl_s=600)
            old = [f"old{i}" for i in range(3)]
            assert await dp.put_blocks_packed("deg", old, *pack_blocks([block(1000, i) for i in range(3)]), session_id=gone) == 3
            await eventually(lambda: cache.exists(*[keys.block_key("deg", h) for h in old]))

            kv_server.stop()
            hashes = [f"new{i}" for i in range(4)]
            blocks = [block(2000, 10 + i) for i in range(4)]
            assert await dp.put_blocks_packed("deg", hashes, *pack_blocks(blocks), session_id=sid) == 4
            await eventually(lambda: down(["kv"]))
            rec = await dp.append_turn("deg", sid, 0, [{"role": "user", "content": "during kv outage"}], 3)
            assert rec.version == 1
            stored = await durable.hgetall(keys.session_key("deg", sid))
            assert int(stored[b"version"]) == 1 and b"during kv outage" in stored[b"messages"]
            assert len(await durable.smembers(keys.session_blocks_key("deg", sid))) == 4
            assert await dp.delete_session("deg", gone) is True
            assert await durable.hgetall(keys.session_key("deg", gone)) == SESSION_TOMBSTONE
            assert not await durable.exists(keys.session_blocks_key("deg", gone))
            status = await dp.status()
            assert status["degraded"] is True and status["unsynced_sessions"] == 0
            assert status["unsynced_blocks"] == 4 + 3  # blocks to write, blocks to erase
            assert (await dp.get_session("deg", sid)).version == 1

            kv_server.start()
            await eventually(lambda: down([]))
            await cache.aclose()
            cache = aioredis.Redis.from_url(kv_server.url)  # its connections died with the server
            for h, b in zip(hashes, blocks):
                assert await cache.get(keys.block_key("deg", h)) == b
            assert not await cache.exists(*[keys.block_key("deg", h) for h in old])
            assert (await dp.status())["unsynced_blocks"] == 0

            redis_server.stop()
            more = [f"more{i}" for i in range(2)]
            assert await dp.put_blocks_packed("deg", more, *pack_blocks([block(500, 30), block(500, 31)])) == 2
            rec = await dp.append_turn("deg", sid, 1, [{"role": "user", "content": "during sessions outage"}], 3)
            assert rec.version == 2
            assert await down(["sessions"])
            await eventually(lambda: cache.exists(*[keys.block_key("deg", h) for h in more]))  # still written behind
            assert (await dp.status())["unsynced_sessions"] == 1
            # A session deleted now: its blocks (listed only in memory so far) leave the
            # KV server at once; the session itself once its server is back.
            pend = ["pend0", "pend1"]
            assert await dp.put_blocks_packed("deg", pend, *pack_blocks([block(500, 40), block(500, 41)]), session_id=later) == 2
            await eventually(lambda: cache.exists(*[keys.block_key("deg", h) for h in pend]))
            assert await dp.delete_session("deg", later) is True
            assert not await cache.exists(*[keys.block_key("deg", h) for h in pend])

            redis_server.start()
            await eventually(lambda: down([]))
            await durable.aclose()
            durable = aioredis.Redis.from_url(redis_server.url)
            assert int(await durable.hget(keys.session_key("deg", sid), "version")) == 2
            assert await durable.hgetall(keys.session_key("deg", later)) == SESSION_TOMBSTONE
            assert not await durable.exists(keys.session_blocks_key("deg", later))
        finally:
            if not redis_server.running:
                redis_server.start()
            await dp.drain()
            await durable.aclose()
            await cache.aclose()


async def test_what_changes_while_it_is_written_back_is_written_too():
    """The write-back after an outage awaits Redis while the flag is still up, so requests
    still change memory meanwhile: a turn appended, or a block listed for the session,
    during that write must be written by a later pass, not marked done with it (a lost
    turn, seen once in CI under traffic)."""
    with LocalRedis() as server:
        dp = dataplane(server.url, 50, socket_timeout_s=0.5, connect_timeout_s=0.5, reconnect_interval_s=0.1)
        durable = aioredis.Redis.from_url(server.url)
        releases: list[asyncio.Event] = []
        try:
            sid = "sess_" + "a" * 32
            await dp.create_session("wb", session_id=sid, ttl_s=600)
            server.stop()
            assert (await dp.append_turn("wb", sid, 0, [{"role": "user", "content": "t0"}], 1)).version == 1
            assert (await dp.status())["degraded"] is True

            # A write-back call pauses once, after it reached Redis, until the test has
            # changed memory behind it.
            def pause_once(name: str) -> tuple[asyncio.Event, asyncio.Event]:
                real = getattr(dp._store, name)
                in_flight, go = asyncio.Event(), asyncio.Event()

                async def paused(*args, **kwargs):
                    out = await real(*args, **kwargs)
                    setattr(dp._store, name, real)
                    in_flight.set()
                    await go.wait()
                    return out

                setattr(dp._store, name, paused)
                releases.append(go)
                return in_flight, go

            turn_written, turn_go = pause_once("put_session_if_newer")
            list_written, list_go = pause_once("add_session_blocks")
            server.start()
            await asyncio.wait_for(turn_written.wait(), 30)
            # Still degraded: this turn and these blocks' listing are in memory only.
            assert (await dp.append_turn("wb", sid, 1, [{"role": "user", "content": "t1"}], 1)).version == 2
            assert await dp.put_blocks_packed("wb", ["wb0", "wb1"], *pack_blocks([block(500, 1), block(500, 2)]), session_id=sid) == 2
            turn_go.set()
            await asyncio.wait_for(list_written.wait(), 30)
            assert await dp.put_blocks_packed("wb", ["wb2"], *pack_blocks([block(500, 3)]), session_id=sid) == 1
            list_go.set()

            await eventually(lambda: _degraded(dp, False))
            stored = await durable.hgetall(keys.session_key("wb", sid))
            assert int(stored[b"version"]) == 2 and b"t1" in stored[b"messages"]
            listed = await durable.smembers(keys.session_blocks_key("wb", sid))
            assert len(listed) == 3
            assert (await dp.status())["unsynced_sessions"] == 0
        finally:
            for go in releases:
                go.set()
            await dp.drain()
            await durable.aclose()


async def _degraded(dp: DataPlane, value: bool) -> bool:
    return (await dp.status())["degraded"] is value
