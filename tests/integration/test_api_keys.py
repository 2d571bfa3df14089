"""API keys → tenants through a real Serve application (``security.api_keys_file``): the
401s, a key's tenant scoping its sessions and KV blocks, and a key revoked in the file
without a restart. Each engine in turn; the app runs beside the shared one."""

from __future__ import annotations

import asyncio
import math
import os
import time

import httpx
import openai
import pytest

from app.model_builder import build_lora_adapter
from tests.fixtures.models import get_model_path
from tests.fixtures.serve_app import (
    ENGINE_ARGS,
    TEST_MAX_QUEUE_DEPTH,
    app_args,
    deployed_app,
    openai_client,
    vllm_importable,
    wait_for,
    worker_handle,
)

APP_NAME = "keyed"
ROUTE_PREFIX = "/keyed"
ACME = "acme-0123456789abcdef"
GLOBEX = "globex-0123456789abcdef"
INITECH = "initech-0123456789abcdef"
# initech alone has rate limits (acme and globex none).
INITECH_RPM, INITECH_TPM = 4, 400
RELOAD_S = 0.5
SHARE = 0.25


@pytest.fixture(scope="module", params=sorted(ENGINE_ARGS))
def keyed_app(request, tmp_path_factory, ray_cluster, redis_server, http_port):
    engine = request.param
    if engine == "vllm" and not vllm_importable():
        pytest.skip("vLLM is not installed here")
    keys_file = tmp_path_factory.mktemp("keys") / "api_keys"
    keys_file.write_text(f"# tenant:key\nacme:{ACME}\nglobex:{GLOBEX}\ninitech:{INITECH}\n")
    # A LoRA adapter for acme alone, and one for every tenant.
    adapter = build_lora_adapter(get_model_path("tiny"), tmp_path_factory.mktemp("lora") / "a", seed=5)
    args = app_args(
        get_model_path("tiny"),
        redis_server.url,
        model={"lora_modules": [{"name": "acme-sql", "path": str(adapter), "tenants": ["acme"]},
                                {"name": "shared", "path": str(adapter)}]},
        engine=ENGINE_ARGS[engine],
        security={
            "api_keys_file": str(keys_file), "reload_interval_s": RELOAD_S,
            "rate_limits": {"tenants": {"initech": {"requests_per_minute": INITECH_RPM,
                                                    "tokens_per_minute": INITECH_TPM}}},
        },
        # A tenant may hold a quarter of the router queue (12 of 48 places): fewer than
        # the engine's 16 sequences, so each admitted request runs at once.
        router={"max_queue_share_per_tenant": SHARE},
    )
    with deployed_app(args, APP_NAME, ROUTE_PREFIX, http_port) as base_url:
        yield engine, base_url, keys_file


def test_a_request_without_a_known_key_is_401_and_probes_need_none(keyed_app):
    _, base, _ = keyed_app
    with httpx.Client(base_url=base, timeout=60) as http:
        for path in ("/health", "/ready"):
            assert http.get(path).status_code == 200, path
        body = {"model": "tiny-llama", "prompt": "hi", "max_tokens": 2}
        for headers, code in [
            ({}, "missing_api_key"),
            ({"Authorization": f"Basic {ACME}"}, "missing_api_key"),
            ({"Authorization": "Bearer not-a-key-of-this-server"}, "invalid_api_key"),
        ]:
            for method, path, kw in [
                ("POST", "/v1/completions", {"json": body}),
                ("POST", "/v1/chat/completions", {"json": {**body, "messages": [{"role": "user", "content": "x"}]}}),
                ("GET", "/v1/models", {}),
                ("GET", "/v1/models/tiny-llama", {}),
                ("POST", "/v1/sessions", {}),
                ("GET", "/v1/sessions/sess_" + "0" * 32, {}),
                ("DELETE", "/v1/sessions/sess_" + "0" * 32, {}),
                ("POST", "/v1/responses", {"json": {"model": "tiny-llama", "input": "x"}}),
                ("GET", "/v1/responses/resp_" + "0" * 32, {}),
                ("DELETE", "/v1/responses/resp_" + "0" * 32, {}),
            ]:
                r = http.request(method, path, headers=headers, **kw)
                assert r.status_code == 401, (method, path, r.text)
                assert r.json()["error"]["code"] == code and r.headers["www-authenticate"].startswith("Bearer")
                assert r.json()["error"]["type"] == "invalid_request_error"  # as OpenAI's 401s
        assert http.get("/v1/models", headers={"Authorization": f"Bearer {ACME}"}).status_code == 200
    # The openai client sends its api_key as the Bearer key.
    with pytest.raises(openai.AuthenticationError):
        openai_client(base, api_key="wrong-key-0123456789").models.list()
    reply = openai_client(base, api_key=ACME).completions.create(model="tiny-llama", prompt="hi", max_tokens=2)
    assert reply.usage.completion_tokens == 2

    def counted(text: str) -> bool:
        lines = text.splitlines()
        return any('tenant="acme"' in line for line in lines if line.startswith("ray_llm_generation_tokens_total")) and any(
            'reason="invalid"' in line for line in lines if line.startswith("ray_llm_auth_failures_total"))

    # /metrics takes no key; the nodes export every second.
    wait_for(lambda: counted(httpx.get(base + "/metrics", timeout=60).text), 90, "acme's tokens and the 401s in /metrics")


