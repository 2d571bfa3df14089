"""DataPlane through a real Ray Serve deployment (2 replicas, key-affinity routing) and a
real redis-server: sessions, KV blocks through L2 and L3, corruption, Redis outage and
recovery, replica death."""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest

from app.config import AppConfig
from app.errors import ConflictError, NotFoundError
from deployments.compute.engines.kv import TIER_L2, TIER_L3, block_hashes
from deployments.dataplane import keys
from deployments.dataplane.blocks import BlockHeader, encode_block, unpack_blocks
from deployments.dataplane.connector import DataPlaneKVConnector
from deployments.dataplane.types import new_session_id
from tests.fixtures.polling import eventually
from tests.fixtures.redis import SESSION_TOMBSTONE, redis_client, redis_server  # noqa: F401  (until conftest wires the plugin)

pytestmark = pytest.mark.integration

APP_NAME = "dataplane-test"
BLOCK_SIZE = 4


def dataplane_args(redis_url: str) -> dict:
    return {
        "dataplane": {
            "num_replicas": 2,
            "num_cpus": 0.1,
            "block_size": BLOCK_SIZE,
            "l2_capacity_bytes": 1 << 20,
            "sync_interval_ms": 50,
            "redis": {
                "url": redis_url,
                "password_env": None,
                "socket_timeout_s": 0.5,
                "connect_timeout_s": 0.5,
                "reconnect_interval_s": 0.2,
            },
        }
    }


@pytest.fixture(scope="module")
def dataplane(ray_cluster, redis_server):  # noqa: F811
    from ray import serve
    from ray.serve.context import _get_global_client

    from deployments.dataplane.deployment import dataplane_deployment

    try:
        serve_was_running = _get_global_client() is not None
    except Exception:
        serve_was_running = False
    args = dataplane_args(redis_server.url)
    config = AppConfig.model_validate(args)
    app = dataplane_deployment(config).bind(config.model_dump(mode="json"))
    handle = serve.run(app, name=APP_NAME, route_prefix=None)
    yield handle
    serve.delete(APP_NAME)
    if not serve_was_running:
        # Let a later fixture start Serve with its own HTTP options.
        serve.shutdown()


def make_blocks(tenant: str, n: int, seed: int = 0) -> tuple[list[str], list[bytes]]:
    token_ids = [seed * 1000 + i for i in range(n * BLOCK_SIZE)]
    hashes = block_hashes("m", tenant, token_ids, BLOCK_SIZE)
    blocks = [
        encode_block(BlockHeader("float32", (1, 2, 1, BLOCK_SIZE, 8)), bytes([(seed + i) % 256]) * 256)
        for i in range(n)
    ]
    return hashes, blocks


def tenant_name() -> str:
    return f"t-{uuid.uuid4().hex[:8]}"


async def new_session(dp, tenant: str, **kwargs):
    sid = new_session_id()
    return await dp.create_session.remote(tenant, session_id=sid, shard_key=sid, **kwargs)


async def test_session_create_get_append_delete(dataplane, redis_client):  # noqa: F811
    tenant = tenant_name()
    rec = await new_session(dataplane, tenant)
    sid = rec.id
    assert (rec.tenant, rec.version, rec.messages, rec.num_tokens) == (tenant, 0, [], 0)
    assert redis_client.exists(keys.session_key(tenant, sid))

    got = await dataplane.get_session.remote(tenant, sid, shard_key=sid)
    assert got.id == sid and got.version == 0

    turn = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    rec = await dataplane.append_turn.remote(tenant, sid, 0, turn, 7, shard_key=sid)
    assert rec.version == 1 and rec.messages == turn and rec.num_tokens == 7
    rec = await dataplane.append_turn.remote(tenant, sid, 1, [{"role": "user", "content": "2"}], 3, shard_key=sid)
    assert rec.version == 2 and rec.num_tokens == 10
    got = await dataplane.get_session.remote(tenant, sid, shard_key=sid)
    assert got.messages == [*turn, {"role": "user", "content": "2"}] and got.version == 2

    with pytest.raises(ConflictError, match="version 2, not 1"):
        await dataplane.append_turn.remote(tenant, sid, 1, [{"role": "user", "content": "x"}], 1, shard_key=sid)
    with pytest.raises(ConflictError):
        await dataplane.create_session.remote(tenant, session_id=sid, shard_key=sid)

    assert await dataplane.delete_session.remote(tenant, sid, shard_key=sid) is True
    assert redis_client.hgetall(keys.session_key(tenant, sid)) == SESSION_TOMBSTONE
    assert await dataplane.get_session.remote(tenant, sid, shard_key=sid) is None
    with pytest.raises(NotFoundError):
        await dataplane.append_turn.remote(tenant, sid, 2, [{"role": "user", "content": "x"}], 1, shard_key=sid)


async def test_racing_appends_one_wins_and_no_turn_is_lost(dataplane):
    tenant = tenant_name()
    sid = (await new_session(dataplane, tenant)).id
    n = 8

    async def append(i: int, version: int):
        msg = [{"role": "user", "content": f"turn-{i}"}]
        return await dataplane.append_turn.remote(tenant, sid, version, msg, 1, shard_key=sid)

    results = await asyncio.gather(*(append(i, 0) for i in range(n)), return_exceptions=True)
    winners = [r for r in results if not isinstance(r, BaseException)]
    losers = [i for i, r in enumerate(results) if isinstance(r, BaseException)]
    assert len(winners) == 1 and winners[0].version == 1
    assert all(isinstance(results[i], ConflictError) for i in losers), results

    for i in losers:  # each loser reloads and retries, as a client would
        while True:
            current = await dataplane.get_session.remote(tenant, sid, shard_key=sid)
            try:
                await append(i, current.version)
                break
            except ConflictError:
                continue
    final = await dataplane.get_session.remote(tenant, sid, shard_key=sid)
    contents = [m["content"] for m in final.messages]
    assert sorted(contents) == sorted(f"turn-{i}" for i in range(n))  # no loss, no duplicate
    assert final.version == n and final.num_tokens == n


async def test_an_append_made_again_after_it_landed_is_its_success_not_a_409(dataplane, redis_client):  # noqa: F811
    # A call whose replica died after Redis took the write is sent again (by the
    # SessionClient, or by Serve's router when the acceptance was lost): same turn id.
    tenant = tenant_name()
    sid = (await new_session(dataplane, tenant)).id
    turn = [{"role": "user", "content": "once"}, {"role": "assistant", "content": "only"}]
    first = await dataplane.append_turn.remote(tenant, sid, 0, turn, 5, turn_id="turn-a", shard_key=sid)
    again = await dataplane.append_turn.remote(tenant, sid, 0, turn, 5, turn_id="turn-a", shard_key=sid)
    assert (again.version, again.messages, again.num_tokens) == (1, turn, 5) == (
        first.version, first.messages, first.num_tokens
    )
    stored = redis_client.hgetall(keys.session_key(tenant, sid))
    assert int(stored[b"version"]) == 1 and stored[b"last_turn"] == b"turn-a"
    # Another turn on the same version is still the race it is.
    with pytest.raises(ConflictError):
        await dataplane.append_turn.remote(tenant, sid, 0, turn, 5, turn_id="turn-b", shard_key=sid)
    with pytest.raises(ConflictError):  # and so is an anonymous one
        await dataplane.append_turn.remote(tenant, sid, 0, turn, 5, shard_key=sid)
    # Once a later turn landed, the old id no longer matches: a stale repeat is a conflict.
    await dataplane.append_turn.remote(tenant, sid, 1, [{"role": "user", "content": "2"}], 1, turn_id="turn-c", shard_key=sid)
    with pytest.raises(ConflictError):
        await dataplane.append_turn.remote(tenant, sid, 0, turn, 5, turn_id="turn-a", shard_key=sid)
    got = await dataplane.get_session.remote(tenant, sid, shard_key=sid)
    assert got.version == 2 and [m["content"] for m in got.messages] == ["once", "only", "2"]


