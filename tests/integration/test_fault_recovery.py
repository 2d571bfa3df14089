"""Engine death in a live app, for each engine: the stream that was producing tokens ends
with an error event and ``[DONE]``; requests that had no token yet (queued in the engine)
and requests sent during the outage are retried once by the router and succeed; Serve's
health check replaces the replica; ``/ready`` comes back. Each engine runs in its default
layout. With torch the ingress and its worker are apart, and the retry waits for the new
worker replica. With vLLM they share the "Server" replica that dies with its engine:
Serve stops it gracefully, and its router's retry goes to the replacement replica (a
peer, app/server.py) while the old one holds the client's connection.

Runs its own application ("faults" at "/faults", one worker replica running one sequence
at a time, so the others queue, and a 1 s health check) beside the shared "llm" app,
which it does not touch. Every wait is bounded.
"""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.fixtures.models import get_model_path
from tests.fixtures.serve_app import (
    ENGINE_ARGS,
    app_args,
    vllm_importable,
    wait_for,
    wait_ready,
    worker_deployment_name,
)

HEAP_PREFAULT_BYTES = 64 << 20

pytestmark = pytest.mark.integration

APP_NAME = "faults"
ROUTE_PREFIX = "/faults"
PROMPT = list(range(10, 42))
LONG_MAX_TOKENS = 2000  # the tiny model's context is 2048
SHORT_MAX_TOKENS = 8
NUM_QUEUED = 3
NUM_DURING_OUTAGE = 2
# Serving again within 60 s of the death, or, on a loaded machine, within a fresh start of
# the app plus 60 s (health-check detection, stopping the old replica, and starting the
# new one on a machine that is busy with that): a vLLM replica is three processes importing
# torch and vLLM (~35 s on a quiet 2-core machine, 90-140 s with other suites running).
RECOVERY_FLOOR_S = 60.0
RECOVERY_SLACK_S = 60.0
REQUEST_TIMEOUT_S = 150.0


@pytest.fixture(params=sorted(ENGINE_ARGS))
def faults_app(request, ray_cluster, redis_server, http_port):
    from ray import serve

    from app.builder import build_app

    engine = request.param
    if engine == "vllm" and not vllm_importable():
        pytest.skip("vLLM is not installed here")
    # One sequence at a time: while the long stream runs, the others wait in the engine.
    engine_args = {**ENGINE_ARGS[engine], "max_num_seqs": 1}
    args = app_args(
        get_model_path("tiny"),
        redis_server.url,
        engine=engine_args,
        # A stopping Server replica keeps the requests it retries on its replacement for
        # up to graceful_shutdown_timeout_s: longer than the replacement's start.
        compute={"health_check_period_s": 1.0, "health_check_timeout_s": 5.0, "graceful_shutdown_timeout_s": 300},
        limits={"request_timeout_s": REQUEST_TIMEOUT_S},
        dataplane={"enabled": False},
        # Off by default (it slowed L3 loads, loadtests/README.md); on here, small, so that
        # a real replica, and the one that replaces it, run its path.
        serve_runtime={"prefault_heap_bytes": HEAP_PREFAULT_BYTES},
    )
    base_url = f"http://127.0.0.1:{http_port}{ROUTE_PREFIX}"
    started = time.monotonic()
    try:
        serve.run(build_app(args), name=APP_NAME, route_prefix=ROUTE_PREFIX, blocking=False)
        wait_ready(base_url, timeout_s=240)
        budget_s = max(RECOVERY_FLOOR_S, time.monotonic() - started + RECOVERY_SLACK_S)
        handle = serve.get_deployment_handle(worker_deployment_name(APP_NAME), app_name=APP_NAME)
        yield engine, base_url, handle, budget_s
    finally:
        serve.delete(APP_NAME)


def _body(max_tokens: int, stream: bool) -> dict:
    return {
        "model": "tiny-llama",
        "prompt": PROMPT,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": stream,
    }


class LongStream(threading.Thread):
    """A streaming completion read in the background: its events, in order."""

    def __init__(self, base_url: str):
        super().__init__(daemon=True)
        self.base_url = base_url
        self.events: list = []  # parsed JSON payloads, and "[DONE]"
        self.first_token = threading.Event()
        self.error: BaseException | None = None

    def run(self):
        try:
            with httpx.stream(
                "POST",
                self.base_url + "/v1/completions",
                json=_body(LONG_MAX_TOKENS, stream=True),
                timeout=httpx.Timeout(REQUEST_TIMEOUT_S, connect=10),
            ) as r:
                assert r.status_code == 200, r.read()
                for line in r.iter_lines():
                    if not line.startswith("data: "):
                        continue
                    data = line[len("data: ") :]
                    event = data if data == "[DONE]" else json.loads(data)
                    self.events.append(event)
                    if isinstance(event, dict) and event.get("choices"):
                        self.first_token.set()
        except BaseException as e:  # noqa: BLE001 - reported by the test
            self.error = e
        finally:
            self.first_token.set()


