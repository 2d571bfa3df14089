"""``ingress.with_worker`` (app/server.py): the Router drives a ComputeWorker in its own
process through ``LocalWorkerHandle``. A real Router and a real ComputeWorker over a
stand-in engine (pure unit test: no Ray cluster): the deltas arrive in order, a client
that leaves mid-stream aborts the sequence in the engine, the worker gets its own copy
of the request, and once the local engine is dead a request is retried on a peer (a
stand-in for the Server deployment's own handle). Also: which layout the config picks
when ``ingress.with_worker`` is unset."""

from __future__ import annotations

import asyncio

from app.server import LocalWorkerHandle
from deployments.compute.deployment import ComputeWorker
from deployments.compute.engines.protocol import (
    EngineCapabilities,
    EngineDeadError,
    GenerationRequest,
    SamplingParams,
    TokenDelta,
)
from deployments.router.deployment import Router
from loadtests.vllm_variants import parse_variant
from tests.fixtures.engines import StandInEngine

import pytest


class _Engine(StandInEngine):
    def __init__(self):
        self.started: list[GenerationRequest] = []
        self.aborted: list[str] = []
        self.finished: list[str] = []

    async def generate(self, request):
        self.started.append(request)
        request.kv_lookup = "consumed by the engine"  # a field the engine may set
        try:
            for i in range(request.sampling.max_tokens):
                await asyncio.sleep(0.002)
                last = i + 1 == request.sampling.max_tokens
                yield TokenDelta(text=f"t{i} ", token_ids=[10 + i], finish_reason="length" if last else None,
                                 num_output_tokens=i + 1)
            self.finished.append(request.request_id)
        except GeneratorExit:
            self.aborted.append(request.request_id)
            raise


CONFIG = {
    "engine": {"warmup": False, "stream_interval_ms": 0, "stream_max_messages_per_s": 0},
    "dataplane": {"enabled": False},
    "telemetry": {"log_level": "INFO"},
}


async def _router_and_engine():
    engine = _Engine()
    worker = ComputeWorker.__new__(ComputeWorker)
    await ComputeWorker.__init__(worker, CONFIG, engine_factory=lambda *a, **k: engine)
    return Router(LocalWorkerHandle(worker), CONFIG), engine


def _request(request_id: str, max_tokens: int) -> GenerationRequest:
    return GenerationRequest(request_id, [1, 2, 3], SamplingParams(max_tokens=max_tokens))


def test_the_router_streams_a_local_workers_deltas_in_order():
    async def run():
        router, engine = await _router_and_engine()
        request = _request("r1", 5)
        deltas = [d async for d in router.generate(request)]
        return request, deltas, engine

    request, deltas, engine = asyncio.run(run())
    assert [t for d in deltas for t in d.token_ids] == [10, 11, 12, 13, 14]
    assert deltas[-1].finish_reason == "length" and engine.finished == ["r1"]
    # The worker got a copy, as over a handle: what the engine set stays on its copy.
    assert engine.started[0] is not request and request.kv_lookup is None


def test_a_client_that_leaves_aborts_the_sequence_in_the_engine():
    async def run():
        router, engine = await _router_and_engine()
        stream = router.generate(_request("r2", 1000))
        first = await stream.__anext__()
        await stream.aclose()  # what Starlette does when the client goes away
        for _ in range(100):  # the worker's stream closes in a task of its own
            if engine.aborted:
                break
            await asyncio.sleep(0.01)
        return first, engine

    first, engine = asyncio.run(run())
    assert first.token_ids == [10]
    assert engine.aborted == ["r2"] and engine.finished == []


def test_a_stream_read_in_two_tasks_ends_its_worker_span_cleanly(caplog):
    """As the ingress reads it: the first delta in the request handler's task, the rest in
    the streaming body's. The worker's span must not be the current one across its
    yields (a context attached in one task cannot be detached in another)."""
    import logging

    from opentelemetry import trace
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from app.ingress import _LocalStream

    exporter = InMemorySpanExporter()

    async def run():
        router, _engine = await _router_and_engine()  # sets up the tracer provider
        trace.get_tracer_provider().add_span_processor(SimpleSpanProcessor(exporter))
        stream = _LocalStream(router.generate(_request("r9", 3)))
        first = await stream.__anext__()

        async def rest():
            return [d async for d in stream]

        return [first, *await asyncio.ensure_future(rest())]

    with caplog.at_level(logging.ERROR):
        deltas = asyncio.run(run())
    assert [t for d in deltas for t in d.token_ids] == [10, 11, 12]
    assert not [r for r in caplog.records if "detach" in r.getMessage()], caplog.text
    spans = [s for s in exporter.get_finished_spans() if s.name == "worker.generate"]
    assert len(spans) == 1 and spans[0].attributes["llm.output_tokens"] == 3


