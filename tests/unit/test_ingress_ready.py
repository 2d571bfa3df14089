"""What /ready says of the data plane, from every replica's ``DataPlane.status``
(``app.ingress.dataplane_readiness``; the whole app: tests/integration/test_redis_outage.py)."""

from __future__ import annotations

from app.ingress import dataplane_readiness

OK = {"degraded": False, "degraded_servers": [], "refusing_writes": []}
DOWN = {"degraded": True, "degraded_servers": ["kv", "sessions"], "refusing_writes": []}
KV_DOWN = {"degraded": True, "degraded_servers": ["kv"], "refusing_writes": []}
FULL = {"degraded": False, "degraded_servers": [], "refusing_writes": ["sessions"]}


def counts(ok=0, degraded=0, refusing=0, unanswered=0) -> dict:
    return {"degraded": degraded, "refusing_writes": refusing, "ok": ok, "unanswered": unanswered}


def test_every_replica_ok_is_ok():
    assert dataplane_readiness([OK, OK]) == {"dataplane": "ok", "dataplane_replicas": counts(ok=2)}


def test_one_replica_still_reconnecting_keeps_the_pool_degraded():
    # The order of the answers does not matter: the worst replica's state is the pool's.
    for answers in ([OK, KV_DOWN], [KV_DOWN, OK]):
        assert dataplane_readiness(answers) == {
            "dataplane": "degraded", "dataplane_degraded": ["kv"], "dataplane_replicas": counts(ok=1, degraded=1),
        }


def test_degraded_outranks_refusing_and_the_roles_are_the_union():
    assert dataplane_readiness([FULL, DOWN, KV_DOWN]) == {
        "dataplane": "degraded",
        "dataplane_degraded": ["kv", "sessions"],
        "dataplane_refusing_writes": ["sessions"],
        "dataplane_replicas": counts(degraded=2, refusing=1),
    }


def test_refusing_writes_on_one_replica_is_the_pools_state():
    assert dataplane_readiness([OK, FULL]) == {
        "dataplane": "refusing_writes", "dataplane_refusing_writes": ["sessions"],
        "dataplane_replicas": counts(ok=1, refusing=1),
    }


def test_a_replica_that_did_not_answer_is_counted_not_taken_for_ok():
    assert dataplane_readiness([OK, TimeoutError()]) == {
        "dataplane": "ok", "dataplane_replicas": counts(ok=1, unanswered=1),
    }
    assert dataplane_readiness([RuntimeError("gone")]) == {
        "dataplane": "unavailable", "dataplane_replicas": counts(unanswered=1),
    }
    assert dataplane_readiness([]) == {"dataplane": "unavailable", "dataplane_replicas": counts()}