def test_a_tenant_neither_reads_nor_detects_another_tenants_session(keyed_app):
    _, base, _ = keyed_app
    acme, globex = (openai_client(base, api_key=k) for k in (ACME, GLOBEX))
    auth = {k: {"Authorization": f"Bearer {v}"} for k, v in (("acme", ACME), ("globex", GLOBEX))}
    with httpx.Client(base_url=base, timeout=60) as http:
        sid = http.post("/v1/sessions", headers=auth["acme"]).json()["id"]
        first = acme.chat.completions.create(
            model="tiny-llama", messages=[{"role": "user", "content": "acme's secret plan"}],
            max_tokens=4, temperature=0, extra_headers={"X-Session-Id": sid},
        )
        assert first.choices[0].message.content
        absent = "sess_" + "f" * 32
        for method in ("GET", "DELETE"):
            theirs = http.request(method, f"/v1/sessions/{sid}", headers=auth["globex"])
            nobody = http.request(method, f"/v1/sessions/{absent}", headers=auth["globex"])
            # The same answer as for a session that does not exist (only the id differs).
            assert theirs.status_code == nobody.status_code == 404
            assert theirs.json()["error"]["message"].replace(sid, absent) == nobody.json()["error"]["message"]
        # A turn on it (header or body) is the same 404 and appends nothing.
        for extra in ({"extra_headers": {"X-Session-Id": sid}}, {"extra_body": {"session_id": sid}}):
            with pytest.raises(openai.NotFoundError):
                globex.chat.completions.create(
                    model="tiny-llama", messages=[{"role": "user", "content": "let me in"}], max_tokens=2, **extra
                )
        mine = http.get(f"/v1/sessions/{sid}", headers=auth["acme"]).json()
        assert mine["version"] == 1 and [m["content"] for m in mine["messages"]][0] == "acme's secret plan"
        # Its own session of the same name space works as usual.
        own = http.post("/v1/sessions", headers=auth["globex"]).json()["id"]
        assert http.get(f"/v1/sessions/{own}", headers=auth["globex"]).status_code == 200
        assert http.get(f"/v1/sessions/{own}", headers=auth["acme"]).status_code == 404


