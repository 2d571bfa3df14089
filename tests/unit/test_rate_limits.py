"""Per-tenant rate limits (app/rate_limits.py) against a real redis-server: the buckets,
their headers and refusals, what a refused request leaves untouched, refunds, refill,
two limiters (two ingress replicas) sharing one bucket, and Redis down or refusing writes."""

from __future__ import annotations

import time

import pytest

from app.config import RateLimitsConfig, RedisConfig
from app.errors import RateLimitError
from app.rate_limits import RateLimiter, duration
from deployments.dataplane.keys import rate_key
from tests.fixtures.serve_app import free_port


def limiter(redis_server, **limits) -> RateLimiter:
    return RateLimiter(RateLimitsConfig.model_validate(limits), RedisConfig(url=redis_server.url))


@pytest.fixture
def fresh(redis_client):
    """Every tenant these tests use starts with full buckets."""
    for tenant in ("acme", "globex", "default"):
        redis_client.delete(rate_key(tenant))
    return redis_client


async def test_a_tenant_gets_its_requests_per_minute_then_a_429_that_says_when(redis_server, fresh):
    rl = limiter(redis_server, requests_per_minute=3)
    remaining = []
    for _ in range(3):
        grant = await rl.acquire("acme", 10)
        assert grant.tokens == 0  # no token limit: nothing to give back
        assert grant.headers["x-ratelimit-limit-requests"] == "3"
        assert "x-ratelimit-limit-tokens" not in grant.headers
        remaining.append(int(grant.headers["x-ratelimit-remaining-requests"]))
    assert remaining == [2, 1, 0]
    with pytest.raises(RateLimitError) as e:
        await rl.acquire("acme", 10)
    err = e.value
    assert err.status_code == 429 and err.code == "rate_limit_exceeded"
    assert "on requests per minute: limit 3" in err.message
    # One request refills every 20 s; the first of the three is due back in about 20 s.
    assert 15 <= int(err.headers["Retry-After"]) <= 20
    assert err.headers["x-ratelimit-remaining-requests"] == "0"
    await rl.close()


async def test_a_request_refused_for_its_tokens_uses_no_request(redis_server, fresh):
    rl = limiter(redis_server, requests_per_minute=2, tokens_per_minute=100)
    grant = await rl.acquire("acme", 60)
    assert grant.tokens == 60
    assert grant.headers["x-ratelimit-remaining-tokens"] == "40"
    assert grant.headers["x-ratelimit-remaining-requests"] == "1"
    with pytest.raises(RateLimitError) as e:
        await rl.acquire("acme", 60)
    assert "on tokens per minute: limit 100, requested 60" in e.value.message
    assert e.value.headers["x-ratelimit-remaining-requests"] == "1"  # still there
    assert (await rl.acquire("acme", 10)).headers["x-ratelimit-remaining-requests"] == "0"
    with pytest.raises(RateLimitError, match="on requests per minute"):
        await rl.acquire("acme", 1)
    await rl.close()


async def test_more_tokens_than_a_minutes_worth_is_refused_without_a_retry_after(redis_server, fresh):
    rl = limiter(redis_server, tokens_per_minute=100)
    with pytest.raises(RateLimitError) as e:
        await rl.acquire("acme", 101)
    assert "Request too large" in e.value.message and "requested 101" in e.value.message
    assert "Retry-After" not in e.value.headers
    assert (await rl.acquire("acme", 100)).tokens == 100  # the refusal charged nothing
    await rl.close()


async def test_unused_tokens_go_back_to_the_bucket(redis_server, fresh):
    rl = limiter(redis_server, tokens_per_minute=1000)
    grant = await rl.acquire("acme", 1000)
    with pytest.raises(RateLimitError):
        await rl.acquire("acme", 700)
    await rl.refund(grant, 800)  # it generated 200 of what it was charged
    assert int((await rl.acquire("acme", 700)).headers["x-ratelimit-remaining-tokens"]) in (100, 101)
    await rl.refund(grant, 5000)  # never more than it was charged, nor past a full bucket
    assert (await rl.acquire("acme", 1000)).tokens == 1000
    await rl.close()


