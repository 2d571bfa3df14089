"""Two session paths through a whole application of their own (torch engine, a real
DataPlane, a real Redis): a history that outgrows the context under ``truncate_oldest``,
and a turn whose stored KV blocks rotted in Redis. This app has no L1 prefix cache in the
worker (``prefix_cache_bytes: 0``), so a later turn's prefix can only come from the data
plane, and a short context (``max_model_len``) that a few turns outgrow."""

from __future__ import annotations

import httpx
import pytest

from tests.fixtures.serve_app import app_args, deployed_app, openai_client, wait_for

pytestmark = pytest.mark.integration

APP = "edges"
MAX_MODEL_LEN = 256
BLOCK_SIZE = 16  # the engine's default


@pytest.fixture(scope="module")
def edges_app(ray_cluster, redis_server, http_port):
    from tests.fixtures.models import get_model_path

    model_path = get_model_path("tiny")
    args = app_args(
        model_path,
        redis_server.url,
        model={"max_model_len": MAX_MODEL_LEN},
        engine={"name": "torch", "max_num_seqs": 4, "num_threads": 1, "prefix_cache_bytes": 0},
        dataplane={"num_replicas": 1, "sessions": {"overflow_policy": "truncate_oldest"}},
    )
    with deployed_app(args, APP, f"/{APP}", http_port) as base_url:
        yield base_url, str(model_path)


def _handle(deployment: str):
    from ray import serve

    return serve.get_deployment_handle(deployment, app_name=APP)


def _new_session(base_url: str) -> str:
    r = httpx.post(base_url + "/v1/sessions", timeout=30)
    assert r.status_code == 201, r.text
    return r.json()["id"]


def _turn(client, sid: str, text: str, max_tokens: int):
    return client.chat.completions.create(
        model="tiny-llama",
        messages=[{"role": "user", "content": text}],
        extra_headers={"X-Session-Id": sid},
        temperature=0,
        max_tokens=max_tokens,
    )


def _record(sid: str):
    """The data plane's record, with the reply token ids the API does not show."""
    return _handle("DataPlane").get_session.remote("default", sid, shard_key=sid).result(timeout_s=30)


def test_truncate_oldest_drops_the_oldest_messages_from_the_prompt_and_keeps_them_stored(edges_app):
    """Turns go on past the context: each is a 200 whose prompt is the newest messages
    that fit (oldest first out), token for token what a stateless request with exactly
    those messages gets, while the session keeps every message of every turn."""
    from transformers import AutoTokenizer

    from app.sessions import exact_prompt_ids

    base_url, model_path = edges_app
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    client = openai_client(base_url)
    sid = _new_session(base_url)
    max_tokens = 16
    texts = [" ".join(f"turn{t}word{i}" for i in range(12)) for t in range(10)]
    truncated_turns = 0
    for t, text in enumerate(texts):
        history = _record(sid).messages
        reply = _turn(client, sid, text, max_tokens)
        full = exact_prompt_ids(tokenizer, history + [{"role": "user", "content": text}])
        # What the server should have sent: drop history messages, oldest first, until
        # the prompt and the completion's room fit the context.
        kept = list(history)
        prompt = full
        while len(prompt) + max_tokens > MAX_MODEL_LEN:
            assert kept, "even the new message alone does not fit: the test's turns are too long"
            kept.pop(0)
            prompt = exact_prompt_ids(tokenizer, kept + [{"role": "user", "content": text}])
        truncated_turns += len(full) != len(prompt)
        assert reply.usage.prompt_tokens == len(prompt), (t, reply.usage, len(full))
        stateless = client.completions.create(model="tiny-llama", prompt=prompt, temperature=0, max_tokens=max_tokens)
        assert reply.choices[0].message.content == stateless.choices[0].text, t
        # Nothing stored is dropped: the session holds every turn, in order.
        stored = _record(sid)
        assert stored.version == t + 1
        assert [m["content"] for m in stored.messages[0::2]] == texts[: t + 1]
        assert stored.messages[-1]["content"] == reply.choices[0].message.content
    # The turns outgrew the context several times over, so truncation was exercised.
    assert truncated_turns >= 3, truncated_turns
    shown = httpx.get(f"{base_url}/v1/sessions/{sid}", timeout=30).json()
    assert len(shown["messages"]) == 2 * len(texts)
    # Its token count is the last turn's: the part of the history it sent, and the reply.
    assert shown["num_tokens"] == reply.usage.prompt_tokens + reply.usage.completion_tokens <= MAX_MODEL_LEN


