"""Placement and deadlines through a real Serve app with two ComputeWorker replicas (tiny
model, torch engine, data plane on): every turn of a session lands on one replica, and a
request past ``limits.request_timeout_s`` gets a 504 in the OpenAI error shape while its
sequence is aborted in the engine.

Runs its own application ("placement" at "/placement") beside the shared "llm" app. Which
replica served what is read from each replica's routing stats (``num_requests``,
``num_running``, ``prefix_keys``), asked of the replica actors directly.
"""

from __future__ import annotations

import time

import httpx
import pytest

from loadtests import placement as placement_bench
from tests.fixtures.models import get_model_path
from tests.fixtures.serve_app import app_args, deployed_app

pytestmark = pytest.mark.integration

APP_NAME = "placement"
ROUTE_PREFIX = "/placement"
# Short enough that the deadline test's ~1900 tokens (2.6 s measured on the 2-core box; CI
# once finished them inside 3 s) run past it with a 2x margin, long enough for the
# 4-token turns of the session test (~0.1 s).
TIMEOUT_S = 1.2
NUM_SESSIONS = 4
NUM_TURNS = 4


@pytest.fixture(scope="module")
def placement_app(ray_cluster, redis_server, http_port):
    args = app_args(
        get_model_path("tiny"),
        redis_server.url,
        compute={"num_replicas": 2, "num_cpus": 0.5},
        limits={"request_timeout_s": TIMEOUT_S},
    )
    with deployed_app(args, APP_NAME, ROUTE_PREFIX, http_port) as base_url:
        yield base_url


def replica_stats() -> dict[str, dict]:
    return placement_bench.replica_stats(APP_NAME)


def wait_for_replicas(n: int) -> dict[str, dict]:
    return placement_bench.wait_for_replicas(n, timeout_s=60, app=APP_NAME)


def chat_turn(client: httpx.Client, session_id: str, text: str) -> None:
    body = {
        "model": "tiny-llama",
        "messages": [{"role": "user", "content": text}],
        "max_tokens": 4,
        "temperature": 0,
        "ignore_eos": True,
    }
    r = client.post("/v1/chat/completions", json=body, headers={"X-Session-Id": session_id})
    assert r.status_code == 200, r.text


def test_turns_of_a_session_land_on_one_replica(placement_app):
    assert len(wait_for_replicas(2)) == 2
    homes = []
    with httpx.Client(base_url=placement_app, timeout=60) as client:
        for s in range(NUM_SESSIONS):
            sid = client.post("/v1/sessions").json()["id"]
            before = {n: st["num_requests"] for n, st in replica_stats().items()}
            for t in range(NUM_TURNS):
                chat_turn(client, sid, f"session {s} turn {t}: the river runs past the old stone mill")
            after = replica_stats()
            served = {n: after[n]["num_requests"] - before[n] for n in before}
            # Plain power-of-two-choices would split 4 turns over 2 idle replicas (all on
            # one with probability 1/8 per session).
            assert sorted(served.values()) == [0, NUM_TURNS], served
            home = max(served, key=served.get)
            homes.append(home)
            # The home replica's L1 holds this session's blocks, and it reports them.
            assert after[home]["prefix_keys"], "the serving replica reported no cached blocks"
    print("session homes:", homes)


def test_request_past_its_deadline_gets_504_and_is_aborted(placement_app):
    # Long enough to run well past the deadline: 1900 tokens take ~2.6 s on this model.
    body = {
        "model": "tiny-llama",
        "prompt": list(range(10, 110)),
        "max_tokens": 1900,
        "temperature": 0,
        "ignore_eos": True,
    }
    with httpx.Client(base_url=placement_app, timeout=60) as client:
        started = time.monotonic()
        r = client.post("/v1/completions", json=body)
        answered = time.monotonic()
    assert r.status_code == 504, r.text
    error = r.json()["error"]
    assert error["type"] == "timeout" and "longer" in error["message"]
    assert TIMEOUT_S - 0.1 <= answered - started < TIMEOUT_S + 2.0
    # The sequence was aborted: no replica is still running it shortly after (it had
    # hundreds of tokens, more than a second of decoding, left).
    deadline = answered + 1.0
    while True:
        running = {n: st["num_running"] for n, st in replica_stats().items()}
        if not any(running.values()):
            break
        assert time.monotonic() < deadline, f"still running after the 504: {running}"
        time.sleep(0.05)
