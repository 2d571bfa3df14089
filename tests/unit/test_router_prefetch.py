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


async def test_a_request_without_a_session_is_prefetched_only_when_its_prefix_is_known(one_worker):
    from deployments.dataplane.root_index import RootIndex

    async def fetch(tenant, since, limit):
        return []

    dp = _DataPlane()
    request = _session_request()
    request.session_id = None
    assert _router("always", dp)._prefetch(request) is False  # no root index: nothing known
    index = RootIndex(fetch, sync_interval_s=60)
    config = {"dataplane": {"prefetch": "always", "block_size": 16}, "engine": {"name": "torch"}}
    router = Router(_Worker(), config, dp, root_index=index)
    assert router._prefetch(request) is False  # a prefix nobody stored
    hashes = router._kv_hashes(request)
    index.add(request.tenant, hashes[0])  # its chain was stored (by an earlier request)
    assert router._prefetch(request) is True
    await asyncio.sleep(0)
    assert [c[0][1] for c in dp.prefetch.calls] == [hashes]


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


class _ServeLikeDataPlane(_DataPlane):
    app_name = "app"
    deployment_name = "DataPlane"


@pytest.mark.parametrize("owner_known", [True, False])
async def test_the_router_sends_its_lookup_straight_to_the_owner_replica_when_known(one_worker, monkeypatch, owner_known):
    import pickle

    from deployments.dataplane import routing

    got = []

    def handle_request(metadata, *args, **kwargs):
        got.append((pickle.loads(metadata), args, kwargs))
        return "direct-ref"

    actor = SimpleNamespace(handle_request=SimpleNamespace(remote=handle_request))
    monkeypatch.setattr(routing, "owner_actor", lambda app, deployment, key: actor if owner_known else None)
    dp = _ServeLikeDataPlane()
    router = _router("when_queued", dp)
    request = _session_request()
    await router._start_kv_lookup(request)
    hashes = router._kv_hashes(request)
    if owner_known:
        # The actor call's ObjectRef at once: no round of Serve's that accepts it first.
        assert request.kv_lookup == "direct-ref" and dp.lookup_prefix.calls == []
        metadata, args, kwargs = got[0]
        assert (metadata.call_method, metadata.app_name, args) == ("lookup_prefix", "app", ("default", hashes))
        assert kwargs == {"shard_key": hashes[0], "with_refs": True, "direct_l3": True}
    else:
        assert request.kv_lookup == "lookup-ref" and got == [] and len(dp.lookup_prefix.calls) == 1
    assert request.kv_lookup_key == hashes[-1]


async def test_a_prefetch_goes_straight_to_the_owner_replica_when_known(one_worker, monkeypatch):
    import pickle

    from deployments.dataplane import routing

    got = []

    def handle_request(metadata, *args, **kwargs):
        got.append((pickle.loads(metadata).call_method, args, kwargs))

        async def done():
            return 3

        return done()

    actor = SimpleNamespace(handle_request=SimpleNamespace(remote=handle_request))
    monkeypatch.setattr(routing, "owner_actor", lambda app, deployment, key: actor)
    dp = _ServeLikeDataPlane()
    router = _router("always", dp)
    request = _session_request()
    assert router._prefetch(request) is True
    await asyncio.sleep(0)
    hashes = router._kv_hashes(request)
    assert got == [("prefetch", ("default", hashes), {"shard_key": hashes[0]})] and dp.prefetch.calls == []


async def test_with_direct_calls_off_the_router_lookup_goes_through_serve(one_worker, monkeypatch):
    from deployments.dataplane import routing

    monkeypatch.setattr(routing, "owner_actor", lambda app, deployment, key: pytest.fail("looked for the owner"))
    dp = _ServeLikeDataPlane()
    config = {"dataplane": {"prefetch": "when_queued", "block_size": 16, "direct_calls": False}, "engine": {"name": "torch"}}
    request = _session_request()
    await Router(_Worker(), config, dp)._start_kv_lookup(request)
    assert request.kv_lookup == "lookup-ref" and len(dp.lookup_prefix.calls) == 1


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


def _turn(prompt: list[int], session_id: str = "sess_x") -> GenerationRequest:
    r = GenerationRequest(f"req-{len(prompt)}", prompt, SamplingParams(max_tokens=20))
    r.session_id = session_id
    r.session_continues = True
    return r