async def test_session_expires_after_ttl(dataplane, redis_client):  # noqa: F811
    tenant = tenant_name()
    sid = (await new_session(dataplane, tenant, ttl_s=1)).id
    assert await dataplane.get_session.remote(tenant, sid, shard_key=sid) is not None
    await asyncio.sleep(2.3)
    assert await dataplane.get_session.remote(tenant, sid, shard_key=sid) is None
    assert not redis_client.exists(keys.session_key(tenant, sid))
    with pytest.raises(NotFoundError):
        await dataplane.append_turn.remote(tenant, sid, 0, [{"role": "user", "content": "x"}], 1, shard_key=sid)


async def test_using_a_session_pushes_its_expiry_out(dataplane, redis_client):  # noqa: F811
    """``cache_ttl_s`` counts from the last use: a read and a turn each set the record's
    Redis TTL back to the session's ``ttl_s``, and the expiry it reports moves with it."""
    tenant = tenant_name()
    rec = await new_session(dataplane, tenant, ttl_s=600)
    key = keys.session_key(tenant, rec.id)
    for use in (
        lambda: dataplane.get_session.remote(tenant, rec.id, shard_key=rec.id),
        lambda: dataplane.append_turn.remote(tenant, rec.id, 0, [{"role": "user", "content": "x"}], 1, shard_key=rec.id),
    ):
        redis_client.expire(key, 30)  # as if 570 s had passed since the last use
        before = time.time()
        used = await use()
        assert 590 <= redis_client.ttl(key) <= 600
        assert used.expires_at >= before + 590


async def test_tenants_are_isolated(dataplane):
    a, b = tenant_name(), tenant_name()
    sid = (await new_session(dataplane, a)).id
    await dataplane.append_turn.remote(a, sid, 0, [{"role": "user", "content": "secret"}], 1, shard_key=sid)
    assert await dataplane.get_session.remote(b, sid, shard_key=sid) is None
    with pytest.raises(NotFoundError):
        await dataplane.append_turn.remote(b, sid, 1, [{"role": "user", "content": "x"}], 1, shard_key=sid)
    assert await dataplane.delete_session.remote(b, sid, shard_key=sid) is False
    assert (await dataplane.get_session.remote(a, sid, shard_key=sid)).version == 1

    hashes, blocks = make_blocks(a, 2)
    await dataplane.put_blocks.remote(a, hashes, blocks, shard_key=hashes[0])
    assert (await dataplane.lookup_prefix.remote(b, hashes, shard_key=hashes[0])).num_blocks == 0
    assert await dataplane.get_blocks.remote(b, hashes, shard_key=hashes[0]) is None


async def test_blocks_roundtrip_through_l3(dataplane, redis_client):  # noqa: F811
    tenant = tenant_name()
    hashes, blocks = make_blocks(tenant, 3, seed=1)
    shard = hashes[0]
    assert await dataplane.put_blocks.remote(tenant, hashes, blocks, shard_key=shard) == 3
    hit = await dataplane.lookup_prefix.remote(tenant, hashes, shard_key=shard)
    assert (hit.num_blocks, hit.tier, hit.num_bytes) == (3, TIER_L2, sum(map(len, blocks)))

    flushed = await dataplane.flush_l2.remote(shard_key=shard)
    assert flushed["kept_dirty"] == 0
    for h, b in zip(hashes, blocks):
        assert redis_client.get(keys.block_key(tenant, h)) == b
        assert int(redis_client.get(keys.block_index_key(tenant, h))) == len(b)
    hit = await dataplane.lookup_prefix.remote(tenant, hashes, shard_key=shard)
    assert (hit.num_blocks, hit.tier) == (3, TIER_L3)

    assert await dataplane.get_blocks.remote(tenant, hashes, shard_key=shard) == blocks
    hit = await dataplane.lookup_prefix.remote(tenant, hashes, shard_key=shard)
    assert hit.tier == TIER_L2  # promoted by the read

    # A gap ends the prefix: only the leading run counts.
    other, _ = make_blocks(tenant, 2, seed=9)
    hit = await dataplane.lookup_prefix.remote(tenant, [hashes[0], other[1], hashes[2]], shard_key=shard)
    assert hit.num_blocks == 1
    await dataplane.flush_l2.remote(shard_key=shard)
    assert await dataplane.prefetch.remote(tenant, hashes, shard_key=shard) == 3
    assert (await dataplane.lookup_prefix.remote(tenant, hashes, shard_key=shard)).tier == TIER_L2
    used_before = (await dataplane.stats.remote(shard_key=shard)).get("prefetch_used", 0)
    assert await dataplane.get_blocks.remote(tenant, hashes[:2], shard_key=shard) == blocks[:2]
    assert await dataplane.get_blocks.remote(tenant, hashes[:2], shard_key=shard) == blocks[:2]
    # Each prefetched block counts once, when a reader first takes it.
    assert (await dataplane.stats.remote(shard_key=shard))["prefetch_used"] == used_before + 2


async def test_corrupt_block_in_redis_is_a_miss(dataplane, redis_client):  # noqa: F811
    tenant = tenant_name()
    hashes, blocks = make_blocks(tenant, 2, seed=2)
    shard = hashes[0]
    await dataplane.put_blocks.remote(tenant, hashes, blocks, shard_key=shard)
    await dataplane.flush_l2.remote(shard_key=shard)
    before = (await dataplane.stats.remote(shard_key=shard)).get("corrupt_blocks", 0)
    key = keys.block_key(tenant, hashes[1])
    data = bytearray(redis_client.get(key))
    data[-1] ^= 0xFF  # flip payload bytes: the checksum no longer matches
    redis_client.set(key, bytes(data))

    assert await dataplane.get_blocks.remote(tenant, hashes, shard_key=shard) is None
    stats = await dataplane.stats.remote(shard_key=shard)
    assert stats["corrupt_blocks"] == before + 1
    assert not redis_client.exists(key)  # a corrupt block is deleted, not served again
    assert (await dataplane.lookup_prefix.remote(tenant, hashes, shard_key=shard)).num_blocks == 1


