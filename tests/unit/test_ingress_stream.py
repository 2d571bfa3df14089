"""The SSE body of the ingress: an error after streaming began ends the stream with an
error event and [DONE]; a normal stream ends with finish_reason, usage and [DONE]; with
n choices, chunks carry their choice's index and one failing choice stops them all. A
finished choice's stream is read to its end in the request's task (the generators behind
it run their code after the last delta there)."""

import asyncio
import json
from types import SimpleNamespace


from app.config import AppConfig
from app.ingress import Ingress, _Call, _LocalStream
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
        self.ended = False  # read to its end

    def __aiter__(self):
        return self

    async def __anext__(self):
        if not self._items:
            self.ended = True
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
    ing._stopping = set()
    ing._reply_parser = None
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
    return [c async for c in ing._stream_body(req, [call], [first], [stream])]


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
    assert out[2]["choices"] == [] and out[2]["usage"] == {
        "prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5, "prompt_tokens_details": {"cached_tokens": 0}}
    assert out[-1] == "[DONE]"
    assert not stream.cancelled and stream.ended


async def test_a_finished_streams_generators_end_in_the_request_task():
    ing = make_ingress()
    req = CompletionRequest.model_validate({"model": "tiny-llama", "prompt": "x", "stream": True})
    ended_in = []

    async def router_generate():
        # As the router's and the worker's generators: code after the last yield.
        yield TokenDelta("b", [2], "length", 3, 2)
        ended_in.append(asyncio.current_task())

    out = events(await collect(ing, req, TokenDelta("a", [1], None, 3, 1), _LocalStream(router_generate())))
    assert out[-1] == "[DONE]"
    # Not left at its last yield for the garbage collector to close in another task.
    assert ended_in == [asyncio.current_task()]


async def test_a_finished_stream_that_does_not_end_is_cancelled_after_the_bound(monkeypatch):
    import app.ingress as ingress

    monkeypatch.setattr(ingress, "DRAIN_TIMEOUT_S", 0.05)
    ing = make_ingress()
    req = CompletionRequest.model_validate({"model": "tiny-llama", "prompt": "x", "stream": True})

    class Stuck(FakeStream):
        async def __anext__(self):
            if self._items:
                return self._items.pop(0)
            await asyncio.sleep(3600)  # never ends after its finish

    stream = Stuck([TokenDelta("b", [2], "length", 3, 2)])
    out = events(await asyncio.wait_for(collect(ing, req, TokenDelta("a", [1], None, 3, 1), stream), 5))
    assert out[-1] == "[DONE]" and stream.cancelled


async def test_a_buffered_choice_reads_its_stream_to_the_end():
    ing = make_ingress()
    stream = FakeStream([TokenDelta("b", [2], None, 3, 2), TokenDelta("c", [3], "stop", 3, 3)])
    call = _Call("completions", "r1", 3)
    text = await ing._rest_of_choice(call, TokenDelta("a", [1], None, 3, 1), stream)
    assert text == "abc" and stream.ended


async def test_client_disconnect_cancels_the_upstream_stream():
    ing = make_ingress()
    req = CompletionRequest.model_validate({"model": "tiny-llama", "prompt": "x", "stream": True})
    stream = FakeStream([TokenDelta("b", [2], None, 3, 2)] * 5)
    call = _Call("completions", "r1", 3)
    gen = ing._stream_body(req, [call], [TokenDelta("a", [1], None, 3, 1)], [stream])
    await gen.__anext__()
    await gen.aclose()  # what Starlette does when the client goes away
    assert stream.cancelled


async def collect_n(ing, req, firsts, streams):
    calls = [_Call("completions", f"r{i}", 3) for i in range(len(firsts))]
    for call, first in zip(calls, firsts):
        call.head = calls[0]  # n choices of one prompt
        call.on_delta(first)
    return [c async for c in ing._stream_body(req, calls, firsts, streams)]


async def test_n_choices_stream_with_their_index_and_usage_sums_them():
    ing = make_ingress()
    req = CompletionRequest.model_validate(
        {"model": "tiny-llama", "prompt": "x", "stream": True, "n": 2, "stream_options": {"include_usage": True}}
    )
    streams = [
        FakeStream([TokenDelta("b", [2], None, 3, 2), TokenDelta("c", [3], "length", 3, 3)]),
        FakeStream([TokenDelta("y", [9], "stop", 3, 2)]),
    ]
    firsts = [TokenDelta("a", [1], None, 3, 1), TokenDelta("x", [8], None, 3, 1)]
    out = events(await collect_n(ing, req, firsts, streams))
    by_index = {0: "", 1: ""}
    finish = {}
    for e in out[:-2]:
        (choice,) = e["choices"]
        by_index[choice["index"]] += choice["text"]
        if choice["finish_reason"]:
            finish[choice["index"]] = choice["finish_reason"]
    assert by_index == {0: "abc", 1: "xy"} and finish == {0: "length", 1: "stop"}
    assert out[-2]["usage"] == {
        "prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8, "prompt_tokens_details": {"cached_tokens": 0}}
    assert out[-1] == "[DONE]"
    assert all(s.ended for s in streams)


async def test_one_failing_choice_ends_the_stream_and_stops_the_others():
    ing = make_ingress()
    req = CompletionRequest.model_validate({"model": "tiny-llama", "prompt": "x", "stream": True, "n": 2})

    class Endless(FakeStream):
        async def __anext__(self):
            import asyncio

            await asyncio.sleep(3600)

    streams = [FakeStream([EngineDeadError("boom")]), Endless([])]
    firsts = [TokenDelta("a", [1], None, 3, 1), TokenDelta("x", [8], None, 3, 1)]
    out = events(await collect_n(ing, req, firsts, streams))
    assert out[-2]["error"]["type"] == "service_unavailable" and out[-1] == "[DONE]"
    assert all(s.cancelled for s in streams)


class ByteTokenizer:
    """Each id one byte string; a sequence decodes as its bytes joined (a piece of a UTF-8
    character alone is U+FFFD), as byte-level BPE decodes."""

    def __init__(self, pieces: dict[int, bytes]):
        self.pieces = pieces

    def decode(self, ids, **_):
        return b"".join(self.pieces[i] for i in ids).decode("utf-8", "replace")


async def test_logprobs_of_tokens_without_text_yet_go_with_the_next_chunk():
    """A token that ends inside a character sends no chunk of its own; its logprob entry
    must not be lost but go out with the chunk that carries its text, in order. Its text
    in the entry is vLLM's: "" for the first piece of "é", the whole character for the
    piece that completes it (what it adds to the token before it), so the completions
    API's text offsets are offsets in the reply's text."""
    ing = make_ingress()
    ing._tokenizer = ByteTokenizer({1: b"a", 2: b"\xc3", 3: b"\xa9", 4: b"d", 9: b"e"})
    ing._token_text = lambda i: ing._tokenizer.decode([i])
    ing._piece_text = ing._piece_text_uncached
    req = CompletionRequest.model_validate({"model": "tiny-llama", "prompt": "x", "stream": True, "logprobs": 1})
    first = TokenDelta("a", [1], None, 3, 1, logprobs=[(-0.1, [(1, -0.1)])])
    stream = FakeStream([
        TokenDelta("", [2], None, 3, 2, logprobs=[(-0.2, [(2, -0.2)])]),
        TokenDelta("\u00e9", [3], None, 3, 3, logprobs=[(-0.3, [(9, -0.25)])]),
        TokenDelta("", [4], "length", 3, 4, logprobs=[(float("-inf"), [(4, float("-inf"))])]),
    ])
    out = events(await collect(ing, req, first, stream))
    lps = [e["choices"][0]["logprobs"] for e in out[:-1]]
    assert [lp["tokens"] for lp in lps] == [["a"], ["", "\u00e9"], ["d"]]
    assert [lp["token_logprobs"] for lp in lps] == [[-0.1], [-0.2, -0.3], [-9999.0]]  # JSON has no -inf
    assert [lp["text_offset"] for lp in lps] == [[0], [1, 1], [2]]
    # The legacy form lists the chosen token among the top ones when it is not there.
    assert lps[1]["top_logprobs"] == [{"": -0.2}, {"e": -0.25, "\u00e9": -0.3}]


async def test_a_reply_sent_whole_carries_every_tokens_logprobs():
    ing = make_ingress()
    ing._token_text = {1: "a", 2: "b"}.get
    call = _Call("completions", "r1", 3)
    call.logprob_items = []
    first = TokenDelta("a", [1], None, 3, 1, logprobs=[(-0.5, [(1, -0.5), (2, -1.5)])])
    call.on_delta(first)
    stream = FakeStream([TokenDelta("b", [2], "stop", 3, 2, logprobs=[(-0.7, [])])])
    assert await ing._rest_of_choice(call, first, stream) == "ab"
    body, offset = ing._logprobs_json(False, call.logprob_items)
    assert body == {"tokens": ["a", "b"], "token_logprobs": [-0.5, -0.7],
                    "top_logprobs": [{"a": -0.5, "b": -1.5}, {"b": -0.7}], "text_offset": [0, 1]}
    assert offset == 2
    chat, _ = ing._logprobs_json(True, call.logprob_items)
    assert chat["content"][0] == {"token": "a", "logprob": -0.5, "bytes": [97], "top_logprobs": [
        {"token": "a", "logprob": -0.5, "bytes": [97]}, {"token": "b", "logprob": -1.5, "bytes": [98]}]}
    assert ing._logprobs_json(True, None) == (None, 0)


def test_a_tool_call_reply_becomes_tool_calls():
    from app.ingress import tool_reply

    content, calls, finish = tool_reply("named", "get_weather", '{"city":"Oslo"}', "stop")
    assert content is None and finish == "stop"
    assert calls[0]["type"] == "function" and calls[0]["id"].startswith("call_")
    assert calls[0]["function"] == {"name": "get_weather", "arguments": '{"city":"Oslo"}'}
    text = '[{"name":"get_weather","parameters":{"city":"Paris"}},{"name":"noop","parameters":{}}]'
    content, calls, finish = tool_reply("required", None, text, "stop")
    assert content is None and finish == "tool_calls"
    assert [c["function"] for c in calls] == [
        {"name": "get_weather", "arguments": '{"city": "Paris"}'}, {"name": "noop", "arguments": "{}"}]
    assert len({c["id"] for c in calls}) == 2
    # Cut short: nothing to parse, the text stays text.
    assert tool_reply("required", None, '[{"name":"get_w', "length") == ('[{"name":"get_w', [], "length")


def tool_request(choice):
    from app.schemas import ChatCompletionRequest

    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    return ChatCompletionRequest.model_validate({
        "model": "tiny-llama", "messages": [{"role": "user", "content": "x"}], "stream": True,
        "tools": tools, "tool_choice": choice})


async def test_a_named_tool_call_streams_its_arguments_as_they_come():
    ing = make_ingress()
    req = tool_request({"type": "function", "function": {"name": "f"}})
    stream = FakeStream([TokenDelta("", [2], None, 3, 2), TokenDelta('"a":', [3], None, 3, 3),
                         TokenDelta("1}", [4], "stop", 3, 4)])
    out = events(await collect(ing, req, TokenDelta("{", [1], None, 3, 1), stream))
    deltas = [e["choices"][0]["delta"] for e in out[:-1]]
    assert deltas[0] == {"role": "assistant", "content": ""}
    parts = [d["tool_calls"][0] for d in deltas[1:] if "tool_calls" in d]
    assert all("content" not in d for d in deltas[1:]) and [p["index"] for p in parts] == [0, 0, 0]
    assert parts[0]["function"] == {"name": "f", "arguments": "{"} and parts[0]["id"].startswith("call_")
    assert all("id" not in p and "name" not in p["function"] for p in parts[1:])
    assert "".join(p["function"]["arguments"] for p in parts) == '{"a":1}'
    assert [e["choices"][0]["finish_reason"] for e in out[:-1]][-1] == "stop"


async def test_required_tool_calls_stream_whole_when_the_choice_ends():
    ing = make_ingress()
    stream = FakeStream([TokenDelta('"f","parameters":{}}]', [2], "stop", 3, 2)])
    out = events(await collect(ing, tool_request("required"), TokenDelta('[{"name":', [1], None, 3, 1), stream))
    deltas = [e["choices"][0]["delta"] for e in out[:-1]]
    (call,) = deltas[1]["tool_calls"]
    assert call["index"] == 0 and call["function"] == {"name": "f", "arguments": "{}"}
    assert [e["choices"][0]["finish_reason"] for e in out[:-1]] == [None, None, "tool_calls"]


def test_request_features_name_what_a_request_asked_for():
    from app.ingress import request_features
    from app.schemas import ChatCompletionRequest
    from deployments.compute.engines.protocol import SamplingParams

    plain = CompletionRequest.model_validate({"model": "m", "prompt": "x"})
    assert request_features(plain, SamplingParams(max_tokens=1)) == []
    full = SamplingParams(max_tokens=1, logprobs=0, structured_output=("regex", "a"), top_k=3)
    assert request_features(plain, full) == ["logprobs", "structured_output", "sampling_controls"]
    tools = ChatCompletionRequest.model_validate({
        "model": "m", "messages": [{"role": "user", "content": "x"}],
        "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required"})
    assert request_features(tools, SamplingParams(max_tokens=1, structured_output=("json", "{}"))) == ["tool_call"]