def test_a_tenant_neither_reads_nor_continues_another_tenants_response(keyed_app):
    _, base, _ = keyed_app
    acme, globex = (openai_client(base, api_key=k) for k in (ACME, GLOBEX))
    auth = {k: {"Authorization": f"Bearer {v}"} for k, v in (("acme", ACME), ("globex", GLOBEX))}
    mine = acme.responses.create(model="tiny-llama", input="acme's secret plan", max_output_tokens=4)
    absent = "resp_" + "f" * 32
    with httpx.Client(base_url=base, timeout=60) as http:
        for method, tail in (("GET", ""), ("DELETE", ""), ("GET", "/input_items")):
            theirs = http.request(method, f"/v1/responses/{mine.id}{tail}", headers=auth["globex"])
            nobody = http.request(method, f"/v1/responses/{absent}{tail}", headers=auth["globex"])
            # The same answer as for a response that does not exist (only the id differs).
            assert theirs.status_code == nobody.status_code == 404
            assert theirs.json()["error"]["message"].replace(mine.id, absent) == nobody.json()["error"]["message"]
        with pytest.raises(openai.NotFoundError):
            globex.responses.create(model="tiny-llama", input="continue it", previous_response_id=mine.id,
                                    max_output_tokens=2)
        kept = http.get(f"/v1/responses/{mine.id}", headers=auth["acme"])
        assert kept.status_code == 200 and kept.json()["id"] == mine.id
        items = http.get(f"/v1/responses/{mine.id}/input_items", headers=auth["acme"])
        assert items.status_code == 200 and items.json()["data"][0]["content"][0]["text"] == "acme's secret plan"
    assert acme.responses.create(model="tiny-llama", input="go on", previous_response_id=mine.id,
                                 max_output_tokens=2).previous_response_id == mine.id


def test_a_tenant_reuses_its_own_kv_blocks_and_never_anothers(keyed_app):
    """The same prompt from two tenants, twice each. A tenant's first request reuses no
    KV (``usage.prompt_tokens_details.cached_tokens`` 0), though the other tenant's is
    stored; its second reuses the whole prefix its first left (unless the torch engine
    measured the import slower than the prefill). On torch the data plane holds each
    tenant's blocks under its own name; vLLM's own prefix cache is salted per tenant."""
    from ray import serve

    from deployments.compute.engines.kv import block_hashes

    engine, base, _ = keyed_app
    prompt = list(range(100, 100 + 4 * 16 + 1))  # 4 whole blocks before the last token
    clients = {"acme": openai_client(base, api_key=ACME), "globex": openai_client(base, api_key=GLOBEX)}

    def ask(tenant: str):
        reply = clients[tenant].completions.create(model="tiny-llama", prompt=prompt, max_tokens=4, temperature=0)
        return reply.choices[0].text, reply.usage.prompt_tokens_details.cached_tokens

    torch_engine = engine == "torch"
    if torch_engine:
        worker = worker_handle(APP_NAME)
        dataplane = serve.get_deployment_handle("DataPlane", app_name=APP_NAME)
        hashes = {t: block_hashes("tiny-llama", t, prompt[:-1], 16) for t in clients}

    def stored(tenant: str) -> int:
        h = hashes[tenant]
        return dataplane.lookup_prefix.remote(tenant, h, shard_key=h[0]).result(timeout_s=30).num_blocks

    def kv() -> dict:
        return worker.kv_stats.remote().result(timeout_s=30) if torch_engine else {}

    texts = []
    for tenant in ("acme", "globex"):
        if torch_engine:
            assert stored(tenant) == 0, tenant  # the other tenant's blocks are not this one's
        before = kv()
        text, cached = ask(tenant)
        texts.append(text)
        assert cached == 0, tenant
        mid = kv()
        if torch_engine:
            assert mid["prefix_hit_tokens"] == before["prefix_hit_tokens"], (tenant, before, mid)
            wait_for(lambda: stored(tenant) == 4, 30, f"{tenant}'s blocks in the data plane")
        text, cached = ask(tenant)
        texts.append(text)
        after = kv()
        if torch_engine and after["fetch_skipped"] > mid["fetch_skipped"]:
            assert cached == 0, tenant  # recomputed: measured faster than the import
        else:
            assert cached == 4 * 16, tenant
            if torch_engine:
                assert after["prefix_hit_tokens"] - mid["prefix_hit_tokens"] == cached, (tenant, mid, after)
    assert len(set(texts)) == 1

    def counted(text: str) -> bool:
        return any('tenant="globex"' in line for line in text.splitlines()
                   if line.startswith("ray_llm_prompt_cached_tokens_total"))

    if cached:  # the hit rate by tenant, in /metrics
        wait_for(lambda: counted(httpx.get(base + "/metrics", timeout=60).text), 90, "globex's cached tokens in /metrics")


