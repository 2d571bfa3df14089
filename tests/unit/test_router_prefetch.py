"""When the router asks the data plane for a prefetch (``dataplane.prefetch``): with
``when_queued`` only while no worker is idle (the request will wait); with an idle worker
the request leaves at once, so a prefetch would only add a data-plane call in front of the
lookup. The router starts that lookup itself then (``kv_lookup``), for the worker to await
instead of asking; and the worker's connector falls back to its own call when the
router's failed. Test doubles for the handles; no Ray cluster."""

import asyncio
from types import SimpleNamespace

import pytest

from deployments.compute.engines.kv import PrefixHit
from deployments.compute.engines.protocol import EngineCapabilities, GenerationRequest, SamplingParams, TokenDelta
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


class _Started:
    """What a Serve handle call returns: ``_to_object_ref`` resolves once assigned."""

    def __init__(self, ref):
        self.ref = ref

    async def _to_object_ref(self):
        if isinstance(self.ref, Exception):
            raise self.ref
        return self.ref


class _Lookups:
    def __init__(self, ref="lookup-ref"):
        self.calls = []
        self.ref = ref

    def remote(self, *args, **kwargs):
        self.calls.append((args, kwargs))
        return _Started(self.ref)


class _DataPlane:
    def __init__(self):
        self.prefetch = _Calls()
        self.lookup_prefix = _Lookups()


class _Worker:
    """The worker's handle: capabilities (batching wanted, as the torch engine's) and a
    one-delta stream; records the KV lookup each request it got carried."""

    def __init__(self):
        self.sent = []
        self.capabilities = SimpleNamespace(remote=self._capabilities)
        self.generate = SimpleNamespace(remote=self._generate)

    def options(self, **_):
        return self

    async def _capabilities(self):
        return EngineCapabilities(wants_router_batching=True)

    def _generate(self, request, batch_key=None):
        self.sent.append((request.kv_lookup, request.kv_lookup_key))

        async def deltas():
            yield TokenDelta(text="x", token_ids=[7], finish_reason="length")

        return deltas()


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
    assert router._prefetch(_session_request()) == bool(expected)
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


async def test_router_starts_the_lookup_the_worker_would_make(one_worker):
    dp = _DataPlane()
    router = _router("when_queued", dp)
    request = _session_request()
    await router._start_kv_lookup(request)
    (tenant, hashes), kwargs = dp.lookup_prefix.calls[0]
    # With the L3 blocks as hashes: the worker reads those from Redis itself (the default).
    assert tenant == "default" and len(hashes) == 3
    assert kwargs == {"shard_key": hashes[0], "with_refs": True, "direct_l3": True}
    # What the engine checks against its own hashes before it awaits the call.
    assert request.kv_lookup == "lookup-ref" and request.kv_lookup_key == hashes[-1]


@pytest.mark.parametrize("case", ["vllm", "no_reuse", "short_prompt", "dataplane_down"])
async def test_no_router_lookup_when_it_cannot_serve_the_worker(one_worker, case):
    dp = _DataPlane()
    config = {"dataplane": {"block_size": 16, "kv_reuse": case != "no_reuse"},
              "engine": {"name": "vllm" if case == "vllm" else "torch"}}
    router = Router(_Worker(), config, dp)
    request = _session_request()
    if case == "short_prompt":
        request.prompt_token_ids = list(range(10))  # not one whole block
    if case == "dataplane_down":
        dp.lookup_prefix.ref = ConnectionError("no replica")
    await router._start_kv_lookup(request)  # never raises
    assert request.kv_lookup is None and request.kv_lookup_key is None
    assert len(dp.lookup_prefix.calls) == (1 if case == "dataplane_down" else 0)


class _Handle:
    """The data plane's handle as the worker's connector calls it."""

    def __init__(self):
        self.lookups = 0

    @property
    def lookup_prefix(self):
        handle = self

        class _M:
            def remote(self, *args, **kwargs):
                handle.lookups += 1

                async def answer():
                    return PrefixHit(2, "L2", 100)

                return answer()

        return _M()


