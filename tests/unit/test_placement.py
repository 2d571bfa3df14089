"""Placement policy (pure logic): power of two choices, batch affinity, load tracking,
consistent hashing with bounded loads, the prefix index and scoring, the decision, and the
circuit breaker with an injected clock."""

import math
import random

import pytest

from deployments.compute.engines.kv import block_hashes
from deployments.router.placement import (
    CLOSED,
    HALF_OPEN,
    OPEN,
    REASON_AFFINITY,
    REASON_P2C,
    REASON_PREFIX,
    BatchAffinity,
    BoundedLoadRing,
    BreakerBoard,
    CircuitBreaker,
    PrefixIndex,
    WorkerLoadTracker,
    best_prefix,
    block_key,
    choose_pair,
    classify_outcome,
    decide,
    leading_hits,
    pack_keys,
    unpack_keys,
)


def test_choose_pair_puts_shorter_queue_first():
    queues = {"a": 5, "b": 1, "c": 3, "d": 9}
    rng = random.Random(0)
    for _ in range(200):
        pair = choose_pair(list(queues), queues.__getitem__, rng)
        assert len(pair) == 2 and pair[0] != pair[1]
        assert queues[pair[0]] <= queues[pair[1]]


def test_choose_pair_samples_every_replica():
    rng = random.Random(1)
    seen = set()
    for _ in range(200):
        seen.update(choose_pair(["a", "b", "c", "d"], lambda r: 0, rng))
    assert seen == {"a", "b", "c", "d"}


def test_choose_pair_spreads_ties_with_two_replicas():
    rng = random.Random(2)
    firsts = [choose_pair(["a", "b"], lambda r: 0, rng)[0] for _ in range(400)]
    assert 120 < firsts.count("a") < 280


def test_choose_pair_single_replica():
    assert choose_pair(["only"], lambda r: 3, random.Random()) == ["only"]


def test_never_picks_the_longest_queue_first_among_many():
    # With P2C the longest of 4 queues is never ranked first.
    queues = {"a": 0, "b": 1, "c": 2, "d": 100}
    rng = random.Random(3)
    assert all(choose_pair(list(queues), queues.__getitem__, rng)[0] != "d" for _ in range(300))


def test_batch_affinity_expires_and_is_bounded():
    now = [0.0]
    aff = BatchAffinity(ttl_s=1.0, max_entries=2, clock=lambda: now[0])
    aff.put("b1", "r1")
    assert aff.get("b1") == "r1"
    now[0] = 2.0
    assert aff.get("b1") is None
    aff.put("b2", "r2")
    aff.put("b3", "r3")
    aff.put("b4", "r4")
    assert aff.get("b2") is None and aff.get("b4") == "r4"


def test_tracker_counts_inflight_and_forgets_removed_replicas():
    t = WorkerLoadTracker()
    assert t.num_replicas == 0
    t.set_replicas(["r1", "r2"])
    t.routed("r1")
    t.routed("r1")
    t.completed("r1")
    assert t.inflight("r1") == 1 and t.inflight("r2") == 0
    t.completed("r2")  # never below zero
    assert t.inflight("r2") == 0
    t.set_replicas(["r2"])
    assert t.num_replicas == 1 and t.inflight("r1") == 0


# ---------------------------------------------------------------- bounded-load ring

NODES = ["a", "b", "c"]


def _ring(load_factor=1.25):
    ring = BoundedLoadRing(load_factor)
    ring.set_nodes(NODES)
    return ring


def test_capacity_formula():
    ring = _ring(1.25)
    assert ring.capacity({"a": 2, "b": 1, "c": 0}) == math.ceil(1.25 * 4 / 3) == 2
    assert ring.capacity({"a": 3, "b": 3, "c": 0}) == 3  # ceil(1.25 * 7 / 3) = ceil(2.92)
    assert ring.capacity({}) == 0


