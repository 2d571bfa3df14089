"""The gRPC API (``llm.proto``): methods of the Ingress deployment that Ray Serve's gRPC
proxy calls by the RPC's name.

Each RPC is the REST call it mirrors, served by the very same code: the request message
becomes the JSON body (and its metadata the headers: ``authorization``, ``x-session-id``)
of an in-process HTTP request that goes through the REST route, and the route's answer
comes back as the response message, or as a gRPC status (``GRPC_STATUS``) with the error's
message as details and its type, code, param and ``Retry-After`` as trailing metadata.
So both APIs check, authenticate, batch, reuse KV, count and log alike; nothing here
decides anything about a request. The cost is a JSON encode and parse per request and per
streamed chunk; ``loadtests.grpc_vs_rest`` measures the whole against REST.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from typing import Any, AsyncIterator, Callable, Optional

import grpc
from google.protobuf import json_format
from google.protobuf.message import Message
from ray.serve import metrics
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from app.errors import APIError, InvalidRequestError, status_of_error
from app.grpc_api import llm_pb2 as pb

logger = logging.getLogger("ray.serve")

# The REST API's HTTP status → the gRPC status of the same answer.
GRPC_STATUS = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    401: grpc.StatusCode.UNAUTHENTICATED,
    403: grpc.StatusCode.PERMISSION_DENIED,
    404: grpc.StatusCode.NOT_FOUND,
    409: grpc.StatusCode.ABORTED,
    413: grpc.StatusCode.RESOURCE_EXHAUSTED,
    422: grpc.StatusCode.INVALID_ARGUMENT,
    429: grpc.StatusCode.RESOURCE_EXHAUSTED,
    499: grpc.StatusCode.CANCELLED,
    503: grpc.StatusCode.UNAVAILABLE,
    504: grpc.StatusCode.DEADLINE_EXCEEDED,
}

# The REST route of each generation endpoint (``Ingress._serve``'s endpoint names).
GENERATION_PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}

# Metadata that travels as the HTTP request's headers (gRPC metadata keys are lower case).
FORWARDED_METADATA = ("authorization", "x-session-id")


def grpc_status(http_status: int) -> grpc.StatusCode:
    return GRPC_STATUS.get(http_status, grpc.StatusCode.INTERNAL if http_status >= 500 else grpc.StatusCode.UNKNOWN)


def _json_value(value: Any) -> Any:
    """A Struct's numbers are doubles: whole ones go back to ints (``max_length: 5`` in a
    schema, a token id in ``logit_bias``), as the JSON a client writes holds them."""
    if isinstance(value, float) and math.isfinite(value) and value.is_integer() and abs(value) < 2**53:
        return int(value)
    if isinstance(value, dict):
        return {k: _json_value(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_json_value(v) for v in value]
    return value


def message_body(msg: Message) -> dict:
    """The JSON body ``msg`` stands for: its fields that are set (proto3 ``optional``
    ones when present, others when not at their default), under their names (the REST
    body's), with ``extra``'s fields beside them."""
    body: dict = {}
    extra = None
    for field, value in msg.ListFields():
        name = field.name
        if name == "extra":
            extra = _json_value(json_format.MessageToDict(value))
            continue
        if field.message_type is not None:
            if field.message_type.full_name.startswith("google.protobuf."):
                value = _json_value(json_format.MessageToDict(value))
            elif field.is_repeated:
                value = [message_body(v) for v in value]
            else:
                value = message_body(value)
        elif field.is_repeated:
            value = list(value)
        body[name] = value
    for name, value in (extra or {}).items():
        if name in body:
            raise InvalidRequestError(f"'{name}' is given both as a field and in 'extra'; give it once.", param=name)
        body[name] = value
    return body


def to_message(data: dict, cls: type[Message]) -> Message:
    return json_format.ParseDict(data, cls(), ignore_unknown_fields=True)


def _client(peer: str) -> Optional[tuple[str, int]]:
    """``ipv4:127.0.0.1:5000`` / ``ipv6:[::1]:5000`` → (host, port)."""
    try:
        _, _, address = peer.partition(":")
        host, _, port = address.rpartition(":")
        return host.strip("[]"), int(port)
    except (AttributeError, ValueError):
        return None


def http_request(method: str, path: str, context, body: Optional[dict] = None) -> Request:
    """An in-process HTTP request for the REST route: ``body`` as its JSON, the RPC's
    forwarded metadata as its headers."""
    raw = b"" if body is None else json.dumps(body, separators=(",", ":")).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode())]
    for key, value in (context.invocation_metadata() if context is not None else ()):
        if key.lower() in FORWARDED_METADATA and isinstance(value, str):
            headers.append((key.lower().encode(), value.encode("latin-1", "replace")))
    scope = {
        "type": "http",
        "method": method,
        "path": path,
        "raw_path": path.encode(),
        "root_path": "",
        "query_string": b"",
        "headers": headers,
        "scheme": "grpc",
        "http_version": "2",
        "client": _client(context.peer()) if context is not None else None,
        "server": None,
    }
    sent = False

    async def receive() -> dict:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": raw, "more_body": False}
        # Nothing more comes: a call that ends is cancelled, not disconnected.
        await asyncio.get_running_loop().create_future()
        return {"type": "http.disconnect"}  # pragma: no cover

    return Request(scope, receive)


def _answer_metadata(headers) -> list[tuple[str, str]]:
    """The REST answer's headers a gRPC client gets as trailing metadata: the request's
    id, ``retry-after``, and a rate-limited tenant's ``x-ratelimit-*`` (app/rate_limits.py)."""
    return [(k.lower(), v) for k, v in (headers or {}).items()
            if k.lower() in ("x-request-id", "retry-after") or k.lower().startswith("x-ratelimit-")]


def _set_error(context, status: int, error: dict, headers=None) -> grpc.StatusCode:
    code = grpc_status(status)
    if context is not None:
        context.set_code(code)
        context.set_details(str(error.get("message") or "")[:2000])
        trailing = [
            (f"llm-error-{k}", str(error[k])) for k in ("type", "code", "param") if error.get(k) is not None
        ]
        context.set_trailing_metadata(trailing + _answer_metadata(headers))
    return code


def _api_error(e: Exception, method: str) -> APIError:
    """``e`` as the client sees it: an ``APIError`` as it is (a request message no body
    stands for), anything else a bug of this layer: logged, and a generic 500."""
    if isinstance(e, APIError):
        return e
    logger.exception("grpc %s: the reply could not be built", method)
    return APIError("Internal error building the reply.")


def _error_of(response: Response) -> dict:
    try:
        return json.loads(response.body)["error"]
    except (ValueError, KeyError, TypeError):
        return {"message": f"HTTP {response.status_code}", "type": "internal_error"}


def _sse_events(chunk: bytes | str) -> list[dict | None]:
    """The events of a piece of the REST stream (``data: {...}``; ``[DONE]`` is None)."""
    if isinstance(chunk, str):
        chunk = chunk.encode()
    out = []
    for line in chunk.split(b"\n"):
        if line.startswith(b"data: "):
            data = line[6:].strip()
            out.append(None if data == b"[DONE]" else json.loads(data))
    return out


class _Metrics:
    def __init__(self):
        self.requests = metrics.Counter(
            "llm_grpc_requests",
            "gRPC calls by method and status code (OK, INVALID_ARGUMENT, ...).",
            tag_keys=("method", "code"),
        )


class GrpcIngress:
    """The RPCs of ``llm.proto``'s ``LLM`` service, mixed into the Ingress deployment
    (which has the REST routes they call: ``_serve``, ``create_session``, ...)."""

    _grpc_metrics: Optional[_Metrics] = None

    def _grpc_count(self, method: str, code: grpc.StatusCode, started: float) -> None:
        if GrpcIngress._grpc_metrics is None:
            GrpcIngress._grpc_metrics = _Metrics()
        GrpcIngress._grpc_metrics.requests.inc(tags={"method": method, "code": code.name})
        logger.debug("grpc %s: %s in %.1f ms", method, code.name, 1000 * (time.monotonic() - started))

    async def _grpc_unary(self, method: str, context, call: Callable[[], Any], reply: type[Message]) -> Message:
        started = time.monotonic()
        with self._tracer.start_as_current_span(f"ingress.grpc.{method}") as span:
            span.set_attribute("rpc.system", "grpc")
            span.set_attribute("rpc.method", method)
            out = reply()
            try:
                response = await call()
                if response.status_code >= 400:
                    code = _set_error(context, response.status_code, _error_of(response), response.headers)
                else:
                    out = to_message(json.loads(response.body), reply)
                    code = grpc.StatusCode.OK
                    if context is not None and (metadata := _answer_metadata(response.headers)):
                        context.set_trailing_metadata(metadata)
            except Exception as e:  # noqa: BLE001 - a status, never a traceback to the client
                e = _api_error(e, method)
                code = _set_error(context, e.status_code, e.body()["error"], e.headers)
            span.set_attribute("rpc.grpc.status_code", code.value[0])
            self._grpc_count(method, code, started)
            return out

    async def _grpc_stream(
        self, method: str, context, endpoint: str, schema, body_of: Callable[[], dict], chunk: type[Message]
    ) -> AsyncIterator[Message]:
        started = time.monotonic()
        code = grpc.StatusCode.OK
        body_iterator = None

        def fail(status: int, error: dict, headers=None) -> Message:
            """The stream's status set to ``error``'s, and the last chunk, which says it
            too (and carries the context's code to the proxy)."""
            nonlocal code
            code = _set_error(context, status, error, headers)
            return chunk(error=to_message(error, pb.Error))

        with self._tracer.start_as_current_span(f"ingress.grpc.{method}") as span:
            span.set_attribute("rpc.system", "grpc")
            span.set_attribute("rpc.method", method)
            try:
                body = body_of()
                body["stream"] = True
                # The last chunk carries usage unless the client said otherwise.
                body.setdefault("stream_options", {"include_usage": True})
                response = await self._generate(endpoint, context, body, schema)
                if not isinstance(response, StreamingResponse):
                    # Refused before the first token: the REST route's status and error.
                    yield fail(response.status_code, _error_of(response), response.headers)
                    return
                if context is not None and (metadata := _answer_metadata(response.headers)):
                    context.set_trailing_metadata(metadata)
                body_iterator = response.body_iterator
                async for piece in body_iterator:
                    for event in _sse_events(piece):
                        if event is None:
                            return
                        if "error" in event:  # mid-stream: its event carries no status
                            yield fail(status_of_error(event["error"]), event["error"])
                            return
                        if event.get("usage") is None:
                            event.pop("usage", None)
                        yield to_message(event, chunk)
            except (asyncio.CancelledError, GeneratorExit):
                code = grpc.StatusCode.CANCELLED  # the client went away
                raise
            except Exception as e:  # noqa: BLE001 - a status, never a traceback to the client
                e = _api_error(e, method)
                yield fail(e.status_code, e.body()["error"], e.headers)
            finally:
                if body_iterator is not None:
                    # A client that went away: the REST stream's own clean-up stops the
                    # generation behind it (its slot frees at once).
                    await body_iterator.aclose()
                span.set_attribute("rpc.grpc.status_code", code.value[0])
                self._grpc_count(method, code, started)

    def _generate(self, endpoint: str, context, body: dict, schema):
        """The REST route's answer to ``body`` on generation ``endpoint``."""
        request = http_request("POST", GENERATION_PATHS[endpoint], context, body)
        return self._serve(endpoint, request, schema)

    # ---- the RPCs (names as in llm.proto) ----------------------------------------------

    async def ChatCompletion(self, request: pb.ChatCompletionRequest, grpc_context=None) -> pb.ChatCompletionResponse:
        from app.schemas import ChatCompletionRequest

        def call():
            return self._generate("chat", grpc_context, {**message_body(request), "stream": False}, ChatCompletionRequest)

        return await self._grpc_unary("ChatCompletion", grpc_context, call, pb.ChatCompletionResponse)

    async def ChatCompletionStream(self, request: pb.ChatCompletionRequest, grpc_context=None) -> AsyncIterator[pb.ChatCompletionChunk]:
        from app.schemas import ChatCompletionRequest

        async for out in self._grpc_stream(
            "ChatCompletionStream", grpc_context, "chat", ChatCompletionRequest, lambda: message_body(request), pb.ChatCompletionChunk
        ):
            yield out

    async def Completion(self, request: pb.CompletionRequest, grpc_context=None) -> pb.CompletionResponse:
        from app.schemas import CompletionRequest

        def call():
            return self._generate("completions", grpc_context, {**_completion_body(request), "stream": False},
                                  CompletionRequest)

        return await self._grpc_unary("Completion", grpc_context, call, pb.CompletionResponse)

    async def CompletionStream(self, request: pb.CompletionRequest, grpc_context=None) -> AsyncIterator[pb.CompletionChunk]:
        from app.schemas import CompletionRequest

        async for out in self._grpc_stream(
            "CompletionStream", grpc_context, "completions", CompletionRequest, lambda: _completion_body(request), pb.CompletionChunk
        ):
            yield out

    async def CreateSession(self, request: pb.CreateSessionRequest, grpc_context=None) -> pb.Session:
        body = {"ttl_s": request.ttl_s} if request.ttl_s else None
        return await self._grpc_unary(
            "CreateSession", grpc_context, lambda: self.create_session(http_request("POST", "/v1/sessions", grpc_context, body)), pb.Session
        )

    async def GetSession(self, request: pb.GetSessionRequest, grpc_context=None) -> pb.Session:
        path = f"/v1/sessions/{request.id}"
        return await self._grpc_unary(
            "GetSession", grpc_context, lambda: self.get_session(request.id, http_request("GET", path, grpc_context)), pb.Session
        )

    async def DeleteSession(self, request: pb.DeleteSessionRequest, grpc_context=None) -> pb.DeleteSessionResponse:
        path = f"/v1/sessions/{request.id}"
        return await self._grpc_unary(
            "DeleteSession", grpc_context, lambda: self.delete_session(request.id, http_request("DELETE", path, grpc_context)), pb.DeleteSessionResponse
        )

    async def ListModels(self, request: pb.ListModelsRequest, grpc_context=None) -> pb.ListModelsResponse:
        return await self._grpc_unary(
            "ListModels", grpc_context, lambda: self.models(http_request("GET", "/v1/models", grpc_context)), pb.ListModelsResponse
        )


def _completion_body(request: pb.CompletionRequest) -> dict:
    body = message_body(request)
    ids = body.pop("prompt_token_ids", None)
    if ids:
        if "prompt" in body:
            raise InvalidRequestError("Give the prompt as 'prompt' or as 'prompt_token_ids', not both.", param="prompt")
        body["prompt"] = ids
    return body
