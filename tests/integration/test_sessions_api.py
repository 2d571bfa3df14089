"""Sessions through the real Serve application, a real DataPlane and a real Redis:
multi-turn chat with X-Session-Id, racing turns, deletion, bad ids, and KV reuse that
changes no token."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest

from tests.fixtures.serve_app import wait_for, worker_handle

pytestmark = pytest.mark.integration


def new_session(served_app, **body) -> dict:
    r = httpx.post(served_app.base_url + "/v1/sessions", json=body or None, timeout=30)
    assert r.status_code == 201, r.text
    s = r.json()
    assert s["id"].startswith("sess_") and s["version"] == 0 and s["messages"] == []
    return s


def get_session(served_app, sid) -> httpx.Response:
    return httpx.get(f"{served_app.base_url}/v1/sessions/{sid}", timeout=30)


def turn(client, model, sid, text, **kw):
    return client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": text}],
        extra_headers={"X-Session-Id": sid},
        temperature=0,
        max_tokens=kw.pop("max_tokens", 8),
        **kw,
    )


def test_multi_turn_conversation_keeps_history_in_order(served_app):
    client = served_app.client()
    sid = new_session(served_app)["id"]
    replies = []
    for i in range(3):
        r = turn(client, served_app.model_id, sid, f"turn {i} question")
        replies.append(r.choices[0].message.content)
    s = get_session(served_app, sid).json()
    assert s["version"] == 3
    assert [m["role"] for m in s["messages"]] == ["user", "assistant"] * 3
    assert [m["content"] for m in s["messages"][0::2]] == [f"turn {i} question" for i in range(3)]
    assert [m["content"] for m in s["messages"][1::2]] == replies
    # The prompt grew with the history: the last turn saw all earlier messages.
    assert s["num_tokens"] > 3 * 8


def test_n_above_one_in_a_session_turn_is_400_and_appends_nothing(served_app):
    sid = new_session(served_app)["id"]
    body = {"model": served_app.model_id, "messages": [{"role": "user", "content": "two replies?"}], "n": 2}
    r = httpx.post(
        served_app.base_url + "/v1/chat/completions", json=body, headers={"X-Session-Id": sid}, timeout=30
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "n", r.text
    assert get_session(served_app, sid).json()["version"] == 0


def test_a_session_turn_calls_a_tool_and_the_next_turn_answers_it(served_app):
    """Tools in session turns: a named function call, then its output as a tool message
    in the next turn (tool_choice none, the tools still given), with template variables.
    Each prompt is the stored history with the replies' generated ids spliced in, rendered
    with the turn's tools (the tiny model's template shows none of them; the unit test in
    test_chat_template_errors.py has one that does): the second reply equals a stateless
    completion of exactly those ids, so KV reuse changed no token; the history holds
    every message."""
    from transformers import AutoTokenizer

    from app.sessions import TOKEN_IDS_KEY, exact_prompt_ids

    tool = {"type": "function", "function": {
        "name": "get_weather", "description": "Weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                       "required": ["city"], "additionalProperties": False}}}
    client = served_app.client()
    sid = new_session(served_app)["id"]
    kwargs = {"chat_template_kwargs": {"enable_thinking": False}}
    called = turn(client, served_app.model_id, sid, "weather in Paris?", tools=[tool], max_tokens=40,
                  tool_choice={"type": "function", "function": {"name": "get_weather"}}, extra_body=kwargs)
    [call] = called.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and set(json.loads(call.function.arguments)) == {"city"}
    answered = client.chat.completions.create(
        model=served_app.model_id, extra_headers={"X-Session-Id": sid}, temperature=0, max_tokens=8,
        messages=[{"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}],
        tools=[tool], tool_choice="none", extra_body=kwargs,
    )
    s = get_session(served_app, sid).json()
    assert s["version"] == 2 and [m["role"] for m in s["messages"]] == ["user", "assistant", "tool", "assistant"]
    assert s["messages"][2]["tool_call_id"] == call.id and s["messages"][3]["content"] == answered.choices[0].message.content
    stored = stored_record(served_app, sid).messages
    tokenizer = AutoTokenizer.from_pretrained(served_app.model_path)
    prompt = exact_prompt_ids(tokenizer, stored[:3], [tool], kwargs["chat_template_kwargs"])
    # It starts with the first prompt and the call's generated ids, exactly.
    first_prompt = exact_prompt_ids(tokenizer, stored[:1], [tool], kwargs["chat_template_kwargs"])
    assert prompt[: called.usage.prompt_tokens] == first_prompt and len(first_prompt) == called.usage.prompt_tokens
    assert stored[1][TOKEN_IDS_KEY] == prompt[len(first_prompt) : len(first_prompt) + len(stored[1][TOKEN_IDS_KEY])]
    stateless = client.completions.create(model=served_app.model_id, prompt=prompt, temperature=0, max_tokens=8)
    assert answered.choices[0].message.content == stateless.choices[0].text
    assert answered.usage.prompt_tokens == len(prompt)


def test_a_completion_request_that_names_a_session_is_400_and_appends_nothing(served_app):
    sid = new_session(served_app)["id"]
    body = {"model": served_app.model_id, "prompt": "hello", "max_tokens": 2}
    for extra, headers in [({}, {"X-Session-Id": sid}), ({"session_id": sid}, {})]:
        r = httpx.post(served_app.base_url + "/v1/completions", json={**body, **extra}, headers=headers, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == "session_id", r.text
        assert "/v1/chat/completions" in r.json()["error"]["message"]
    assert get_session(served_app, sid).json()["version"] == 0
    # Without one it is served.
    assert httpx.post(served_app.base_url + "/v1/completions", json=body, timeout=60).status_code == 200


def stored_record(served_app, sid):
    """The DataPlane's own record (with the reply token ids the API never shows)."""
    from ray import serve

    dataplane = serve.get_deployment_handle("DataPlane", app_name="llm")
    return dataplane.get_session.remote("default", sid, shard_key=sid).result(timeout_s=30)