def test_owners_are_a_fixed_permutation_per_key():
    ring = _ring()
    order = ring.owners("session-1", NODES)
    assert sorted(order) == NODES
    # The same in another instance built in another order (another process).
    other = BoundedLoadRing(1.25)
    other.set_nodes(list(reversed(NODES)))
    assert other.owners("session-1", NODES) == order
    # Ineligible replicas are skipped, the order of the rest is kept.
    assert ring.owners("session-1", order[1:]) == order[1:]


def test_assign_exact_walk_over_the_bound():
    ring = _ring(1.25)
    x, y, z = ring.owners("s-42", NODES)
    # Idle: the home.
    assert ring.assign("s-42", {x: 0, y: 0, z: 0}) == (x, 0)
    # Home at 3, others idle: cap = ceil(1.25 * 4 / 3) = 2, home would be at 4 -> next.
    assert ring.assign("s-42", {x: 3, y: 0, z: 0}) == (y, 1)
    # Home 3, next 2: cap = ceil(1.25 * 6 / 3) = 3; next would be at 3 <= 3 -> next.
    assert ring.assign("s-42", {x: 3, y: 2, z: 0}) == (y, 1)
    # Home 3, next 3: cap = ceil(1.25 * 7 / 3) = 3; both would be at 4 -> the third.
    assert ring.assign("s-42", {x: 3, y: 3, z: 0}) == (z, 2)
    # Home 2, others 1: cap = ceil(1.25 * 5 / 3) = 3, home would be at 3 -> home.
    assert ring.assign("s-42", {x: 2, y: 1, z: 1}) == (x, 0)
    assert ring.assign("s-42", {}) is None


def test_assign_replica_unknown_to_the_ring_still_gets_requests():
    ring = _ring()
    # "d" was reported by Serve before the ring was updated: last in order, but usable.
    loads = {"a": 9, "b": 9, "c": 9, "d": 0}
    assert ring.owners("k", loads)[-1] == "d"
    assert ring.assign("k", loads) == ("d", 3)


def test_sequential_assignment_never_exceeds_the_bound():
    ring = _ring(1.25)
    loads = {n: 0 for n in NODES}
    for i in range(300):
        node, _ = ring.assign(f"session-{i}", loads)
        loads[node] += 1
        assert max(loads.values()) <= math.ceil(1.25 * sum(loads.values()) / len(NODES))


def test_homes_spread_and_move_little_when_a_replica_joins():
    ring = _ring()
    idle = {n: 0 for n in NODES}
    homes = {f"s{i}": ring.assign(f"s{i}", idle)[0] for i in range(900)}
    counts = {n: list(homes.values()).count(n) for n in NODES}
    assert min(counts.values()) > 200, counts
    ring.set_nodes(NODES + ["d"])
    idle4 = {n: 0 for n in NODES + ["d"]}
    moved = [k for k, home in homes.items() if ring.assign(k, idle4)[0] != home]
    # Only keys that now belong to the new replica move.
    assert all(ring.assign(k, idle4)[0] == "d" for k in moved)
    assert 100 < len(moved) < 400


def test_load_factor_below_one_is_refused():
    with pytest.raises(ValueError):
        BoundedLoadRing(0.9)


# ---------------------------------------------------------------- prefix index

TOKENS = list(range(100, 100 + 16 * 6 + 3))  # 6 full blocks of 16 and a tail


def _keys(tokens=TOKENS, tenant="t"):
    return [block_key(h) for h in block_hashes("m", tenant, tokens, 16)]


def test_block_keys_are_the_chained_hash_prefixes():
    keys = _keys()
    assert len(keys) == 6 and all(len(k) == 8 for k in keys)
    assert keys[0] == bytes.fromhex(block_hashes("m", "t", TOKENS, 16)[0][:16])
    # Another tenant never shares a key.
    assert not set(keys) & set(_keys(tenant="other"))
    assert unpack_keys(pack_keys(keys)) == frozenset(keys)
    with pytest.raises(ValueError):
        unpack_keys(b"123")


def test_leading_hits_stop_at_the_first_missing_block():
    keys = _keys()
    held = {keys[0], keys[1], keys[3]}
    assert leading_hits(keys, held.__contains__) == 2
    assert leading_hits(keys, lambda k: True) == 6
    assert leading_hits([], lambda k: True) == 0


