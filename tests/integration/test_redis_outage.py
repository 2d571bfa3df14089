"""Redis stops and comes back while session traffic runs through the whole application:
no request fails, /ready stays 200 and says `degraded`, and every acknowledged turn ends
up in Redis once it is back."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from deployments.dataplane import keys
from tests.fixtures.serve_app import ServeLogTail

pytestmark = pytest.mark.integration


def ready_body(base_url: str) -> tuple[int, dict]:
    r = httpx.get(base_url + "/ready", timeout=30)
    return r.status_code, r.json()


def wait_for_dataplane(base_url: str, state: str, timeout_s: float = 30) -> list[int]:
    """Poll /ready until it reports the data plane in ``state``; return the statuses seen."""
    seen = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        code, body = ready_body(base_url)
        seen.append(code)
        if body.get("dataplane") == state:
            return seen
        time.sleep(0.3)
    raise AssertionError(f"/ready never reported dataplane={state!r} (statuses {seen})")


def test_redis_outage_under_traffic_loses_no_turn(served_app, redis_server, redis_client):
    base = served_app.base_url
    logs = ServeLogTail("llm")  # the shared app (tests/fixtures/serve_app.py)
    sessions = [httpx.post(base + "/v1/sessions", timeout=30).json()["id"] for _ in range(3)]
    acknowledged: dict[str, int] = {sid: 0 for sid in sessions}
    failures: list[str] = []
    stop = threading.Event()

    def talk(sid: str) -> None:
        with httpx.Client(base_url=base, timeout=60) as client:
            while not stop.is_set():
                r = client.post(
                    "/v1/chat/completions",
                    headers={"X-Session-Id": sid},
                    json={
                        "model": served_app.model_id,
                        "messages": [{"role": "user", "content": f"turn {acknowledged[sid]}"}],
                        "max_tokens": 4,
                        "temperature": 0,
                    },
                )
                if r.status_code == 200:
                    acknowledged[sid] += 1
                else:
                    failures.append(f"{r.status_code} {r.text[:200]}")
                time.sleep(0.05)

    threads = [threading.Thread(target=talk, args=(sid,), daemon=True) for sid in sessions]
    for t in threads:
        t.start()
    try:
        time.sleep(2)
        redis_server.stop()
        statuses = wait_for_dataplane(base, "degraded")
        # One server holds both roles here: both are down, and /ready names them.
        deadline = time.monotonic() + 10
        while ready_body(base)[1].get("dataplane_degraded") != ["kv", "sessions"]:
            assert time.monotonic() < deadline, ready_body(base)
            time.sleep(0.2)
        time.sleep(2)  # traffic keeps flowing with Redis gone
        during = dict(acknowledged)
        redis_server.start()
        statuses += wait_for_dataplane(base, "ok", timeout_s=60)
        time.sleep(1)
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=60)
        if not redis_server.running:
            redis_server.start()

    assert not failures, f"{failures[:5]}\n{logs.report()}"
    assert set(statuses) == {200}, statuses
    assert all(n > 0 for n in during.values()), during
    # Every acknowledged turn is in Redis (written back after the outage), in order. /ready
    # said "ok" once every data-plane replica had written back what it kept.
    def versions():
        return {
            sid: int(redis_client.hget(keys.session_key("default", sid), "version") or -1)
            for sid in acknowledged
        }

    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and versions() != acknowledged:
        time.sleep(0.5)
    assert versions() == acknowledged
    for sid, n in acknowledged.items():
        record = httpx.get(f"{base}/v1/sessions/{sid}", timeout=30).json()
        assert [m["content"] for m in record["messages"][0::2]] == [f"turn {i}" for i in range(n)]


def test_responses_stored_while_redis_is_down_are_continued_then_written_back(served_app, redis_server, redis_client):
    """A response stored during an outage is kept by its data-plane replica: it can be
    read and continued at once, and it is in Redis once the server is back."""
    base = served_app.base_url
    body = {"model": served_app.model_id, "max_output_tokens": 4, "temperature": 0}
    try:
        redis_server.stop()
        wait_for_dataplane(base, "degraded")
        first = httpx.post(base + "/v1/responses", json={**body, "input": "during the outage"}, timeout=60)
        assert first.status_code == 200, first.text
        rid = first.json()["id"]
        second = httpx.post(base + "/v1/responses", json={**body, "input": "and on", "previous_response_id": rid},
                            timeout=60)
        assert second.status_code == 200, second.text
        assert second.json()["usage"]["input_tokens"] > first.json()["usage"]["input_tokens"]
        read = httpx.get(f"{base}/v1/responses/{rid}", timeout=30)
        assert read.status_code == 200 and read.json() == first.json()
        redis_server.start()
        wait_for_dataplane(base, "ok", timeout_s=60)
    finally:
        if not redis_server.running:
            redis_server.start()
    ids = (rid, second.json()["id"])

    def written_back() -> bool:
        return all(int(redis_client.hget(keys.session_key("default", i), "version") or -1) == 1 for i in ids)

    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not written_back():
        time.sleep(0.5)
    assert written_back()
    assert httpx.get(f"{base}/v1/responses/{ids[1]}", timeout=30).json() == second.json()


def test_a_sessions_redis_that_refuses_writes_is_a_503_that_loses_nothing(served_app, redis_client):
    """The Redis answers but is full (``maxmemory`` with ``noeviction``: what a durable
    sessions server runs with): a session create or turn is a 503 naming the cause, with
    nothing saved; a turn is refused before its reply is generated (a streamed one gets
    the 503 itself, not tokens and then an error event); a session still reads, a delete
    still frees, stateless requests go on, /ready says so; once memory is freed the
    session goes on in order."""
    base = served_app.base_url
    chat = {"model": served_app.model_id, "max_tokens": 4, "temperature": 0}
    # Every replica up (an outage before this test ends with each one's reconnect): a
    # replica still degraded would keep a write in memory, not refuse it.
    wait_for_dataplane(base, "ok")
    with httpx.Client(base_url=base, timeout=60) as client:
        sid, spare = (client.post("/v1/sessions").json()["id"] for _ in range(2))

        def turn(content: str, **extra) -> httpx.Response:
            body = {**chat, "messages": [{"role": "user", "content": content}], **extra}
            return client.post("/v1/chat/completions", headers={"X-Session-Id": sid}, json=body)

        assert turn("first").status_code == 200
        answer = {"model": served_app.model_id, "max_output_tokens": 4, "temperature": 0}
        rid = client.post("/v1/responses", json={**answer, "input": "stored before"}).json()["id"]
        key = keys.session_key("default", sid)
        before = redis_client.hgetall(key)
        redis_client.config_set("maxmemory", 1)
        try:
            # One server holds both roles here; some replica's write probe notices.
            wait_for_dataplane(base, "refusing_writes")
            expected = (200, {
                "status": "ready", "model": served_app.model_id,
                "dataplane": "refusing_writes", "dataplane_refusing_writes": ["kv", "sessions"],
                # Both replicas (app_args: two), each from its own write probe.
                "dataplane_replicas": {"degraded": 0, "refusing_writes": 2, "ok": 0, "unanswered": 0},
            })
            deadline = time.monotonic() + 10  # each replica's probe notices within a second
            while (seen := ready_body(base)) != expected:
                assert time.monotonic() < deadline, seen
                time.sleep(0.2)
            refused = [
                turn("second"),
                turn("streamed", stream=True),
                # Named in the body: the prompt waits for the read (no header to start it early).
                client.post("/v1/chat/completions", json={
                    **chat, "session_id": sid, "stream": True,
                    "messages": [{"role": "user", "content": "in the body"}]}),
                client.post("/v1/sessions"),
            ]
            # A response that continues a stored one is refused before its reply, as a
            # session turn is; a new one is refused when its store is (after its reply).
            refused += [
                client.post("/v1/responses", json={**answer, "input": "go on", "previous_response_id": rid}),
                client.post("/v1/responses", json={**answer, "input": "go on", "previous_response_id": rid,
                                                   "stream": True}),
                client.post("/v1/responses", json={**answer, "input": "a new one"}),
            ]
            with client.stream("POST", "/v1/responses", json={**answer, "input": "new", "stream": True}) as r:
                events = [json.loads(line[len("data: "):]) for line in r.iter_lines() if line.startswith("data: ")]
            assert [e["type"] for e in events[-2:]] == ["error", "response.failed"], events[-3:]
            assert events[-2]["code"] == "store_refusing_writes"
            unstored = client.post("/v1/responses", json={**answer, "input": "x", "store": False})
            assert unstored.status_code == 200, unstored.text
            assert client.get(f"/v1/responses/{rid}").status_code == 200
            for r in refused:
                assert r.status_code == 503, r.text
                assert r.headers["retry-after"] == "5"
                assert r.headers["content-type"] == "application/json"
                assert r.json()["error"]["code"] == "store_refusing_writes"
                assert "not accepting writes" in r.json()["error"]["message"]
            assert redis_client.hgetall(key) == before
            got = client.get(f"/v1/sessions/{sid}")
            assert got.status_code == 200 and got.json()["version"] == 1
            stateless = client.post("/v1/chat/completions", json={**chat, "messages": [{"role": "user", "content": "x"}]})
            assert stateless.status_code == 200, stateless.text
            # A full server takes a delete (its first write is a DEL, which frees memory).
            assert client.delete(f"/v1/sessions/{spare}").status_code == 200
            assert client.get(f"/v1/sessions/{spare}").status_code == 404
        finally:
            redis_client.config_set("maxmemory", 0)
        wait_for_dataplane(base, "ok")
        assert turn("third").status_code == 200
        assert client.post("/v1/responses", json={**answer, "input": "on", "previous_response_id": rid}).status_code == 200
        record = client.get(f"/v1/sessions/{sid}").json()
        assert record["version"] == 2
        assert [m["content"] for m in record["messages"][0::2]] == ["first", "third"]