def test_grpc_calls_take_the_key_as_metadata_and_keep_tenants_apart(keyed_app, grpc_port):
    """The gRPC API (Serve's gRPC proxy, this app named by the ``application`` metadata)
    authenticates as the REST API does: ``authorization: Bearer <key>`` metadata, else
    UNAUTHENTICATED with the 401's code; the key's tenant scopes its sessions."""
    import grpc

    from app.grpc_api import llm_pb2 as pb
    from app.grpc_api import llm_pb2_grpc

    app = ("application", APP_NAME)

    def key(k: str):
        return (app, ("authorization", f"Bearer {k}"))

    chat = pb.ChatCompletionRequest(model="tiny-llama", messages=[pb.ChatMessage(role="user", content="hi")], max_tokens=2)
    with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
        stub = llm_pb2_grpc.LLMStub(channel)
        for metadata, code in [((app,), "missing_api_key"), (key("not-a-key-of-this-server"), "invalid_api_key")]:
            for call in (
                lambda md: stub.ChatCompletion(chat, metadata=md, timeout=60),
                lambda md: list(stub.ChatCompletionStream(chat, metadata=md, timeout=60)),
                lambda md: stub.ListModels(pb.ListModelsRequest(), metadata=md, timeout=60),
                lambda md: stub.CreateSession(pb.CreateSessionRequest(), metadata=md, timeout=60),
            ):
                with pytest.raises(grpc.RpcError) as e:
                    call(metadata)
                assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED, e.value.details()
                assert {m.key: m.value for m in e.value.trailing_metadata()}["llm-error-code"] == code
        assert stub.ChatCompletion(chat, metadata=key(ACME), timeout=60).usage.completion_tokens == 2
        session = stub.CreateSession(pb.CreateSessionRequest(), metadata=key(ACME), timeout=60)
        assert stub.GetSession(pb.GetSessionRequest(id=session.id), metadata=key(ACME), timeout=60).id == session.id
        for call in (
            lambda: stub.GetSession(pb.GetSessionRequest(id=session.id), metadata=key(GLOBEX), timeout=60),
            lambda: stub.ChatCompletion(chat, metadata=key(GLOBEX) + (("x-session-id", session.id),), timeout=60),
        ):
            with pytest.raises(grpc.RpcError) as e:
                call()
            assert e.value.code() == grpc.StatusCode.NOT_FOUND
        assert stub.GetSession(pb.GetSessionRequest(id=session.id), metadata=key(ACME), timeout=60).version == 0