def _wait_for_blocks_in_redis(redis_client, sid: str) -> list[str]:
    """The Redis keys of the blocks listed under the session, once each payload is there
    (the worker exports after the reply; the data plane writes behind every 50 ms)."""
    from deployments.dataplane import keys

    listed = keys.session_blocks_key("default", sid)
    members = wait_for(lambda: redis_client.smembers(listed), 30, "the session's blocks listed under it")
    block_keys = [keys.block_key("default", keys.split_session_block_member(m.decode())[1]) for m in members]
    wait_for(lambda: redis_client.exists(*block_keys) == len(block_keys), 30, "the blocks' payloads in Redis")
    return block_keys


def _corrupt_count() -> int:
    return _handle("DataPlane").stats.remote(shard_key="any").result(timeout_s=30).get("corrupt_blocks", 0)


def test_a_turn_whose_stored_blocks_rotted_recomputes_them_exactly_and_stores_them_again(edges_app, redis_client):
    """A bit flipped in every stored block of a session's first turn: the next turn finds
    them unusable (counted, erased), prefills its whole prompt instead, and its greedy
    reply equals a stateless request with the same prompt ids. Its own export stores
    sound blocks under the same keys, which the turn after reuses."""
    from transformers import AutoTokenizer

    from app.sessions import exact_prompt_ids
    from deployments.dataplane.blocks import CorruptBlockError, decode_block

    base_url, model_path = edges_app
    client = openai_client(base_url)
    worker = _handle("ComputeWorker")
    sid = _new_session(base_url)
    _turn(client, sid, " ".join(f"first{i}" for i in range(40)), 8)
    block_keys = _wait_for_blocks_in_redis(redis_client, sid)
    assert len(block_keys) >= 3, block_keys
    sound = {k: redis_client.get(k) for k in block_keys}
    # Out of the data plane's memory (written to Redis first), so the next turn reads Redis.
    _handle("DataPlane").flush_l2.remote(shard_key="any").result(timeout_s=60)
    for key in block_keys:
        data = bytearray(sound[key])
        data[-5] ^= 0x5A  # one payload byte: its checksum no longer matches
        with pytest.raises(CorruptBlockError):
            decode_block(bytes(data), verify=True)
        redis_client.set(key, bytes(data))

    corrupt_before = _corrupt_count()
    before = worker.kv_stats.remote().result(timeout_s=30)
    second = _turn(client, sid, "and then?", 8)
    after = worker.kv_stats.remote().result(timeout_s=30)
    assert _corrupt_count() > corrupt_before, "the rotten blocks were never read"
    assert after["prefix_hit_tokens"] == before["prefix_hit_tokens"], (before, after)
    assert after["prefilled_tokens"] - before["prefilled_tokens"] == second.usage.prompt_tokens, (before, after)
    # The turn is stored like any other.
    record = _record(sid)
    assert record.version == 2 and record.messages[-1]["content"] == second.choices[0].message.content

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    prompt = exact_prompt_ids(tokenizer, record.messages[:-1])
    assert len(prompt) == second.usage.prompt_tokens

    # The second turn's export put sound blocks back under the same keys (its prompt
    # starts with the first turn's tokens, so their blocks have the same hashes).
    def restored() -> bool:
        for key in block_keys:
            data = redis_client.get(key)
            if data is None:
                return False
            try:
                decode_block(data, verify=True)
            except CorruptBlockError:
                return False
        return True

    wait_for(restored, 30, "the recomputed blocks back in Redis, sound")

    stateless = client.completions.create(model="tiny-llama", prompt=prompt, temperature=0, max_tokens=8)
    assert second.choices[0].message.content == stateless.choices[0].text

    # The next turn reuses them (unless the worker measured the fetch slower than prefill).
    before = worker.kv_stats.remote().result(timeout_s=30)
    _turn(client, sid, "once more", 4)
    after = worker.kv_stats.remote().result(timeout_s=30)
    reused = after["prefix_hit_tokens"] - before["prefix_hit_tokens"]
    assert reused >= len(block_keys) * BLOCK_SIZE or after["fetch_skipped"] > before["fetch_skipped"], (before, after)