def test_index_uses_reports_and_remembered_placements():
    now = [0.0]
    index = PrefixIndex(memory_s=10.0, clock=lambda: now[0])
    keys = _keys()
    index.set_reported("a", pack_keys(keys[:3]))
    assert index.hits(keys, ["a", "b"]) == {"a": 3, "b": 0}
    # This process sent the whole prompt to b: b holds 6 until the memory expires.
    index.remember(keys, "b")
    assert index.hits(keys, ["a", "b"]) == {"a": 3, "b": 6}
    now[0] = 10.5
    assert index.hits(keys, ["a", "b"]) == {"a": 3, "b": 0}
    # Reports and memory combine per block.
    index.remember(keys[3:5], "a")
    assert index.hits(keys, ["a"]) == {"a": 5}
    # A new report replaces the old one; an empty one removes it; a malformed one is ignored.
    index.set_reported("a", pack_keys(keys[:1]))
    assert index.hits(keys[:3], ["a"]) == {"a": 1}
    index.set_reported("a", b"bad")
    assert index.hits(keys[:3], ["a"]) == {"a": 1}
    index.set_reported("a", None)
    assert index.hits(keys[:3], ["a"]) == {"a": 0}


def test_index_memory_is_bounded_and_forgets_removed_replicas():
    index = PrefixIndex(memory_s=100.0, max_remembered=4)
    keys = _keys()
    index.remember(keys, "a")  # 6 keys, the 2 oldest dropped
    assert index.hits(keys, ["a"]) == {"a": 0}
    assert index.hits(keys[2:], ["a"]) == {"a": 4}
    index.set_reported("b", pack_keys(keys))
    index.forget_replicas_except(["a"])
    assert index.hits(keys, ["b"]) == {"b": 0}


def test_prefix_score_balances_hits_against_queue():
    # score = hit_blocks * block_size - weight * queue_len
    hits = {"a": 4, "b": 1}
    queue = {"a": 3, "b": 0}
    # a: 64 - 48 = 16, b: 16 - 0 = 16: a tie goes to more blocks.
    assert best_prefix(hits, queue, 16, 16.0) == ("a", 16.0)
    # a: 64 - 96 = -32, b: 16.
    assert best_prefix(hits, queue, 16, 32.0) == ("b", 16.0)
    # The best score holds nothing (a's queue is too long): no prefix decision.
    assert best_prefix({"a": 1}, {"a": 10, "b": 0}, 16, 64.0) is None
    assert best_prefix({}, {"a": 0, "b": 0}, 16, 64.0) is None


# ---------------------------------------------------------------- the decision


def test_decide_session_goes_home_then_spills_over_the_bound():
    ring = _ring(1.25)
    x, y, z = ring.owners("sess", NODES)
    d = decide({x: 0, y: 0, z: 0}, ring=ring, rng=random.Random(0), session_id="sess")
    assert (d.order[0], d.reason, d.ring_rank) == (x, REASON_AFFINITY, 0)
    assert sorted(d.order) == sorted(NODES)
    d = decide({x: 3, y: 0, z: 0}, ring=ring, rng=random.Random(0), session_id="sess")
    assert (d.order[0], d.reason, d.ring_rank) == (y, REASON_AFFINITY, 1)


def test_decide_session_prefers_a_replica_holding_more_of_its_prefix_within_the_bound():
    ring = _ring(1.25)
    x, y, z = ring.owners("sess", NODES)
    d = decide({x: 0, y: 0, z: 0}, ring=ring, rng=random.Random(0), session_id="sess", hit_blocks={y: 3})
    assert (d.order[0], d.reason, d.hit_blocks) == (y, REASON_PREFIX, 3)
    # Equal hits: the home wins.
    d = decide({x: 0, y: 0, z: 0}, ring=ring, rng=random.Random(0), session_id="sess", hit_blocks={x: 3, y: 3})
    assert (d.order[0], d.reason) == (x, REASON_AFFINITY)
    # The holder is over the bound (cap = ceil(1.25 * 5 / 3) = 3, y would be at 5): home.
    d = decide({x: 0, y: 4, z: 0}, ring=ring, rng=random.Random(0), session_id="sess", hit_blocks={y: 3})
    assert (d.order[0], d.reason) == (x, REASON_AFFINITY)