async def test_delete_session_erases_l2_and_l3(dataplane, redis_client):  # noqa: F811
    tenant = tenant_name()
    hashes, blocks = make_blocks(tenant, 3, seed=3)
    # A session on another shard than its blocks, so deleting must reach that shard's L2.
    blocks_replica = (await dataplane.stats.remote(shard_key=hashes[0]))["replica"]
    for _ in range(64):
        sid = new_session_id()
        if (await dataplane.stats.remote(shard_key=sid))["replica"] != blocks_replica:
            break
    else:
        pytest.fail("every session id hashed to the blocks' replica: is routing by shard_key?")
    await dataplane.create_session.remote(tenant, session_id=sid, shard_key=sid)
    await dataplane.put_blocks.remote(tenant, hashes, blocks, sid, shard_key=hashes[0])

    def l3_keys():
        return [
            k for h in hashes
            for k in (keys.block_key(tenant, h), keys.block_index_key(tenant, h))
            if redis_client.exists(k)
        ]

    async def written():
        return len(l3_keys()) == 6

    await eventually(written, 10)  # write-behind reached Redis
    assert redis_client.scard(keys.session_blocks_key(tenant, sid)) == 3
    assert (await dataplane.lookup_prefix.remote(tenant, hashes, shard_key=hashes[0])).tier == TIER_L2

    assert await dataplane.delete_session.remote(tenant, sid, shard_key=sid) is True
    assert l3_keys() == []
    assert not redis_client.exists(keys.session_blocks_key(tenant, sid))
    assert redis_client.hgetall(keys.session_key(tenant, sid)) == SESSION_TOMBSTONE
    # Not in L2 either (the blocks' shard may be another replica than the session's).
    assert (await dataplane.lookup_prefix.remote(tenant, hashes, shard_key=hashes[0])).num_blocks == 0


async def test_delete_session_drops_its_blocks_from_every_replicas_l2(dataplane, redis_client):  # noqa: F811
    """Blocks that a put left on another replica than their chain's owner (Serve's
    router takes the next replica on the ring when the owner is full) leave that
    replica's L2 too: the delete drops them on every replica (Serve's broadcast)."""
    await eventually(lambda: _pool_whole(dataplane), 60, 0.5)
    tenant = tenant_name()
    sid = new_session_id()
    hashes, blocks = make_blocks(tenant, 2, seed=12)
    owner = (await dataplane.stats.remote(shard_key=hashes[0]))["replica"]

    async def fallback_l2_blocks() -> int:
        stats = await dataplane.stats.remote(shard_key=hashes[0], exclude_replica=owner)
        assert stats["replica"] != owner
        return stats["l2_num_blocks"]

    await dataplane.create_session.remote(tenant, session_id=sid, shard_key=sid)
    before = await fallback_l2_blocks()
    stored = await dataplane.put_blocks.remote(tenant, hashes, blocks, sid, shard_key=hashes[0], exclude_replica=owner)
    assert stored == 2 and await fallback_l2_blocks() == before + 2
    assert redis_client.scard(keys.session_blocks_key(tenant, sid)) == 2
    assert await dataplane.delete_session.remote(tenant, sid, shard_key=sid) is True
    assert await fallback_l2_blocks() == before
    assert not any(redis_client.exists(keys.block_key(tenant, h)) for h in hashes)


async def test_connector_lookup_load_save_and_bandwidth(dataplane):
    tenant = tenant_name()
    conn = DataPlaneKVConnector(dataplane, BLOCK_SIZE)
    hashes, blocks = make_blocks(tenant, 4, seed=4)
    assert (await conn.lookup(tenant, hashes)).num_blocks == 0
    assert await conn.load(tenant, hashes) is None
    conn.save(tenant, hashes, blocks)
    await conn.drain()

    async def handed_off():
        stats = await dataplane.stats.remote(shard_key=hashes[0])
        return stats.get("handoff_bytes_ref", 0), stats.get("handoff_bytes_inline", 0)

    nbytes = sum(len(b) for b in blocks)
    before = await handed_off()
    hit = await conn.lookup(tenant, hashes)
    assert (hit.num_blocks, hit.tier, hit.refs) == (4, TIER_L2, None)
    # All in L2: the lookup handed over references into the data plane's object-store
    # copy (nothing copied), and the load that follows uses them without a second call.
    assert await handed_off() == (before[0] + nbytes, before[1])
    assert await conn.load(tenant, hashes) == blocks
    assert await handed_off() == (before[0] + nbytes, before[1])
    # A load with no lookup before it asks for the references itself.
    assert await conn.load(tenant, hashes) == blocks
    assert await handed_off() == (before[0] + 2 * nbytes, before[1])
    assert conn.bandwidth_bytes_per_s(TIER_L2) > 0
    assert conn.bandwidth_bytes_per_s(TIER_L3) is None
    await dataplane.flush_l2.remote(shard_key=hashes[0])
    assert (await conn.lookup(tenant, hashes)).tier == TIER_L3
    assert await handed_off() == (before[0] + 2 * nbytes, before[1])  # no refs from L3
    assert await conn.load(tenant, hashes) == blocks
    assert conn.bandwidth_bytes_per_s(TIER_L3) > 0
    # Read from Redis once into one object-store copy, which L2 keeps and hands out.
    assert await handed_off() == (before[0] + 3 * nbytes, before[1])
    assert await conn.load(tenant, hashes) == blocks
    assert await handed_off() == (before[0] + 4 * nbytes, before[1])


def big_blocks(n: int, seed: int, nbytes: int = 64 << 10) -> list[bytes]:
    """Blocks large enough (together) for Ray to keep their object in the shared-memory
    object store rather than inline."""
    import numpy as np

    rng = np.random.default_rng(seed)
    return [
        encode_block(BlockHeader("uint8", (nbytes,)), rng.integers(0, 256, nbytes, dtype=np.uint8).tobytes())
        for _ in range(n)
    ]


async def kill_and_churn(worker) -> None:
    """Kill ``worker`` (an actor that owns objects the data plane keeps), wait until it is
    gone, then churn the object store's memory: what L2 maps must not be reused."""
    import numpy as np
    import ray

    ray.kill(worker)

    async def worker_gone():
        try:
            await worker.__ray_ready__.remote()
            return False
        except ray.exceptions.RayActorError:
            return True

    await eventually(worker_gone)
    churn = [ray.put(np.full(4 << 20, 7, dtype=np.uint8)) for _ in range(8)]
    del churn


async def test_a_workers_put_is_kept_by_reference_and_outlives_the_worker(dataplane, redis_client):  # noqa: F811
    """A worker's save puts its blocks into the object store once and the data plane
    keeps that object (no copy of its own); when the worker is gone the blocks still
    come back whole, from L2 and, after write-behind, from L3."""
    import ray

    tenant = tenant_name()
    hashes = [f"byref{i}-{uuid.uuid4().hex[:8]}" for i in range(4)]
    blocks = big_blocks(4, seed=21)
    nbytes = sum(len(b) for b in blocks)

    @ray.remote(num_cpus=0)
    class Worker:
        async def save(self, handle, tenant, hashes, blocks):
            return await DataPlaneKVConnector(handle, BLOCK_SIZE).put(tenant, hashes, blocks)

    async def stats():
        return await dataplane.stats.remote(shard_key=hashes[0])

    before = await stats()
    worker = Worker.remote()
    assert await worker.save.remote(dataplane, tenant, hashes, blocks) == 4
    after = await stats()
    assert after["put_bytes_ref"] - before.get("put_bytes_ref", 0) == nbytes
    assert after.get("put_bytes_copy", 0) == before.get("put_bytes_copy", 0)

    conn = DataPlaneKVConnector(dataplane, BLOCK_SIZE)
    assert await conn.load(tenant, hashes) == blocks
    await kill_and_churn(worker)
    assert await conn.load(tenant, hashes) == blocks  # by reference, or inline (lost_refs)
    data, lengths = await dataplane.get_blocks_packed.remote(tenant, hashes, shard_key=hashes[0])
    assert [bytes(b) for b in unpack_blocks(data, lengths)] == blocks
    # Written behind from those views: Redis holds the same bytes.
    await dataplane.flush_l2.remote(shard_key=hashes[0])
    assert [redis_client.get(keys.block_key(tenant, h)) for h in hashes] == blocks
    assert (await conn.lookup(tenant, hashes)).tier == TIER_L3
    assert await conn.load(tenant, hashes) == blocks


