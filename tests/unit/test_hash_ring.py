"""The consistent-hash ring that shards data-plane keys over replicas."""

import subprocess
import sys

import pytest

from deployments.dataplane.routing import HashRing

KEYS = [f"key-{i}" for i in range(20_000)]


def owners(ring: HashRing) -> dict[str, str]:
    return {k: ring.owner(k) for k in KEYS}


def test_empty_ring_has_no_owner():
    assert HashRing().owner("x") is None
    assert HashRing().owners("x", 3) == []


def test_keys_spread_over_nodes():
    ring = HashRing([f"replica-{i}" for i in range(4)])
    counts: dict[str, int] = {}
    for k, n in owners(ring).items():
        counts[n] = counts.get(n, 0) + 1
    assert set(counts) == {f"replica-{i}" for i in range(4)}
    for n in counts.values():  # 5000 each ideally; virtual nodes keep it close
        assert 3500 < n < 6500, counts


def test_adding_a_node_moves_about_one_nth_of_keys_all_to_it():
    ring = HashRing([f"replica-{i}" for i in range(4)])
    before = owners(ring)
    ring.add("replica-4")
    after = owners(ring)
    moved = [k for k in KEYS if before[k] != after[k]]
    assert all(after[k] == "replica-4" for k in moved)
    assert 0.12 < len(moved) / len(KEYS) < 0.28  # ideal 1/5


def test_removing_a_node_moves_only_its_keys():
    ring = HashRing([f"replica-{i}" for i in range(5)])
    before = owners(ring)
    ring.remove("replica-2")
    after = owners(ring)
    moved = [k for k in KEYS if before[k] != after[k]]
    assert set(moved) == {k for k in KEYS if before[k] == "replica-2"}
    assert 0.12 < len(moved) / len(KEYS) < 0.28


def test_owners_are_distinct_and_start_with_owner():
    ring = HashRing(["a", "b", "c"])
    for k in KEYS[:200]:
        ranked = ring.owners(k, 5)
        assert ranked[0] == ring.owner(k)
        assert sorted(ranked) == ["a", "b", "c"]


def test_same_owners_in_another_process_and_any_insertion_order():
    nodes = ["r-x", "r-y", "r-z"]
    here = [HashRing(nodes).owner(k) for k in KEYS[:50]]
    assert here == [HashRing(reversed(nodes)).owner(k) for k in KEYS[:50]]
    code = (
        "from deployments.dataplane.routing import HashRing;"
        f"r=HashRing({nodes!r});print(','.join(r.owner(f'key-{{i}}') for i in range(50)))"
    )
    # A fresh interpreter has another PYTHONHASHSEED: positions must not depend on it.
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True,
        env={"PYTHONHASHSEED": "12345", "PATH": ""}, cwd=".",
    ).stdout.strip()
    assert out.split(",") == here


def _choose(ring: HashRing, candidates: list[str], **kwargs) -> list[list[str]]:
    """KeyAffinityRequestRouter's choice over replicas named ``candidates`` (its ranking
    logic alone: the router's state is only its ring)."""
    import asyncio
    from types import SimpleNamespace

    from deployments.dataplane.routing import KeyAffinityRequestRouter

    router = SimpleNamespace(_ring=ring)
    replicas = [SimpleNamespace(replica_id=name) for name in candidates]
    ranked = asyncio.run(
        KeyAffinityRequestRouter.choose_replicas(router, replicas, SimpleNamespace(kwargs=kwargs))
    )
    return [[r.replica_id for r in rank] for rank in ranked]


def test_a_key_goes_to_its_owner_then_the_next_ones():
    ring = HashRing(["a", "b", "c"])
    key = next(k for k in (f"s{i}" for i in range(1000)) if ring.owner(k) == "a")
    assert _choose(ring, ["a", "b", "c"], shard_key=key) == [[n] for n in ring.owners(key, 3)]


def test_an_excluded_replica_takes_no_call_and_its_keys_go_to_their_next_owner():
    """What a stopping data-plane replica's hand-over relies on (DataPlane.drain): never
    back to itself, and to the replica that owns the key once it is gone."""
    ring = HashRing(["a", "b", "c"])
    key = next(k for k in (f"s{i}" for i in range(1000)) if ring.owner(k) == "a")
    ranked = _choose(ring, ["a", "b", "c"], shard_key=key, exclude_replica="a")
    assert ranked == [[n] for n in ring.owners(key, 3)[1:]]
    assert ranked[0] == [HashRing(["b", "c"]).owner(key)]
    assert _choose(ring, ["a", "b", "c"], exclude_replica="a") == [["b", "c"]]
    assert _choose(ring, ["a"], shard_key=key, exclude_replica="a") == []


def test_a_replicas_actor_name_from_a_siblings():
    from deployments.dataplane.routing import replica_actor_name

    assert replica_actor_name("SERVE_REPLICA::llm#DataPlane#ab12cd", "zz99") == "SERVE_REPLICA::llm#DataPlane#zz99"
    assert replica_actor_name("SERVE_REPLICA::DataPlane#ab12cd", "zz99") == "SERVE_REPLICA::DataPlane#zz99"
    for sibling, replica in (("no-hash", "zz99"), ("SERVE_REPLICA::llm#DataPlane#ab", ""), ("SERVE_REPLICA::a#b#c", "x#y")):
        with pytest.raises(ValueError):
            replica_actor_name(sibling, replica)


def test_the_replicas_a_router_got_name_each_keys_owner_actor(monkeypatch):
    """What direct data-plane calls use (DataPlaneKVConnector._call): the owner on the
    same ring as the router's choice, with the actor Serve keeps for it; nothing before
    the router got replicas, nor when one has no actor handle."""
    from types import SimpleNamespace

    from deployments.dataplane import routing

    monkeypatch.setattr(routing, "_running", {})
    # The router's own update_replicas; Serve's bookkeeping in its base left out.
    monkeypatch.setattr(routing.RequestRouter, "update_replicas", lambda self, replicas: None)
    router = routing.KeyAffinityRequestRouter.__new__(routing.KeyAffinityRequestRouter)
    router._deployment_id = SimpleNamespace(app_name="app", name="DataPlane")
    router.initialize_state(vnodes=64)
    replicas = [SimpleNamespace(replica_id=SimpleNamespace(unique_id=n), _actor_handle=f"actor-{n}") for n in "abc"]
    update = router.update_replicas
    assert routing.owner_actor("app", "DataPlane", "k") is None
    update(replicas)
    ring = HashRing("abc", vnodes=64)
    for key in KEYS[:50]:
        assert routing.owner_actor("app", "DataPlane", key) == f"actor-{ring.owner(key)}"
        assert _choose(ring, list("abc"), shard_key=key)[0] == [ring.owner(key)]
    assert routing.owner_actor("other-app", "DataPlane", KEYS[0]) is None
    # A replica gone: its keys' owners are the next ones, as the router's.
    update(replicas[1:])
    assert {routing.owner_actor("app", "DataPlane", k) for k in KEYS[:50]} == {"actor-b", "actor-c"}
    replicas[1]._actor_handle = None
    update(replicas[1:])
    assert routing.owner_actor("app", "DataPlane", KEYS[0]) is None