def _torch_router(dp) -> Router:
    return Router(_Worker(), {"dataplane": {"block_size": 16}, "engine": {"name": "torch"}}, dp)


FIRST, REPLY, NEW = list(range(100, 150)), list(range(500, 520)), list(range(600, 640))


async def test_a_sessions_next_turn_goes_with_the_lookup_started_before_its_prompt(one_worker):
    """After a session turn (its prompt and reply ids, and the version it left), the
    next turn's lookup of those blocks starts as that turn arrives (before its prompt
    exists) and goes to the worker in place of a lookup of the new prompt, keyed by the
    last block it covered, which the engine checks against the prompt's own hashes."""
    from deployments.compute.engines.kv import block_hashes
    from deployments.compute.engines.torch_engine import _started_lookup

    dp = _DataPlane()
    router = _torch_router(dp)
    assert router.start_session_lookup("default", "sess_x") is None  # nothing served yet
    router.remember_session_turn("default", "sess_x", 2, FIRST + REPLY)
    chain = block_hashes(router._config.model.id, "default", FIRST + REPLY, 16)
    assert len(chain) == 4  # 70 tokens
    assert router.start_session_lookup("default", "other") is None
    assert router.start_session_lookup("tenant-b", "sess_x") is None
    assert router.start_session_lookup("default", "sess_x", version=4) is None  # turns since
    assert dp.lookup_prefix.calls == []
    lookup = router.start_session_lookup("default", "sess_x", version=2)
    assert lookup.version == 2 and await lookup.task == ("default", chain, "lookup-ref")
    (tenant, hashes), kwargs = dp.lookup_prefix.calls[0]
    assert hashes == chain and kwargs["shard_key"] == chain[0] and kwargs["with_refs"] is True

    # A turn with a cache_salt keeps the salted chain (the hashes its blocks have).
    router.remember_session_turn("default", "sess_salted", 2, FIRST + REPLY, "s3cret")
    salted = router.start_session_lookup("default", "sess_salted", version=2)
    salted_chain = block_hashes(router._config.model.id, "default", FIRST + REPLY, 16, "s3cret")
    assert salted_chain != chain and await salted.task == ("default", salted_chain, "lookup-ref")
    router.drop_session_lookup(salted)
    dp.lookup_prefix.calls.pop()

    second = _turn(FIRST + REPLY + NEW)  # the history, then the new messages
    _ = [d async for d in router.generate(second, session_lookup=lookup.task)]
    assert len(dp.lookup_prefix.calls) == 1  # no lookup of the new prompt
    assert (second.kv_lookup, second.kv_lookup_key, second.kv_lookup_blocks) == ("lookup-ref", chain[-1], 4)
    own = block_hashes(router._config.model.id, "default", second.prompt_token_ids[:-1], 16)
    assert len(own) == 6 and own[:4] == chain
    assert _started_lookup(second, own) == "lookup-ref"


async def test_a_prompt_that_does_not_extend_the_last_turn_looks_itself_up(one_worker):
    """A history the prompt no longer starts with (truncated, edited): the early lookup is
    left unused and the prompt's own blocks are looked up, as without it."""
    dp = _DataPlane()
    router = _torch_router(dp)
    router.remember_session_turn("default", "sess_x", 2, FIRST + REPLY)
    lookup = router.start_session_lookup("default", "sess_x")
    truncated = _turn(FIRST[16:] + REPLY + NEW)
    _ = [d async for d in router.generate(truncated, session_lookup=lookup.task)]
    assert len(dp.lookup_prefix.calls) == 2  # the early lookup, this prompt's own
    own = dp.lookup_prefix.calls[1][0][1]
    assert truncated.kv_lookup_key == own[-1] and truncated.kv_lookup_blocks is None


async def test_a_failed_early_lookup_falls_back_to_the_usual_one(one_worker):
    dp = _DataPlane()
    router = _torch_router(dp)
    router.remember_session_turn("default", "sess_x", 2, FIRST + REPLY)
    dp.lookup_prefix.ref = ConnectionError("no data-plane replica")
    lookup = router.start_session_lookup("default", "sess_x")
    with pytest.raises(ConnectionError):
        await lookup.task
    dp.lookup_prefix.ref = "second-ref"
    second = _turn(FIRST + REPLY + NEW)
    _ = [d async for d in router.generate(second, session_lookup=lookup.task)]
    assert second.kv_lookup == "second-ref" and second.kv_lookup_blocks is None