def test_capabilities_and_ready_answer_as_a_handles_would():
    async def run():
        router, engine = await _router_and_engine()
        return await router.ready(), await router._capabilities_worker.capabilities.remote()

    ready, caps = asyncio.run(run())
    assert ready is True and caps == EngineCapabilities()


@pytest.mark.parametrize(
    ("text", "pin", "with_worker", "dataplane"),
    [("15:500", False, None, False), ("15:500:pin", True, None, False), ("15:500:with_worker", False, True, False),
     ("15:500:with_worker:pin", True, True, False), ("15:500:apart", False, False, False),
     ("15:500:dataplane", False, None, True), ("15:500:apart:dataplane", False, False, True)],
)
def test_variants_parse_their_flags(text, pin, with_worker, dataplane):
    v = parse_variant(text)
    assert (v["interval_ms"], v["max_messages_per_s"], v["pin"], v["with_worker"], v["dataplane"]) == (
        15.0, 500.0, pin, with_worker, dataplane
    )


@pytest.mark.parametrize("text", ["15", "15:500:pinned", "15:500:pin:pin", "15:500:apart:with_worker", "15:500:dataplane:dataplane"])
def test_a_bad_variant_is_refused(text):
    with pytest.raises(ValueError):
        parse_variant(text)


def test_the_server_deployment_takes_computes_options_plus_the_ingress_cpus():
    from app.config import AppConfig
    from app.server import server_deployment

    cfg = AppConfig.model_validate(
        {
            "ingress": {"with_worker": True, "num_cpus": 0.5, "num_replicas": 7},
            "compute": {"num_cpus": 2, "num_replicas": 3, "resources": {"compute_node": 0.01},
                        "health_check_period_s": 4, "graceful_shutdown_timeout_s": 50},
            "router": {"max_queue_depth": 100},
        }
    )
    d = server_deployment(cfg)
    assert d.name == "Server"
    assert d.num_replicas == 3  # compute's, not ingress.num_replicas
    assert d.ray_actor_options == {"num_cpus": 2.5, "num_gpus": 0.0, "resources": {"compute_node": 0.01}}
    assert d.max_ongoing_requests == 200
    assert d._deployment_config.health_check_period_s == 4
    assert d._deployment_config.graceful_shutdown_timeout_s == 50

    autoscaled = server_deployment(
        AppConfig.model_validate({"compute": {"autoscaling": {"enabled": True, "min_replicas": 1, "max_replicas": 4}}})
    )
    assert autoscaled._deployment_config.autoscaling_config.max_replicas == 4

    sharded = server_deployment(
        AppConfig.model_validate(
            {"engine": {"name": "vllm", "vllm": {"tensor_parallel_size": 2}}, "compute": {"num_cpus": 2}}
        )
    )
    # The replica's own bundle holds the ingress's share too; one GPU bundle per shard.
    assert sharded._replica_config.placement_group_bundles == [{"CPU": 2.25}, {"GPU": 1, "CPU": 1}, {"GPU": 1, "CPU": 1}]
    assert sharded.ray_actor_options["num_cpus"] == 2.25


def test_without_peers_a_dead_local_engine_fails_its_request_at_once_with_503():
    from app.errors import to_api_error

    async def run():
        engine = _DeadEngine()
        engine.dead = True
        worker = ComputeWorker.__new__(ComputeWorker)
        await ComputeWorker.__init__(worker, CONFIG | {"limits": {"request_timeout_s": 30}},
                                     engine_factory=lambda *a, **k: engine)
        router = Router(LocalWorkerHandle(worker), CONFIG | {"limits": {"request_timeout_s": 30}})
        started = asyncio.get_running_loop().time()
        with pytest.raises(EngineDeadError) as info:
            async for _ in router.generate(_request("r3", 5)):
                pass
        return info.value, asyncio.get_running_loop().time() - started

    error, took = asyncio.run(run())
    # Not held for a retry on a worker that will never be ready (the deadline is 30 s).
    assert took < 5, took
    assert to_api_error(error).status_code == 503


class _DeadEngine(_Engine):
    def __init__(self):
        super().__init__()
        self.dead = False

    async def generate(self, request):
        if self.dead:
            raise EngineDeadError("the EngineCore died")
        async for delta in super().generate(request):
            yield delta

    async def check_health(self):
        if self.dead:
            raise EngineDeadError("the EngineCore died")


