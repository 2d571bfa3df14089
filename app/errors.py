"""Errors that reach clients, in the OpenAI error shape.

Every failure a client can see is an :class:`APIError` (or is mapped to one by
:func:`to_api_error`): ``{"error": {"message", "type", "param", "code"}}`` with the right
HTTP status. Deployments raise these directly; Ray wraps exceptions that cross a Serve
hop, so :func:`to_api_error` unwraps causes before mapping.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Optional

logger = logging.getLogger("ray.serve")


class APIError(Exception):
    status_code = 500
    error_type = "internal_error"

    def __init__(
        self,
        message: str,
        *,
        param: Optional[str] = None,
        code: Optional[str] = None,
        headers: Optional[dict[str, str]] = None,
    ):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": self.error_type,
                "param": self.param,
                "code": self.code,
            }
        }

    def __reduce__(self):
        # Keep keyword fields when Ray pickles the exception across a Serve hop.
        return (_rebuild, (type(self), self.message, self.param, self.code, self.headers))


def _rebuild(cls, message, param, code, headers):
    return cls(message, param=param, code=code, headers=headers)


class InvalidRequestError(APIError):
    status_code = 400
    error_type = "invalid_request_error"


class AuthenticationError(APIError):
    status_code = 401
    # What OpenAI answers a missing or wrong key with (the code tells them apart).
    error_type = "invalid_request_error"


class NotFoundError(APIError):
    status_code = 404
    error_type = "invalid_request_error"


class ConflictError(APIError):
    status_code = 409
    error_type = "invalid_request_error"


class PayloadTooLargeError(APIError):
    status_code = 413
    error_type = "invalid_request_error"


class RateLimitError(APIError):
    status_code = 429
    error_type = "rate_limit_error"


class ServiceUnavailableError(APIError):
    status_code = 503
    error_type = "service_unavailable"


class GatewayTimeoutError(APIError):
    status_code = 504
    error_type = "timeout"


def status_of_error(error: dict) -> int:
    """The HTTP status of an error body's ``error`` object (``APIError.body``), for a
    stream's error event, which carries no status: its type, and for the types several
    statuses share, its code."""
    kind, code = error.get("type"), error.get("code")
    if kind != "invalid_request_error":
        return {"rate_limit_error": 429, "service_unavailable": 503, "timeout": 504}.get(kind, 500)
    return {
        "missing_api_key": 401,
        "invalid_api_key": 401,
        "model_not_found": 404,
        "session_not_found": 404,
        "session_version_conflict": 409,
    }.get(code, 400)


def _causes(exc: BaseException):
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = getattr(exc, "cause", None) or exc.__cause__


def replica_death_types() -> tuple[type, ...]:
    """Ray's errors for a call whose replica died or could not be reached, or a deployment
    with no replica to take it: the same call may be made again on another replica."""
    try:
        import ray.exceptions as rex
        from ray.serve.exceptions import DeploymentUnavailableError
    except ImportError:  # pragma: no cover - Ray is always there when a handle is
        return ()
    return (rex.ActorDiedError, rex.ActorUnavailableError, rex.RayActorError, DeploymentUnavailableError)


def to_api_error(exc: BaseException) -> APIError:
    """Map any exception to the APIError a client should see (no traceback leaks)."""
    # Imported here: engines and Ray are optional for callers of this module.
    from deployments.compute.engines.protocol import EngineDeadError, RequestRejected

    for cause in _causes(exc):
        if isinstance(cause, APIError):
            return cause
        if isinstance(cause, RequestRejected):
            return InvalidRequestError(str(cause), param=cause.param)
        if isinstance(cause, EngineDeadError):
            return ServiceUnavailableError(
                "The model worker is restarting; retry shortly.", headers={"Retry-After": "1"}
            )
        if isinstance(cause, (asyncio.TimeoutError, TimeoutError)):
            return GatewayTimeoutError("The request took longer than allowed.")
    try:
        import ray.exceptions as rex
        from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError
    except ImportError:  # pragma: no cover
        rex = None
    if rex is not None:
        for cause in _causes(exc):
            if isinstance(cause, BackPressureError):
                return RateLimitError(
                    "The server is at capacity; retry later.", headers={"Retry-After": "1"}
                )
            if isinstance(
                cause,
                (
                    rex.ActorDiedError,
                    rex.ActorUnavailableError,
                    rex.RayActorError,
                    DeploymentUnavailableError,
                ),
            ):
                return ServiceUnavailableError(
                    "A model worker is unavailable; retry shortly.", headers={"Retry-After": "1"}
                )
    logger.exception("unexpected error while serving a request", exc_info=exc)
    return APIError("The server had an error while processing your request.")
