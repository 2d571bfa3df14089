"""DataPlaneKVConnector's lookup-then-load over a scripted data-plane handle (pure logic,
no Ray cluster): which blocks a load uses, and that a load never holds a request."""

from __future__ import annotations

import asyncio

from deployments.compute.engines.kv import TIER_L2, TIER_L3, PrefixHit
from deployments.dataplane import connector as connector_mod
from deployments.dataplane.connector import DataPlaneKVConnector

TENANT = "default"
HASHES = ["h1", "h2"]


class _Method:
    def __init__(self, answer):
        self.answer = answer
        self.calls = 0

    def remote(self, *args, **kwargs):
        self.calls += 1
        answer = self.answer(*args, **kwargs) if callable(self.answer) else self.answer

        async def run():
            if isinstance(answer, BaseException):  # raised when awaited, as a Ray call's
                raise answer
            return answer

        return run()


class _Handle:
    def __init__(self, lookups: list[PrefixHit], refs):
        self._lookups = list(lookups)
        self.lookup_prefix = _Method(lambda *a, **k: self._lookups.pop(0))
        self.get_block_refs = _Method(refs)


def _inline(*blocks: bytes):
    """``get_block_refs`` segments holding ``blocks`` inline, in order."""
    return [(list(blocks), list(range(len(blocks))))]


def test_a_lookup_without_references_drops_an_earlier_lookups_for_the_same_run():
    # The first lookup of the run came with its blocks (L2, from some replica); the next
    # found the run only in L3, with none. The load after it must ask the data plane now,
    # not use the first lookup's references: their holder may be gone since.
    stale, fresh = _inline(b"old1", b"old2"), _inline(b"new1", b"new2")
    handle = _Handle(
        [
            PrefixHit(2, TIER_L2, 8, refs=stale),
            PrefixHit(2, TIER_L3, 8, refs=None),
        ],
        refs=fresh,
    )
    conn = DataPlaneKVConnector(handle, block_size=16)

    async def main():
        await conn.lookup(TENANT, HASHES)
        await conn.lookup(TENANT, HASHES)
        return await conn.load(TENANT, HASHES)

    blocks = asyncio.run(main())
    assert [bytes(b) for b in blocks] == [b"new1", b"new2"]
    assert handle.get_block_refs.calls == 1


def test_a_lookup_with_references_is_what_the_load_uses():
    handle = _Handle([PrefixHit(2, TIER_L2, 8, refs=_inline(b"a", b"b"))], refs=_inline(b"x", b"y"))
    conn = DataPlaneKVConnector(handle, block_size=16)

    async def main():
        await conn.lookup(TENANT, HASHES)
        return await conn.load(TENANT, HASHES)

    assert [bytes(b) for b in asyncio.run(main())] == [b"a", b"b"]
    assert handle.get_block_refs.calls == 0


def test_blocks_that_never_arrive_are_a_miss_within_the_timeout(monkeypatch):
    # An object that cannot be had (a fetch that never ends) must cost the call timeout,
    # then the engine recomputes: never a request held until its deadline.
    async def never(segments, read_l3=None):
        await asyncio.get_running_loop().create_future()

    monkeypatch.setattr(connector_mod, "resolve_block_refs", never)
    handle = _Handle([PrefixHit(2, TIER_L2, 8, refs=_inline(b"a", b"b"))], refs=None)
    conn = DataPlaneKVConnector(handle, block_size=16, timeout_s=0.05)

    async def main():
        await conn.lookup(TENANT, HASHES)
        return await asyncio.wait_for(conn.load(TENANT, HASHES), 5)

    assert asyncio.run(main()) is None


def _lost(segments, read_l3=None):
    import ray

    async def fail():
        raise ray.exceptions.OwnerDiedError("ab" * 14, None, "")

    return fail()


def test_an_object_whose_owner_is_gone_is_read_inline_from_the_data_plane(monkeypatch):
    # L2 keeps a worker's put by reference; when that worker is gone, Ray cannot hand the
    # object to a worker on another node. The data plane still maps it: the load asks
    # for the bytes in the reply instead of recomputing.
    from deployments.dataplane.blocks import pack_blocks

    monkeypatch.setattr(connector_mod, "resolve_block_refs", _lost)
    handle = _Handle([], refs=_inline(b"a", b"b"))
    handle.get_blocks_packed = _Method(lambda *a, **k: pack_blocks([b"a1", b"b22"]))
    conn = DataPlaneKVConnector(handle, block_size=16)
    blocks = asyncio.run(conn.load(TENANT, HASHES))
    assert [bytes(b) for b in blocks] == [b"a1", b"b22"]
    assert (conn.lost_refs, handle.get_blocks_packed.calls) == (1, 1)


def test_other_failures_to_map_the_blocks_stay_a_miss(monkeypatch):
    async def broken(segments, read_l3=None):
        raise RuntimeError("object store full")

    monkeypatch.setattr(connector_mod, "resolve_block_refs", broken)
    handle = _Handle([], refs=_inline(b"a", b"b"))
    handle.get_blocks_packed = _Method(lambda *a, **k: None)
    conn = DataPlaneKVConnector(handle, block_size=16)
    assert asyncio.run(conn.load(TENANT, HASHES)) is None
    assert (conn.lost_refs, handle.get_blocks_packed.calls) == (0, 0)


