"""The gRPC API's translation (app/grpc_api/service.py) without a server: a request
message to the REST body it stands for, a stream's error event to its status, the
in-process HTTP request a call becomes."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from google.protobuf import struct_pb2

from app.errors import (
    APIError,
    AuthenticationError,
    ConflictError,
    GatewayTimeoutError,
    InvalidRequestError,
    NotFoundError,
    PayloadTooLargeError,
    RateLimitError,
    ServiceUnavailableError,
    status_of_error,
)
from app.grpc_api import llm_pb2 as pb
from app.grpc_api.service import _api_error, _completion_body, _sse_events, grpc_status, http_request, message_body


def struct(d: dict) -> struct_pb2.Struct:
    s = struct_pb2.Struct()
    s.update(d)
    return s


def test_a_request_message_is_the_json_body_of_its_set_fields():
    msg = pb.ChatCompletionRequest(
        model="m",
        messages=[pb.ChatMessage(role="system", content="terse"), pb.ChatMessage(role="user", content="hi")],
        temperature=0.0,  # optional: present though it is the default, so sent
        seed=2**62 + 1,  # int64 stays an exact int (JSON mapping would make it a string)
        stop=["a", "b"],
        extra=struct({"logit_bias": {"7": 3}, "response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "string", "maxLength": 5, "x-ratio": 0.5}}}}),
    )
    assert message_body(msg) == {
        "model": "m",
        "messages": [{"role": "system", "content": "terse"}, {"role": "user", "content": "hi"}],
        "temperature": 0.0,
        "seed": 2**62 + 1,
        "stop": ["a", "b"],
        # A Struct's numbers are doubles: whole ones are ints again, as a client wrote them.
        "logit_bias": {"7": 3},
        "response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "string", "maxLength": 5, "x-ratio": 0.5}}},
    }
    body = message_body(msg)
    assert type(body["logit_bias"]["7"]) is int and type(body["seed"]) is int
    # Unset optional fields and empty ones are left out: the server's defaults apply.
    assert message_body(pb.ChatCompletionRequest(model="m")) == {"model": "m"}
    # A message's content is sent when set, an empty one too (proto3 optional).
    assert message_body(pb.ChatMessage(role="user", content="")) == {"role": "user", "content": ""}
    assert message_body(pb.ChatMessage(role="assistant")) == {"role": "assistant"}
    tools = message_body(pb.ChatMessage(role="assistant", tool_calls=struct({"x": [{"id": "c1"}]})["x"]))
    assert tools == {"role": "assistant", "tool_calls": [{"id": "c1"}]}


def test_a_field_given_twice_is_refused_naming_it():
    with pytest.raises(InvalidRequestError) as e:
        message_body(pb.ChatCompletionRequest(model="m", max_tokens=3, extra=struct({"max_tokens": 4})))
    assert e.value.param == "max_tokens"
    assert _completion_body(pb.CompletionRequest(model="m", prompt_token_ids=[1, 2])) == {"model": "m", "prompt": [1, 2]}
    with pytest.raises(InvalidRequestError) as e:
        _completion_body(pb.CompletionRequest(model="m", prompt="a", prompt_token_ids=[1]))
    assert e.value.param == "prompt"


@pytest.mark.parametrize(
    "error",
    [
        InvalidRequestError("x", param="temperature"),
        AuthenticationError("x", code="missing_api_key"),
        AuthenticationError("x", code="invalid_api_key"),
        NotFoundError("x", code="model_not_found"),
        NotFoundError("x", code="session_not_found"),
        ConflictError("x", code="session_version_conflict"),
        RateLimitError("x", code="queue_full"),
        ServiceUnavailableError("x", code="store_refusing_writes"),
        GatewayTimeoutError("x", code="timeout"),
        APIError("x"),
    ],
)
def test_a_stream_error_event_gives_back_its_status(error):
    """A stream's error event carries no status; its type and code give it back, and
    every status the API answers has a gRPC status of its own."""
    assert status_of_error(error.body()["error"]) == error.status_code
    assert grpc_status(error.status_code) not in (grpc.StatusCode.OK, grpc.StatusCode.UNKNOWN)


def test_every_error_class_status_has_a_grpc_status():
    for cls in (InvalidRequestError, AuthenticationError, NotFoundError, ConflictError, PayloadTooLargeError,
                RateLimitError, ServiceUnavailableError, GatewayTimeoutError, APIError):
        assert grpc_status(cls.status_code) not in (grpc.StatusCode.OK, grpc.StatusCode.UNKNOWN), cls
    assert grpc_status(409) == grpc.StatusCode.ABORTED and grpc_status(503) == grpc.StatusCode.UNAVAILABLE


def test_sse_events_are_parsed_and_done_ends():
    assert _sse_events(b'data: {"a":1}\n\ndata: [DONE]\n\n') == [{"a": 1}, None]
    assert _sse_events('data: {"error":{"type":"timeout"}}\n\n') == [{"error": {"type": "timeout"}}]


class _Context:
    def __init__(self, metadata, peer):
        self._md, self._peer = metadata, peer

    def invocation_metadata(self):
        return self._md

    def peer(self):
        return self._peer


def test_the_http_request_carries_the_body_and_only_the_forwarded_metadata():
    ctx = _Context(
        [("authorization", "Bearer k"), ("x-session-id", "sess_1"), ("application", "llm"), ("cookie", "c")],
        "ipv6:[::1]:5050",
    )
    req = http_request("POST", "/v1/chat/completions", ctx, {"model": "m"})
    assert req.headers["authorization"] == "Bearer k" and req.headers["x-session-id"] == "sess_1"
    assert "cookie" not in req.headers and "application" not in req.headers
    assert req.client.host == "::1" and req.client.port == 5050
    assert int(req.headers["content-length"]) == len(b'{"model":"m"}')

    async def body():
        return await req.body()

    assert asyncio.run(body()) == b'{"model":"m"}'
    assert http_request("GET", "/v1/models", _Context([], "ipv4:127.0.0.1:9")).client.host == "127.0.0.1"


def test_a_bug_of_the_grpc_layer_is_a_generic_internal_error_and_a_request_error_stays_itself():
    bad = InvalidRequestError("x", param="prompt")
    assert _api_error(bad, "Completion") is bad
    bug = _api_error(KeyError("choices"), "Completion")
    assert bug.status_code == 500 and grpc_status(bug.status_code) == grpc.StatusCode.INTERNAL
    assert "choices" not in bug.message  # nothing of the exception reaches the client


def test_an_answers_id_retry_after_and_rate_limit_headers_become_trailing_metadata():
    from app.grpc_api.service import _answer_metadata

    headers = {"X-Request-Id": "r1", "Retry-After": "3", "x-ratelimit-remaining-tokens": "90",
               "x-ratelimit-reset-requests": "1s", "content-type": "application/json", "set-cookie": "x"}
    assert sorted(_answer_metadata(headers)) == [
        ("retry-after", "3"), ("x-ratelimit-remaining-tokens", "90"), ("x-ratelimit-reset-requests", "1s"),
        ("x-request-id", "r1"),
    ]
    assert _answer_metadata(None) == []
