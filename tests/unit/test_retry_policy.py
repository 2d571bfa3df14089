"""Which worker failures let the router send a request again (pure: no Ray cluster)."""

import asyncio

import pytest
import ray.exceptions as rex
from ray.exceptions import RayTaskError
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError

from app.errors import RateLimitError
from deployments.compute.engines.protocol import EngineDeadError, EngineError, RequestRejected
from deployments.router.deployment import is_retryable_death


def _wrapped(exc: BaseException) -> BaseException:
    """As Ray delivers an exception raised in a replica: a RayTaskError that is also an
    instance of the original class and carries it as ``cause``."""
    try:
        raise exc
    except BaseException as e:  # noqa: BLE001
        return RayTaskError("generate", "Traceback ...", e).as_instanceof_cause()


class _Cause(Exception):
    """Any wrapper that only points at the real failure through ``cause``."""

    def __init__(self, cause):
        super().__init__("wrapped")
        self.cause = cause


@pytest.mark.parametrize(
    "exc",
    [
        EngineDeadError("vLLM EngineCore died"),
        rex.ActorDiedError(),
        rex.ActorUnavailableError("unavailable", None),
        rex.RayActorError(),
        DeploymentUnavailableError(None),
    ],
    ids=lambda e: type(e).__name__,
)
def test_deaths_are_retryable(exc):
    assert is_retryable_death(exc)
    assert is_retryable_death(_Cause(exc))


def test_engine_death_raised_in_a_replica_is_retryable():
    assert is_retryable_death(_wrapped(EngineDeadError("engine loop died")))


def test_chained_death_is_retryable():
    try:
        try:
            raise EngineDeadError("dead")
        except EngineDeadError as e:
            raise RuntimeError("while streaming") from e
    except RuntimeError as outer:
        assert is_retryable_death(outer)


@pytest.mark.parametrize(
    "exc",
    [
        EngineError("vLLM failed the request"),  # a live engine failing one request
        RequestRejected("prompt too long", param="prompt"),
        RateLimitError("queue full"),
        BackPressureError(num_queued_requests=1, max_queued_requests=1),
        asyncio.TimeoutError(),
        asyncio.CancelledError(),
        ValueError("bad"),
    ],
    ids=lambda e: type(e).__name__,
)
def test_other_failures_are_not_retryable(exc):
    assert not is_retryable_death(exc)
    assert not is_retryable_death(_wrapped(exc) if isinstance(exc, Exception) else exc)