async def test_blocks_promoted_with_a_workers_bytes_outlive_the_worker(dataplane, redis_server, redis_client):  # noqa: F811
    """A worker that read blocks from L3 itself hands them to the data plane for their
    promotion (its object, kept by reference); when the worker is gone they still come
    back whole from L2, and Redis's copies are untouched."""
    import ray

    tenant = tenant_name()
    hashes = [f"promgone{i}-{uuid.uuid4().hex[:8]}" for i in range(4)]
    blocks = big_blocks(4, seed=41)
    conn = DataPlaneKVConnector(dataplane, BLOCK_SIZE)
    assert await conn.put(tenant, hashes, blocks) == 4
    await dataplane.flush_l2.remote(shard_key=hashes[0])

    @ray.remote(num_cpus=0)
    class Worker:
        async def read(self, handle, redis_url, tenant, hashes):
            from deployments.dataplane.redis_store import BlockReader

            reader = BlockReader.from_config(AppConfig.model_validate(dataplane_args(redis_url)).dataplane.redis)
            worker_conn = DataPlaneKVConnector(handle, BLOCK_SIZE, l3_reader=reader, promote_delay_s=0.05)
            try:
                got = await worker_conn.load(tenant, hashes)
                await worker_conn.drain()  # the promotion
                return [bytes(b) for b in got], worker_conn.direct_l3["reads"], worker_conn.promotions
            finally:
                await reader.close()

    async def stats():
        return await dataplane.stats.remote(shard_key=hashes[0])

    before = await stats()
    worker = Worker.remote()
    got, reads, promotions = await worker.read.remote(dataplane, redis_server.url, tenant, hashes)
    assert got == blocks and reads == 1 and promotions == {"by_ref": 1, "reread": 0}
    assert (await stats())["promoted_from_worker"] - before.get("promoted_from_worker", 0) == 4
    assert (await conn.lookup(tenant, hashes)).tier == TIER_L2
    await kill_and_churn(worker)
    assert await conn.load(tenant, hashes) == blocks  # by reference, or inline (lost_refs)
    data, lengths = await dataplane.get_blocks_packed.remote(tenant, hashes, shard_key=hashes[0])
    assert [bytes(b) for b in unpack_blocks(data, lengths)] == blocks
    assert [redis_client.get(keys.block_key(tenant, h)) for h in hashes] == blocks


async def test_a_connectors_calls_go_straight_to_the_replica_that_owns_the_key(dataplane):  # noqa: F811
    """A worker's KV calls go to the owner replica's actor itself (Serve's plain call,
    without the caller's Serve router), on the ring Serve's router uses: the put lands
    where the Serve handle's call for the same key finds it, and every read after it
    comes back whole, from L2 and from L3."""
    tenant = tenant_name()
    hashes = [f"direct{i}-{uuid.uuid4().hex[:8]}" for i in range(3)]
    blocks = big_blocks(3, seed=33)

    async def stats():
        return await dataplane.stats.remote(shard_key=hashes[0])

    await stats()  # this process's router has the replicas (as a worker's, after a call)
    before = await stats()
    conn = DataPlaneKVConnector(dataplane, BLOCK_SIZE)
    assert await conn.put(tenant, hashes, blocks) == 3
    after = await stats()
    assert after["put_bytes_ref"] - before.get("put_bytes_ref", 0) == sum(len(b) for b in blocks)
    assert (await conn.lookup(tenant, hashes)).tier == TIER_L2
    assert await conn.load(tenant, hashes) == blocks
    await dataplane.flush_l2.remote(shard_key=hashes[0])
    assert (await conn.lookup(tenant, hashes)).tier == TIER_L3
    assert await conn.load(tenant, hashes) == blocks
    # The put, two lookups and the L3 load (the L2 load used its lookup's references).
    assert conn.direct_calls == {"calls": 4, "fallbacks": 0}


async def test_a_put_by_reference_from_another_node_is_copied_and_bad_ones_are_refused(dataplane):
    """From another node the data plane copies the object into one of its own (L2 must
    not pin the caller's node's memory); a reference that is not one, sizes that do not
    match, and a corrupt block are refused or dropped, never stored."""
    import ray

    from app.errors import InvalidRequestError
    from deployments.dataplane.blocks import block_arrays

    tenant = tenant_name()
    hashes = [f"copy{i}-{uuid.uuid4().hex[:8]}" for i in range(3)]
    blocks = big_blocks(3, seed=22)
    arrays, lengths = block_arrays(blocks)

    async def stats():
        return await dataplane.stats.remote(shard_key=hashes[0])

    before = await stats()
    stored = await dataplane.put_block_refs.remote(
        tenant, hashes, [ray.put(arrays)], lengths, node_id="f" * 56, shard_key=hashes[0]
    )
    assert stored == 3
    after = await stats()
    assert after["put_bytes_copy"] - before.get("put_bytes_copy", 0) == sum(lengths)
    assert after.get("put_bytes_ref", 0) == before.get("put_bytes_ref", 0)
    assert await DataPlaneKVConnector(dataplane, BLOCK_SIZE).load(tenant, hashes) == blocks

    with pytest.raises(InvalidRequestError, match="refs"):
        await dataplane.put_block_refs.remote(tenant, hashes, [b"not a reference"], lengths, shard_key=hashes[0])
    with pytest.raises(InvalidRequestError, match="lengths"):
        await dataplane.put_block_refs.remote(
            tenant, hashes, [ray.put(arrays)], [lengths[0], lengths[1], 5], shard_key=hashes[0]
        )
    with pytest.raises(InvalidRequestError, match="refs"):
        await dataplane.put_block_refs.remote(tenant, hashes[:1], [ray.put([object()])], [1], shard_key=hashes[0])

    # A block whose payload no longer matches its checksum is not stored (the others are).
    bad = [f"bad{i}-{uuid.uuid4().hex[:8]}" for i in range(2)]
    corrupt = bytearray(blocks[0])
    corrupt[-1] ^= 0xFF
    data, sizes = block_arrays([bytes(corrupt), blocks[1]])
    node = ray.get_runtime_context().get_node_id()
    before = await dataplane.stats.remote(shard_key=bad[0])
    stored = await dataplane.put_block_refs.remote(tenant, bad, [ray.put(data)], sizes, node_id=node, shard_key=bad[0])
    assert stored == 1
    after = await dataplane.stats.remote(shard_key=bad[0])
    assert after["corrupt_blocks"] == before.get("corrupt_blocks", 0) + 1
    assert (await DataPlaneKVConnector(dataplane, BLOCK_SIZE).lookup(tenant, bad)).num_blocks == 0


