"""Exact-state tests of the L2 memory tier: eviction order, watermarks, dirty hand-back."""

import pytest

from deployments.dataplane.tiers import Evicted, MemoryTier


def make_tier(policy="lru", capacity=100, high=0.8, low=0.5):
    return MemoryTier(capacity, high_watermark=high, low_watermark=low, policy=policy)


def val(n: int, fill: bytes = b"x") -> bytes:
    return fill * n


def test_put_get_peek_delete_and_sizes():
    t = make_tier()
    assert t.put("a", val(10)) == []
    assert "a" in t and "b" not in t
    assert t.used_bytes == 10
    assert t.get("a") == val(10)
    assert t.peek("a") == val(10)
    assert t.get("b") is None
    t.put("a", val(20))  # replace: usage follows the new size
    assert t.used_bytes == 20 and len(t) == 1
    assert t.delete("a") == val(20)
    assert t.used_bytes == 0 and "a" not in t
    assert t.delete("a") is None


def test_lru_evicts_least_recent_down_to_low_watermark():
    t = make_tier("lru")  # high 80 bytes, low 50 bytes
    for k in "abcd":
        assert t.put(k, val(20)) == []  # 80 bytes: at, not past, the high mark
    t.get("a")  # recency now b, c, d, a
    evicted = t.put("e", val(20))  # 100 > 80: evict down to <= 50
    assert [e.key for e in evicted] == ["b", "c", "d"]
    assert t.keys() == ["a", "e"]
    assert t.used_bytes == 40
    assert t.num_evictions == 3


def test_peek_does_not_count_as_use():
    t = make_tier("lru")
    for k in "abcd":
        t.put(k, val(20))
    t.peek("a")
    evicted = t.put("e", val(20))
    assert [e.key for e in evicted] == ["a", "b", "c"]


def test_lfu_evicts_least_frequent_ties_by_recency():
    t = make_tier("lfu")
    for k in "abcd":
        t.put(k, val(20))  # each used once
    t.get("a")
    t.get("a")  # a: 3 uses
    t.get("c")  # c: 2 uses
    t.get("b")  # b: 2 uses, used after c
    # Order to evict: d (1 use), then c before b (same count, c less recent), then a.
    evicted = t.put("e", val(20))  # e: 1 use, the newest: evicted after d
    assert [e.key for e in evicted] == ["d", "e", "c"]
    assert sorted(t.keys()) == ["a", "b"]
    assert t.used_bytes == 40


def test_lru_and_lfu_differ_on_same_history():
    history = ["a", "a", "a", "b", "c", "d"]
    results = {}
    for policy in ("lru", "lfu"):
        t = make_tier(policy, capacity=100, high=0.8, low=0.6)
        for k in "abcd":
            t.put(k, val(20))
        for k in history:
            t.get(k)
        results[policy] = [e.key for e in t.put("e", val(20))]
    assert results["lru"] == ["a", "b"]  # a was used long ago
    assert results["lfu"] == ["e", "b"]  # a is hot; e and the rest were used once or twice


def test_dirty_evictions_are_handed_back_with_their_values():
    t = make_tier("lru")
    t.put("a", val(30, b"A"), dirty=True)
    t.put("b", val(30, b"B"))
    assert t.dirty == {"a"}
    evicted = t.put("c", val(30, b"C"), dirty=True)
    assert evicted == [Evicted("a", val(30, b"A"), True), Evicted("b", val(30, b"B"), False)]
    assert t.dirty == {"c"}


def test_mark_clean_only_for_the_written_value():
    t = make_tier()
    first = val(10, b"1")
    t.put("a", first, dirty=True)
    items = t.dirty_items()
    assert items == [("a", first)]
    stored = items[0][1]
    t.put("a", val(10, b"2"), dirty=True)  # a newer write arrives while the first is in flight
    t.mark_clean("a", stored)
    assert t.dirty == {"a"} and t.num_dirty == 1  # the newer value still has to be written
    t.mark_clean("a", t.peek("a"))
    assert t.dirty == frozenset() and t.num_dirty == 0


def test_pinned_entries_are_never_evicted():
    t = make_tier("lru")
    t.put("a", val(30), pinned=True)
    t.put("b", val(30))
    evicted = t.put("c", val(30))
    assert [e.key for e in evicted] == ["b", "c"]  # skipping pinned a until below 50
    assert "a" in t
    t.pin("a", False)
    evicted = t.put("d", val(60))  # 90 > 80: a (unpinned now, oldest), then d itself
    assert [e.key for e in evicted] == ["a", "d"]


def test_value_larger_than_tier_is_returned_not_stored():
    t = make_tier()
    evicted = t.put("big", val(90), dirty=True)
    assert evicted == [Evicted("big", val(90), True)]
    assert "big" not in t and t.used_bytes == 0 and t.dirty == frozenset()


def test_clear_returns_everything_with_dirty_flags():
    t = make_tier()
    t.put("a", val(10), dirty=True)
    t.put("b", val(10))
    out = t.clear()
    assert {(e.key, e.dirty) for e in out} == {("a", True), ("b", False)}
    assert len(t) == 0 and t.used_bytes == 0 and t.dirty == frozenset()


def test_delete_clears_dirty():
    t = make_tier()
    t.put("a", val(10), dirty=True)
    t.delete("a")
    assert t.dirty == frozenset()


