"""The stored form of vLLM's KV blocks (``engines/vllm_kv_blocks.py``): labels, per-rank
names, and moving blocks between paged caches of any physical order. No vLLM needed; on a
CUDA machine the same tests run with the caches on the GPU (``loadtests/gpu_check.sh``)."""

from __future__ import annotations

import pytest
import torch

from deployments.compute.engines.vllm_kv_blocks import (
    CPU_LAYOUT,
    block_bytes,
    block_layout,
    gather_blocks,
    rank_suffix,
    scatter_blocks,
)

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def test_the_cpu_layout_keeps_its_label_and_shape():
    assert block_layout("cpu", "auto", (100, 4, 16, 128)) == (CPU_LAYOUT, (4, 2, 16, 64))


def test_the_same_shape_on_another_device_or_cache_dtype_is_another_layout():
    """The CPU backend reads a block's content as [k tokens, v tokens], the GPU backends as
    [k, v] per token: equal shapes, other meanings, so their labels must differ."""
    cpu, _ = block_layout("cpu", "auto", (100, 4, 16, 128))
    cuda, cuda_shape = block_layout("cuda", "auto", (100, 4, 16, 128))
    fp8, _ = block_layout("cuda", "fp8", (100, 4, 16, 128))
    cpu_fp8, _ = block_layout("cpu", "fp8", (100, 4, 16, 128))
    assert len({cpu, cuda, fp8, cpu_fp8}) == 4
    assert cuda_shape == (4, 16, 128)
    # MLA: one latent vector per token (heads = 1, content not split in two).
    assert block_layout("cuda", "auto", (100, 1, 64, 576))[1] == (1, 64, 576)


@pytest.mark.parametrize("shape", [(100, 4, 16), (100, 4, 16, 127), (0, 4, 16, 128), (100, 4, 16, 128, 1)])
def test_shapes_that_are_not_per_layer_views_are_refused(shape):
    with pytest.raises(ValueError):
        block_layout("cpu", "auto", shape)


def test_each_rank_of_a_sharded_engine_names_its_own_part():
    assert rank_suffix(0, 1, 0, 1) == ""
    names = {rank_suffix(t, 2, p, 2) for t in range(2) for p in range(2)}
    assert len(names) == 4 and "" not in names
    assert rank_suffix(1, 2, 0, 1) != rank_suffix(1, 4, 0, 1)  # another sharding, other parts


def _caches(device, dtype, physical, num_layers=3, num_blocks=9, heads=2, block=4, content=6, fill=True):
    """Per-layer logical views [num_blocks, heads, block, content] over memory in the given
    physical order ("BHNC": contiguous; "BNHC": tokens before heads, as GPU layouts keep)."""
    caches = []
    for _ in range(num_layers):
        if physical == "BHNC":
            view = torch.zeros(num_blocks, heads, block, content, dtype=dtype, device=device)
        else:
            view = torch.zeros(num_blocks, block, heads, content, dtype=dtype, device=device).permute(0, 2, 1, 3)
        if fill:
            view.copy_(torch.randn(view.shape, device=device).to(dtype))
        caches.append(view)
    return caches


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("src_order,dst_order", [("BHNC", "BNHC"), ("BNHC", "BHNC"), ("BNHC", "BNHC")])
@pytest.mark.parametrize("staging_bytes", [64 << 20, 1, 2 * 3 * 2 * 4 * 6 * 4])  # all at once, one by one, two
def test_blocks_move_between_caches_of_any_physical_order(device, dtype, src_order, dst_order, staging_bytes):
    src = _caches(device, dtype, src_order)
    dst = _caches(device, dtype, dst_order, fill=False)
    stacked = gather_blocks(src, [3, 7, 0], staging_bytes=staging_bytes)
    assert stacked.device.type == "cpu" and stacked.is_contiguous()
    assert stacked.shape == (3, 3, 2, 4, 6)
    payloads = [block_bytes(stacked, i) for i in range(3)]
    assert all(len(p) == 3 * 2 * 4 * 6 * stacked.element_size() for p in payloads)
    scatter_blocks(dst, [1, 4, 8], payloads, staging_bytes=staging_bytes)
    for layer in range(3):
        torch.testing.assert_close(dst[layer][1], src[layer][3], rtol=0, atol=0)
        torch.testing.assert_close(dst[layer][4], src[layer][7], rtol=0, atol=0)
        torch.testing.assert_close(dst[layer][8], src[layer][0], rtol=0, atol=0)
        untouched = [b for b in range(9) if b not in (1, 4, 8)]
        assert not dst[layer][untouched].any()


def test_a_block_is_its_layers_in_logical_order():
    """The payload is [layers, heads, tokens, content] whatever the memory order: the same
    bytes from a contiguous cache and from a permuted one holding the same values."""
    a = _caches("cpu", torch.float32, "BHNC", num_layers=2)
    b = _caches("cpu", torch.float32, "BNHC", num_layers=2, fill=False)
    for x, y in zip(a, b):
        y.copy_(x)
    assert block_bytes(gather_blocks(a, [5]), 0) == block_bytes(gather_blocks(b, [5]), 0)
    expected = torch.stack([a[0][5], a[1][5]]).contiguous().view(torch.uint8).numpy().tobytes()
    assert block_bytes(gather_blocks(a, [5]), 0) == expected


def test_scatter_of_nothing_changes_nothing():
    caches = _caches("cpu", torch.float32, "BHNC")
    before = [c.clone() for c in caches]
    scatter_blocks(caches, [], [])
    assert all(torch.equal(x, y) for x, y in zip(caches, before))