async def test_the_bucket_refills_as_time_passes(redis_server, fresh):
    rl = limiter(redis_server, requests_per_minute=60)  # one a second
    admitted = 0
    with pytest.raises(RateLimitError):
        for _ in range(200):
            await rl.acquire("acme", 1)
            admitted += 1
    assert 60 <= admitted <= 62  # a minute's worth (and what refilled meanwhile)
    time.sleep(1.2)
    await rl.acquire("acme", 1)
    await rl.close()


async def test_replicas_share_a_tenants_bucket_and_tenants_have_their_own(redis_server, fresh):
    config = {"requests_per_minute": 2, "tenants": {"globex": {"tokens_per_minute": 50}}}
    one, two = limiter(redis_server, **config), limiter(redis_server, **config)
    await one.acquire("acme", 1)
    await two.acquire("acme", 1)
    with pytest.raises(RateLimitError):
        await one.acquire("acme", 1)
    # globex has its own entry: no request limit, 50 tokens a minute.
    for _ in range(5):
        grant = await two.acquire("globex", 10)
    assert "x-ratelimit-limit-requests" not in grant.headers
    with pytest.raises(RateLimitError, match="tokens per minute"):
        await one.acquire("globex", 10)
    # A tenant without limits (none at the top level here) is not even looked up.
    assert await limiter(redis_server, tenants={"globex": {"tokens_per_minute": 5}}).acquire("acme", 10**6) is None
    for rl in (one, two):
        await rl.close()


async def test_with_redis_down_requests_pass_unchecked():
    rl = RateLimiter(
        RateLimitsConfig(requests_per_minute=1),
        RedisConfig(url=f"redis://127.0.0.1:{free_port()}/0", connect_timeout_s=0.5, socket_timeout_s=0.5),
    )
    assert await rl.acquire("acme", 1) is None
    assert await rl.acquire("acme", 1) is None
    await rl.close()


async def test_a_redis_that_refuses_writes_lets_requests_pass(redis_server, fresh):
    rl = limiter(redis_server, requests_per_minute=1)
    policy = fresh.config_get("maxmemory-policy")["maxmemory-policy"]
    fresh.config_set("maxmemory-policy", "noeviction")
    fresh.config_set("maxmemory", 1)  # every write: OOM
    try:
        assert await rl.acquire("acme", 1) is None
        assert await rl.acquire("acme", 1) is None
    finally:
        fresh.config_set("maxmemory", 0)
        fresh.config_set("maxmemory-policy", policy)
    assert await rl.acquire("acme", 1) is not None  # checked again, the bucket full
    with pytest.raises(RateLimitError):
        await rl.acquire("acme", 1)
    await rl.close()


async def test_each_check_is_a_span_with_its_outcome(redis_server, fresh):
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from app import telemetry
    from app.config import TelemetryConfig

    if not isinstance(trace.get_tracer_provider(), TracerProvider):
        telemetry.setup(TelemetryConfig(), "test")
    exporter = InMemorySpanExporter()
    trace.get_tracer_provider().add_span_processor(SimpleSpanProcessor(exporter))
    rl = limiter(redis_server, requests_per_minute=1, tokens_per_minute=50)
    await rl.acquire("acme", 20)
    with pytest.raises(RateLimitError):
        await rl.acquire("acme", 20)
    spans = [s for s in exporter.get_finished_spans() if s.name == "ingress.rate_limit"]
    assert [s.attributes["llm.rate_limit.result"] for s in spans] == ["admitted", "refused"]
    assert spans[0].attributes["llm.tenant"] == "acme" and spans[0].attributes["llm.rate_limit.tokens"] == 20
    assert spans[0].attributes["llm.rate_limit.remaining_tokens"] == 30
    assert spans[1].attributes["llm.rate_limit.remaining_requests"] == 0
    await rl.close()


def test_waits_are_written_as_openai_writes_them():
    assert [duration(ms) for ms in (0, 120, 1000, 1500, 59_000, 60_000, 360_000, 61_500)] == [
        "0ms", "120ms", "1s", "1.5s", "59s", "1m0s", "6m0s", "1m2s",
    ]