def test_a_tenant_that_floods_the_router_leaves_room_for_the_others(keyed_app):
    """acme sends twice its share of the router queue at once: its share is admitted and
    the rest gets 429 tenant_queue_full with Retry-After, while globex's requests, sent
    as acme's run, are served. Without the share acme would take every place it asked for."""
    _, base, _ = keyed_app
    share = math.ceil(TEST_MAX_QUEUE_DEPTH * SHARE)
    flood = 2 * share
    acme, globex = ({"Authorization": f"Bearer {k}"} for k in (ACME, GLOBEX))
    long_body = {"model": "tiny-llama", "prompt": [12] * 8, "max_tokens": 400, "ignore_eos": True, "stream": True}
    # More choices than the share holds could never get in: a 400, not a 429 to retry.
    r = httpx.post(base + "/v1/completions", headers=acme, timeout=60,
                   json={"model": "tiny-llama", "prompt": "x", "max_tokens": 1, "n": share + 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "n" and "share" in r.json()["error"]["message"], r.text

    async def main():
        limits = httpx.Limits(max_connections=flood + 8)
        async with httpx.AsyncClient(base_url=base, timeout=120, limits=limits) as client:
            async def open_stream():
                request = client.build_request("POST", "/v1/completions", json=long_body, headers=acme)
                return await client.send(request, stream=True)  # back at the first token, or the 429

            streams = await asyncio.gather(*(open_stream() for _ in range(flood)))
            try:
                refused = []
                for r in streams:
                    if r.status_code == 429:
                        await r.aread()
                        refused.append((r.json(), r.headers.get("retry-after")))
                others = await asyncio.gather(*(
                    client.post("/v1/completions", headers=globex,
                                json={"model": "tiny-llama", "prompt": "my turn", "max_tokens": 2})
                    for _ in range(4)
                ))
            finally:
                for r in streams:
                    await r.aclose()
            return [r.status_code for r in streams], refused, others

    codes, refused, others = asyncio.run(main())
    assert codes.count(200) == share and codes.count(429) == flood - share, codes
    for error, retry_after in refused:
        assert error["error"]["code"] == "tenant_queue_full" and int(retry_after) >= 1, error
    assert [r.status_code for r in others] == [200] * 4, [r.text for r in others]


def test_a_tenants_rate_limits_hold_its_requests_and_tokens_and_no_one_elses(keyed_app, grpc_port, redis_client):
    """initech may start 4 requests and use 400 tokens a minute: its answers carry
    OpenAI's x-ratelimit headers; a request over a whole minute's tokens is a 429 that
    uses nothing; the fifth request is a 429 with Retry-After, over REST and gRPC alike;
    acme, without limits, is served throughout and gets no such headers."""
    import grpc

    from app.grpc_api import llm_pb2 as pb
    from app.grpc_api import llm_pb2_grpc
    from deployments.dataplane.keys import rate_key

    _, base, _ = keyed_app
    redis_client.delete(rate_key("initech"))  # the other engine's app used the same Redis
    initech, acme = ({"Authorization": f"Bearer {k}"} for k in (INITECH, ACME))
    body = {"model": "tiny-llama", "prompt": [12] * 6, "max_tokens": 4, "ignore_eos": True}
    with httpx.Client(base_url=base, timeout=60) as http:
        r = http.post("/v1/completions", headers=initech, json=body)
        assert r.status_code == 200, r.text
        assert r.headers["x-ratelimit-limit-requests"] == str(INITECH_RPM)
        assert r.headers["x-ratelimit-remaining-requests"] == str(INITECH_RPM - 1)
        assert r.headers["x-ratelimit-limit-tokens"] == str(INITECH_TPM)
        assert int(r.headers["x-ratelimit-remaining-tokens"]) == INITECH_TPM - 10  # 6 + 4 charged
        r = http.post("/v1/completions", headers=initech, json={**body, "max_tokens": INITECH_TPM})
        assert r.status_code == 429 and "retry-after" not in r.headers, r.text
        assert r.json()["error"]["code"] == "rate_limit_exceeded" and "too large" in r.json()["error"]["message"]
        with http.stream("POST", "/v1/completions", headers=initech, json={**body, "stream": True}) as r:
            assert r.status_code == 200
            assert r.headers["x-ratelimit-remaining-requests"] == str(INITECH_RPM - 2)  # the 429 used none
            assert "[DONE]" in r.read().decode()
        assert INITECH_RPM == 4
        assert http.post("/v1/completions", headers=initech, json=body).status_code == 200
        # The fourth over gRPC: the headers come as trailing metadata.
        with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
            reply, call = llm_pb2_grpc.LLMStub(channel).Completion.with_call(
                pb.CompletionRequest(model="tiny-llama", prompt_token_ids=[12] * 6, max_tokens=4),
                metadata=(("application", APP_NAME), ("authorization", f"Bearer {INITECH}")), timeout=60)
        assert reply.usage.completion_tokens <= 4
        trailing = dict(call.trailing_metadata())
        assert trailing["x-ratelimit-limit-requests"] == str(INITECH_RPM)
        assert trailing["x-ratelimit-remaining-requests"] == "0" and "x-ratelimit-remaining-tokens" in trailing
        r = http.post("/v1/chat/completions", headers=initech,
                      json={"model": "tiny-llama", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        assert r.status_code == 429, r.text
        error = r.json()["error"]
        assert error["type"] == "rate_limit_error" and error["code"] == "rate_limit_exceeded"
        assert "requests per minute" in error["message"] and int(r.headers["retry-after"]) >= 1
        assert r.headers["x-ratelimit-remaining-requests"] == "0"
        r = http.post("/v1/completions", headers=acme, json=body)
        assert r.status_code == 200 and "x-ratelimit-limit-requests" not in r.headers
    chat = pb.ChatCompletionRequest(model="tiny-llama", messages=[pb.ChatMessage(role="user", content="hi")], max_tokens=2)
    with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
        with pytest.raises(grpc.RpcError) as e:
            llm_pb2_grpc.LLMStub(channel).ChatCompletion(
                chat, metadata=(("application", APP_NAME), ("authorization", f"Bearer {INITECH}")), timeout=60)
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    trailing = {m.key: m.value for m in e.value.trailing_metadata()}
    assert trailing["llm-error-code"] == "rate_limit_exceeded" and int(trailing["retry-after"]) >= 1

    def counted(text: str) -> bool:
        return any('tenant="initech"' in line and 'limit="requests"' in line
                   for line in text.splitlines() if line.startswith("ray_llm_rate_limited_total"))

    wait_for(lambda: counted(httpx.get(base + "/metrics", timeout=60).text), 90, "initech's 429s in /metrics")


# Last in the module: it revokes globex's key (the next engine's app starts with both).
def test_an_adapter_for_one_tenant_does_not_exist_for_the_others(keyed_app):
    _, base, _ = keyed_app

    def ask(key, method, path, body=None):
        return httpx.request(method, base + path, json=body, headers={"Authorization": f"Bearer {key}"}, timeout=120)

    completion = {"model": "acme-sql", "prompt": [1, 2, 3], "max_tokens": 2}
    assert ask(ACME, "POST", "/v1/completions", completion).status_code == 200
    assert [m["id"] for m in ask(ACME, "GET", "/v1/models").json()["data"]] == ["tiny-llama", "acme-sql", "shared"]
    assert ask(ACME, "GET", "/v1/models/acme-sql").status_code == 200
    # globex: every way of naming it is a 404, as for a name nobody configured, and no
    # message or list shows it.
    assert [m["id"] for m in ask(GLOBEX, "GET", "/v1/models").json()["data"]] == ["tiny-llama", "shared"]
    for method, path, body in (
        ("POST", "/v1/completions", completion),
        ("POST", "/v1/completions", {**completion, "model": "tiny-llama:acme-sql"}),
        ("POST", "/v1/chat/completions", {"model": "acme-sql", "messages": [{"role": "user", "content": "hi"}]}),
        ("POST", "/v1/responses", {"model": "acme-sql", "input": "hi", "store": False}),
        ("POST", "/tokenize", {"model": "acme-sql", "prompt": "hi"}),
        ("GET", "/v1/models/acme-sql", None),
    ):
        reply = ask(GLOBEX, method, path, body)
        assert reply.status_code == 404, (path, reply.text)
        # The same answer as for a name nobody configured (the name sent aside).
        unknown = ask(GLOBEX, method, path.replace("acme-sql", "nobodys"),
                      body and {k: (v.replace("acme-sql", "nobodys") if isinstance(v, str) else v) for k, v in body.items()})
        assert reply.text.replace("acme-sql", "NAME") == unknown.text.replace("nobodys", "NAME"), (reply.text, unknown.text)
    assert ask(GLOBEX, "POST", "/v1/completions", {**completion, "model": "shared"}).status_code == 200


# Last: it revokes globex's and initech's keys.
def test_a_key_revoked_in_the_file_is_refused_without_a_restart(keyed_app):
    _, base, keys_file = keyed_app
    headers = {"Authorization": f"Bearer {GLOBEX}"}
    assert httpx.get(base + "/v1/models", headers=headers, timeout=30).status_code == 200
    keys_file.write_text(f"acme:{ACME}\n")
    stamp = time.time() + 2  # a new mtime even on a coarse file system
    os.utime(keys_file, (stamp, stamp))
    wait_for(lambda: httpx.get(base + "/v1/models", headers=headers, timeout=30).status_code == 401,
             10 * RELOAD_S + 10, "globex's key refused")
    assert httpx.get(base + "/v1/models", headers={"Authorization": f"Bearer {ACME}"}, timeout=30).status_code == 200