def test_decide_without_session_uses_prefix_then_p2c():
    ring = _ring()
    queue = {"a": 1, "b": 0, "c": 0}
    d = decide(queue, ring=ring, rng=random.Random(0), hit_blocks={"a": 5}, queue_weight_tokens=16)
    assert (d.order[0], d.reason, d.score) == ("a", REASON_PREFIX, 5 * 16 - 16)
    d = decide(queue, ring=ring, rng=random.Random(0))
    # Any two of the three include an idle one, which P2C ranks first.
    assert d.reason == REASON_P2C and d.order[0] in ("b", "c")
    assert sorted(d.order) == ["a", "b", "c"]


def test_decide_p2c_baseline_ignores_sessions_and_caches():
    ring = _ring()
    rng = random.Random(5)
    firsts = set()
    for _ in range(100):
        d = decide({"a": 0, "b": 0, "c": 0}, ring=ring, rng=rng, session_id="s", hit_blocks={"a": 9}, cache_aware=False)
        assert d.reason == REASON_P2C
        firsts.add(d.order[0])
    assert firsts == {"a", "b", "c"}


# ---------------------------------------------------------------- circuit breaker


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def _breaker(clock, **kw):
    args = {"window_s": 10.0, "min_requests": 5, "error_rate": 0.5, "cooldown_s": 5.0, "half_open_probes": 1, "clock": clock}
    return CircuitBreaker(**{**args, **kw})


def test_breaker_opens_at_the_error_rate_after_min_requests():
    clock = Clock()
    b = _breaker(clock)
    for _ in range(4):
        assert b.record(False) is None  # 4 < min_requests
    assert b.state == CLOSED and b.available()
    assert b.record(False) == OPEN
    assert b.state == OPEN and not b.available()


def test_breaker_error_rate_is_a_fraction_of_the_window():
    clock = Clock()
    b = _breaker(clock)
    for ok in (True, True, True, False, False):  # 2/5 = 0.4
        assert b.record(ok) is None
    assert b.error_fraction() == pytest.approx(0.4)
    assert b.record(False) == OPEN  # 3/6 = 0.5


def test_breaker_forgets_outcomes_older_than_the_window():
    clock = Clock()
    b = _breaker(clock)
    for _ in range(4):
        b.record(False)
    clock.t = 10.5  # those 4 left the window
    for _ in range(4):
        assert b.record(True) is None
    assert b.record(False) is None  # 1/5
    assert b.state == CLOSED


def test_breaker_half_open_probe_closes_or_reopens():
    clock = Clock()
    b = _breaker(clock)
    for _ in range(5):
        b.record(False)
    clock.t = 4.99
    assert b.state == OPEN and not b.available()
    clock.t = 5.0
    assert b.state == HALF_OPEN and b.available()
    b.on_routed()  # the probe
    assert not b.available()  # one probe at a time
    assert b.record(False) == OPEN  # failed probe: another cool-down from now
    clock.t = 9.99
    assert b.state == OPEN
    clock.t = 10.0
    assert b.state == HALF_OPEN
    b.on_routed()
    assert b.record(True) == CLOSED
    assert b.available() and b.error_fraction() == 0.0
    # Closed again with a fresh window: one failure does not reopen it.
    assert b.record(False) is None and b.state == CLOSED


def test_breaker_cancelled_probe_frees_its_slot_and_late_verdicts_are_ignored():
    clock = Clock()
    b = _breaker(clock)
    for _ in range(5):
        b.record(False)
    assert b.record(True) is None  # a request routed before it opened
    assert b.state == OPEN
    clock.t = 5.0
    b.on_routed()
    assert not b.available()
    b.on_cancelled(was_probe=True)
    assert b.available() and b.state == HALF_OPEN


