"""Faults and overload under load, through the whole application over HTTP (loopback only;
every phase bounded in requests and time).

* A ComputeWorker replica is killed (``ray.kill`` of its actor: the process is gone) under
  steady non-streaming load on two replicas: at least 99.9% of the requests succeed, and a
  new replica is running and taking requests within 30 s. (Non-streaming requests are
  counted because a client of one sees nothing until the reply is complete; a stream that
  already had tokens when its replica died ends with an error event by design, see
  test_fault_recovery.py.)
* A DataPlane replica is killed under session traffic: no request fails and every
  acknowledged turn is in its session afterwards, once and in order. (Redis stopping
  under session traffic is test_redis_outage.py.)
* Overload at 4x the capacity measured here first: every request not served gets 429 with
  Retry-After, quickly (p99 < 1 s); accepted requests keep a p99 bounded by the admission
  queue (twice max_queue_depth / the rate accepted requests complete at, plus 2 s); the
  resident memory of every replica process of the app stays flat.

One application ("loadfaults" at "/loadfaults") beside the shared "llm" app: two torch
ComputeWorkers, two DataPlane replicas, a small router queue. Each test starts from a
healthy app (all replicas running, /ready 200). Deployment names come from
``serve.status()``; nothing is asked of the router.
"""

from __future__ import annotations

import asyncio
import gc
import math
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

import httpx
import pytest

from tests.fixtures.engines import thread_nices
from tests.fixtures.load import Outcome, completion_body, fault_app_args, open_loop
from tests.fixtures.models import get_model_path
from tests.fixtures.serve_app import ServeLogTail, deployed_app, wait_for, wait_ready

pytestmark = pytest.mark.integration

APP_NAME = "loadfaults"
ROUTE_PREFIX = "/loadfaults"
MAX_QUEUE_DEPTH = 16
REPLICA_BACK_WITHIN_S = 30.0
# How often the test asks Ray and Serve whether the replacement serves. Each poll is three
# RPCs (GCS, Serve's controller, the replica) and this process runs at nice 0 while Ray's
# workers run at nice 15: at 20 polls/s this process took ~30% of a core while it waited
# (~6% before the kill, ~15% at 4 polls/s; `top`), from the replica it was waiting for.
# A replica found later than it was ready only counts against the bound.
POLL_INTERVAL_S = 0.25
MIN_SUCCESS_RATE = 0.999
REJECT_P99_S = 1.0
OVERLOAD_FACTOR = 4.0
OVERLOAD_S = 8.0
# Long enough that 4x capacity overloads the engines, not the HTTP front. Each request
# costs the front ~13 ms of CPU whatever its length (Serve's proxy ~4.4, the ingress ~6,
# this client ~3: per-process CPU during an overload at 50 req/s), on the same 2 cores as
# the engines. At 256 tokens capacity measured 6-15 req/s from minute to minute, so 4x
# offered 23-62 req/s, and the 429 p99 followed the offered rate, not the queue bound:
# 0.04-0.20 s at 23-33 req/s (6 runs), 0.11-1.03 s at 37-50 (12), 0.36-1.60 s at 53-62
# (8, CI's failure among them); all before engine.cpu_nice, which since runs the engines
# below the front (loadtests/overload.py). At 512 tokens: capacity 4.5-7.3 req/s, offered
# 18-30, 429 p99 56-166 ms (4 runs).
OVERLOAD_MAX_TOKENS = 512
CAPACITY_PROBE_S = 6.0
CAPACITY_CLIENTS = 16  # = the engine slots of both replicas (2 x max_num_seqs 8)
# The accepted-request p99 bound: the admission queue drained at the accepted rate, twice, plus this.
ACCEPTED_P99_SLACK_S = 2.0
# Resident memory of one replica process may grow by at most this much during overload.
RSS_GROWTH_BOUND = (1.25, 64 << 20)  # factor, plus bytes