class _PeerStream:
    """What ``handle.options(stream=True).worker_generate.remote()`` returns: an async
    iterator of deltas with ``cancel()``; ``fail`` raises a death before any delta (a call
    routed to a replica whose engine is dead too)."""

    def __init__(self, n: int, fail: bool):
        self._n, self._fail, self.cancelled = n, fail, False

    def __aiter__(self):
        return self._gen()

    async def _gen(self):
        if self._fail:
            raise EngineDeadError("peer's engine is dead too")
        for i in range(self._n):
            yield TokenDelta(text="p", token_ids=[100 + i], finish_reason="length" if i + 1 == self._n else None,
                             num_output_tokens=i + 1)

    def cancel(self):
        self.cancelled = True


class _Peers:
    """A stand-in for the Server deployment's handle to itself: the first ``dead_calls``
    generate calls land on a dead replica."""

    def __init__(self, dead_calls: int = 0):
        self.dead_calls = dead_calls
        self.calls: list[str] = []
        self.ready_calls = 0
        outer = self

        class _Method:
            def __init__(self, fn):
                self.remote = fn

        async def ready():
            outer.ready_calls += 1
            return True

        def generate(request, batch_key=None):
            outer.calls.append(request.request_id)
            return _PeerStream(request.sampling.max_tokens, fail=len(outer.calls) <= outer.dead_calls)

        self.worker_ready = _Method(ready)
        self.worker_generate = _Method(generate)

    def options(self, **_kwargs):
        return self


async def _router_with_peers(peers):
    engine = _DeadEngine()
    worker = ComputeWorker.__new__(ComputeWorker)
    config = CONFIG | {"limits": {"request_timeout_s": 30}}
    await ComputeWorker.__init__(worker, config, engine_factory=lambda *a, **k: engine)
    return Router(LocalWorkerHandle(worker, peers), config), engine


@pytest.mark.parametrize("dead_calls", [0, 2])
def test_once_the_local_engine_is_dead_a_request_is_retried_on_a_peer(dead_calls, monkeypatch):
    import app.server as server

    monkeypatch.setattr(server, "PEER_ROUTING_RETRY_INTERVAL_S", 0.01)
    peers = _Peers(dead_calls)

    async def run():
        router, engine = await _router_with_peers(peers)
        before = [d async for d in router.generate(_request("alive", 3))]
        engine.dead = True
        after = [d async for d in router.generate(_request("r5", 4))]
        again = [d async for d in router.generate(_request("r6", 2))]
        return before, after, again

    before, after, again = asyncio.run(run())
    # While the local engine lives, no peer is asked.
    assert [t for d in before for t in d.token_ids] == [10, 11, 12]
    # After its death: the router's retry waits for a peer's ready, then streams from it;
    # calls that land on a dead replica first are routed again, not failed.
    assert [t for d in after for t in d.token_ids] == [100, 101, 102, 103]
    assert [t for d in again for t in d.token_ids] == [100, 101]
    assert peers.calls == ["r5"] * (dead_calls + 1) + ["r6"]
    assert peers.ready_calls >= 1


def test_a_peer_routing_to_dead_replicas_only_gives_up_with_a_503(monkeypatch):
    import app.server as server
    from app.errors import to_api_error

    monkeypatch.setattr(server, "PEER_ROUTING_RETRY_INTERVAL_S", 0.01)
    monkeypatch.setattr(server, "PEER_ROUTING_RETRY_S", 0.1)
    peers = _Peers(dead_calls=10**6)

    async def run():
        router, engine = await _router_with_peers(peers)
        engine.dead = True
        with pytest.raises(EngineDeadError) as info:
            async for _ in router.generate(_request("r7", 3)):
                pass
        return info.value

    error = asyncio.run(run())
    assert to_api_error(error).status_code == 503
    assert 2 <= len(peers.calls) < 100, len(peers.calls)


@pytest.mark.parametrize(
    ("args", "with_worker"),
    [
        ({}, False),  # torch: ingress and worker apart (router batching and placement)
        ({"engine": {"name": "vllm"}}, True),  # one vLLM replica: in one process
        ({"engine": {"name": "vllm"}, "compute": {"num_replicas": 2}}, False),  # placement
        ({"engine": {"name": "vllm"}, "compute": {"autoscaling": {"enabled": True}}}, False),
        ({"engine": {"name": "vllm"}, "ingress": {"num_replicas": 2}}, False),
        ({"engine": {"name": "vllm"}, "ingress": {"with_worker": False}}, False),  # said outright
        ({"ingress": {"with_worker": True}}, True),
    ],
)
def test_the_layout_the_config_picks(args, with_worker):
    from app.config import AppConfig

    config = AppConfig.model_validate(args)
    assert config.ingress.with_worker is with_worker
    # Resolved once: what the deployments get back says the same.
    assert AppConfig.model_validate(config.model_dump(mode="json")).ingress.with_worker is with_worker
