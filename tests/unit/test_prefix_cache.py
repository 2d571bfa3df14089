"""The torch engine's L1 prefix cache (pure torch, no model): blocks by chained hash,
leading-block lookups, copies in and out, LRU eviction by bytes, and the reported keys."""

import pytest
import torch

from deployments.compute.engines.prefix_cache import PrefixCache
from deployments.router.placement import block_key, unpack_keys

BS = 4
SHAPE = (2, 2, 3, BS, 5)  # layers, k/v, kv heads, block_size, head dim
BLOCK_BYTES = 2 * 2 * 3 * BS * 5 * 4


def span(num_blocks, start=0.0):
    n = 2 * 2 * 3 * num_blocks * BS * 5
    return torch.arange(start, start + n, dtype=torch.float32).reshape(2, 2, 3, num_blocks * BS, 5)


HASHES = [f"{i:02x}" * 16 for i in range(8)]


def test_put_then_get_returns_a_copy_of_the_leading_blocks():
    cache = PrefixCache(1 << 20, BS)
    s = span(3)
    cache.put(HASHES[:3], s)
    assert len(cache) == 3 and cache.num_bytes == 3 * BLOCK_BYTES
    assert cache.longest_prefix(HASHES[:5]) == 3
    out = cache.get(HASHES[:2])
    torch.testing.assert_close(out, s[:, :, :, : 2 * BS])
    out.zero_()  # the caller's tensor is its own
    torch.testing.assert_close(cache.get(HASHES[:2]), s[:, :, :, : 2 * BS])
    s.zero_()  # and so is the cache's
    assert cache.get(HASHES[:1]).abs().sum() > 0


def test_lookup_stops_at_the_first_missing_block():
    cache = PrefixCache(1 << 20, BS)
    cache.put([HASHES[0], HASHES[2]], span(2))
    assert cache.longest_prefix(HASHES) == 1
    assert cache.longest_prefix(HASHES[1:]) == 0
    assert cache.get(HASHES[:2]) is None


def test_lru_eviction_by_bytes_keeps_recently_used_blocks():
    cache = PrefixCache(3 * BLOCK_BYTES, BS)
    cache.put(HASHES[:3], span(3))
    cache.longest_prefix(HASHES[:1])  # block 0 is now the most recently used
    cache.put(HASHES[3:4], span(1, 1000.0))
    assert cache.evictions == 1 and cache.num_bytes == 3 * BLOCK_BYTES
    assert cache.longest_prefix(HASHES[:1]) == 1  # kept
    assert cache.longest_prefix(HASHES[1:2]) == 0  # the least recently used went


def test_put_checks_the_span_and_skips_blocks_it_holds():
    cache = PrefixCache(1 << 20, BS)
    with pytest.raises(ValueError):
        cache.put(HASHES[:2], span(3))
    first = span(2)
    cache.put(HASHES[:2], first)
    cache.put(HASHES[:2], span(2, 500.0))  # the same blocks again: kept as they were
    torch.testing.assert_close(cache.get(HASHES[:2]), first)
    with pytest.raises(ValueError):
        PrefixCache(0, BS)


def test_packed_keys_are_the_placement_keys_of_recent_blocks():
    cache = PrefixCache(1 << 20, BS, max_reported_keys=3)
    assert cache.packed_keys() == b""
    cache.put(HASHES[:5], span(5))
    keys = unpack_keys(cache.packed_keys())
    assert keys == {block_key(h) for h in HASHES[2:5]}
    assert cache.packed_keys() is cache.packed_keys()  # cached until the next change


def test_discard_drops_only_the_blocks_named_and_frees_their_bytes():
    cache = PrefixCache(1 << 20, BS)
    cache.put(HASHES[:4], span(4))
    reported = unpack_keys(cache.packed_keys())
    # A deleted session's blocks: two held, one never held.
    assert cache.discard([HASHES[1], HASHES[3], HASHES[6]]) == 2
    assert len(cache) == 2 and cache.num_bytes == 2 * BLOCK_BYTES
    assert cache.longest_prefix(HASHES[:4]) == 1  # the chain breaks where block 1 was
    assert cache.get(HASHES[1:2]) is None
    torch.testing.assert_close(cache.get(HASHES[:1]), span(4)[:, :, :, :BS])
    # Placement no longer hears of them.
    assert unpack_keys(cache.packed_keys()) == reported - {block_key(HASHES[1]), block_key(HASHES[3])}
    assert cache.discard([HASHES[1]]) == 0
    # The freed bytes are room again: nothing else is evicted to fit two new blocks.
    small = PrefixCache(3 * BLOCK_BYTES, BS)
    small.put(HASHES[:3], span(3))
    small.discard(HASHES[1:3])
    small.put(HASHES[4:6], span(2))
    assert small.longest_prefix(HASHES[:1]) == 1 and small.evictions == 0