@pytest.fixture(scope="module")
def lf_app(ray_cluster, redis_server, http_port):
    args = fault_app_args(get_model_path("tiny"), redis_server.url, MAX_QUEUE_DEPTH)
    with deployed_app(args, APP_NAME, ROUTE_PREFIX, http_port) as base_url:
        yield base_url


# ---- helpers ------------------------------------------------------------------------


def _replica_names(deployment: str) -> set[str]:
    import ray

    prefix = f"SERVE_REPLICA::{APP_NAME}#{deployment}#"
    return {a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith(prefix)}


def _running_replicas(deployment: str) -> int:
    from ray import serve

    status = serve.status().applications[APP_NAME].deployments[deployment]
    return status.replica_states.get("RUNNING", 0)


def _wait_healthy(base_url: str, timeout_s: float = 120) -> None:
    """All deployments of the app at their target with every replica running."""
    from ray import serve

    deadline = time.monotonic() + timeout_s
    while True:
        status = serve.status().applications[APP_NAME]
        if status.status == "RUNNING" and all(
            d.status == "HEALTHY" and set(d.replica_states) == {"RUNNING"} for d in status.deployments.values()
        ):
            break
        assert time.monotonic() < deadline, f"app not healthy after {timeout_s}s: {status}"
        time.sleep(0.5)
    wait_ready(base_url, timeout_s=max(5.0, deadline - time.monotonic()))


def _kill_replica(name: str) -> None:
    import ray

    ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)


def _ongoing(name: str) -> int:
    """Requests the replica holds now (Serve's own count on the replica actor)."""
    import ray

    try:
        return ray.get(ray.get_actor(name, namespace="serve").get_num_ongoing_requests.remote(), timeout=5)
    except Exception:  # noqa: BLE001 - a replica still starting or gone
        return 0


@dataclass
class SteadyLoad:
    """``concurrency`` client threads, each sending non-streaming completions back to back
    until stopped."""

    base_url: str
    concurrency: int = 4
    max_tokens: int = 8
    outcomes: list[Outcome] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)

    def _run(self) -> None:
        with httpx.Client(base_url=self.base_url, timeout=httpx.Timeout(90, connect=10)) as client:
            while not self._stop.is_set():
                started = time.monotonic()
                try:
                    r = client.post("/v1/completions", json=completion_body(self.max_tokens))
                    outcome = Outcome(r.status_code, time.monotonic() - started, r.text[:300])
                except httpx.HTTPError as e:
                    outcome = Outcome(-1, time.monotonic() - started, repr(e))
                self.outcomes.append(outcome)

    def __enter__(self):
        self._threads = [threading.Thread(target=self._run, daemon=True) for _ in range(self.concurrency)]
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=120)

    def failures(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.status != 200]


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(q * len(ordered)) - 1)]


# ---- ComputeWorker replica killed under steady load ---------------------------------


