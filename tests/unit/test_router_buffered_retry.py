"""A worker that dies after producing tokens: a streaming client keeps what it got and the
stream fails (no retry, no duplicated text); a buffered (non-streaming) request, whose
client has seen nothing yet, runs again on a live worker and gets one clean reply. The
worker handle is a test double; no Ray cluster."""

import asyncio

import pytest
from ray.exceptions import ActorDiedError

from deployments.compute.engines.protocol import (
    GenerationRequest,
    SamplingParams,
    TokenDelta,
)
from deployments.router.deployment import Router
from tests.fixtures.worker_double import StreamWorker


class _DyingStream:
    """``num_deltas`` deltas, then the replica dies (or, if ``dies`` is False, finishes)."""

    def __init__(self, text: str, num_deltas: int, dies: bool):
        self.text, self.num_deltas, self.dies, self.sent = text, num_deltas, dies, 0

    def __aiter__(self):
        return self

    async def __anext__(self):
        await asyncio.sleep(0)
        if self.sent < self.num_deltas:
            self.sent += 1
            last = not self.dies and self.sent == self.num_deltas
            return TokenDelta(text=self.text, token_ids=[7], finish_reason="length" if last else None)
        if self.dies:
            raise ActorDiedError()
        raise StopAsyncIteration

    def cancel(self):
        pass


class _Worker(StreamWorker):
    """First call: a replica that dies after 2 deltas; later calls: a healthy one."""

    def __init__(self):
        self.calls = 0

        def stream(request):
            self.calls += 1
            if self.calls == 1:
                return _DyingStream("dead ", 2, dies=True)
            return _DyingStream("ok ", 3, dies=False)

        super().__init__(stream)


def _router(worker) -> Router:
    return Router(worker, {"limits": {"request_timeout_s": 30}, "dataplane": {"enabled": False}})


def _request(buffered: bool) -> GenerationRequest:
    return GenerationRequest("req-1", [1, 2, 3], SamplingParams(max_tokens=3), buffered=buffered)


@pytest.mark.asyncio
async def test_buffered_request_is_retried_after_tokens_and_gets_one_clean_reply():
    worker = _Worker()
    router = _router(worker)
    deltas = [d async for d in router.generate(_request(buffered=True))]
    assert worker.calls == 2
    assert "".join(d.text for d in deltas) == "ok ok ok "  # nothing of the dead attempt
    assert deltas[-1].finish_reason == "length"
    assert router.queue_depth() == 0


@pytest.mark.asyncio
async def test_streaming_request_that_already_has_tokens_is_not_retried():
    worker = _Worker()
    router = _router(worker)
    got = []
    with pytest.raises(ActorDiedError):
        async for d in router.generate(_request(buffered=False)):
            got.append(d.text)
    assert worker.calls == 1
    assert got == ["dead ", "dead "]
    assert router.queue_depth() == 0


@pytest.mark.asyncio
async def test_reject_if_full_answers_429_before_any_work_and_only_when_full():
    from app.errors import RateLimitError, to_api_error

    router = Router(_Worker(), {"router": {"max_queue_depth": 1}, "dataplane": {"enabled": False}})
    router.reject_if_full()  # empty: passes
    stream = router.generate(_request(buffered=False))
    first = await stream.__anext__()  # admitted: the queue now holds 1 of 1
    assert first.text
    with pytest.raises(RateLimitError) as info:
        router.reject_if_full()
    err = to_api_error(info.value)
    assert err.status_code == 429 and err.headers["Retry-After"] == "1"
    await stream.aclose()
    router.reject_if_full()  # released: passes again
