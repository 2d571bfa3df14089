"""Placement policy: power-of-two-choices on queue length, batch affinity, load tracking."""

import random

from deployments.router.placement import BatchAffinity, WorkerLoadTracker, choose_pair


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