@pytest.mark.parametrize("by_ref", [True, False], ids=["worker-bytes", "reread"])
async def test_connector_reads_l3_itself_and_the_replica_promotes_it(dataplane, redis_server, redis_client, by_ref):  # noqa: F811
    """``direct_l3_reads``: after a flush the worker's connector reads the blocks from
    Redis itself (the data plane hands over hashes, no reference and no copy), and a
    moment later the owning replica has them in L2 again, handed out by reference. The
    promotion takes the bytes the worker read, through the object store: Redis does not
    send them a second time. Without the worker's bytes (none kept for promotions: a
    budget of 0) the replica reads them from Redis again."""
    from deployments.dataplane.redis_store import BlockReader

    tenant = tenant_name()
    config = AppConfig.model_validate(dataplane_args(redis_server.url))
    reader = BlockReader.from_config(config.dataplane.redis)
    conn = DataPlaneKVConnector(
        dataplane, BLOCK_SIZE, l3_reader=reader, promote_delay_s=0.1, promote_hold_bytes=64 << 20 if by_ref else 0
    )
    try:
        hashes, _ = make_blocks(tenant, 5, seed=9)
        blocks = big_blocks(5, seed=9)
        nbytes = sum(len(b) for b in blocks)
        conn.save(tenant, hashes, blocks)
        await conn.drain()
        await dataplane.flush_l2.remote(shard_key=hashes[0])

        async def stats():
            return await dataplane.stats.remote(shard_key=hashes[0])

        def sent_by_redis() -> int:
            return int(redis_client.info("stats")["total_net_output_bytes"])

        before = await stats()
        hit = await conn.lookup(tenant, hashes)
        assert (hit.num_blocks, hit.tier) == (5, TIER_L3)
        assert await conn.load(tenant, hashes) == blocks
        assert conn.direct_l3["reads"] == 1 and conn.direct_l3["fallbacks"] == 0
        mid = await stats()
        assert mid.get("get_hits_L3", 0) == before.get("get_hits_L3", 0)  # Redis not read there
        assert mid["handoff_blocks_direct_l3"] - before.get("handoff_blocks_direct_l3", 0) == 5
        assert mid.get("handoff_bytes_ref", 0) == before.get("handoff_bytes_ref", 0)
        assert conn.bandwidth_bytes_per_s(TIER_L3) > 0

        sent = sent_by_redis()
        await conn.drain()  # the promotion
        sent = sent_by_redis() - sent
        after = await stats()
        assert after["promoted"] - before.get("promoted", 0) == 5
        from_worker = after.get("promoted_from_worker", 0) - before.get("promoted_from_worker", 0)
        if by_ref:
            assert conn.promotions == {"by_ref": 1, "reread": 0}
            assert from_worker == 5
            assert sent < nbytes / 4, (sent, nbytes)  # index entries and replies, not the blocks
        else:
            assert conn.promotions == {"by_ref": 0, "reread": 1}
            assert from_worker == 0
            assert sent >= nbytes, (sent, nbytes)
        assert conn._promote_held == 0
        assert (await conn.lookup(tenant, hashes)).tier == TIER_L2
        assert await conn.load(tenant, hashes) == blocks
        assert (await stats())["handoff_bytes_ref"] - after.get("handoff_bytes_ref", 0) == nbytes
        assert conn.direct_l3["reads"] == 1
    finally:
        await reader.close()


async def test_a_promotion_with_the_workers_bytes_takes_only_sound_blocks_still_in_redis(dataplane):  # noqa: F811
    """``promote`` with the worker's object: blocks whose index entry Redis no longer
    has (deleted since the worker's read, or never written) and blocks that fail their
    check stay out of L2; the rest come up, copied out of the worker's object (L2 must
    not keep the whole object alive for part of it), and a whole object from this node is
    kept as it is; a malformed call is refused."""
    import ray

    from app.errors import InvalidRequestError
    from deployments.dataplane.blocks import block_arrays

    tenant = tenant_name()
    hashes = [f"prom{i}-{uuid.uuid4().hex[:8]}" for i in range(4)]
    blocks = big_blocks(4, seed=31)
    conn = DataPlaneKVConnector(dataplane, BLOCK_SIZE)
    assert await conn.put(tenant, hashes[:3], blocks[:3], chain_root=hashes[0]) == 3
    await dataplane.flush_l2.remote(shard_key=hashes[0])  # written to Redis, L2 emptied

    async def stats():
        return await dataplane.stats.remote(shard_key=hashes[0])

    corrupt = bytearray(blocks[1])
    corrupt[-1] ^= 0xFF
    arrays, lengths = block_arrays([blocks[0], bytes(corrupt), blocks[2], blocks[3]])
    node = ray.get_runtime_context().get_node_id()
    before = await stats()
    given = ray.put(arrays)
    in_l2 = await dataplane.promote.remote(tenant, hashes, refs=[given], lengths=lengths, node_id=node, shard_key=hashes[0])
    after = await stats()
    assert in_l2 == 2  # hashes[0] and [2]: [1] failed its check, [3] is not in Redis
    assert after["promoted_from_worker"] - before.get("promoted_from_worker", 0) == 2
    assert after["corrupt_blocks"] - before.get("corrupt_blocks", 0) == 1
    assert after.get("put_bytes_ref", 0) == before.get("put_bytes_ref", 0)  # promotions are not puts
    hit = await dataplane.lookup_prefix.remote(tenant, hashes, shard_key=hashes[0])
    assert (hit.num_blocks, hit.tier) == (3, TIER_L3)  # [1] is still in Redis, intact
    from deployments.dataplane.connector import resolve_block_refs

    def sources(segments) -> set[str]:
        return {src.hex() for src, _ in segments if isinstance(src, ray.ObjectRef)}

    got = await dataplane.get_block_refs.remote(tenant, [hashes[0], hashes[2]], shard_key=hashes[0])
    assert [bytes(b) for b in await resolve_block_refs(got)] == [blocks[0], blocks[2]]
    assert len(sources(got)) == 1 and given.hex() not in sources(got)  # a copy of the two
    assert (await dataplane.lookup_prefix.remote(tenant, hashes[3:], shard_key=hashes[0])).num_blocks == 0

    # Every block of the object wanted, from this node: L2 keeps the worker's object.
    whole = [f"whole{i}-{uuid.uuid4().hex[:8]}" for i in range(2)]
    assert await conn.put(tenant, whole, blocks[:2], chain_root=whole[0]) == 2
    await dataplane.flush_l2.remote(shard_key=whole[0])
    arrays, lengths = block_arrays(blocks[:2])
    given = ray.put(arrays)
    assert await dataplane.promote.remote(
        tenant, whole, refs=[given], lengths=lengths, node_id=node, shard_key=whole[0]
    ) == 2
    got = await dataplane.get_block_refs.remote(tenant, whole, shard_key=whole[0])
    assert sources(got) == {given.hex()}
    assert [bytes(b) for b in await resolve_block_refs(got)] == blocks[:2]

    with pytest.raises(InvalidRequestError, match="refs"):
        await dataplane.promote.remote(tenant, hashes, refs=[b"not a reference"], lengths=lengths, shard_key=hashes[0])
    with pytest.raises(InvalidRequestError, match="lengths"):
        await dataplane.promote.remote(tenant, hashes, refs=[ray.put(arrays)], lengths=lengths[:2], shard_key=hashes[0])