def test_saves_go_by_reference_only_through_a_serve_handle():
    # An in-process stand-in (tests, tools) gets the blocks in the call; a Serve handle
    # gets a reference to one object the connector put (DataPlane.put_block_refs). Calls
    # go straight to replicas by default only over a Serve handle too.
    from ray.serve.handle import DeploymentHandle

    stand_in = DataPlaneKVConnector(_Handle([], refs=None), block_size=16)
    assert (stand_in._puts_by_ref, stand_in._direct.enabled) == (False, False)
    handle = DeploymentHandle.__new__(DeploymentHandle)
    assert (DataPlaneKVConnector(handle, block_size=16)._puts_by_ref, DataPlaneKVConnector(handle, block_size=16)._direct.enabled) == (True, True)
    assert DataPlaneKVConnector(handle, block_size=16, direct_calls=False)._direct.enabled is False


def test_forgotten_bandwidths_are_measured_again():
    conn = DataPlaneKVConnector(None, block_size=16)
    conn.record_fetch(TIER_L3, 262_285, 0.0109)  # a cold one-block read: 24 MB/s
    assert conn.bandwidth_bytes_per_s(TIER_L3) < 30e6
    conn.forget_bandwidth()
    assert conn.bandwidth_bytes_per_s(TIER_L3) is None and conn.bandwidth_bytes_per_s(TIER_L2) is None
    conn.record_fetch(TIER_L3, 22_294_260, 0.0173)
    assert conn.bandwidth_bytes_per_s(TIER_L3) > 1e9


class _ServeLikeHandle(_Handle):
    app_name = "app"
    deployment_name = "DataPlane"


def _actor(answer):
    """A replica's actor stand-in: ``handle_request`` answers ``answer`` (called if
    callable; an exception is raised when awaited), and ``got`` records the metadata and
    arguments of each call."""
    import pickle
    from types import SimpleNamespace

    got = []

    def handle_request(metadata, *args, **kwargs):
        got.append((pickle.loads(metadata), args, kwargs))
        return answer() if callable(answer) else answer

    return SimpleNamespace(handle_request=_Method(handle_request), got=got)


def _owner(monkeypatch, actor, seen: list):
    def owner_actor(app, deployment, shard_key):
        seen.append((app, deployment, shard_key))
        return actor

    from deployments.dataplane import routing

    monkeypatch.setattr(routing, "owner_actor", owner_actor)


def test_calls_go_straight_to_the_owner_replica_when_its_actor_is_known(monkeypatch):
    actor, seen = _actor(_inline(b"a", b"b")), []
    _owner(monkeypatch, actor, seen)
    handle = _ServeLikeHandle([], refs=_inline(b"x", b"y"))
    conn = DataPlaneKVConnector(handle, block_size=16, direct_calls=True)
    assert [bytes(b) for b in asyncio.run(conn.load(TENANT, HASHES))] == [b"a", b"b"]
    assert handle.get_block_refs.calls == 0
    assert seen == [("app", "DataPlane", HASHES[0])]
    metadata, args, kwargs = actor.got[0]
    assert (metadata.call_method, metadata.app_name, args) == ("get_block_refs", "app", (TENANT, HASHES))
    assert kwargs["shard_key"] == HASHES[0]
    assert conn.direct_calls == {"calls": 1, "fallbacks": 0}


def test_a_replica_that_died_under_a_direct_call_leaves_the_call_to_serve(monkeypatch):
    import ray

    actor, seen = _actor(lambda: ray.exceptions.ActorDiedError()), []
    _owner(monkeypatch, actor, seen)
    handle = _ServeLikeHandle([], refs=_inline(b"x", b"y"))
    conn = DataPlaneKVConnector(handle, block_size=16, direct_calls=True)
    assert [bytes(b) for b in asyncio.run(conn.load(TENANT, HASHES))] == [b"x", b"y"]
    assert handle.get_block_refs.calls == 1
    assert conn.direct_calls == {"calls": 0, "fallbacks": 1}


def test_a_direct_calls_own_error_is_the_calls_not_served_again(monkeypatch):
    # The replica raised (bad arguments, its own failure): Serve would get the same, so the
    # load is a miss and nothing is sent twice.
    actor, seen = _actor(ValueError("bad hashes")), []
    _owner(monkeypatch, actor, seen)
    handle = _ServeLikeHandle([], refs=_inline(b"x", b"y"))
    conn = DataPlaneKVConnector(handle, block_size=16, direct_calls=True)
    assert asyncio.run(conn.load(TENANT, HASHES)) is None
    assert handle.get_block_refs.calls == 0 and conn.direct_calls == {"calls": 0, "fallbacks": 0}


def test_without_the_owners_actor_or_with_direct_calls_off_calls_go_through_serve(monkeypatch):
    actor, seen = _actor(_inline(b"a", b"b")), []
    _owner(monkeypatch, None, seen)
    handle = _ServeLikeHandle([], refs=_inline(b"x", b"y"))
    assert [bytes(b) for b in asyncio.run(DataPlaneKVConnector(handle, block_size=16, direct_calls=True).load(TENANT, HASHES))] == [b"x", b"y"]
    _owner(monkeypatch, actor, seen)
    off = DataPlaneKVConnector(handle, block_size=16, direct_calls=False)
    assert [bytes(b) for b in asyncio.run(off.load(TENANT, HASHES))] == [b"x", b"y"]
    assert handle.get_block_refs.calls == 2 and actor.got == []


def test_a_serve_without_the_entry_point_turns_direct_calls_off(monkeypatch):
    actor, seen = _actor(_inline(b"a", b"b")), []
    del actor.handle_request
    _owner(monkeypatch, actor, seen)
    handle = _ServeLikeHandle([], refs=_inline(b"x", b"y"))
    conn = DataPlaneKVConnector(handle, block_size=16, direct_calls=True)
    for _ in range(2):
        assert [bytes(b) for b in asyncio.run(conn.load(TENANT, HASHES))] == [b"x", b"y"]
    assert conn._direct.enabled is False and len(seen) == 1 and handle.get_block_refs.calls == 2
