"""The torch engine on a CUDA device beside the same engine on the CPU: the same greedy
tokens and close logits; KV blocks exported on one device import on the other, both ways
(a conversation moves between a GPU replica and a CPU one through the data plane); bf16
blocks import on the GPU; L1 feeds a GPU engine from host memory.

Runs only where CUDA is (skipped on CI's CPUs): ``loadtests/gpu_check.sh`` runs it on an
accelerator. The engines import every stored prefix (``always_fetch``): on a GPU the
fetch-or-recompute decision may rightly prefer recomputing a tiny model's prefix, and
these tests are about what an import gives, not whether to make one."""

import asyncio

import pytest
import pytest_asyncio
import torch

from deployments.compute.engines.kv import block_hashes
from deployments.compute.engines.kv_codec import decode_kv_blocks
from deployments.compute.engines.torch_engine import TorchEngine
from deployments.dataplane.blocks import decode_block
from tests.fixtures.kv import DictKVConnector
from tests.integration.test_torch_engine_kv import (
    BLOCK,
    PROMPTS,
    LogitsRecorder,
    collect,
    encode,
    make_request,
    run_and_export,
)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


async def _started(path, device, store=None, dtype="float32", **kw):
    eng = TorchEngine(str(path), max_num_seqs=4, num_threads=2, device=device, dtype=dtype, kv_connector=store,
                      model_id=f"tiny-{dtype}", block_size=BLOCK, always_fetch=store is not None, **kw)
    eng.logits_hook = LogitsRecorder()
    await eng.start()
    return eng


@pytest_asyncio.fixture
async def engines(tiny_model_path):
    """Started engines, shut down after the test: ``await engines(device, store, ...)``."""
    started = []

    async def make(device, store=None, dtype="float32", **kw):
        started.append(await _started(tiny_model_path, device, store, dtype, **kw))
        return started[-1]

    yield make
    for eng in started:
        await eng.shutdown()


@pytest.mark.asyncio
async def test_cuda_and_cpu_give_the_same_greedy_tokens_and_close_logits(engines):
    gpu, cpu = await engines("cuda"), await engines("cpu")
    assert gpu.device.type == "cuda" and next(gpu.model.parameters()).is_cuda
    ids = [encode(cpu, p) for p in PROMPTS]
    # Six prompts on four slots: the GPU engine batches them, joins and leaves between steps.
    on_gpu = await asyncio.gather(*(collect(gpu, make_request(f"g{i}", x, max_tokens=16)) for i, x in enumerate(ids)))
    for i, x in enumerate(ids):
        assert on_gpu[i] == await collect(cpu, make_request(f"c{i}", x, max_tokens=16)), PROMPTS[i]
        torch.testing.assert_close(gpu.logits_hook.first[f"g{i}"], cpu.logits_hook.first[f"c{i}"], atol=1e-3, rtol=0)


@pytest.mark.asyncio
@pytest.mark.parametrize("exporter,importer", [("cpu", "cuda"), ("cuda", "cpu")])
async def test_blocks_exported_on_one_device_import_on_the_other(engines, exporter, importer):
    store = DictKVConnector(block_size=BLOCK)
    source = await engines(exporter, store)
    target = await engines(importer, store)
    reference = await engines(importer)
    ids = encode(source, PROMPTS[0])
    first = await run_and_export(source, make_request("first", ids))
    hashes = block_hashes("tiny-float32", "default", ids, BLOCK)
    assert all(("default", h) in store.blocks for h in hashes)
    # The stored bytes say nothing about the device: a block from the GPU decodes on the host.
    span = decode_kv_blocks([store.blocks[("default", h)] for h in hashes], dtype=torch.float32,
                            shape=source._kv_block_shape)
    assert span.device.type == "cpu" and span.shape[3] == len(hashes) * BLOCK

    again = await collect(target, make_request("again", ids))
    hit = (len(ids) - 1) // BLOCK * BLOCK
    stats = target.kv_stats()
    assert stats.prefix_hit_tokens == hit and stats.fetch_failures == 0
    assert stats.prefilled_tokens == len(ids) - hit
    recomputed = await collect(reference, make_request("ref", ids))
    assert again == recomputed == first
    torch.testing.assert_close(target.logits_hook.first["again"], reference.logits_hook.first["ref"],
                               atol=1e-4, rtol=0)


@pytest.mark.asyncio
async def test_bf16_blocks_import_on_cuda_close_to_a_recompute(engines):
    store = DictKVConnector(block_size=BLOCK)
    engine = await engines("cuda", store, dtype="bfloat16")
    plain = await engines("cuda", dtype="bfloat16")
    ids = encode(engine, PROMPTS[0])
    await run_and_export(engine, make_request("first", ids))
    header, _ = decode_block(next(iter(store.blocks.values())))
    assert header.dtype == "bfloat16"
    await collect(engine, make_request("again", ids))
    assert engine.kv_stats().prefix_hit_tokens == (len(ids) - 1) // BLOCK * BLOCK
    await collect(plain, make_request("ref", ids))
    await collect(plain, make_request("other", encode(engine, PROMPTS[1])))
    imported, recomputed = engine.logits_hook.first["again"], plain.logits_hook.first["ref"]
    other = plain.logits_hook.first["other"]
    # bf16 rounds differently when the prefix is not recomputed with its suffix; the
    # difference must still be far smaller than what another prompt changes.
    assert (imported - recomputed).abs().max() < 0.1 * (other - recomputed).abs().max()


@pytest.mark.asyncio
async def test_l1_feeds_a_cuda_engine_from_host_memory(engines):
    store = DictKVConnector(block_size=BLOCK)
    engine = await engines("cuda", store, prefix_cache_bytes=64 << 20)
    plain = await engines("cuda")
    turn1 = encode(engine, PROMPTS[1])
    out1 = await run_and_export(engine, make_request("t1", turn1, max_tokens=10))
    turn2 = turn1 + out1 + encode(engine, " and then what happened to the worker")[1:]
    loads = len(store.loads)
    out2 = await run_and_export(engine, make_request("t2", turn2, max_tokens=10))
    hit = (len(turn1) + len(out1) - 1) // BLOCK * BLOCK
    assert engine.kv_stats().l1_hit_tokens == hit and len(store.loads) == loads
    assert out2 == await collect(plain, make_request("r2", turn2, max_tokens=10))


@pytest.mark.asyncio
async def test_a_cuda_engine_turns_cudnn_attention_off(engines):
    """SDPA's cuDNN backend builds a graph per new shape (every decode step here): the
    engine turns it off when it loads on CUDA (loadtests/README.md: ~6x faster bf16 decode
    steps on an H200)."""
    torch.backends.cuda.enable_cudnn_sdp(True)
    try:
        await engines("cuda")
        assert not torch.backends.cuda.cudnn_sdp_enabled()
    finally:
        torch.backends.cuda.enable_cudnn_sdp(True)