async def test_a_chain_continued_later_stays_on_one_shard(dataplane):
    # A session's next turn exports only its new blocks. Sharded by the first of those,
    # they could land on another replica than the chain's first block, where every lookup
    # of the chain goes: that replica would see them only in Redis, after write-behind.
    tenant = tenant_name()
    conn = DataPlaneKVConnector(dataplane, BLOCK_SIZE)

    async def owner(shard_key: str) -> str:
        return (await dataplane.stats.remote(shard_key=shard_key))["actor_name"]

    for seed in range(40):  # a chain whose continuation's first block has another owner
        hashes, blocks = make_blocks(tenant, 6, seed=100 + seed)
        if await owner(hashes[0]) != await owner(hashes[3]):
            break
    else:
        pytest.fail("no chain with a continuation owned by another replica in 40 tries")
    conn.save(tenant, hashes[:3], blocks[:3])
    await conn.drain()
    conn.save(tenant, hashes[3:], blocks[3:], chain_root=hashes[0])
    await conn.drain()
    # Right away (write-behind runs every 50 ms here): the whole chain, in L2 on the
    # replica that every lookup of the chain goes to, handed over with the lookup.
    hit = await dataplane.lookup_prefix.remote(tenant, hashes, shard_key=hashes[0], with_refs=True)
    assert (hit.num_blocks, hit.tier) == (6, TIER_L2) and hit.refs is not None
    assert (await conn.lookup(tenant, hashes)).num_blocks == 6
    assert await conn.load(tenant, hashes) == blocks


async def test_chain_roots_are_published_for_the_routers_index(dataplane, redis_server, redis_client):  # noqa: F811
    """Each stored chain's root (its first block hash, also for a continuation stored
    later) reaches Redis's ``kvroots`` set within a few publish periods, where a router's
    mirror (``redis_fetcher`` + ``RootIndex``) reads it; a lookup that hits refreshes
    its score; entries older than the L3 TTL are pruned."""
    from deployments.dataplane.root_index import RootIndex, redis_fetcher

    tenant = tenant_name()
    conn = DataPlaneKVConnector(dataplane, BLOCK_SIZE)
    hashes, blocks = make_blocks(tenant, 4, seed=7)
    conn.save(tenant, hashes[:2], blocks[:2])
    await conn.drain()
    conn.save(tenant, hashes[2:], blocks[2:], chain_root=hashes[0])  # a continuation
    await conn.drain()
    key = keys.kv_roots_key(tenant)

    async def published():
        return redis_client.zrange(key, 0, -1, withscores=True)

    await eventually(published, 10)
    await asyncio.sleep(1.0)  # four publish periods: both saves are published by now
    rows = await published()
    assert [r for r, _ in rows] == [hashes[0].encode()], rows  # the continuation's root too
    first_score = rows[0][1]
    assert abs(first_score - time.time()) < 30

    cfg = AppConfig.model_validate(dataplane_args(redis_server.url)).dataplane
    fetch, close = redis_fetcher(cfg)
    index = RootIndex(fetch, sync_interval_s=0.25)
    index.may_hold(tenant, "-")
    await index.sync_once()
    assert index.may_hold(tenant, hashes[0]) is True
    assert index.may_hold(tenant, hashes[1]) is False  # not a root
    other, _ = make_blocks(tenant, 1, seed=8)
    assert index.may_hold(tenant, other[0]) is False

    # A lookup that hits marks the root as in use: a newer score.
    await asyncio.sleep(0.05)
    hit = await dataplane.lookup_prefix.remote(tenant, hashes, shard_key=hashes[0])
    assert hit.num_blocks == 4

    async def refreshed():
        score = redis_client.zscore(key, hashes[0])
        return score is not None and score > first_score

    await eventually(refreshed, 10)
    # Pruned past the TTL: an entry scored long ago goes with the next publish.
    redis_client.zadd(key, {"ancient-root": time.time() - 10 * 86_400})
    conn.save(tenant, other, make_blocks(tenant, 1, seed=8)[1])
    await conn.drain()

    async def pruned():
        return redis_client.zscore(key, "ancient-root") is None and redis_client.zscore(key, other[0]) is not None

    await eventually(pruned, 10)
    assert redis_client.ttl(key) > 0
    await close()


async def test_connector_failure_is_a_miss():
    class Broken:
        def __getattr__(self, name):
            raise RuntimeError("data plane gone")

    conn = DataPlaneKVConnector(Broken(), BLOCK_SIZE)
    hashes, blocks = make_blocks("t", 2)
    assert (await conn.lookup("t", hashes)).num_blocks == 0
    assert await conn.load("t", hashes) is None
    conn.save("t", hashes, blocks)  # logged, never raised
    await conn.drain()


async def test_redis_outage_degrades_and_resyncs(dataplane, redis_server, redis_client):  # noqa: F811
    tenant = tenant_name()
    sid = (await new_session(dataplane, tenant)).id
    await dataplane.append_turn.remote(tenant, sid, 0, [{"role": "user", "content": "before"}], 1, shard_key=sid)
    hashes, blocks = make_blocks(tenant, 2, seed=5)

    redis_server.stop()
    try:
        version = 1
        for i in range(4):  # traffic keeps succeeding while Redis is gone
            rec = await dataplane.append_turn.remote(
                tenant, sid, version, [{"role": "user", "content": f"during-{i}"}], 1, shard_key=sid
            )
            version = rec.version
        with pytest.raises(ConflictError):  # CAS still holds in memory
            await dataplane.append_turn.remote(tenant, sid, 1, [{"role": "user", "content": "x"}], 1, shard_key=sid)
        # A repeat of the last turn (same id) is its success in memory too, applied once.
        last = [{"role": "user", "content": "during-5"}]
        rec = await dataplane.append_turn.remote(tenant, sid, 5, last, 1, turn_id="t5", shard_key=sid)
        again = await dataplane.append_turn.remote(tenant, sid, 5, last, 1, turn_id="t5", shard_key=sid)
        assert rec.version == again.version == 6 and again.messages[-1] == last[0]
        with pytest.raises(ConflictError):
            await dataplane.append_turn.remote(tenant, sid, 5, last, 1, turn_id="t6", shard_key=sid)
        created = await new_session(dataplane, tenant)
        await dataplane.put_blocks.remote(tenant, hashes, blocks, shard_key=hashes[0])
        assert await dataplane.get_blocks.remote(tenant, hashes, shard_key=hashes[0]) == blocks
        got = await dataplane.get_session.remote(tenant, sid, shard_key=sid)
        assert got.version == 6
        status = await dataplane.status.remote(shard_key=sid)
        assert status["degraded"] is True and status["unsynced_sessions"] >= 1
    finally:
        redis_server.start()

    async def recovered():
        # Every shard this test touched (with 2 replicas they may all be one).
        for shard in (sid, created.id, hashes[0]):
            if (await dataplane.status.remote(shard_key=shard))["degraded"]:
                return False
        return True

    await eventually(recovered, 30)
    stored = redis_client.hgetall(keys.session_key(tenant, sid))
    assert int(stored[b"version"]) == 6
    assert b"during-5" in stored[b"messages"] and b"before" in stored[b"messages"]
    assert stored[b"messages"].count(b"during-5") == 1 and stored[b"last_turn"] == b"t5"
    assert redis_client.exists(keys.session_key(tenant, created.id))
    for h, b in zip(hashes, blocks):
        assert redis_client.get(keys.block_key(tenant, h)) == b

    async def root_published():  # kept through the outage, published once it ended
        return redis_client.zscore(keys.kv_roots_key(tenant), hashes[0]) is not None

    await eventually(root_published, 10)
    # And the session continues normally, through Redis again.
    rec = await dataplane.append_turn.remote(tenant, sid, 6, [{"role": "user", "content": "after"}], 1, shard_key=sid)
    assert rec.version == 7
    assert int(redis_client.hget(keys.session_key(tenant, sid), "version")) == 7