def test_compute_replica_killed_under_load(lf_app):
    base_url = lf_app
    _wait_healthy(base_url)
    before = _replica_names("ComputeWorker")
    assert len(before) == 2, before
    logs = ServeLogTail(APP_NAME)

    with SteadyLoad(base_url, concurrency=4) as load:
        time.sleep(3)
        served_before_kill = len(load.outcomes)
        assert served_before_kill > 0, "no request finished before the kill"
        # The real fault: the replica dies while it holds requests.
        def busiest_replica():
            name, ongoing = max(((n, _ongoing(n)) for n in before), key=lambda kv: kv[1])
            return (name, ongoing) if ongoing > 0 else None

        victim, in_flight_on_victim = wait_for(busiest_replica, 10, "a replica holding requests", 0.01)
        _kill_replica(victim)
        killed_at = time.monotonic()

        # A new replica: running (per serve.status) and taking requests.
        seen: dict[str, float] = {}

        def new_replica_serving():
            names = _replica_names("ComputeWorker")
            fresh = names - before
            now = time.monotonic() - killed_at
            if victim not in names:
                seen.setdefault("victim gone", now)
            if fresh:
                seen.setdefault("new actor", now)
            if victim in names or not fresh or _running_replicas("ComputeWorker") < 2:
                return None
            seen.setdefault("running", now)
            return next((n for n in fresh if _ongoing(n) > 0), None)

        new = wait_for(
            new_replica_serving, REPLICA_BACK_WITHIN_S + 30, "a new ComputeWorker replica serving", POLL_INTERVAL_S
        )
        back_after_s = time.monotonic() - killed_at
        time.sleep(2)  # steady load on the recovered pair

    total = len(load.outcomes)
    failures = load.failures()
    success_rate = 1 - len(failures) / total
    print(
        f"[compute kill] {total} requests ({served_before_kill} before the kill, "
        f"{in_flight_on_victim} in flight on the killed replica), "
        f"{len(failures)} failed, success {success_rate:.4%}; replacement {new.rsplit('#', 1)[-1]} "
        f"serving {back_after_s:.1f}s after the kill ("
        + ", ".join(f"{k} at {v:.1f}s" for k, v in seen.items())
        + ")"
    )
    for f in failures[:5]:
        print(f"  failed: {f.status} after {f.latency_s:.2f}s {f.body}")
    assert back_after_s <= REPLICA_BACK_WITHIN_S, f"replica back only after {back_after_s:.1f}s"
    assert success_rate >= MIN_SUCCESS_RATE, (
        f"{len(failures)} of {total} requests failed ({success_rate:.4%} succeeded): "
        f"{[(f.status, f.body[:120]) for f in failures[:5]]}\n{logs.report()}"
    )


# ---- DataPlane replica killed under session traffic ---------------------------------


# ~25 tokens a turn (prompt and reply in the history): 40 turns stay well inside 2048.
TURNS_PER_SESSION = 40


def test_dataplane_replica_killed_under_session_traffic_loses_no_turn(lf_app):
    base_url = lf_app
    _wait_healthy(base_url)
    before = _replica_names("DataPlane")
    assert len(before) == 2, before
    logs = ServeLogTail(APP_NAME)
    with httpx.Client(base_url=base_url, timeout=30) as client:
        sessions = [client.post("/v1/sessions").json()["id"] for _ in range(6)]
    acknowledged = {sid: 0 for sid in sessions}
    failures: list[str] = []
    stop = threading.Event()

    def post(client: httpx.Client, what: str, status: int, path: str, **kwargs) -> httpx.Response | None:
        """The answer if it has ``status``; else None, with the failure recorded."""
        try:
            r = client.post(path, **kwargs)
        except httpx.HTTPError as e:
            failures.append(f"{what}: {e!r}")
            return None
        if r.status_code != status:
            failures.append(f"{what}: {r.status_code} {r.text[:200]}")
            return None
        return r

    def talk(sid: str) -> None:
        with httpx.Client(base_url=base_url, timeout=httpx.Timeout(90, connect=10)) as client:
            while not stop.is_set():
                n = acknowledged[sid]
                if n == TURNS_PER_SESSION:
                    # The history would soon outgrow the model's context (a CI run whose
                    # replacement replica came slowly reached turn 82, 2061 tokens, and
                    # got the over-context 400): go on in a fresh session, checked alike.
                    if (r := post(client, f"new session after {sid}", 201, "/v1/sessions")) is None:
                        return
                    sid = r.json()["id"]
                    acknowledged[sid] = n = 0
                r = post(
                    client,
                    f"{sid} turn {n}",
                    200,
                    "/v1/chat/completions",
                    headers={"X-Session-Id": sid},
                    json={
                        "model": "tiny-llama",
                        "messages": [{"role": "user", "content": f"turn {n}"}],
                        "max_tokens": 4,
                        "temperature": 0,
                    },
                )
                if r is None:
                    return  # the session's next turn would conflict; stop this talker
                acknowledged[sid] = n + 1

    threads = [threading.Thread(target=talk, args=(sid,), daemon=True) for sid in sessions]
    for t in threads:
        t.start()
    try:
        time.sleep(2)
        at_kill = sum(list(acknowledged.values()))  # list(): one C call, talkers add keys
        # Preferably while it holds calls (session reads/appends, KV lookups and puts are
        # short, so give it a few seconds); else the loss of an idle shard is the fault.
        busy_until = time.monotonic() + 5
        victim, in_flight_on_victim = min(before), 0
        while time.monotonic() < busy_until:
            name, ongoing = max(((n, _ongoing(n)) for n in before), key=lambda kv: kv[1])
            if ongoing > 0:
                victim, in_flight_on_victim = name, ongoing
                break
        _kill_replica(victim)
        killed_at = time.monotonic()
        wait_for(
            lambda: victim not in (names := _replica_names("DataPlane"))
            and len(names) == 2
            and _running_replicas("DataPlane") == 2,
            60,
            "a new DataPlane replica",
            0.25,
        )
        back_after_s = time.monotonic() - killed_at
        time.sleep(2)  # traffic on the new replica set
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=120)

    total = sum(acknowledged.values())
    print(
        f"[dataplane kill] {total} turns acknowledged ({at_kill} before the kill, "
        f"{in_flight_on_victim} calls in flight on the killed replica) over "
        f"{len(acknowledged)} sessions, {len(failures)} failed; new replica after {back_after_s:.1f}s"
    )
    assert not failures, f"{failures[:5]}\n{logs.report()}"
    assert total > at_kill, "no turn was acknowledged after the kill"
    with httpx.Client(base_url=base_url, timeout=30) as client:
        for sid, n in acknowledged.items():
            record = client.get(f"/v1/sessions/{sid}").json()
            users = [m["content"] for m in record["messages"] if m["role"] == "user"]
            assert users == [f"turn {i}" for i in range(n)], (sid, n, users)
            assert record["version"] == n, (sid, record["version"], n)