def _complete(base_url: str) -> tuple[int, dict, float]:
    r = httpx.post(
        base_url + "/v1/completions",
        json=_body(SHORT_MAX_TOKENS, stream=False),
        timeout=httpx.Timeout(REQUEST_TIMEOUT_S, connect=10),
    )
    return r.status_code, r.json(), time.monotonic()


def _worker_replicas() -> set[str]:
    import ray

    prefix = f"SERVE_REPLICA::{APP_NAME}#{worker_deployment_name(APP_NAME)}#"
    return {a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith(prefix)}


def _retries_counted(base_url: str) -> float:
    text = httpx.get(base_url + "/metrics", timeout=10).text
    total = 0.0
    for line in text.splitlines():
        if line.startswith("ray_llm_router_retries") and not line.startswith("#"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_engine_death_fails_running_stream_retries_queued_and_replaces_replica(faults_app):
    engine, base_url, worker, budget_s = faults_app
    before = _worker_replicas()
    assert len(before) == 1, before

    long_stream = LongStream(base_url)
    long_stream.start()
    assert long_stream.first_token.wait(60), "the long stream produced no token"
    assert long_stream.error is None, long_stream.error

    with ThreadPoolExecutor(NUM_QUEUED + NUM_DURING_OUTAGE) as pool:
        queued = [pool.submit(_complete, base_url) for _ in range(NUM_QUEUED)]
        # They sit behind the long stream in the engine (max_num_seqs=1), with no token.
        wait_for(
            lambda: worker.stats.remote().result(timeout_s=5).num_waiting >= NUM_QUEUED,
            30,
            "the short requests to queue in the engine",
        )
        assert long_stream.is_alive(), "the long stream ended before the engine was killed"

        killed_pids = worker.debug_kill_engine.remote().result(timeout_s=10)
        killed_at = time.monotonic()
        if engine == "vllm":
            assert killed_pids, "no EngineCore child process was found"
        during_outage = [pool.submit(_complete, base_url) for _ in range(NUM_DURING_OUTAGE)]

        # (1) The running stream ends, promptly, with an error event and [DONE].
        long_stream.join(30)
        assert not long_stream.is_alive(), "the running stream hangs after the engine died"
        assert long_stream.error is None, long_stream.error
        assert long_stream.events[-1] == "[DONE]"
        error_event = long_stream.events[-2]
        assert isinstance(error_event, dict) and "error" in error_event, long_stream.events[-3:]
        assert error_event["error"]["type"] == "service_unavailable", error_event
        assert not any(
            isinstance(e, dict) and any(c.get("finish_reason") for c in e.get("choices", []))
            for e in long_stream.events
        ), "the long stream finished normally: the engine died too late"

        # Queued and new requests succeed after the router's retry, within the budget.
        recovered_s = 0.0
        for future in queued + during_outage:
            status, body, done_at = future.result(timeout=REQUEST_TIMEOUT_S + 30)
            assert status == 200, body
            assert body["usage"]["completion_tokens"] == SHORT_MAX_TOKENS, body
            recovered_s = max(recovered_s, done_at - killed_at)
            assert recovered_s < budget_s, f"served again only {recovered_s:.1f}s after the engine died"
    print(f"[{engine}] stream failed, retried requests served {recovered_s:.1f}s after the kill "
          f"(budget {budget_s:.0f}s)")

    # Serve replaced the replica (the old one is gone, a new one serves).
    after = wait_for(
        lambda: (lambda now: now if now and not (now & before) else None)(_worker_replicas()),
        30,
        "Serve to replace the worker replica",
    )
    assert len(after) == 1, after

    # (2) /ready is 200 again, and the app serves a fresh request.
    wait_ready(base_url, timeout_s=max(5.0, budget_s - (time.monotonic() - killed_at)))
    status, body, _ = _complete(base_url)
    assert status == 200, body

    # Each retry was counted (the metric reaches /metrics within a few report intervals).
    assert wait_for(lambda: _retries_counted(base_url) >= 1, 30, "llm_router_retries in /metrics")


def _metric_values(base_url: str, name: str, **labels) -> list[float]:
    """Values of ``name``'s samples in /metrics that carry all of ``labels``."""
    want = [f'{k}="{v}"' for k, v in labels.items()]
    text = httpx.get(base_url + "/metrics", timeout=60).text
    return [
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name + "{") and all(w in line for w in want)
    ]


def test_a_torch_worker_prefaults_its_heap(faults_app):
    """``serve_runtime.prefault_heap_bytes``: the torch worker's replica touched that much
    malloc heap before it reported ready, which it does only on one malloc arena with freed
    memory kept (app/host_memory.py); the gauge says how far it got."""
    engine, base_url, _handle, _budget_s = faults_app
    if engine != "torch":
        pytest.skip("the torch engine's KV buffers only")

    def all_done():
        values = _metric_values(base_url, "ray_llm_heap_prefaulted_bytes", component="ComputeWorker")
        return values and all(v == HEAP_PREFAULT_BYTES for v in values)

    assert wait_for(all_done, 90, f"llm_heap_prefaulted_bytes = {HEAP_PREFAULT_BYTES} in /metrics")
