"""A tenant's share of the router queue (``router.max_queue_share_per_tenant``): one
tenant that floods the router is refused past its share while the others still get in.
The admission logic alone, then through a Router with a test-double worker (no Ray)."""

import asyncio

import pytest

from app.errors import RateLimitError
from deployments.compute.engines.protocol import GenerationRequest, SamplingParams, TokenDelta
from deployments.router.deployment import QUEUE_FULL, TENANT_QUEUE_FULL, Admission, Router
from tests.fixtures.worker_double import StreamWorker


def test_a_tenant_holds_at_most_its_share_and_the_queue_bound_still_holds():
    a = Admission(4, tenant_share=0.5)
    assert a.max_tenant_depth == 2
    assert a.try_acquire("acme") is None and a.try_acquire("acme") is None
    assert a.try_acquire("acme") == TENANT_QUEUE_FULL and a.depth == 2  # refused: nothing taken
    assert a.try_acquire("globex") is None and a.try_acquire("globex") is None
    assert a.try_acquire("initech") == QUEUE_FULL and a.refusal("acme") == QUEUE_FULL
    a.release("acme")
    assert a.refusal("acme") is None and a.refusal("globex") == TENANT_QUEUE_FULL
    a.release("acme")
    assert a.by_tenant == {"globex": 2} and a.depth == 2
    # No share (the default): one tenant may take the whole queue; a share rounds up and
    # always leaves a tenant at least one place.
    assert Admission(4).max_tenant_depth == 4
    assert Admission(10, tenant_share=0.25).max_tenant_depth == 3
    assert Admission(10, tenant_share=0.01).max_tenant_depth == 1
    assert Admission(48, tenant_share=0.5).max_tenant_depth == 24


class _Stream:
    """Deltas until the test lets it finish."""

    def __init__(self, done: asyncio.Event):
        self.done = done

    def __aiter__(self):
        return self

    async def __anext__(self):
        await asyncio.sleep(0)
        if self.done.is_set():
            raise StopAsyncIteration
        return TokenDelta(text="x", token_ids=[7])

    def cancel(self):
        pass


def _request(i: int, tenant: str) -> GenerationRequest:
    return GenerationRequest(f"req-{i}", [1, 2, 3], SamplingParams(max_tokens=3), tenant=tenant)


@pytest.mark.asyncio
async def test_a_tenant_past_its_share_gets_429_while_another_still_gets_in():
    done = asyncio.Event()
    router = Router(
        StreamWorker(lambda request: _Stream(done)),
        {"router": {"max_queue_depth": 4, "max_queue_share_per_tenant": 0.5}, "dataplane": {"enabled": False}},
    )
    streams = []
    for i in range(2):
        stream = router.generate(_request(i, "acme"))
        await stream.__anext__()  # admitted, running
        streams.append(stream)
    with pytest.raises(RateLimitError) as info:
        router.reject_if_full("acme")
    assert info.value.code == TENANT_QUEUE_FULL and info.value.headers["Retry-After"] == "1"
    assert "share" in info.value.message
    with pytest.raises(RateLimitError) as info:
        await router.generate(_request(2, "acme")).__anext__()
    assert info.value.code == TENANT_QUEUE_FULL
    router.reject_if_full("globex")  # another tenant: passes
    other = router.generate(_request(3, "globex"))
    assert (await other.__anext__()).text == "x"
    assert router.queue_depth() == 3
    await streams.pop().aclose()
    router.reject_if_full("acme")  # a place of its own freed
    for s in (*streams, other):
        await s.aclose()
    assert router.queue_depth() == 0


@pytest.mark.parametrize("share", [0, -0.5, 1.5])
def test_a_share_outside_zero_to_one_fails_the_config_naming_it(share):
    from pydantic import ValidationError

    from app.config import AppConfig

    with pytest.raises(ValidationError, match="max_queue_share_per_tenant"):
        AppConfig.model_validate({"router": {"max_queue_share_per_tenant": share}})