# ---- overload at 4x measured capacity -------------------------------------------------


def _replica_rss(deployments: list[str]) -> dict[int, tuple[str, int]]:
    """pid -> (deployment, RSS bytes) of this app's replica processes (found by their
    process title, ``ray::ServeReplica:<app>:<deployment>``)."""
    import psutil

    found = {}
    for proc in psutil.process_iter(["pid", "cmdline"]):
        title = " ".join(proc.info["cmdline"] or [])
        for d in deployments:
            if title.startswith(f"ray::ServeReplica:{APP_NAME}:{d}"):
                try:
                    found[proc.pid] = (d, proc.memory_info().rss)
                except psutil.Error:
                    pass
    return found


def _measure_capacity(base_url: str, max_tokens: int) -> tuple[float, float]:
    """Completed requests per second with enough clients to keep every engine slot busy,
    and the median latency of one request then."""
    with SteadyLoad(base_url, concurrency=CAPACITY_CLIENTS, max_tokens=max_tokens) as load:
        time.sleep(1)  # ramp up
        first = len(load.outcomes)
        t0 = time.monotonic()
        time.sleep(CAPACITY_PROBE_S)
        done = len(load.outcomes) - first
        elapsed = time.monotonic() - t0
    assert not load.failures(), [(f.status, f.body) for f in load.failures()[:5]]
    return done / elapsed, _percentile([o.latency_s for o in load.outcomes], 0.5)