def test_board_filters_replicas_and_reports_changes():
    clock = Clock()
    changes = []
    board = BreakerBoard(lambda: _breaker(clock), lambda r, s: changes.append((r, s)))
    assert board.available(["r1", "r2"]) == ["r1", "r2"]
    for _ in range(5):
        board.record("r1", False)
    assert board.available(["r1", "r2"]) == ["r2"]
    clock.t = 5.0
    assert board.available(["r1", "r2"]) == ["r1", "r2"]
    probe = board.on_routed("r1")
    assert probe and board.available(["r1", "r2"]) == ["r2"]
    board.record("r1", True, was_probe=probe)
    assert board.state("r1") == CLOSED
    assert changes == [("r1", OPEN), ("r1", HALF_OPEN), ("r1", CLOSED)]
    board.record("r2", None)  # a cancelled call: no verdict
    assert board.state("r2") == CLOSED


def test_classify_outcome_of_worker_calls():
    import ray.exceptions as rex
    from ray.exceptions import RayTaskError

    from app.errors import RateLimitError
    from deployments.compute.engines.protocol import (
        EngineDeadError,
        EngineError,
        RequestRejected,
    )

    def wrapped(exc):
        try:
            raise exc
        except BaseException as e:  # noqa: BLE001
            return RayTaskError("generate", "Traceback ...", e).as_instanceof_cause()

    assert classify_outcome(None) is True
    assert classify_outcome(wrapped(RequestRejected("too long", param="prompt"))) is True
    assert classify_outcome(wrapped(RateLimitError("busy"))) is True
    assert classify_outcome(rex.TaskCancelledError()) is None
    assert classify_outcome(wrapped(EngineDeadError("dead"))) is False
    assert classify_outcome(wrapped(EngineError("step failed"))) is False
    assert classify_outcome(rex.ActorDiedError()) is False


def test_outcomes_reach_the_breaker_of_the_replica_the_call_ran_on():
    from deployments.router.placement import OutcomeRegistry

    clock = Clock()
    board = BreakerBoard(lambda: _breaker(clock, min_requests=2))
    outcomes = OutcomeRegistry(max_entries=3)
    outcomes.routed("q1", board, "r1", False)
    outcomes.routed("q2", board, "r1", False)
    assert outcomes.report("q1", False) == "r1"
    assert outcomes.report("q1", False) is None  # reported once
    assert outcomes.report("unknown", False) is None
    assert board.state("r1") == CLOSED
    assert outcomes.report("q2", False) == "r1"
    assert board.state("r1") == OPEN
    # Bounded: the oldest unreported entries go.
    for i in range(5):
        outcomes.routed(f"x{i}", board, "r2", False)
    assert len(outcomes) == 3 and outcomes.report("x0", True) is None


@pytest.mark.parametrize(
    "section,field,value",
    [
        ("placement", "load_factor", 0.5),
        ("placement", "policy", "random"),
        ("circuit_breaker", "error_rate", 0),
        ("circuit_breaker", "min_requests", 0),
    ],
)
def test_placement_config_is_validated(section, field, value):
    from pydantic import ValidationError

    from app.config import AppConfig

    with pytest.raises(ValidationError) as info:
        AppConfig.model_validate({"router": {section: {field: value}}})
    assert f"router.{section}.{field}" in str(info.value).replace("\n", ".")


def test_placement_config_reaches_the_request_router():
    from app.config import AppConfig
    from deployments.router.placement import router_kwargs

    config = AppConfig.model_validate(
        {"model": {"id": "m1"}, "router": {"placement": {"policy": "p2c", "load_factor": 2}}}
    )
    kwargs = router_kwargs(config)
    assert kwargs["policy"] == "p2c" and kwargs["load_factor"] == 2 and kwargs["model_id"] == "m1"
    assert kwargs["block_size"] == config.dataplane.block_size and kwargs["breaker_enabled"] is True