async def test_the_connector_awaits_the_router_started_lookup_instead_of_asking():
    from deployments.dataplane.connector import DataPlaneKVConnector

    handle = _Handle()
    connector = DataPlaneKVConnector(handle, 16)

    async def started():
        return PrefixHit(3, "L3", 300)

    hit = await connector.lookup("default", ["a", "b", "c"], started=started())
    assert (hit.num_blocks, hit.tier) == (3, "L3") and handle.lookups == 0
    assert connector.early_lookups == {"used": 1, "failed": 0}

    async def failed():
        raise ConnectionError("data-plane replica died")

    hit = await connector.lookup("default", ["a", "b", "c"], started=failed())
    assert (hit.num_blocks, hit.tier) == (2, "L2") and handle.lookups == 1  # asked itself
    assert connector.early_lookups == {"used": 1, "failed": 1}


class _HeldLookups(_Lookups):
    """Lookup calls whose assignment waits until the test lets it through."""

    def __init__(self):
        super().__init__()
        self.release = asyncio.Event()

    def remote(self, *args, **kwargs):
        self.calls.append((args, kwargs))
        lookups = self

        class _Held:
            async def _to_object_ref(self):
                await lookups.release.wait()
                return lookups.ref

        return _Held()


async def test_the_lookup_is_assigned_while_the_request_queues(one_worker):
    """The router-started lookup's assignment (~3 ms) runs while the request waits for its
    batch, not before it joins the queue; the worker call still carries its reference."""
    dp = _DataPlane()
    dp.lookup_prefix = _HeldLookups()
    router = _router("when_queued", dp)
    worker = router._worker  # the _Worker (options() returns itself)
    consumer = asyncio.ensure_future(_drain(router.generate(_session_request())))
    # The request goes through the queue (dispatched at once: the worker is idle) although
    # its lookup is not assigned yet; the worker call waits for the reference.
    for _ in range(200):
        if router._num_inflight == 1:
            break
        await asyncio.sleep(0.005)
    assert router._num_inflight == 1 and len(dp.lookup_prefix.calls) == 1 and worker.sent == []
    dp.lookup_prefix.release.set()
    assert await asyncio.wait_for(consumer, 5) == 1
    (ref, key), = worker.sent
    assert ref == "lookup-ref" and key == dp.lookup_prefix.calls[0][0][1][-1]


async def _drain(stream) -> int:
    return len([d async for d in stream])


async def test_root_index_skips_certain_misses_for_requests_without_a_session(one_worker):
    """No stored chain starts with the prompt's first block (the index is fresh): no
    lookup, here or in the worker (``kv_lookup_skip``), also for a session's first turn;
    a later turn of a session always looks up. Once a request has run, its root is known
    here and the same prompt looks up."""
    from deployments.dataplane.root_index import RootIndex

    async def fetch(tenant, since, limit):
        return [("some-other-root", 1.0)]

    index = RootIndex(fetch, sync_interval_s=60)
    dp, worker = _DataPlane(), _Worker()
    router = Router(worker, {"dataplane": {"block_size": 16}, "engine": {"name": "torch"}}, dp, root_index=index)
    index.may_hold("default", "-")  # the tenant is known...
    await index.sync_once()  # ...and synced

    async def run(request):
        return [d async for d in router.generate(request)]

    stateless = _session_request()
    stateless.session_id = None
    await run(stateless)
    assert stateless.kv_lookup_skip is True and dp.lookup_prefix.calls == []
    assert worker.sent[-1] == (None, None)

    first_turn = _session_request()  # a session's first turn: nothing of its own yet
    first_turn.prompt_token_ids = list(range(200, 250))
    await run(first_turn)
    assert first_turn.kv_lookup_skip is True and dp.lookup_prefix.calls == []

    session = _session_request()  # a later turn: the previous one's blocks just left
    session.prompt_token_ids = list(range(300, 350))
    session.session_continues = True
    await run(session)
    assert session.kv_lookup_skip is False and len(dp.lookup_prefix.calls) == 1

    again = _session_request()
    again.session_id = None
    await run(again)  # same prompt: the first request's blocks were exported
    assert again.kv_lookup_skip is False and len(dp.lookup_prefix.calls) == 2
    await index.stop()


async def test_a_stale_root_index_skips_nothing(one_worker):
    from deployments.dataplane.root_index import RootIndex

    async def fetch(tenant, since, limit):
        raise ConnectionError("redis down")

    index = RootIndex(fetch, sync_interval_s=60)
    dp = _DataPlane()
    router = Router(_Worker(), {"dataplane": {"block_size": 16}, "engine": {"name": "torch"}}, dp, root_index=index)
    request = _session_request()
    request.session_id = None
    _ = [d async for d in router.generate(request)]
    assert request.kv_lookup_skip is False and len(dp.lookup_prefix.calls) == 1
    await index.stop()