def test_overload_at_4x_capacity_rejects_fast_and_stays_flat(lf_app):
    base_url = lf_app
    from ray import serve

    _wait_healthy(base_url)
    deployments = list(serve.status().applications[APP_NAME].deployments)
    max_tokens = OVERLOAD_MAX_TOKENS  # see its definition
    capacity, median_s = _measure_capacity(base_url, max_tokens)
    assert capacity > 0
    rss_before = _replica_rss(deployments)
    assert {d for d, _ in rss_before.values()} >= {"Ingress", "ComputeWorker"}, rss_before
    for pid, (deployment, _) in rss_before.items():
        if deployment == "ComputeWorker":
            # engine.cpu_nice (default 4): the engine's threads below the replica's others.
            nices = thread_nices(pid)
            assert max(nices.values()) == min(19, nices[pid] + 4), (pid, nices)

    rate = OVERLOAD_FACTOR * capacity
    # This process's heap (Ray, Serve, pytest) made full collections of 0.1-0.33 s, which
    # landed in the latencies it measures; what exists now lives to the end of the test.
    gc.collect()
    gc.freeze()
    try:
        outcomes, offered = asyncio.run(open_loop(base_url, rate, OVERLOAD_S, max_tokens))
    finally:
        gc.unfreeze()
    time.sleep(3)  # let the queue drain and the allocator settle
    rss_after = _replica_rss(deployments)

    accepted = [o for o in outcomes if o.status == 200]
    rejected = [o for o in outcomes if o.status == 429]
    other = [o for o in outcomes if o.status not in (200, 429)]
    reject_p99 = _percentile([o.latency_s for o in rejected], 0.99)
    accepted_p99 = _percentile([o.latency_s for o in accepted], 0.99)
    # Bounded = no longer than the admission queue implies (Little's law): at most
    # max_queue_depth requests are admitted, so one waits about max_queue_depth / the rate
    # they complete at. That rate is the one measured during the overload (on these 2
    # shared cores the engines slow down while the front answers the 429s); a queue
    # anywhere outside the bounded one (the HTTP proxy, the ingress) breaks the bound.
    first_sent = min(o.sent_at for o in outcomes)
    served_for_s = max(o.sent_at + o.latency_s for o in accepted) - first_sent if accepted else 1.0
    accepted_rate = len(accepted) / served_for_s
    accepted_bound = 2 * MAX_QUEUE_DEPTH / accepted_rate + ACCEPTED_P99_SLACK_S
    rss_lines = []
    for pid, (d, before_rss) in sorted(rss_before.items(), key=lambda kv: kv[1][0]):
        after_rss = rss_after.get(pid, (d, -1))[1]
        rss_lines.append(f"{d}[{pid}] {before_rss / 2**20:.0f}->{after_rss / 2**20:.0f} MiB")
    print(
        f"[overload] capacity {capacity:.1f} req/s (median {median_s * 1000:.0f} ms at {CAPACITY_CLIENTS} clients, {max_tokens} tokens each); "
        f"offered {offered:.1f} req/s for {OVERLOAD_S:.0f}s ({offered / capacity:.1f}x): "
        f"{len(accepted)} accepted at {accepted_rate:.1f} req/s (p99 {accepted_p99:.2f}s, bound "
        f"{accepted_bound:.2f}s; at capacity {2 * MAX_QUEUE_DEPTH / capacity + ACCEPTED_P99_SLACK_S:.2f}s), "
        f"{len(rejected)} rejected with 429 (p99 {reject_p99 * 1000:.0f} ms), {len(other)} other "
        f"{dict(Counter(o.status for o in other))}; "
        f"RSS {', '.join(rss_lines)}"
    )

    assert offered >= 0.875 * rate, f"the client offered only {offered:.1f} of {rate:.1f} req/s"
    assert not other, [(o.status, o.body) for o in other[:5]]
    assert rejected, "4x capacity produced no 429: the queue bound did not act"
    assert accepted, "nothing was served under overload"
    assert all(o.retry_after for o in rejected), "a 429 without Retry-After"
    assert reject_p99 < REJECT_P99_S, f"p99 of a 429 took {reject_p99:.2f}s"
    assert accepted_p99 <= accepted_bound, f"accepted p99 {accepted_p99:.2f}s over {accepted_bound:.2f}s"
    factor, extra = RSS_GROWTH_BOUND
    for pid, (d, before_rss) in rss_before.items():
        assert pid in rss_after, f"{d} process {pid} is gone after the overload"
        after_rss = rss_after[pid][1]
        assert after_rss <= before_rss * factor + extra, (
            f"{d}[{pid}] RSS grew {before_rss / 2**20:.0f} -> {after_rss / 2**20:.0f} MiB"
        )