def _replica_states() -> dict:
    from ray import serve

    return dict(serve.status().applications[APP_NAME].deployments["DataPlane"].replica_states)


async def test_a_replica_stopped_during_an_outage_hands_its_turns_over(dataplane, redis_server, redis_client):  # noqa: F811
    """A redeploy down to one replica while Redis is down: each session's owner held its
    outage turn in memory only. Serve stops the old replicas one by one, each gracefully
    (its drain), and each hands what it holds to a replica that stays (the other old one,
    then the new one, by Serve's rolling order here): both turns are read back at once,
    still during the outage, and reach Redis when it returns. Without the drain the
    first read after the redeploy finds nothing."""
    from ray import serve

    from deployments.dataplane.deployment import dataplane_deployment

    tenant = tenant_name()
    owners: dict[str, str] = {}  # replica actor -> a session it owns
    for _ in range(64):
        s = await new_session(dataplane, tenant)
        owners.setdefault((await dataplane.stats.remote(shard_key=s.id))["actor_name"], s.id)
        if len(owners) == 2:
            break
    assert len(owners) == 2, "the two replicas should each own one of 64 sessions"
    sids = sorted(owners.values())
    for s in sids:
        await dataplane.append_turn.remote(tenant, s, 0, [{"role": "user", "content": "before"}], 1, shard_key=s)
    config = AppConfig.model_validate(dataplane_args(redis_server.url))
    args = config.model_dump(mode="json")
    redis_server.stop()
    try:
        for s in sids:  # acknowledged into the owner's memory only
            rec = await dataplane.append_turn.remote(tenant, s, 1, [{"role": "user", "content": "during"}], 1, shard_key=s)
            assert rec.version == 2
        # A new version with one replica (no `version` is set, so every run is a new
        # one): Serve replaces both replicas, stopping each gracefully.
        serve.run(dataplane_deployment(config).options(num_replicas=1).bind(args), name=APP_NAME, route_prefix=None)

        async def one_left():
            return _replica_states() == {"RUNNING": 1}

        await eventually(one_left, 60, 0.5)
        for s in sids:  # the survivor has both, still during the outage
            rec = await dataplane.get_session.remote(tenant, s, shard_key=s)
            assert rec is not None and rec.version == 2, f"session {s} lost its outage turn: {rec}"
            assert [m["content"] for m in rec.messages] == ["before", "during"]
    finally:
        redis_server.start()
    try:
        async def synced():
            status = await dataplane.status.remote(shard_key=sids[0])
            return not status["degraded"] and status["unsynced_sessions"] == 0

        await eventually(synced, 30)
        for s in sids:
            stored = redis_client.hgetall(keys.session_key(tenant, s))
            assert int(stored[b"version"]) == 2 and b"during" in stored[b"messages"]
    finally:
        serve.run(dataplane_deployment(config).bind(args), name=APP_NAME, route_prefix=None)

        async def two_again():
            return _replica_states() == {"RUNNING": 2}

        await eventually(two_again, 60, 0.5)


async def test_killing_a_replica_loses_no_acknowledged_turn(dataplane):
    import ray

    tenant = tenant_name()
    sid = new_session_id()

    async def owner_connected():
        return not (await dataplane.status.remote(shard_key=sid))["degraded"]

    # Only turns acknowledged while Redis is reachable are promised to survive.
    await eventually(owner_connected, 30)
    await dataplane.create_session.remote(tenant, session_id=sid, shard_key=sid)
    for v in range(3):
        await dataplane.append_turn.remote(tenant, sid, v, [{"role": "user", "content": f"t{v}"}], 1, shard_key=sid)
    owner = await dataplane.stats.remote(shard_key=sid)
    assert not owner["degraded"]
    ray.kill(ray.get_actor(owner["actor_name"], namespace="serve"), no_restart=True)

    rec = await eventually(lambda: _read_back(dataplane, tenant, sid), 60, 0.5)
    assert [m["content"] for m in rec.messages] == ["t0", "t1", "t2"] and rec.version == 3
    # Serve replaces the replica; the pool is whole again.
    await eventually(lambda: _pool_whole(dataplane, without=owner["actor_name"]), 60, 0.5)


async def _read_back(dataplane, tenant: str, sid: str):
    try:
        return await dataplane.get_session.remote(tenant, sid, shard_key=sid)
    except Exception:  # noqa: BLE001 - the dead replica until Serve notices
        return None


async def _pool_whole(dataplane, without: str = "") -> bool:
    """Two replicas running that both answer, neither of them ``without`` (a killed one:
    Serve's controller notices a dead replica only at its next health check, seconds
    later, and counts it as running until then)."""
    if _replica_states() != {"RUNNING": 2}:
        return False
    try:
        names = {(await dataplane.stats.remote(shard_key=f"probe-{i}"))["actor_name"] for i in range(16)}
    except Exception:  # noqa: BLE001 - a dead replica's answer
        return False
    return len(names) == 2 and without not in names


async def test_a_replica_killed_during_an_outage_loses_no_acknowledged_turn(dataplane, redis_server, redis_client):  # noqa: F811
    """A crash cannot drain. While Redis is down the owner acknowledges a turn only once
    the session's next owner holds a copy (DataPlane.back_up); the owner is then killed
    (no drain), and the copy reaches Redis when it returns. Without the copy the turn
    died with the owner's memory: Redis would still hold version 1. The copy's holder
    finds its owner alive, then gone, as Ray's registry of named actors tells it
    (DataPlane._replica_alive: a copy is changed only once its owner is gone)."""
    import ray

    from app.serve_context import named_actor_alive
    from deployments.dataplane.routing import replica_actor_name

    tenant = tenant_name()
    sid = new_session_id()
    # The copy needs another live replica (with one, the turn is still acknowledged).
    await eventually(lambda: _pool_whole(dataplane), 60, 0.5)

    async def owner_connected():
        return not (await dataplane.status.remote(shard_key=sid))["degraded"]

    await eventually(owner_connected, 30)
    await dataplane.create_session.remote(tenant, session_id=sid, shard_key=sid)
    await dataplane.append_turn.remote(tenant, sid, 0, [{"role": "user", "content": "before"}], 1, shard_key=sid)
    owner = await dataplane.stats.remote(shard_key=sid)
    redis_server.stop()
    try:
        rec = await dataplane.append_turn.remote(
            tenant, sid, 1, [{"role": "user", "content": "during"}], 1, turn_id="t-during", shard_key=sid
        )
        assert rec.version == 2
        holder = await dataplane.stats.remote(shard_key=sid, exclude_replica=owner["replica"])
        assert holder["actor_name"] != owner["actor_name"]
        # The name the holder looks its owner up by, from its own and the owner's ring name.
        assert replica_actor_name(holder["actor_name"], owner["replica"]) == owner["actor_name"]
        assert named_actor_alive(owner["actor_name"]) and named_actor_alive(holder["actor_name"])
        ray.kill(ray.get_actor(owner["actor_name"], namespace="serve"), no_restart=True)

        async def owner_gone():
            return not await asyncio.to_thread(named_actor_alive, owner["actor_name"])

        await eventually(owner_gone, 30, 0.2)
    finally:
        redis_server.start()

    def stored_version():
        return int(redis_client.hget(keys.session_key(tenant, sid), "version") or 0)

    async def written_back():
        return stored_version() == 2

    await eventually(written_back, 60, 0.2)
    assert b"during" in redis_client.hget(keys.session_key(tenant, sid), "messages")

    rec = await eventually(lambda: _read_back(dataplane, tenant, sid), 60, 0.5)
    assert [m["content"] for m in rec.messages] == ["before", "during"] and rec.version == 2
    await eventually(lambda: _pool_whole(dataplane, without=owner["actor_name"]), 60, 0.5)


