"""When the router asks the data plane for a prefetch (``dataplane.prefetch``): with
``when_queued`` only while no worker is idle (the request will wait); with an idle worker
the request leaves at once and the worker's own lookup follows, so a prefetch would only
add a data-plane call in front of it. Test doubles for the handles; no Ray cluster."""

import asyncio

import pytest

from deployments.compute.engines.protocol import GenerationRequest, SamplingParams
from deployments.router import placement
from deployments.router.deployment import Router


class _Calls:
    def __init__(self):
        self.calls = []

    def remote(self, *args, **kwargs):
        self.calls.append((args, kwargs))

        async def done():
            return 0

        return done()


class _DataPlane:
    def __init__(self):
        self.prefetch = _Calls()


class _Worker:
    def options(self, **_):
        return self


def _router(policy: str, dataplane: _DataPlane) -> Router:
    config = {"dataplane": {"prefetch": policy, "block_size": 16}, "engine": {"name": "torch"}}
    return Router(_Worker(), config, dataplane)


def _session_request() -> GenerationRequest:
    r = GenerationRequest("req-1", list(range(100, 150)), SamplingParams(max_tokens=4))
    r.session_id = "sess_x"
    return r


@pytest.fixture
def one_worker(monkeypatch):
    monkeypatch.setattr(placement.TRACKER, "_num_replicas", 1)


@pytest.mark.parametrize(
    "policy, inflight, expected",
    [
        ("when_queued", 0, 0),  # idle worker: dispatched at once, no prefetch
        ("when_queued", 1, 1),  # every worker busy: the request waits, prefetch
        ("always", 0, 1),
        ("off", 1, 0),
    ],
)
async def test_prefetch_policy(one_worker, policy, inflight, expected):
    dp = _DataPlane()
    router = _router(policy, dp)
    router._num_inflight = inflight
    router._prefetch(_session_request())
    await asyncio.sleep(0)
    assert len(dp.prefetch.calls) == expected
    if expected:
        (tenant, hashes), kwargs = dp.prefetch.calls[0]
        # 49 tokens before the last: three whole 16-token blocks, sharded by the first.
        assert len(hashes) == 3 and kwargs["shard_key"] == hashes[0]


async def test_no_prefetch_for_requests_without_a_session(one_worker):
    dp = _DataPlane()
    router = _router("always", dp)
    request = _session_request()
    request.session_id = None
    router._prefetch(request)
    assert dp.prefetch.calls == []