@pytest.mark.parametrize(
    "kwargs",
    [
        {"capacity_bytes": 0},
        {"capacity_bytes": 100, "high_watermark": 0.5, "low_watermark": 0.5},
        {"capacity_bytes": 100, "policy": "fifo"},
    ],
)
def test_bad_arguments_are_rejected(kwargs):
    with pytest.raises(ValueError):
        MemoryTier(**kwargs)


# ---------------------------------------------------------------- shared buffers


def views_of(buffer: bytes, size: int) -> list[memoryview]:
    mv = memoryview(buffer)
    return [mv[i : i + size] for i in range(0, len(buffer), size)]


def test_read_only_views_are_stored_without_a_copy_and_held_memory_is_counted():
    t = make_tier(capacity=1000)
    buffer = bytes(range(40))
    views = views_of(buffer, 10)
    for i, v in enumerate(views):
        t.put(f"k{i}", v)
    assert t.get("k2") is views[2]  # the very view: no copy
    assert t.used_bytes == 40 and t.held_bytes == 40
    t.delete("k0")  # 30 of 40 bytes live: the buffer stays shared
    assert t.used_bytes == 30 and t.held_bytes == 40 and t.num_compactions == 0
    assert t.get("k1") is views[1]


def test_mostly_dead_buffer_is_copied_out_once():
    t = make_tier(capacity=1000)
    buffer = bytes(range(40))
    for i, v in enumerate(views_of(buffer, 10)):
        t.put(f"k{i}", v, dirty=(i == 3))
    t.delete("k0")
    t.delete("k1")  # 20 of 40 live: not below half yet
    assert t.num_compactions == 0
    t.delete("k2")  # 10 of 40 live: the last view is copied out, the buffer let go
    assert t.num_compactions == 1
    value = t.get("k3")
    assert type(value) is bytes and value == buffer[30:40]
    assert t.held_bytes == t.used_bytes == 10
    assert t.dirty == frozenset({"k3"})  # still to be written behind


def test_eviction_releases_shared_buffers():
    t = make_tier(capacity=100, high=0.8, low=0.5)
    first = views_of(bytes(40), 10)
    for i, v in enumerate(first):
        t.put(f"a{i}", v)
    for i, v in enumerate(views_of(bytes(range(50)), 10)):
        t.put(f"b{i}", v)  # 90 > 80: evict the a-views (LRU) down to <= 50
    assert t.used_bytes == 50 and t.keys() == [f"b{i}" for i in range(5)]
    assert t.held_bytes == 50  # nothing of the first buffer is held


def test_writable_buffers_are_copied():
    t = make_tier()
    data = bytearray(b"abc")
    t.put("a", data)
    t.put("b", memoryview(data))
    data[0] = ord("X")
    assert t.get("a") == b"abc" and t.get("b") == b"abc"
    assert type(t.get("a")) is bytes and type(t.get("b")) is bytes


def test_replacing_a_view_releases_it():
    t = make_tier(capacity=1000)
    views = views_of(bytes(20), 10)
    t.put("a", views[0])
    t.put("b", views[1])
    t.put("a", b"new value!")  # a's view is released: 10 of 20 live, not below half
    assert t.num_compactions == 0 and t.held_bytes == 30
    t.put("b", b"other one!")  # the buffer has no view left
    assert t.held_bytes == t.used_bytes == 20


class Group:
    """A named group of separate values (as the data plane's object-store copies are)."""

    def __init__(self, values):
        self.values = values
        self.nbytes = sum(len(v) for v in values)


def test_values_of_a_named_group_are_accounted_as_one_buffer():
    t = make_tier(capacity=1000)
    parts = [memoryview(bytes([i]) * 10).toreadonly() for i in range(4)]
    group = Group(parts)
    for i, v in enumerate(parts):
        t.put(f"k{i}", v, dirty=(i == 3), group=group)
    assert t.get("k2") is parts[2] and t.group_of("k2") is group
    assert t.group_of("nope") is None
    assert t.used_bytes == 40 and t.held_bytes == 40
    t.delete("k0")
    t.delete("k1")  # 20 of 40 live: the group stays
    assert t.num_compactions == 0 and t.held_bytes == 40 and t.group_of("k3") is group
    t.delete("k2")  # 10 of 40 live: copied out of the group, which is let go
    assert t.num_compactions == 1 and t.group_of("k3") is None
    assert type(t.get("k3")) is bytes and t.get("k3") == bytes([3]) * 10
    assert t.held_bytes == t.used_bytes == 10 and t.dirty == frozenset({"k3"})


def test_evictions_and_clear_hand_back_the_group():
    t = make_tier(capacity=100, high=0.8, low=0.7)
    parts = [memoryview(bytes(10)).toreadonly() for _ in range(4)]
    group = Group(parts)
    for i, v in enumerate(parts):
        t.put(f"a{i}", v, dirty=True, group=group)
    evicted = t.put("big", bytes(45))  # 85 > 80: down to <= 70, LRU first
    assert [e.key for e in evicted] == ["a0", "a1"]
    assert all(e.group is group and e.dirty and e.value is parts[i] for i, e in enumerate(evicted))
    (a2,) = [e for e in t.clear() if e.key == "a2"]
    assert a2.group is group and a2.value is parts[2]  # to be put back as it was
