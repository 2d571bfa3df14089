"""The SSE body of the ingress: an error after streaming began ends the stream with an
error event and [DONE]; a normal stream ends with finish_reason, usage and [DONE]."""

import json
from types import SimpleNamespace


from app.config import AppConfig
from app.ingress import Ingress, _Call
from app.schemas import CompletionRequest
from deployments.compute.engines.protocol import EngineDeadError, TokenDelta


class _NoMetric:
    def inc(self, *a, **k):
        pass

    observe = inc


class FakeStream:
    def __init__(self, items):
        self._items = list(items)
        self.cancelled = False

    def __aiter__(self):
        return self

    async def __anext__(self):
        if not self._items:
            raise StopAsyncIteration
        item = self._items.pop(0)
        if isinstance(item, BaseException):
            raise item
        return item

    def cancel(self):
        self.cancelled = True


def make_ingress() -> Ingress:
    ing = Ingress.__new__(Ingress)
    ing._config = AppConfig()
    ing._m = SimpleNamespace(**{k: _NoMetric() for k in ("requests", "ttft", "tpot", "e2e", "prompt_tokens", "output_tokens")})
    return ing


def events(chunks: list[bytes]) -> list:
    out = []
    for c in chunks:
        assert c.startswith(b"data: ") and c.endswith(b"\n\n")
        payload = c[len(b"data: ") : -2]
        out.append(payload.decode() if payload == b"[DONE]" else json.loads(payload))
    return out


async def collect(ing, req, first, stream):
    call = _Call("completions", "r1", 3)
    call.on_delta(first)
    return [c async for c in ing._stream_body(req, call, first, stream, deadline=1e18)]


async def test_error_after_first_token_ends_with_error_event_and_done():
    ing = make_ingress()
    req = CompletionRequest.model_validate({"model": "tiny-llama", "prompt": "x", "stream": True})
    stream = FakeStream([TokenDelta("b", [2], None, 3, 2), EngineDeadError("boom")])
    out = events(await collect(ing, req, TokenDelta("a", [1], None, 3, 1), stream))
    assert [e["choices"][0]["text"] for e in out[:2]] == ["a", "b"]
    assert out[2]["error"]["message"] and out[2]["error"]["type"] == "service_unavailable"
    assert out[-1] == "[DONE]"
    assert stream.cancelled


async def test_normal_stream_has_finish_usage_and_done():
    ing = make_ingress()
    req = CompletionRequest.model_validate(
        {"model": "tiny-llama", "prompt": "x", "stream": True, "stream_options": {"include_usage": True}}
    )
    stream = FakeStream([TokenDelta("b", [2], "length", 3, 2)])
    out = events(await collect(ing, req, TokenDelta("a", [1], None, 3, 1), stream))
    assert out[1]["choices"][0]["finish_reason"] == "length"
    assert out[2]["choices"] == [] and out[2]["usage"] == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
    assert out[-1] == "[DONE]"
    assert not stream.cancelled


async def test_client_disconnect_cancels_the_upstream_stream():
    ing = make_ingress()
    req = CompletionRequest.model_validate({"model": "tiny-llama", "prompt": "x", "stream": True})
    stream = FakeStream([TokenDelta("b", [2], None, 3, 2)] * 5)
    call = _Call("completions", "r1", 3)
    gen = ing._stream_body(req, call, TokenDelta("a", [1], None, 3, 1), stream, deadline=1e18)
    await gen.__anext__()
    await gen.aclose()  # what Starlette does when the client goes away
    assert stream.cancelled