async def test_an_early_lookup_not_started_in_time_holds_the_request_no_longer(one_worker, monkeypatch):
    """No data-plane replica took the early call within LOOKUP_START_TIMEOUT_S: the
    router does not try again (that would hold the request as long again); the worker
    asks the data plane itself."""
    from deployments.router import deployment

    monkeypatch.setattr(deployment, "LOOKUP_START_TIMEOUT_S", 0.05)
    dp = _DataPlane()
    dp.lookup_prefix = _HeldLookups()  # never assigned
    router = _torch_router(dp)
    router.remember_session_turn("default", "sess_x", 2, FIRST + REPLY)
    lookup = router.start_session_lookup("default", "sess_x")
    assert await lookup.task is None
    second = _turn(FIRST + REPLY + NEW)
    _ = [d async for d in router.generate(second, session_lookup=lookup.task)]
    assert len(dp.lookup_prefix.calls) == 1  # the early one only
    assert second.kv_lookup is None and second.kv_lookup_key is None


def test_session_turns_are_remembered_only_where_lookups_go_through_the_data_plane():
    for config in ({"engine": {"name": "vllm"}}, {"engine": {"name": "torch"}, "dataplane": {"kv_reuse": False}}):
        router = Router(_Worker(), config, _DataPlane())
        router.remember_session_turn("default", "sess_x", 2, FIRST + REPLY)
        assert router.start_session_lookup("default", "sess_x") is None
    router = _torch_router(None)  # no data plane
    router.remember_session_turn("default", "sess_x", 2, FIRST + REPLY)
    assert router.start_session_lookup("default", "sess_x") is None
    router = _torch_router(_DataPlane())
    router.remember_session_turn("default", "sess_x", 2, FIRST[:15])  # not one whole block
    assert router.start_session_lookup("default", "sess_x") is None


def test_the_engine_uses_a_started_lookup_only_for_the_prompts_own_blocks():
    from deployments.compute.engines.torch_engine import _started_lookup

    hashes = ["h0", "h1", "h2"]
    r = GenerationRequest("r", list(range(60)), SamplingParams(max_tokens=4))
    assert _started_lookup(r, hashes) is None
    r.kv_lookup, r.kv_lookup_key = "ref", "h2"
    assert _started_lookup(r, hashes) == "ref"  # all of the prompt's blocks
    r.kv_lookup_key = "h1"
    assert _started_lookup(r, hashes) is None  # another prompt's lookup
    r.kv_lookup_blocks = 2
    assert _started_lookup(r, hashes) == "ref"  # its first two blocks
    r.kv_lookup_blocks = 4
    assert _started_lookup(r, hashes) is None  # more blocks than the prompt has
    r.kv_lookup_blocks = 0
    assert _started_lookup(r, hashes) is None


async def test_session_chains_are_bounded(one_worker, monkeypatch):
    """The least recently used sessions' chains go first once the hashes held pass the cap."""
    from deployments.router import deployment

    monkeypatch.setattr(deployment, "SESSION_CHAINS_MAX_HASHES", 8)
    router = _torch_router(_DataPlane())
    for sid in ("a", "b", "c"):  # four blocks each
        router.remember_session_turn("default", sid, 2, FIRST + REPLY)
        if sid == "b":
            router.start_session_lookup("default", "a").task.cancel()  # "a" used: "b" is older now
    assert router._session_chain_hashes == 8
    assert router.start_session_lookup("default", "b") is None
    for sid in ("a", "c"):
        router.start_session_lookup("default", sid).task.cancel()
    router.remember_session_turn("default", "a", 4, FIRST + REPLY + NEW)  # its next turn: six
    assert router._session_chain_hashes == 6 and router.start_session_lookup("default", "c") is None


async def test_no_early_lookup_for_a_turn_that_will_be_prefetched(one_worker):
    """Every worker busy: the request will queue and be prefetched (``when_queued``), so no
    lookup starts as it arrives (the worker looks it up when it runs it)."""
    dp = _DataPlane()
    router = _torch_router(dp)
    router.remember_session_turn("default", "sess_x", 2, FIRST + REPLY)
    router._num_inflight = 1
    assert router.start_session_lookup("default", "sess_x") is None
    router._num_inflight = 0
    router.start_session_lookup("default", "sess_x").task.cancel()