SESSION_LOOKUPS = "llm_router_kv_session_lookups"


def test_session_turn_equals_stateless_request_with_the_same_tokens(served_app):
    """The server puts the stored history in front, token for token: the first reply's
    generated ids (not a re-tokenisation of its text) followed by the new message. The
    reply equals a stateless completions request with exactly those prompt ids, so KV
    blocks reused from the data plane change no token."""
    from transformers import AutoTokenizer

    from app.sessions import TOKEN_IDS_KEY, exact_prompt_ids

    worker = worker_handle("llm")
    torch_engine = served_app.engine == "torch"
    lookups_before = settled_result_counts(served_app, SESSION_LOOKUPS) if torch_engine else {}
    before = worker.kv_stats.remote().result(timeout_s=30)
    client = served_app.client()
    sid = new_session(served_app)["id"]
    first = turn(client, served_app.model_id, sid, "a long first message " * 6, max_tokens=12)
    second = turn(client, served_app.model_id, sid, "and a follow up", max_tokens=12)
    after = worker.kv_stats.remote().result(timeout_s=30)
    if torch_engine:
        # The second turn's prefix lookup was started by the router as it arrived and
        # awaited by the worker instead of a call of its own. So was the first's, unless
        # the root index (fresh by then, if an earlier test synced it) skipped it.
        used = after["early_lookups_used"] - before["early_lookups_used"]
        skipped = after["lookups_skipped"] - before["lookups_skipped"]
        assert used + skipped == 2 and used >= 1, (before, after)
        assert after["early_lookups_failed"] == before["early_lookups_failed"]
        # The second turn's was the lookup of the first turn's blocks (prompt and reply),
        # started before its prompt was built (Router.start_session_lookup): its prompt
        # extends them. The first turn had no earlier turn to look up.
        lookups = settled_result_counts(served_app, SESSION_LOOKUPS)
        delta = {k: lookups.get(k, 0) - lookups_before.get(k, 0) for k in ("used", "mismatch", "failed")}
        assert delta == {"used": 1, "mismatch": 0, "failed": 0}, (lookups_before, lookups)
        # Both turns' KV buffers (the cache, the fetched prefix) came from the worker's KV
        # arena (engines/kv_arena.py), which /metrics reports.
        assert after["arena_capacity_bytes"] > 0, after
        assert after["arena_fallbacks"] == before["arena_fallbacks"], (before, after)
        assert after["arena_capacity_bytes"] in _arena_capacities(served_app)
    # usage.prompt_tokens_details.cached_tokens: the prompt tokens whose KV was reused.
    cached = [r.usage.prompt_tokens_details.cached_tokens for r in (first, second)]
    if torch_engine:
        assert sum(cached) == after["prefix_hit_tokens"] - before["prefix_hit_tokens"], (cached, before, after)
    else:
        # vLLM's prefix cache holds the first turn's prompt: whole blocks of it at least.
        assert cached[1] >= 16 * (first.usage.prompt_tokens // 16) > 0, cached
    messages = stored_record(served_app, sid).messages
    history = messages[:2]
    assert history[1]["content"] == first.choices[0].message.content
    assert len(history[1][TOKEN_IDS_KEY]) == first.usage.completion_tokens  # ended by length
    tokenizer = AutoTokenizer.from_pretrained(served_app.model_path)
    prompt = exact_prompt_ids(tokenizer, history + [{"role": "user", "content": "and a follow up"}])
    # The second prompt starts with the first prompt and the first reply, exactly.
    first_prompt = exact_prompt_ids(tokenizer, history[:1])
    assert prompt[: len(first_prompt) + len(history[1][TOKEN_IDS_KEY])] == first_prompt + history[1][TOKEN_IDS_KEY]
    stateless = client.completions.create(
        model=served_app.model_id, prompt=prompt, temperature=0, max_tokens=12
    )
    assert second.choices[0].message.content == stateless.choices[0].text
    assert second.usage.prompt_tokens == stateless.usage.prompt_tokens == len(prompt)


# The data-plane lookup is the torch engine's (vLLM's connector reads Redis itself).
@pytest.mark.parametrize("served_app", ["torch"], indirect=True)
def test_a_new_prompt_without_a_session_skips_the_kv_lookup_and_a_repeat_reuses(served_app):
    """The router's root index (deployments/dataplane/root_index.py): a stateless prompt
    whose first block starts no stored chain goes to the worker without a data-plane
    lookup (a certain miss); once served, its chain is stored and the same prompt looks
    it up and reuses it."""
    import random

    from ray import serve

    from deployments.compute.engines.kv import block_hashes

    worker = worker_handle("llm")
    dataplane = serve.get_deployment_handle("DataPlane", app_name="llm")
    client = served_app.client()

    def ask(prompt):
        return client.completions.create(model=served_app.model_id, prompt=prompt, temperature=0, max_tokens=4)

    ask("warm up the root index for this tenant " * 4)
    time.sleep(1.5)  # a few sync periods: the mirror of this tenant is fresh
    prompt = [random.randrange(30, 250) for _ in range(70)]  # token ids no request had
    before = worker.kv_stats.remote().result(timeout_s=30)
    first = ask(prompt)
    mid = worker.kv_stats.remote().result(timeout_s=30)
    assert mid["lookups_skipped"] - before["lookups_skipped"] == 1, (before, mid)
    assert mid["early_lookups_used"] == before["early_lookups_used"], (before, mid)
    # The worker exports the blocks as the request ends, behind the reply: wait for them.
    hashes = block_hashes(served_app.model_id, "default", prompt[:-1], 16)
    wait_for(
        lambda: dataplane.lookup_prefix.remote("default", hashes, shard_key=hashes[0]).result(timeout_s=30).num_blocks
        == len(hashes),
        30,
        "the first request's blocks in the data plane",
    )
    second = ask(prompt)
    after = worker.kv_stats.remote().result(timeout_s=30)
    assert after["lookups_skipped"] == mid["lookups_skipped"], (mid, after)
    # Found: reused, unless importing it was measured slower than its prefill.
    reused = after["prefix_hit_tokens"] - mid["prefix_hit_tokens"]
    assert reused == len(hashes) * 16 or after["fetch_skipped"] - mid["fetch_skipped"] == 1, (mid, after)
    assert second.choices[0].text == first.choices[0].text


# The data-plane lookup is the torch engine's (vLLM's connector reads Redis itself).
@pytest.mark.parametrize("served_app", ["torch"], indirect=True)
def test_a_later_session_turn_always_looks_up(served_app):
    """A session's later turn is marked ``session_continues`` by the ingress and looks its
    prefix up even when the router's root index has never seen its root (here the first
    turn was stored straight through the data plane, so no router served it and no
    block was exported). Unmarked, it would skip the lookup: a later turn usually
    follows the export of the previous one by milliseconds, before any mirror has it."""
    from ray import serve

    worker = worker_handle("llm")
    dataplane = serve.get_deployment_handle("DataPlane", app_name="llm")
    client = served_app.client()
    turn(client, served_app.model_id, new_session(served_app)["id"], "warm up " * 8)
    time.sleep(1.5)  # the mirror of this tenant is fresh: it says "no" to unknown roots
    sid = new_session(served_app)["id"]
    history = [{"role": "user", "content": "an earlier question " * 4},
               {"role": "assistant", "content": "an earlier answer " * 4}]
    dataplane.append_turn.remote("default", sid, 0, history, 40, shard_key=sid).result(timeout_s=30)
    before = worker.kv_stats.remote().result(timeout_s=30)
    turn(client, served_app.model_id, sid, "and a new one", max_tokens=4)
    after = worker.kv_stats.remote().result(timeout_s=30)
    assert after["lookups_skipped"] == before["lookups_skipped"], (before, after)
    assert after["early_lookups_used"] - before["early_lookups_used"] == 1, (before, after)
    assert get_session(served_app, sid).json()["version"] == 2


def test_session_id_in_body_and_streaming_turn_is_appended(served_app):
    client = served_app.client()
    sid = new_session(served_app)["id"]
    chunks = list(
        client.chat.completions.create(
            model=served_app.model_id,
            messages=[{"role": "user", "content": "stream me"}],
            stream=True,
            max_tokens=6,
            temperature=0,
            extra_body={"session_id": sid},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    s = get_session(served_app, sid).json()
    assert s["version"] == 1 and s["messages"][1] == {"role": "assistant", "content": text}


def test_racing_turns_one_wins_other_gets_409_nothing_lost(served_app):
    sid = new_session(served_app)["id"]

    async def one(client, i):
        return await client.post(
            "/v1/chat/completions",
            headers={"X-Session-Id": sid},
            json={
                "model": served_app.model_id,
                "messages": [{"role": "user", "content": f"racer {i}"}],
                # Long enough that all four read version 0 before the first one appends.
                "max_tokens": 64,
                "temperature": 0,
                "ignore_eos": True,
            },
        )

    async def main():
        async with httpx.AsyncClient(base_url=served_app.base_url, timeout=120) as client:
            return await asyncio.gather(*(one(client, i) for i in range(4)))

    responses = asyncio.run(main())
    codes = sorted(r.status_code for r in responses)
    assert codes.count(200) >= 1 and set(codes) <= {200, 409}, codes
    assert 409 in codes, "4 turns raced on one version yet none conflicted"
    for r in responses:
        if r.status_code == 409:
            err = r.json()["error"]
            assert "version" in err["message"].lower() or "conflict" in err["message"].lower()
    s = get_session(served_app, sid).json()
    winners = [r for r in responses if r.status_code == 200]
    # Exactly the winners' turns are stored, each as one user + one assistant message.
    assert s["version"] == len(winners) == 1
    assert len(s["messages"]) == 2
    assert s["messages"][1]["content"] == winners[0].json()["choices"][0]["message"]["content"]


def test_racing_streamed_turns_one_wins_the_others_end_with_a_409_event(served_app):
    """A streamed reply has sent its 200 before its turn is appended: a turn that loses
    the race ends its stream with the 409's error event (code
    session_version_conflict) and ``[DONE]``, and only the winner's turn is stored."""
    sid = new_session(served_app)["id"]

    async def one(client, i):
        body = {
            "model": served_app.model_id,
            "messages": [{"role": "user", "content": f"streamer {i}"}],
            "max_tokens": 64, "temperature": 0, "ignore_eos": True, "stream": True,
        }
        events = []
        async with client.stream("POST", "/v1/chat/completions", headers={"X-Session-Id": sid}, json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    events.append(line[len("data: "):])
        return events

    async def main():
        async with httpx.AsyncClient(base_url=served_app.base_url, timeout=120) as client:
            return await asyncio.gather(*(one(client, i) for i in range(3)))

    streams = asyncio.run(main())
    assert all(events[-1] == "[DONE]" for events in streams)
    payloads = [[json.loads(e) for e in events[:-1]] for events in streams]
    errors = [[p["error"] for p in ps if "error" in p] for ps in payloads]
    won = [ps for ps, errs in zip(payloads, errors) if not errs]
    lost = [errs for errs in errors if errs]
    assert len(won) == 1 and len(lost) == 2, errors
    assert all(len(errs) == 1 and errs[0]["code"] == "session_version_conflict" for errs in lost)
    text = "".join(c["delta"].get("content") or "" for p in won[0] for c in p.get("choices", []))
    s = get_session(served_app, sid).json()
    assert s["version"] == 1 and s["messages"][1]["content"] == text


def test_delete_then_404_and_turns_rejected(served_app):
    client = served_app.client()
    sid = new_session(served_app)["id"]
    turn(client, served_app.model_id, sid, "remember me")
    r = httpx.delete(f"{served_app.base_url}/v1/sessions/{sid}", timeout=30)
    assert r.status_code == 200 and r.json()["deleted"] is True
    assert get_session(served_app, sid).status_code == 404
    with pytest.raises(openai.NotFoundError):
        turn(client, served_app.model_id, sid, "still there?")
    assert httpx.delete(f"{served_app.base_url}/v1/sessions/{sid}", timeout=30).status_code == 404


def test_delete_erases_the_sessions_kv_blocks_from_redis(served_app, redis_client):
    # The blocks a session's turns computed are listed under it (by the torch engine's
    # export through the data plane, by vLLM's connector directly) and go with it.
    from deployments.dataplane import keys

    client = served_app.client()
    sid = new_session(served_app)["id"]
    long_turn = " ".join(f"word{i}" for i in range(60))  # several blocks of either engine
    turn(client, served_app.model_id, sid, long_turn, max_tokens=4)
    listed = keys.session_blocks_key("default", sid)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not redis_client.scard(listed):
        time.sleep(0.1)  # exported after the reply, written behind every 50 ms
    members = [m.decode() for m in redis_client.smembers(listed)]
    assert members, "the session's blocks were not listed under it"
    block_keys = [keys.block_key("default", keys.split_session_block_member(m)[1]) for m in members]
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and redis_client.exists(*block_keys) < len(block_keys):
        time.sleep(0.1)
    assert redis_client.exists(*block_keys) == len(block_keys)
    assert httpx.delete(f"{served_app.base_url}/v1/sessions/{sid}", timeout=30).status_code == 200
    assert redis_client.exists(*block_keys) == 0 and not redis_client.exists(listed)


# The torch engine's L1 (vLLM's prefix cache has no call to drop single blocks).
@pytest.mark.parametrize("served_app", ["torch"], indirect=True)
def test_delete_drops_the_sessions_blocks_from_the_workers_l1_too(served_app, redis_client):
    """A deleted session's blocks leave the worker's own prefix cache (L1) as well as L2
    and L3: the same prompt afterwards reuses nothing from any tier and recomputes the
    same tokens. Before the delete it came from L1."""
    import random

    from transformers import AutoTokenizer

    from app.sessions import exact_prompt_ids
    from deployments.dataplane import keys

    worker = worker_handle("llm")
    client = served_app.client()
    sid = new_session(served_app)["id"]
    rng = random.Random()
    text = " ".join(f"w{rng.randrange(10**6)}" for _ in range(40))  # blocks no other test has
    turn(client, served_app.model_id, sid, text, max_tokens=4)
    listed = keys.session_blocks_key("default", sid)
    wait_for(lambda: redis_client.scard(listed), 30, "the session's blocks listed under it")
    tokenizer = AutoTokenizer.from_pretrained(served_app.model_path)
    prompt = exact_prompt_ids(tokenizer, [{"role": "user", "content": text}])
    full_blocks = (len(prompt) - 1) // 16  # the last prompt token is always computed

    def ask():
        before = worker.kv_stats.remote().result(timeout_s=30)
        out = client.completions.create(model=served_app.model_id, prompt=prompt, temperature=0, max_tokens=4)
        after = worker.kv_stats.remote().result(timeout_s=30)
        counters = ("l1_hit_tokens", "prefix_hit_tokens", "l1_dropped_blocks", "fetch_skipped")
        return out.choices[0].text, {k: after[k] - before[k] for k in counters}

    # L1 holds the blocks; the engine imports them unless it measured importing them
    # slower than prefilling them (a noisy machine can), and then it imports anyway
    # after _EXPLORE_EVERY_SKIPS (4) skips in a row, to measure again.
    assert full_blocks >= 3
    for _ in range(5):
        first, reused = ask()
        if reused["l1_hit_tokens"]:
            break
        assert reused["fetch_skipped"] == 1 and reused["prefix_hit_tokens"] == 0, reused
    assert reused["l1_hit_tokens"] == full_blocks * 16, reused
    dropped_before = worker.kv_stats.remote().result(timeout_s=30)["l1_dropped_blocks"]
    assert httpx.delete(f"{served_app.base_url}/v1/sessions/{sid}", timeout=30).status_code == 200
    # The turn's blocks (its prompt's and its reply's whole blocks) left L1 with the delete.
    dropped = worker.kv_stats.remote().result(timeout_s=30)["l1_dropped_blocks"] - dropped_before
    assert dropped >= full_blocks, dropped
    again, reused = ask()
    # Nothing to reuse, rather than a reuse skipped: no tier held a block to decide on.
    assert reused["prefix_hit_tokens"] == 0 and reused["l1_hit_tokens"] == 0 and reused["fetch_skipped"] == 0, reused
    assert again == first


def test_unknown_and_malformed_session_ids(served_app):
    assert get_session(served_app, "sess_" + "0" * 32).status_code == 404
    base = f"{served_app.base_url}/v1/sessions/"
    assert httpx.delete(base + "sess_" + "0" * 32, timeout=30).status_code == 404
    # Malformed, wherever it is named: 400 naming the parameter (an id with a slash
    # included, which no route would otherwise match: a 404 that said nothing).
    for r in (
        get_session(served_app, "not-a-session"),
        httpx.delete(base + "not-a-session", timeout=30),
        httpx.get(base + "sess_a%2Fb", timeout=30),
        httpx.delete(base + "sess_a/b", timeout=30),
    ):
        assert r.status_code == 400 and r.json()["error"]["param"] == "session_id", r.text
    with pytest.raises(openai.BadRequestError):
        turn(served_app.client(), served_app.model_id, "bogus", "hi")
    # An empty name is a malformed one, not "no session": the client meant one, and a
    # reply that was never stored would pass silently.
    url = served_app.base_url + "/v1/chat/completions"
    body = {"model": served_app.model_id, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    for r in (
        httpx.post(url, json=body, headers={"X-Session-Id": ""}, timeout=30),
        httpx.post(url, json={**body, "session_id": ""}, timeout=30),
        httpx.post(url, json={**body, "session_id": "bogus"}, timeout=30),
    ):
        assert r.status_code == 400 and r.json()["error"]["param"] == "session_id", r.text


def test_a_session_turn_checks_its_body_before_its_session(served_app):
    """The ingress starts reading the header's session before the body arrives; the
    answer is still the body's error first, then the session's. A header and a body
    naming different sessions is a 400 that changes neither; naming the same one is a
    turn of it."""
    url = served_app.base_url + "/v1/chat/completions"
    good = {"model": served_app.model_id, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    unknown = {"X-Session-Id": "sess_" + "0" * 32}
    r = httpx.post(url, content=b"{not json", headers=unknown, timeout=30)
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"], r.text
    r = httpx.post(url, json={**good, "temperature": 9}, headers={"X-Session-Id": "bogus"}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "temperature", r.text
    r = httpx.post(url, json={**good, "model": "no-such-model"}, headers=unknown, timeout=30)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found", r.text
    r = httpx.post(url, json=good, headers=unknown, timeout=30)
    assert r.status_code == 404 and r.json()["error"]["code"] == "session_not_found", r.text
    r = httpx.post(url, json=good, headers={"X-Session-Id": "bogus"}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "session_id", r.text
    # Which of two named sessions a turn goes to is no guess the server makes.
    sid, other = new_session(served_app)["id"], new_session(served_app)["id"]
    r = httpx.post(url, json={**good, "session_id": other}, headers={"X-Session-Id": sid}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "session_id", r.text
    assert sid in r.json()["error"]["message"] and other in r.json()["error"]["message"]
    assert get_session(served_app, sid).json()["version"] == get_session(served_app, other).json()["version"] == 0
    r = httpx.post(url, json={**good, "session_id": sid}, headers={"X-Session-Id": sid}, timeout=60)
    assert r.status_code == 200, r.text
    assert get_session(served_app, sid).json()["version"] == 1


def test_a_session_create_body_is_read_whole_and_checked(served_app):
    """POST /v1/sessions reads a body sent chunked (no content-length) as well as one with
    a length, and refuses what it would otherwise drop: a body sent chunked was ignored
    (its ttl_s, even an invalid one, with it), an unknown field was ignored, and
    ``"ttl_s": true`` made a session that expired after a second."""
    url = served_app.base_url + "/v1/sessions"
    headers = {"content-type": "application/json"}
    r = httpx.post(url, content=iter([b'{"ttl_s": ', b"0}"]), headers=headers, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "ttl_s", r.text
    r = httpx.post(url, content=iter([b'{"ttl_s": ', b"77}"]), headers=headers, timeout=30)
    assert r.status_code == 201, r.text
    assert r.json()["expires_at"] - r.json()["created"] in (76, 77, 78), r.text
    for body, param in (
        ({"ttl_s": True}, "ttl_s"),
        ({"ttl_s": 60.0}, "ttl_s"),
        ({"ttl": 60}, "ttl"),
        ({"messages": [{"role": "system", "content": "Be terse."}]}, "messages"),
    ):
        r = httpx.post(url, json=body, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert "first chat turn" in r.json()["error"]["message"]
    # No body, an empty one, or an empty object: a session with the configured expiry.
    for kw in ({}, {"content": b""}, {"content": iter([b""])}, {"json": {}}):
        r = httpx.post(url, timeout=30, **kw)
        assert r.status_code == 201, (kw, r.text)
        assert r.json()["expires_at"] - r.json()["created"] > 77


def test_session_ttl_expires(served_app):
    sid = new_session(served_app, ttl_s=1)["id"]
    assert get_session(served_app, sid).status_code == 200
    time.sleep(2.5)
    assert get_session(served_app, sid).status_code == 404


def test_history_over_context_is_400_naming_the_overflow(served_app):
    client = served_app.client()
    sid = new_session(served_app)["id"]
    max_len = client.models.list().data[0].model_extra["max_model_len"]
    with pytest.raises(openai.BadRequestError) as e:
        turn(client, served_app.model_id, sid, "hi", max_tokens=max_len)
    assert "over" in str(e.value) and str(max_len) in str(e.value)
    # The failed turn changed nothing.
    assert get_session(served_app, sid).json()["version"] == 0


def result_counts(served_app, metric: str = "llm_session_turns") -> dict[str, float]:
    """A counter's samples from /metrics, summed by their ``result`` label
    (``llm_session_turns``: hit, stale, miss)."""
    import re

    counts: dict[str, float] = {}
    for line in httpx.get(served_app.base_url + "/metrics", timeout=30).text.splitlines():
        if line.startswith(f"ray_{metric}") and not line.startswith("#"):
            result = re.search(r'result="(\w+)"', line)
            if result:
                counts[result.group(1)] = counts.get(result.group(1), 0.0) + float(line.rsplit(" ", 1)[1])
    return counts


def _arena_capacities(served_app, timeout_s: float = 30.0) -> set[float]:
    """The values of ``llm_engine_kv_arena_bytes{state="capacity"}`` in /metrics (one per
    worker replica of the cluster), once reported (a worker sets it when Serve polls its
    routing stats)."""
    deadline = time.monotonic() + timeout_s
    while True:
        values = {
            float(line.rsplit(" ", 1)[1])
            for line in httpx.get(served_app.base_url + "/metrics", timeout=30).text.splitlines()
            if line.startswith("ray_llm_engine_kv_arena_bytes") and 'state="capacity"' in line
        }
        if values or time.monotonic() > deadline:
            return values
        time.sleep(1.0)


def settled_result_counts(served_app, metric: str = "llm_session_turns") -> dict[str, float]:
    """The counts once two reads a few report intervals (1 s here) apart agree, so that
    nothing an earlier test did is still on its way."""
    last = result_counts(served_app, metric)
    for _ in range(20):
        time.sleep(2.5)
        now = result_counts(served_app, metric)
        if now == last:
            return now
        last = now
    raise AssertionError(f"{metric} never settled: {last}")


# Engine-independent (the ingress alone decides where a turn's history comes from).
@pytest.mark.parametrize("served_app", ["torch"], indirect=True)
def test_turns_start_on_the_ingress_record_and_one_moved_on_elsewhere_uses_the_stores(served_app):
    """The ingress keeps the record of each session it created, read or appended, and
    starts a turn's prompt on it while the store's copy is read (hit). Here another writer
    (as another ingress replica would be) appends a turn in between: the next turn must be
    built on the store's history, not on the ingress's older record (which would end in a
    409 at its commit, or in a reply to the wrong history)."""
    from transformers import AutoTokenizer

    from app.sessions import exact_prompt_ids
    from ray import serve

    dataplane = serve.get_deployment_handle("DataPlane", app_name="llm")
    client = served_app.client()
    before = settled_result_counts(served_app)
    lookups_before = result_counts(served_app, SESSION_LOOKUPS)  # settled with the above
    sid = new_session(served_app)["id"]
    turn(client, served_app.model_id, sid, "first question", max_tokens=6)
    turn(client, served_app.model_id, sid, "second question", max_tokens=6)
    elsewhere = [{"role": "user", "content": "asked elsewhere " * 6},
                 {"role": "assistant", "content": "answered elsewhere " * 6}]
    dataplane.append_turn.remote("default", sid, 2, elsewhere, 60, shard_key=sid).result(timeout_s=30)
    r = turn(client, served_app.model_id, sid, "and back here", max_tokens=6)
    stored = stored_record(served_app, sid)
    assert stored.version == 4
    assert [m["content"] for m in stored.messages[0::2]] == [
        "first question", "second question", elsewhere[0]["content"], "and back here"
    ]
    assert stored.messages[-1]["content"] == r.choices[0].message.content
    tokenizer = AutoTokenizer.from_pretrained(served_app.model_path)
    prompt = exact_prompt_ids(tokenizer, stored.messages[:6] + [{"role": "user", "content": "and back here"}])
    assert r.usage.prompt_tokens == len(prompt)
    after = settled_result_counts(served_app)
    delta = {k: after.get(k, 0) - before.get(k, 0) for k in ("hit", "stale", "miss")}
    # The third turn is stale when the ingress built it before the store's read came
    # back, and a hit on the store's record when the read came back first (it refreshes
    # the ingress's record: under load the body arrives later than the read). Either
    # way it was built on the store's history (checked above), and no turn waited.
    assert delta in ({"hit": 2, "stale": 1, "miss": 0}, {"hit": 3, "stale": 0, "miss": 0}), (before, after)
    # The second turn went with the KV lookup of the first turn's blocks, started before
    # its prompt was built. The third did not: its prompt was built on a version with a
    # turn from elsewhere after this ingress's last one, whose blocks that lookup would
    # not cover (stale). Started on the ingress's older record, its first attempt had it
    # (used), until the store's record replaced that prompt.
    lookups = settled_result_counts(served_app, SESSION_LOOKUPS)
    lookup_delta = {k: lookups.get(k, 0) - lookups_before.get(k, 0) for k in ("used", "stale", "mismatch", "failed")}
    used = 2 if delta["stale"] else 1
    assert lookup_delta == {"used": used, "stale": 1, "mismatch": 0, "failed": 0}, (lookups_before, lookups)


@pytest.mark.parametrize("served_app", ["torch"], indirect=True)
def test_a_session_deleted_elsewhere_is_404_though_the_ingress_held_it(served_app):
    from ray import serve

    dataplane = serve.get_deployment_handle("DataPlane", app_name="llm")
    client = served_app.client()
    sid = new_session(served_app)["id"]
    turn(client, served_app.model_id, sid, "remember me", max_tokens=4)
    assert dataplane.delete_session.remote("default", sid, shard_key=sid).result(timeout_s=30)
    with pytest.raises(openai.NotFoundError):
        turn(client, served_app.model_id, sid, "still there?", max_tokens=4)
    assert get_session(served_app, sid).status_code == 404


def test_a_session_record_this_server_cannot_read_is_a_clear_500_and_deletes(served_app, redis_client):
    """A session key whose content is not a record this server wrote (edited by hand,
    another program's): a 500 naming the session and the field, not a traceback's
    generic one, and nothing guessed; a DELETE still erases it."""
    from deployments.dataplane import keys

    def unreadable(r: httpx.Response, why: str) -> None:
        assert r.status_code == 500, r.text
        error = r.json()["error"]
        assert error["code"] == "session_record_unreadable" and error["param"] == "session_id"
        assert why in error["message"] and "Delete the session" in error["message"]

    for damage, why in (
        (lambda key: redis_client.hset(key, "messages", "not json"), "field 'messages'"),
        (lambda key: redis_client.hdel(key, "version"), "no field 'version'"),
        (lambda key: (redis_client.delete(key), redis_client.set(key, "x")), "another type"),
    ):
        sid = new_session(served_app)["id"]
        damage(keys.session_key("default", sid))
        unreadable(get_session(served_app, sid), why)
        r = httpx.post(
            served_app.base_url + "/v1/chat/completions", headers={"X-Session-Id": sid}, timeout=60,
            json={"model": served_app.model_id, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
        )
        unreadable(r, why)
        assert httpx.delete(f"{served_app.base_url}/v1/sessions/{sid}", timeout=30).status_code == 200
        assert get_session(served_app, sid).status_code == 404


def test_only_the_ingress_writes_an_access_log_line_per_call(served_app):
    """``telemetry.access_log: ingress`` (the default): a session turn takes several
    data-plane calls and a worker call, and only the ingress's replica writes Serve's
    access-log line for its request; the others' lines are dropped (app/telemetry.py)."""
    import re

    from tests.fixtures.serve_app import serve_logs_dir

    sid = new_session(served_app)["id"]
    turn(served_app.client(), served_app.model_id, sid, "which replicas log this?")
    access = re.compile(r" -- (CALL \w+|POST /v1/chat/completions) (OK|ERROR|CANCELLED|\d{3}) ")

    def lines_of(deployment: str) -> list[str]:
        return [line for path in serve_logs_dir().glob(f"replica_llm_{deployment}_*.log")
                for line in path.read_text(errors="replace").splitlines() if access.search(line)]

    # The ingress's own line for the turn (the request's end is logged just after its reply).
    wait_for(lambda: any("POST /v1/chat/completions 200" in line for line in lines_of("Ingress")), 10,
             "the ingress's access-log line")
    assert get_session(served_app, sid).json()["version"] == 1
    for deployment in ("DataPlane", "ComputeWorker"):
        assert list(serve_logs_dir().glob(f"replica_llm_{deployment}_*.log")), f"no {deployment} replica log"
        assert lines_of(deployment) == [], f"{deployment} wrote access-log lines"


def test_session_calls_and_the_routers_lookups_go_straight_to_the_owner_replica(served_app):
    """``dataplane.direct_calls`` (the default): once the ingress's Serve router has seen
    the data-plane replicas, a session call goes to the owner replica's actor itself, and
    so does the KV lookup the router starts for the torch worker; /metrics counts them."""
    client = served_app.client()
    sid = new_session(served_app)["id"]
    for i in range(3):
        turn(client, served_app.model_id, sid, f"turn {i}: a question long enough to fill a block or two")
    assert get_session(served_app, sid).json()["version"] == 3

    def sent(text: str, name: str, *labels: str) -> float:
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith(name + "{") and all(label in line for label in labels))

    def counted() -> bool:
        text = httpx.get(served_app.base_url + "/metrics", timeout=60).text
        appends = sent(text, "ray_llm_session_dataplane_direct_calls_total", 'op="append_turn"', 'outcome="sent"')
        lookups = sent(text, "ray_llm_router_kv_lookup_calls_total", 'via="direct"')
        return appends >= 2 and (lookups >= 1 or served_app.engine != "torch")

    wait_for(counted, 90, "direct session appends (and the router's direct lookups) in /metrics")
