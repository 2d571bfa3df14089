"""Placement and deadlines through real Serve apps (tiny model, torch engine, data plane
on): with two ComputeWorker replicas every turn of a session lands on one replica; a request
past ``limits.request_timeout_s`` gets a 504 in the OpenAI error shape while its sequence is
aborted in the engine.

Runs two applications of its own beside the shared "llm" app: "placement" (two replicas,
the default deadline) and "deadline" (one replica, a deadline far shorter than the long
request takes on any machine seen). Which replica served what is read from each replica's
routing stats (``num_requests``, ``num_running``, ``prefix_keys``), asked of the replica
actors directly.
"""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from loadtests import placement as placement_bench
from tests.fixtures.models import get_model_path
from tests.fixtures.serve_app import app_args, deployed_app

pytestmark = pytest.mark.integration

APP_NAME = "placement"
ROUTE_PREFIX = "/placement"
DEADLINE_APP = "deadline"
DEADLINE_PREFIX = "/deadline"
# The deadline app's limit. The long request's 1900 tokens took 2.6 s on the 2-core box and
# under 1.2 s once in CI (when a limit of 1.2 s let it finish with a 200), so at the fastest
# seen it still runs 4x past this limit, with ~1400 tokens (~0.9 s) left when it is cut.
TIMEOUT_S = 0.3
NUM_SESSIONS = 4
NUM_TURNS = 4


def _tiny_app(redis_url: str, http_port: int, name: str, prefix: str, replicas: int, **overrides):
    args = app_args(get_model_path("tiny"), redis_url, compute={"num_replicas": replicas, "num_cpus": 0.5}, **overrides)
    return deployed_app(args, name, prefix, http_port)


@pytest.fixture(scope="module")
def placement_app(ray_cluster, redis_server, http_port):
    with _tiny_app(redis_server.url, http_port, APP_NAME, ROUTE_PREFIX, 2) as base_url:
        yield base_url


@pytest.fixture(scope="module")
def deadline_app(ray_cluster, redis_server, http_port):
    limits = {"request_timeout_s": TIMEOUT_S}
    with _tiny_app(redis_server.url, http_port, DEADLINE_APP, DEADLINE_PREFIX, 1, limits=limits) as base_url:
        yield base_url


def replica_stats(app: str = APP_NAME) -> dict[str, dict]:
    return placement_bench.replica_stats(app)


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


def test_request_past_its_deadline_gets_504_and_is_aborted(deadline_app):
    (replica,) = placement_bench.wait_for_replicas(1, timeout_s=60, app=DEADLINE_APP)
    # Far longer than the deadline on any machine seen (see TIMEOUT_S).
    body = {
        "model": "tiny-llama",
        "prompt": list(range(10, 110)),
        "max_tokens": 1900,
        "temperature": 0,
        "ignore_eos": True,
    }
    with httpx.Client(base_url=deadline_app, timeout=60) as client:
        # A fresh replica's first call pays one-off costs that could pass so short a
        # deadline before the engine even starts: warm the path with short requests.
        warm = {**body, "max_tokens": 4}
        codes = [client.post("/v1/completions", json=warm).status_code for _ in range(3)]
        assert codes[-1] == 200, codes
    before = replica_stats(DEADLINE_APP)[replica]["num_requests"]
    seen_running = threading.Event()
    answered_event = threading.Event()

    def watch() -> None:
        # Whether the sequence reached the engine before the 504 (not cut in the queue).
        while not answered_event.is_set():
            if replica_stats(DEADLINE_APP)[replica]["num_running"]:
                seen_running.set()
                return
            time.sleep(0.02)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    with httpx.Client(base_url=deadline_app, timeout=60) as client:
        started = time.monotonic()
        r = client.post("/v1/completions", json=body)
        answered = time.monotonic()
    answered_event.set()
    watcher.join(timeout=5)
    assert r.status_code == 504, r.text
    error = r.json()["error"]
    assert error["type"] == "timeout" and "longer" in error["message"]
    assert TIMEOUT_S - 0.1 <= answered - started < TIMEOUT_S + 2.0
    assert replica_stats(DEADLINE_APP)[replica]["num_requests"] == before + 1
    assert seen_running.is_set(), "the request was never running in the engine before its 504"
    # The sequence was aborted: the engine stops running it well before its ~1400 tokens
    # left could have been decoded (0.9 s at the fastest rate seen).
    deadline = answered + 0.6
    while True:
        running = replica_stats(DEADLINE_APP)[replica]["num_running"]
        if not running:
            print(f"no longer running {time.monotonic() - answered:.2f}s after the 504")
            break
        assert time.monotonic() < deadline, f"still running {time.monotonic() - answered:.2f}s after the 504"
        time.sleep(0.05)
