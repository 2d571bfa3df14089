"""The Router's deadline (limits.request_timeout_s): a request still queued or still
streaming when it passes gets a 504, and its work is cancelled (out of the batcher's queue,
or the worker stream is cancelled, which aborts the sequence in the engine). The worker
handle is a test double; no Ray cluster."""

import asyncio
import time

import pytest

from app.errors import GatewayTimeoutError, to_api_error
from deployments.compute.engines.protocol import (
    EngineCapabilities,
    GenerationRequest,
    SamplingParams,
    TokenDelta,
)
from deployments.router.deployment import Router
from tests.fixtures.worker_double import RemoteMethod, StreamWorker


class _Stream:
    """A worker stream: yields ``num_deltas`` deltas, then hangs (a long generation)."""

    def __init__(self, num_deltas: int, finish: bool = False):
        self.num_deltas = num_deltas
        self.finish = finish
        self.sent = 0
        self.cancelled = False

    def __aiter__(self):
        return self

    async def __anext__(self):
        if self.sent < self.num_deltas:
            self.sent += 1
            last = self.finish and self.sent == self.num_deltas
            return TokenDelta(text="x", token_ids=[7], finish_reason="length" if last else None)
        if self.finish:
            raise StopAsyncIteration
        await asyncio.sleep(3600)

    def cancel(self):
        self.cancelled = True


class _Worker(StreamWorker):
    def __init__(self, stream: _Stream):
        self.stream = stream
        super().__init__(lambda request: self.stream)


def _router(stream: _Stream, timeout_s: float, **router) -> Router:
    config = {"limits": {"request_timeout_s": timeout_s}, "router": router, "dataplane": {"enabled": False}}
    return Router(_Worker(stream), config)


def _request() -> GenerationRequest:
    return GenerationRequest("req-1", [1, 2, 3], SamplingParams(max_tokens=100))


async def _consume(router: Router) -> list[TokenDelta]:
    return [d async for d in router.generate(_request())]


@pytest.mark.asyncio
async def test_a_stream_past_its_deadline_gets_504_and_is_cancelled():
    stream = _Stream(num_deltas=2)
    router = _router(stream, 0.3)
    got = []
    started = time.monotonic()

    async def run():
        async for delta in router.generate(_request()):
            got.append(delta)

    with pytest.raises(GatewayTimeoutError) as info:
        await asyncio.wait_for(run(), 10)  # without a deadline: TimeoutError, a failure
    elapsed = time.monotonic() - started
    assert len(got) == 2  # what came before the deadline was delivered
    assert 0.3 <= elapsed < 1.5
    assert stream.cancelled  # the worker call was cancelled: the engine aborts the sequence
    err = to_api_error(info.value)
    assert err.status_code == 504 and err.body()["error"]["code"] == "timeout"
    assert router.queue_depth() == 0  # admission released


@pytest.mark.asyncio
async def test_a_request_still_queued_at_its_deadline_gets_504_and_leaves_the_queue():
    stream = _Stream(num_deltas=1, finish=True)
    router = _router(stream, 0.3, max_batch_size=8, batch_wait_timeout_ms=10_000)
    router._num_inflight = 1  # every worker busy: the request waits for its batch to fill
    started = time.monotonic()
    with pytest.raises(GatewayTimeoutError):
        await asyncio.wait_for(_consume(router), 15)
    assert 0.3 <= time.monotonic() - started < 1.5
    assert router._batcher.num_pending == 0 and router.queue_depth() == 0
    assert stream.sent == 0  # never reached a worker


@pytest.mark.asyncio
async def test_a_request_within_its_deadline_is_untouched():
    stream = _Stream(num_deltas=3, finish=True)
    router = _router(stream, 5.0)
    deltas = await _consume(router)
    assert [d.finish_reason for d in deltas] == [None, None, "length"]
    assert not stream.cancelled