async def test_a_deleted_session_leaves_a_tombstone_that_refuses_stale_copies():
    """RedisStore alone: a delete leaves only a tombstone, which lives as long as the
    record would have; a stale copy written back afterwards (put_session_if_newer, what
    a replica's resync does) is refused, reads and appends see no session, the id stays
    taken. A delete of an id Redis never held writes nothing unless asked to."""
    import redis

    from app.config import RedisConfig
    from app.local_redis import LocalRedis
    from deployments.dataplane.redis_store import RedisStore
    from deployments.dataplane.types import SessionRecord

    with LocalRedis() as server:
        store = RedisStore.from_config(RedisConfig(url=server.url, password_env=None), kv_ttl_s=60)
        client = redis.Redis.from_url(server.url)
        try:
            now = time.time()
            rec = SessionRecord("s", "t", created=now, expires_at=now + 300, ttl_s=300)
            assert await store.create_session(rec)
            assert (await store.append("t", "s", 0, [{"role": "user", "content": "hi"}], 1)).version == 1
            stale = await store.get_session("t", "s")
            assert await store.delete_session("t", "s") is True
            key = keys.session_key("t", "s")
            assert client.hgetall(key) == SESSION_TOMBSTONE
            assert 295 <= client.ttl(key) <= 300
            stale.version = 5
            assert await store.put_session_if_newer(stale) is False
            assert client.hgetall(key) == SESSION_TOMBSTONE
            assert await store.get_session("t", "s") is None
            assert (await store.append("t", "s", 1, [{"role": "user", "content": "x"}], 1)).status == "missing"
            assert await store.create_session(rec) is False
            assert await store.delete_session("t", "s") is False  # already gone

            # Never in Redis: nothing written, unless a tombstone is asked for.
            assert await store.delete_session("t", "never") is False
            assert not client.exists(keys.session_key("t", "never"))
            assert await store.delete_session("t", "outage", tombstone_s=120) is False
            assert client.hgetall(keys.session_key("t", "outage")) == SESSION_TOMBSTONE
            assert 115 <= client.ttl(keys.session_key("t", "outage")) <= 120
            copy = SessionRecord("outage", "t", created=now, expires_at=now + 300, ttl_s=300, version=2)
            assert await store.put_session_if_newer(copy) is False

            # Without a tombstone the same write-back lands (the check above is the
            # tombstone's doing, not the version's).
            other = SessionRecord("other", "t", created=now, expires_at=now + 300, ttl_s=300, version=2)
            assert await store.put_session_if_newer(other) is True
            assert (await store.get_session("t", "other")).version == 2
        finally:
            client.close()
            await store.close()


async def test_store_password_from_env_and_exact_message_roundtrip():
    """RedisStore alone: the password comes from the variable named by password_env, and
    the atomic append keeps messages byte-for-byte (unicode, numbers, nested)."""
    from app.config import RedisConfig
    from app.local_redis import LocalRedis
    from deployments.dataplane.redis_store import RedisStore, RedisUnavailable
    from deployments.dataplane.types import SessionRecord

    with LocalRedis(extra_args=("--requirepass", "s3cret")) as server:
        cfg = RedisConfig(url=server.url, password_env="TEST_DP_REDIS_PASSWORD")
        no_password = RedisStore.from_config(cfg, kv_ttl_s=60, environ={})
        with pytest.raises(RedisUnavailable):
            await no_password.get_session("t", "s")
        await no_password.close()

        store = RedisStore.from_config(cfg, kv_ttl_s=60, environ={"TEST_DP_REDIS_PASSWORD": "s3cret"})
        now = time.time()
        assert await store.create_session(SessionRecord("s", "t", created=now, expires_at=now + 60, ttl_s=60))
        turns = [
            {"role": "user", "content": "héllo ✓ \"quoted\" [1,2]"},
            {"role": "assistant", "content": "", "meta": {"n": 1.5, "ids": [1, 2, 3], "x": None}},
        ]
        result = await store.append("t", "s", 0, turns[:1], 3)
        assert (result.status, result.version) == ("ok", 1)
        assert (await store.append("t", "s", 1, [], 0)).version == 2  # empty append is fine
        assert (await store.append("t", "s", 2, turns[1:], 4)).version == 3
        assert (await store.append("t", "s", 2, turns[1:], 4)).status == "conflict"
        assert (await store.append("t", "other", 0, turns, 4)).status == "missing"
        rec = await store.get_session("t", "s")
        assert rec.messages == turns and rec.num_tokens == 7 and rec.version == 3
        assert await store.get_session("u", "s") is None
        await store.close()


async def test_a_session_record_the_store_cannot_read_is_named_and_deletable():
    """RedisStore alone: a session hash with a field that is missing or not what this
    server writes, or a key of another type, is UnreadableSessionRecord (a 500 naming
    the field) with or without the expiry refresh; delete_session erases it."""
    import redis

    from app.config import RedisConfig
    from app.local_redis import LocalRedis
    from deployments.dataplane.redis_store import RedisStore, UnreadableSessionRecord
    from deployments.dataplane.types import SessionRecord

    with LocalRedis() as server:
        store = RedisStore.from_config(RedisConfig(url=server.url, password_env=None), kv_ttl_s=60)
        client = redis.Redis.from_url(server.url)
        try:
            damages = {
                "field 'messages'": lambda key: client.hset(key, "messages", "[1, 2]"),
                "field 'num_tokens'": lambda key: client.hset(key, "num_tokens", "many"),
                "no field 'tenant'": lambda key: client.hdel(key, "tenant"),
                "another type": lambda key: (client.delete(key), client.rpush(key, "x")),
            }
            for i, (why, damage) in enumerate(damages.items()):
                now, sid = time.time(), f"s{i}"
                assert await store.create_session(SessionRecord(sid, "t", created=now, expires_at=now + 300, ttl_s=300))
                key = keys.session_key("t", sid)
                damage(key)
                for touch in (True, False):
                    with pytest.raises(UnreadableSessionRecord, match=why) as unreadable:
                        await store.get_session("t", sid, touch=touch)
                    assert unreadable.value.status_code == 500
                    assert unreadable.value.code == "session_record_unreadable"
                assert await store.delete_session("t", sid) is True
                assert client.type(key) in (b"none", b"hash") and await store.get_session("t", sid) is None
        finally:
            client.close()
            await store.close()
