"""KV block codec (torch tensor ⇄ stored bytes) and the fetch-or-recompute decision."""

import struct
import types

import numpy as np
import pytest
import torch

from deployments.compute.engines.kv import PrefillTimeModel, PrefixHit, Rate, should_fetch
from deployments.compute.engines.kv_codec import (
    CorruptBlockError,
    block_shape,
    decode_kv_block,
    decode_kv_blocks,
    encode_kv_block,
    encode_kv_blocks,
)
from deployments.dataplane.blocks import BlockHeader, decode_block, encode_block

SHAPE = (2, 2, 3, 4, 8)  # layers, kv, heads, block_size, head_dim


def rand_block(dtype=torch.float32, shape=SHAPE, seed=0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_round_trip_is_bit_exact(dtype):
    block = rand_block(dtype)
    data = encode_kv_block(block)
    header, _ = decode_block(data)
    assert header.shape == SHAPE and header.layout == "layers,kv,heads,tokens,head_dim"
    out = decode_kv_block(data, dtype=dtype, shape=SHAPE)
    assert out.dtype == dtype and tuple(out.shape) == SHAPE
    assert torch.equal(out.view(torch.uint8 if dtype != torch.float32 else torch.int32),
                       block.view(torch.uint8 if dtype != torch.float32 else torch.int32))


def test_decoded_tensor_owns_writable_memory():
    data = encode_kv_block(rand_block())
    out = decode_kv_block(data, dtype=torch.float32, shape=SHAPE)
    out.add_(1)  # must not fail or touch the bytes
    assert torch.equal(decode_kv_block(data, dtype=torch.float32, shape=SHAPE) + 1, out)


def test_non_contiguous_block_encodes_its_values():
    span = rand_block(shape=(2, 2, 3, 12, 8))
    view = span[:, :, :, 4:8]  # not contiguous
    out = decode_kv_block(encode_kv_block(view), dtype=torch.float32, shape=SHAPE)
    assert torch.equal(out, view)


def test_span_splits_into_blocks_and_back():
    span = rand_block(shape=(2, 2, 3, 12, 8), seed=3)
    blocks = encode_kv_blocks(span, block_size=4)
    assert len(blocks) == 3
    assert torch.equal(decode_kv_block(blocks[1], dtype=torch.float32, shape=SHAPE), span[:, :, :, 4:8])
    assert torch.equal(decode_kv_blocks(blocks, dtype=torch.float32, shape=SHAPE), span)
    assert torch.equal(decode_kv_blocks(blocks[:2], dtype=torch.float32, shape=SHAPE), span[:, :, :, :8])
    with pytest.raises(ValueError):
        encode_kv_blocks(span, block_size=5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_blocks_decode_bit_exact_into_a_span_with_room(dtype):
    # As a worker gets them: read-only views of one packed buffer, payloads at odd
    # offsets, decoded into a span that leads a longer buffer (room for the suffix).
    from deployments.compute.engines.kv_buffer import empty_with_room, room_buffer
    from deployments.dataplane.blocks import pack_blocks, unpack_blocks

    span = rand_block(dtype, shape=(2, 2, 3, 12, 8), seed=7)
    encoded = encode_kv_blocks(span, block_size=4)
    data, lengths = pack_blocks([b"x"] + encoded)  # a 1-byte lead: odd offsets
    views = [memoryview(v).toreadonly() for v in unpack_blocks(data, lengths)[1:]]
    out = empty_with_room((2, 2, 3, 12, 8), 5, dtype=dtype)
    out.fill_(0)
    got = decode_kv_blocks(views, dtype=dtype, shape=SHAPE, out=out)
    assert got is out and room_buffer(got).shape[3] == 17
    same_width = torch.int32 if dtype == torch.float32 else torch.int16
    assert torch.equal(got.view(same_width), span.view(same_width))


def test_wrong_dtype_is_corrupt():
    data = encode_kv_block(rand_block(torch.bfloat16))
    with pytest.raises(CorruptBlockError, match="dtype"):
        decode_kv_block(data, dtype=torch.float32, shape=SHAPE)
    with pytest.raises(CorruptBlockError, match="dtype"):
        decode_kv_blocks([encode_kv_block(rand_block()), data], dtype=torch.float32, shape=SHAPE)


@pytest.mark.parametrize("shape", [(2, 2, 3, 8, 8), (3, 2, 3, 4, 8), (2, 2, 3, 4, 16), (2, 2, 6, 4, 8)])
def test_wrong_shape_is_corrupt(shape):
    data = encode_kv_block(rand_block())
    with pytest.raises(CorruptBlockError, match="shape"):
        decode_kv_block(data, dtype=torch.float32, shape=shape)


def test_corrupted_payload_byte_is_corrupt():
    data = bytearray(encode_kv_block(rand_block()))
    data[-5] ^= 0x01
    with pytest.raises(CorruptBlockError, match="checksum"):
        decode_kv_block(bytes(data), dtype=torch.float32, shape=SHAPE)


def test_checked_blocks_skip_only_the_checksum():
    # Blocks a store has checked since they were written (CheckedBlocks): decoding them
    # skips the checksum pass, and nothing else.
    span = rand_block(shape=(2, 2, 3, 8, 8), seed=5)
    blocks = [memoryview(b).toreadonly() for b in encode_kv_blocks(span, block_size=4)]
    out = decode_kv_blocks(blocks, dtype=torch.float32, shape=SHAPE, verify=False)
    assert torch.equal(out, span)
    out.add_(1)  # the span owns its memory: the read-only blocks are untouched
    assert torch.equal(decode_kv_blocks(blocks, dtype=torch.float32, shape=SHAPE), span)
    flipped = bytearray(blocks[1])
    flipped[-5] ^= 0x01
    with pytest.raises(CorruptBlockError, match="checksum"):
        decode_kv_blocks([blocks[0], bytes(flipped)], dtype=torch.float32, shape=SHAPE)
    decode_kv_blocks([blocks[0], bytes(flipped)], dtype=torch.float32, shape=SHAPE, verify=False)
    with pytest.raises(CorruptBlockError, match="shape"):
        decode_kv_blocks(blocks, dtype=torch.float32, shape=(2, 2, 3, 4, 16), verify=False)
    with pytest.raises(CorruptBlockError):
        decode_kv_blocks([bytes(blocks[0])[:-1]], dtype=torch.float32, shape=SHAPE, verify=False)


@pytest.mark.parametrize(
    "mangle",
    [
        lambda d: d[:-1],  # truncated
        lambda d: d[:3],  # shorter than the prefix
        lambda d: b"XXXX" + d[4:],  # bad magic
        lambda d: d[:4] + struct.pack("<I", 10**6) + d[8:],  # bad header length
        lambda d: b"",
    ],
)
def test_damaged_bytes_are_corrupt(mangle):
    data = encode_kv_block(rand_block())
    with pytest.raises(CorruptBlockError):
        decode_kv_block(mangle(data), dtype=torch.float32, shape=SHAPE)


def test_header_lying_about_shape_is_corrupt():
    # A well-formed block whose payload does not fill the shape it claims.
    payload = rand_block().numpy().tobytes()[:-4]
    data = encode_block(BlockHeader(dtype="float32", shape=SHAPE), payload)
    with pytest.raises(CorruptBlockError):
        decode_kv_block(data, dtype=torch.float32, shape=SHAPE)


def test_wrong_layout_is_corrupt():
    block = rand_block()
    data = encode_block(BlockHeader(dtype="float32", shape=SHAPE, layout="layers,heads,kv,tokens,head_dim"),
                        block.numpy().tobytes())
    with pytest.raises(CorruptBlockError, match="layout"):
        decode_kv_block(data, dtype=torch.float32, shape=SHAPE)


def test_block_shape_from_config():
    gqa = types.SimpleNamespace(num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
                                head_dim=None, hidden_size=512)
    assert block_shape(gqa, 16) == (4, 2, 2, 16, 64)
    explicit = types.SimpleNamespace(num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                                     head_dim=64, hidden_size=128)
    assert block_shape(explicit, 8) == (2, 2, 2, 8, 64)


# ---------------------------------------------------------------- Rate


def test_a_rate_restarts_from_a_sample_far_faster_than_it_and_averages_slow_ones():
    """One stalled import (1.8 MB in 835 ms, seen in loadtests.multiturn) must not hold the
    figure down for ~10 samples: a sample over 4x faster than the figure replaces it; one
    that is not, or a slow one, is averaged in as before."""
    r = Rate()
    r.update(1.8e6, 0.835)
    assert r.value == pytest.approx(1.8e6 / 0.835) and r.samples == 1
    r.update(1.8e6, 0.6)  # faster, but not 4x: averaged (ratio of the moving averages)
    assert r.resets == 0 and r.samples == 2
    assert r.value == pytest.approx(1.8e6 / (0.7 * 0.835 + 0.3 * 0.6))
    r.update(22e6, 0.005)  # 4.4 GB/s against ~2.4 MB/s
    assert r.resets == 1 and r.samples == 1 and r.value == pytest.approx(22e6 / 0.005)
    r.update(22e6, 0.5)  # a stall now: averaged in, no reset, and the figure falls
    assert r.resets == 1 and r.samples == 2
    assert 22e6 / 0.5 < r.value < 22e6 / 0.005
    r.update(0, 1.0)  # nothing measured: ignored
    r.update(1.0, 0)
    assert r.samples == 2


# ---------------------------------------------------------------- should_fetch


def test_no_hit_is_never_fetched():
    assert not should_fetch(PrefixHit(0), bandwidth_bytes_per_s=None, recompute_seconds=None)
    assert not should_fetch(PrefixHit(0, "L2", 0), bandwidth_bytes_per_s=1e12, recompute_seconds=10.0)


def test_unmeasured_is_fetched():
    hit = PrefixHit(4, "L3", 4 * 1_000_000)
    assert should_fetch(hit, bandwidth_bytes_per_s=None, recompute_seconds=None)
    assert should_fetch(hit, bandwidth_bytes_per_s=1.0, recompute_seconds=None)
    assert should_fetch(hit, bandwidth_bytes_per_s=None, recompute_seconds=1e-9)


def test_slow_tier_recomputes_fast_tier_fetches():
    hit = PrefixHit(4, "L3", 4 * 1_000_000)  # 4 MB
    # 1 MB/s → 4 s to fetch, against 0.064 s to recompute.
    assert not should_fetch(hit, bandwidth_bytes_per_s=1e6, recompute_seconds=0.064)
    # 10 GB/s → 0.4 ms to fetch.
    assert should_fetch(hit, bandwidth_bytes_per_s=1e10, recompute_seconds=0.064)


# ---------------------------------------------------------------- PrefillTimeModel


def test_prefill_model_fits_fixed_and_per_token_cost():
    model = PrefillTimeModel()
    assert model.per_token_seconds is None and model.marginal_seconds(100) is None
    for tokens in (40, 100, 2100, 70, 130, 1800, 90):
        model.add(tokens, 0.005 + tokens * 2e-4)
    assert model.fixed_seconds == pytest.approx(0.005, rel=1e-6)
    assert model.per_token_seconds == pytest.approx(2e-4, rel=1e-6)
    assert model.marginal_seconds(2000) == pytest.approx(0.4, rel=1e-6)


def test_prefill_model_charges_a_prefix_only_its_marginal_cost():
    """The H200 case: short prefills that are nearly all fixed cost. A tokens-per-second
    average charges 2000 tokens ~40 ms; their marginal cost is ~2 ms."""
    model = PrefillTimeModel()
    sizes = (60, 160, 90, 130, 100, 2100, 80, 150)
    for tokens in sizes:
        model.add(tokens, 0.003 + tokens * 1e-6)
    assert model.marginal_seconds(2000) == pytest.approx(0.002, rel=1e-3)
    average_per_token = sum(0.003 + n * 1e-6 for n in sizes) / sum(sizes)
    assert 2000 * average_per_token > 0.01  # what the old average charged them
    # The import of 2000 tokens' blocks (32 MiB at 1.5 GB/s: ~22 ms) loses to that.
    hit = PrefixHit(125, "L2", 32 << 20)
    assert not should_fetch(hit, bandwidth_bytes_per_s=1.5e9, recompute_seconds=model.marginal_seconds(2000))


def test_prefill_model_without_spread_uses_the_average_and_follows_recent_samples():
    model = PrefillTimeModel(decay=0.5)
    for _ in range(5):
        model.add(100, 0.010)  # all one size: no slope to fit
    assert model.fixed_seconds == 0.0
    assert model.per_token_seconds == pytest.approx(1e-4)
    for _ in range(30):  # the machine got 4× slower: recent samples win
        model.add(100, 0.040)
    assert model.per_token_seconds == pytest.approx(4e-4, rel=1e-3)


def test_prefill_model_ignores_empty_samples_and_never_goes_negative():
    model = PrefillTimeModel()
    model.add(0, 0.01)
    model.add(10, 0.0)
    assert model.per_token_seconds is None
    # Bigger prefills measured faster (noise): the slope is clamped at zero.
    model.add(100, 0.02)
    model.add(1000, 0.01)
    assert model.per_token_seconds == 0.0
    assert model.fixed_seconds >= 0.0


def test_pack_unpack_blocks_roundtrip_without_copy_and_length_check():
    from deployments.dataplane.blocks import pack_blocks, unpack_blocks

    blocks = [b"abc", b"", b"defgh" * 100]
    data, lengths = pack_blocks(blocks)
    views = unpack_blocks(data, lengths)
    assert [bytes(v) for v in views] == blocks and lengths == [3, 0, 500]
    data[0] = ord("X")  # views share the packed buffer
    assert bytes(views[0]) == b"Xbc"
    with pytest.raises(CorruptBlockError):
        unpack_blocks(data, [3, 0, 499])


def test_tier_bandwidth_is_bytes_over_seconds_of_the_averages():
    """A small fetch (mostly fixed per-call cost) must not make a fast tier look slow:
    the figure is average bytes / average seconds, not the average of per-fetch rates."""
    from deployments.dataplane.connector import DataPlaneKVConnector
    from deployments.compute.engines.kv import TIER_L2, TIER_L3

    conn = DataPlaneKVConnector(None, 16, ewma_alpha=0.5)
    assert conn.bandwidth_bytes_per_s(TIER_L2) is None
    conn.record_fetch(TIER_L2, 32 << 20, 0.040)  # 32 MiB in 40 ms
    conn.record_fetch(TIER_L2, 64 << 10, 0.010)  # 64 KiB in 10 ms: 6.5 MB/s on its own
    expected = (0.5 * (64 << 10) + 0.5 * (32 << 20)) / (0.5 * 0.010 + 0.5 * 0.040)
    assert conn.bandwidth_bytes_per_s(TIER_L2) == pytest.approx(expected)
    # The average of the two rates would be ~0.42 GB/s; this is ~0.67 GB/s.
    assert conn.bandwidth_bytes_per_s(TIER_L2) > 0.6e9
    assert conn.bandwidth_bytes_per_s(TIER_L3) is None


def test_pack_of_back_to_back_views_is_a_view_not_a_copy():
    import numpy as np

    from deployments.dataplane.blocks import pack_blocks, unpack_blocks

    buffer = np.arange(100, dtype=np.uint8)
    views = unpack_blocks(memoryview(buffer).toreadonly(), [10, 30, 60])
    data, lengths = pack_blocks(views[1:])
    assert np.shares_memory(data, buffer) and lengths == [30, 60]
    assert bytes(data) == bytes(buffer[10:])
    # Out of order, or from two buffers: copied into a new array.
    data, _ = pack_blocks([views[2], views[0]])
    assert not np.shares_memory(data, buffer)
    assert bytes(data) == bytes(buffer[40:]) + bytes(buffer[:10])
    other = memoryview(np.arange(5, dtype=np.uint8)).toreadonly()
    data, _ = pack_blocks([views[0], other])
    assert not np.shares_memory(data, buffer) and bytes(data) == bytes(buffer[:10]) + bytes(range(5))


def test_unpack_rejects_negative_lengths():
    from deployments.dataplane.blocks import unpack_blocks

    with pytest.raises(CorruptBlockError):
        unpack_blocks(b"abcdef", [8, -2])


def test_encode_block_accepts_views_and_checks_them():
    from deployments.dataplane.blocks import check_block

    payload = bytes(range(256)) * 4
    from_view = encode_block(BlockHeader("uint8", (1024,)), memoryview(payload)[:])
    assert from_view == encode_block(BlockHeader("uint8", (1024,)), payload)
    assert check_block(memoryview(from_view)) == 1024
    damaged = bytearray(from_view)
    damaged[-1] ^= 1
    with pytest.raises(CorruptBlockError, match="checksum"):
        check_block(damaged)


def test_format_2_writes_xxh3_and_format_1_blocks_are_still_read():
    import json
    import zlib

    import xxhash

    from deployments.dataplane.blocks import FORMAT_VERSION, check_block

    payload = bytes(range(256)) * 4

    def meta(block: bytes) -> dict:
        n = int.from_bytes(block[4:8], "little")
        return json.loads(block[8 : 8 + n])

    new = encode_block(BlockHeader("uint8", (1024,)), payload)
    assert FORMAT_VERSION == 2
    assert meta(new)["v"] == 2 and meta(new)["xxh3"] == xxhash.xxh3_64_intdigest(payload)
    assert "crc32" not in meta(new)
    # A block written before format 2 (in Redis across an upgrade) reads and checks as before.
    old = encode_block(BlockHeader("uint8", (1024,), version=1), payload)
    assert meta(old)["v"] == 1 and meta(old)["crc32"] == zlib.crc32(payload)
    assert check_block(old) == 1024 and decode_block(old)[0].version == 1
    damaged = bytearray(old)
    damaged[-1] ^= 1
    with pytest.raises(CorruptBlockError, match="checksum"):
        check_block(damaged)
    # A header naming another version's checksum, or a version nobody wrote, is corrupt.
    with pytest.raises(CorruptBlockError, match="bad header"):
        check_block(old.replace(b'"v":1', b'"v":2', 1))
    with pytest.raises(CorruptBlockError, match="unsupported block format version 3"):
        check_block(new.replace(b'"v":2', b'"v":3', 1))
    with pytest.raises(ValueError, match="unsupported"):
        encode_block(BlockHeader("uint8", (1024,), version=3), payload)


def test_block_arrays_view_the_blocks_without_a_copy():
    import numpy as np

    from deployments.dataplane.blocks import block_arrays

    blocks = [b"abc", memoryview(b"0123456789")[2:6], b""]
    arrays, lengths = block_arrays(blocks)
    assert lengths == [3, 4, 0] and [bytes(a) for a in arrays] == [b"abc", b"2345", b""]
    assert all(a.dtype == np.uint8 for a in arrays)
    assert np.shares_memory(arrays[0], np.frombuffer(blocks[0], dtype=np.uint8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_span_encodes_in_one_buffer_as_block_by_block(dtype):
    # encode_kv_blocks writes every block into one buffer (payloads gathered straight from
    # a strided span, headers padded in front): the same headers and payloads as
    # encode_kv_block gives each block, checked on decode like them.
    from deployments.dataplane.blocks import decode_block

    cache = rand_block(dtype, shape=(2, 2, 3, 20, 8), seed=11)
    span = cache.narrow(3, 2, 12)  # not contiguous, as a slice of a KV cache is
    blocks = encode_kv_blocks(span, block_size=4)
    assert len(blocks) == 3 and all(b.base is blocks[0].base for b in blocks)  # one buffer
    for i, block in enumerate(blocks):
        one = encode_kv_block(span.narrow(3, 4 * i, 4))
        header, payload = decode_block(block)
        assert (header, bytes(payload)) == (decode_block(one)[0], bytes(decode_block(one)[1]))
        start = np.frombuffer(payload, dtype=np.uint8).ctypes.data
        assert (start - blocks[0].ctypes.data) % 64 == 0  # payloads aligned within it
        assert not block.flags.writeable
    broken = bytearray(blocks[1])
    broken[-1] ^= 0xFF
    with pytest.raises(CorruptBlockError, match="checksum"):
        decode_block(bytes(broken))
    assert encode_kv_blocks(span.narrow(3, 0, 0), block_size=4) == []


def test_a_header_written_in_place_must_fit_its_room():
    from deployments.dataplane.blocks import BlockHeader, encode_header_into, header_reserve

    header = BlockHeader("float32", (2, 2, 3, 4, 8))
    room = header_reserve(header, 768)
    assert room % 64 == 0
    encode_header_into(bytearray(room), header, 2**64 - 1, 768)  # the longest checksum fits
    with pytest.raises(ValueError, match="does not fit"):
        encode_header_into(bytearray(room - 64), header, 2**64 - 1, 768)