@pytest.mark.asyncio
async def test_a_first_request_whose_worker_never_answers_gets_504():
    """The first request asks a worker whether it wants router batching; a worker that
    never answers (a replica stuck in start-up) must not hold the request past its
    deadline: the router's deadline is the only one (the ingress keeps no timer)."""
    stream = _Stream(num_deltas=1, finish=True)
    worker = _Worker(stream)

    async def hang():
        await asyncio.sleep(3600)

    worker.capabilities = RemoteMethod(hang)
    config = {"limits": {"request_timeout_s": 0.3}, "router": {}, "dataplane": {"enabled": False}}
    router = Router(worker, config)
    started = time.monotonic()
    with pytest.raises(GatewayTimeoutError):
        await asyncio.wait_for(_consume(router), 10)  # without a deadline: TimeoutError
    assert 0.3 <= time.monotonic() - started < 1.5
    assert stream.sent == 0 and router.queue_depth() == 0
    # The question is asked again by the next request (this one learned nothing).
    assert not router._batching_resolved


class _Counting(_Worker):
    def __init__(self, stream: _Stream):
        super().__init__(stream)
        self.calls = 0

        def call(request, batch_key=None):
            self.calls += 1
            return self.stream

        self.generate = RemoteMethod(call)


@pytest.mark.asyncio
async def test_the_gate_holds_the_worker_call_and_a_failed_gate_never_reaches_a_worker():
    """The ingress's session check (``gate``): no worker call before it passes, none at
    all when it fails, and its error is the request's."""
    config = {"limits": {"request_timeout_s": 10}, "router": {}, "dataplane": {"enabled": False}}
    worker = _Counting(_Stream(num_deltas=1, finish=True))
    router = Router(worker, config)
    gate = asyncio.get_running_loop().create_future()
    consumer = asyncio.ensure_future(_collect(router.generate(_request(), gate=gate)))
    await asyncio.sleep(0.2)
    assert worker.calls == 0 and not consumer.done()
    gate.set_result(None)
    assert [d.finish_reason for d in await asyncio.wait_for(consumer, 5)] == ["length"]
    assert worker.calls == 1

    failed = asyncio.get_running_loop().create_future()
    failed.set_exception(LookupError("the session moved on"))
    with pytest.raises(LookupError):
        await _collect(router.generate(_request(), gate=failed))
    assert worker.calls == 1 and router.queue_depth() == 0


async def _collect(gen) -> list[TokenDelta]:
    return [d async for d in gen]


class _CapsWorker(_Worker):
    """A worker whose engine answers ``capabilities`` with ``caps``, or fails it first
    (a worker still starting)."""

    def __init__(self, stream: _Stream, caps: EngineCapabilities, failures: int = 0):
        super().__init__(stream)
        self.asked = 0

        async def answer():
            self.asked += 1
            if self.asked <= failures:
                raise RuntimeError("worker starting")
            return caps

        self.capabilities = RemoteMethod(answer)


@pytest.mark.asyncio
@pytest.mark.parametrize("wants, size", [(False, 1), (True, 8)])
async def test_the_router_forwards_without_a_batching_wait_to_an_engine_that_batches_itself(wants, size):
    # vLLM batches continuously: the router's batcher turns into pass-through (a batch of
    # one never waits), whatever router.max_batch_size says; the torch engine keeps it.
    config = {"router": {"max_batch_size": 8, "batch_wait_timeout_ms": 10_000}, "dataplane": {"enabled": False}}
    worker = _CapsWorker(_Stream(num_deltas=1, finish=True), EngineCapabilities(wants_router_batching=wants), failures=1)
    router = Router(worker, config)
    # First the worker cannot answer: the configured batching stands, and the next
    # request asks again.
    await _consume(router)
    assert router._batcher.max_batch_size == 8
    started = time.monotonic()
    await _consume(router)
    assert router._batcher.max_batch_size == size and worker.asked == 2
    if not wants:
        assert time.monotonic() - started < 5  # not held for the 10 s batching wait
    await _consume(router)
    assert worker.asked == 2  # resolved once
