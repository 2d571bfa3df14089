"""The gRPC API (app/grpc_api/llm.proto) through Serve's real gRPC proxy, on a real
socket, against the shared application with both engines: the same answers as the REST
API, its errors as gRPC status codes with the error's fields as trailing metadata,
sessions, a stream the client cancels (its generation stops, also when Serve's proxy is
waiting to write to it), and the metrics."""

from __future__ import annotations

import time

import grpc
import httpx
import pytest
from google.protobuf import struct_pb2

from app.grpc_api import llm_pb2 as pb
from app.grpc_api import llm_pb2_grpc
from deployments.compute.engines.protocol import MAX_LOGPROBS
from tests.fixtures.serve_app import idle_worker_stats, serve_logs_dir, suite_ingress, worker_stats

pytestmark = pytest.mark.integration

# The Serve instance may run other applications beside the shared one (test_api_keys).
APP = (("application", "llm"),)


@pytest.fixture(scope="module")
def stub(grpc_port):
    channel = grpc.insecure_channel(f"127.0.0.1:{grpc_port}")
    yield llm_pb2_grpc.LLMStub(channel)
    channel.close()


def rest(served_app, path: str, body: dict, headers=None) -> dict:
    r = httpx.post(served_app.base_url + path, json=body, headers=headers or {}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def trailing(error: grpc.RpcError) -> dict:
    return {m.key: m.value for m in error.trailing_metadata() or ()}


def chat(text: str, **kw) -> pb.ChatCompletionRequest:
    kw.setdefault("temperature", 0)
    return pb.ChatCompletionRequest(model="tiny-llama", messages=[pb.ChatMessage(role="user", content=text)], **kw)


def test_chat_over_grpc_is_the_rest_answer_unary_and_streamed(served_app, stub):
    want = rest(
        served_app, "/v1/chat/completions",
        {"model": served_app.model_id, "messages": [{"role": "user", "content": "gRPC hello"}],
         "max_tokens": 12, "temperature": 0},
    )
    got = stub.ChatCompletion(chat("gRPC hello", max_tokens=12), metadata=APP, timeout=120)
    assert got.id.startswith("chatcmpl-") and got.model == served_app.model_id
    assert len(got.choices) == 1
    assert got.choices[0].message.role == "assistant"
    assert got.choices[0].message.content == want["choices"][0]["message"]["content"]
    assert got.choices[0].finish_reason == want["choices"][0]["finish_reason"]
    assert got.usage.prompt_tokens == want["usage"]["prompt_tokens"]
    assert got.usage.completion_tokens == want["usage"]["completion_tokens"] == 12
    assert got.usage.total_tokens == got.usage.prompt_tokens + 12

    chunks = list(stub.ChatCompletionStream(chat("gRPC hello", max_tokens=12), metadata=APP, timeout=120))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content for c in chunks if c.choices)
    assert text == got.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]
    # Usage comes with the last chunk, unless the request's stream_options say otherwise.
    assert chunks[-1].usage.completion_tokens == 12 and not chunks[-1].choices
    assert not any(c.HasField("usage") for c in chunks[:-1])
    assert not any(c.HasField("error") for c in chunks)
    extra = struct_pb2.Struct()
    extra.update({"stream_options": {"include_usage": False}})
    chunks = list(stub.ChatCompletionStream(chat("gRPC hello", max_tokens=3, extra=extra), metadata=APP, timeout=120))
    assert not any(c.HasField("usage") for c in chunks)


def test_return_token_ids_over_grpc_are_the_rest_answers(served_app, stub):
    body = {"model": served_app.model_id, "messages": [{"role": "user", "content": "ids please"}],
            "max_tokens": 6, "temperature": 0, "return_token_ids": True}
    want = rest(served_app, "/v1/chat/completions", body)
    extra = struct_pb2.Struct()
    extra.update({"return_token_ids": True})
    got = stub.ChatCompletion(chat("ids please", max_tokens=6, extra=extra), metadata=APP, timeout=120)
    assert list(got.prompt_token_ids) == want["prompt_token_ids"]
    assert list(got.choices[0].token_ids) == want["choices"][0]["token_ids"] and len(got.choices[0].token_ids) == 6
    chunks = list(stub.ChatCompletionStream(chat("ids please", max_tokens=6, extra=extra), metadata=APP, timeout=120))
    assert list(chunks[0].prompt_token_ids) == want["prompt_token_ids"]
    assert [t for c in chunks if c.choices for t in c.choices[0].token_ids] == want["choices"][0]["token_ids"]
    done = stub.Completion(pb.CompletionRequest(model="tiny-llama", prompt_token_ids=[11, 12, 13], max_tokens=4,
                                                temperature=0, extra=extra), metadata=APP, timeout=120)
    assert list(done.choices[0].prompt_token_ids) == [11, 12, 13] and len(done.choices[0].token_ids) == 4


def test_completion_over_grpc_takes_token_ids_and_extra_fields_as_rest_does(served_app, stub):
    body = {"model": served_app.model_id, "prompt": [11, 12, 13, 14], "max_tokens": 6, "temperature": 0,
            "logprobs": 2, "logit_bias": {"40": 5}}
    want = rest(served_app, "/v1/completions", body)
    extra = struct_pb2.Struct()
    extra.update({"logit_bias": {"40": 5}})
    got = stub.Completion(
        pb.CompletionRequest(model="tiny-llama", prompt_token_ids=[11, 12, 13, 14], max_tokens=6, temperature=0,
                             logprobs=2, extra=extra),
        metadata=APP, timeout=120,
    )
    assert got.choices[0].text == want["choices"][0]["text"]
    lp = got.choices[0].logprobs
    assert list(lp["tokens"]) == want["choices"][0]["logprobs"]["tokens"]
    assert [round(x, 4) for x in lp["token_logprobs"]] == [round(x, 4) for x in want["choices"][0]["logprobs"]["token_logprobs"]]
    streamed = stub.CompletionStream(pb.CompletionRequest(model="tiny-llama", prompt="abc", max_tokens=5, temperature=0),
                                     metadata=APP, timeout=120)
    chunks = list(streamed)
    unary = stub.Completion(pb.CompletionRequest(model="tiny-llama", prompt="abc", max_tokens=5, temperature=0),
                            metadata=APP, timeout=120)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == unary.choices[0].text
    assert chunks[-1].usage.completion_tokens == unary.usage.completion_tokens == 5


def close(got, want) -> bool:
    """The same JSON value, floats within 1e-4 (a Struct's numbers are all doubles)."""
    if isinstance(want, dict):
        return isinstance(got, dict) and got.keys() == want.keys() and all(close(got[k], want[k]) for k in want)
    if isinstance(want, list):
        return isinstance(got, list) and len(got) == len(want) and all(map(close, got, want))
    if isinstance(want, (int, float)) and not isinstance(want, bool):
        return isinstance(got, (int, float)) and abs(got - want) <= 1e-4
    return got == want


def test_echo_prompt_logprobs_and_a_batch_of_prompts_over_grpc_are_the_rest_answers(served_app, stub):
    """What an evaluation harness sends (the prompt's ids echoed with their logprobs,
    max_tokens 1 or 0) and a batch of prompts: the REST answers, field by field."""
    from google.protobuf import json_format

    ids = [11, 12, 13, 14, 15, 16]
    want = rest(served_app, "/v1/completions", {"model": served_app.model_id, "prompt": ids, "max_tokens": 1,
                                                "temperature": 0, "echo": True, "logprobs": 1, "prompt_logprobs": 2})
    got = stub.Completion(pb.CompletionRequest(model="tiny-llama", prompt_token_ids=ids, max_tokens=1, temperature=0,
                                               echo=True, logprobs=1, prompt_logprobs=2), metadata=APP, timeout=120)
    [choice], [wanted] = got.choices, want["choices"]
    assert choice.text == wanted["text"] and choice.finish_reason == wanted["finish_reason"]
    logprobs = json_format.MessageToDict(choice.logprobs)
    assert logprobs["token_logprobs"][0] is None and len(logprobs["tokens"]) == len(ids) + 1
    assert close(logprobs, wanted["logprobs"]), (logprobs, wanted["logprobs"])
    prompt_logprobs = json_format.MessageToDict(choice.prompt_logprobs)
    assert prompt_logprobs[0] is None and len(prompt_logprobs) == len(ids)
    assert close(prompt_logprobs, wanted["prompt_logprobs"]), (prompt_logprobs, wanted["prompt_logprobs"])
    assert got.usage.prompt_tokens == len(ids) and got.usage.completion_tokens == 1

    # max_tokens 0 with echo: the prompt alone.
    alone = stub.Completion(pb.CompletionRequest(model="tiny-llama", prompt="the prompt alone", max_tokens=0, echo=True),
                            metadata=APP, timeout=120)
    assert alone.choices[0].text == "the prompt alone" and alone.usage.completion_tokens == 0
    # Streamed: the first chunk carries the prompt.
    chunks = list(stub.CompletionStream(pb.CompletionRequest(model="tiny-llama", prompt="abc", max_tokens=3,
                                                             temperature=0, echo=True), metadata=APP, timeout=120))
    texts = [c.choices[0].text for c in chunks if c.choices]
    assert texts[0].startswith("abc")
    unary = stub.Completion(pb.CompletionRequest(model="tiny-llama", prompt="abc", max_tokens=3, temperature=0),
                            metadata=APP, timeout=120)
    assert "".join(texts) == "abc" + unary.choices[0].text

    # Chat: prompt_logprobs at the top of the response.
    body = {"model": served_app.model_id, "messages": [{"role": "user", "content": "score me"}], "max_tokens": 2,
            "temperature": 0, "prompt_logprobs": 1}
    want = rest(served_app, "/v1/chat/completions", body)
    got = stub.ChatCompletion(chat("score me", max_tokens=2, prompt_logprobs=1), metadata=APP, timeout=120)
    assert close(json_format.MessageToDict(got.prompt_logprobs), want["prompt_logprobs"])
    # Not streamed, as with REST (and vLLM).
    with pytest.raises(grpc.RpcError) as e:
        list(stub.ChatCompletionStream(chat("score me", max_tokens=2, prompt_logprobs=1), metadata=APP, timeout=60))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert trailing(e.value)["llm-error-param"] == "prompt_logprobs"

    # A batch of prompts, in `extra`: each prompt's n choices, by index.
    prompts = ["first of two", "second of two"]
    want = rest(served_app, "/v1/completions", {"model": served_app.model_id, "prompt": prompts, "n": 2,
                                                "max_tokens": 3, "temperature": 0})
    extra = struct_pb2.Struct()
    extra.update({"prompt": prompts})
    got = stub.Completion(pb.CompletionRequest(model="tiny-llama", n=2, max_tokens=3, temperature=0, extra=extra),
                          metadata=APP, timeout=120)
    assert [(c.index, c.text) for c in got.choices] == [(c["index"], c["text"]) for c in want["choices"]]
    assert len(got.choices) == 4 and got.usage.prompt_tokens == want["usage"]["prompt_tokens"]


def test_errors_are_grpc_status_codes_with_the_errors_fields(served_app, stub):
    cases = [
        (chat("x", temperature=9), grpc.StatusCode.INVALID_ARGUMENT, {"llm-error-param": "temperature"}),
        (pb.ChatCompletionRequest(model="no-such-model", messages=[pb.ChatMessage(role="user", content="x")]),
         grpc.StatusCode.NOT_FOUND, {"llm-error-code": "model_not_found"}),
        (pb.ChatCompletionRequest(model="tiny-llama"), grpc.StatusCode.INVALID_ARGUMENT, {"llm-error-param": "messages"}),
    ]
    extra = struct_pb2.Struct()
    extra.update({"max_tokens": 3})
    cases.append((chat("x", max_tokens=3, extra=extra), grpc.StatusCode.INVALID_ARGUMENT, {"llm-error-param": "max_tokens"}))
    for request, code, fields in cases:
        with pytest.raises(grpc.RpcError) as e:
            stub.ChatCompletion(request, metadata=APP, timeout=60)
        assert e.value.code() == code, (request, e.value.details())
        assert e.value.details()
        meta = trailing(e.value)
        assert meta["llm-error-type"] == "invalid_request_error"
        assert fields.items() <= meta.items(), meta
        # A stream refused before its first token: the same status, and one chunk saying it.
        seen = []
        with pytest.raises(grpc.RpcError) as e:
            for c in stub.ChatCompletionStream(request, metadata=APP, timeout=60):
                seen.append(c)
        assert e.value.code() == code
        assert len(seen) == 1 and seen[0].error.message == e.value.details(), seen
    with pytest.raises(grpc.RpcError) as e:
        stub.Completion(pb.CompletionRequest(model="tiny-llama", prompt="a", prompt_token_ids=[1]), metadata=APP, timeout=60)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and trailing(e.value)["llm-error-param"] == "prompt"


def test_sessions_over_grpc(served_app, stub):
    with pytest.raises(grpc.RpcError) as e:
        stub.CreateSession(pb.CreateSessionRequest(ttl_s=31 * 86_400), metadata=APP, timeout=60)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and trailing(e.value)["llm-error-param"] == "ttl_s"
    session = stub.CreateSession(pb.CreateSessionRequest(ttl_s=600), metadata=APP, timeout=60)
    assert session.id.startswith("sess_") and session.expires_at - session.created in (599, 600, 601)
    first = stub.ChatCompletion(chat("first", max_tokens=4, session_id=session.id), metadata=APP, timeout=120)
    # By metadata, as the REST API's X-Session-Id header.
    second = stub.ChatCompletion(chat("second", max_tokens=4), metadata=APP + (("x-session-id", session.id),), timeout=120)
    assert second.usage.prompt_tokens > first.usage.prompt_tokens + first.usage.completion_tokens
    got = stub.GetSession(pb.GetSessionRequest(id=session.id), metadata=APP, timeout=60)
    want = httpx.get(f"{served_app.base_url}/v1/sessions/{session.id}", timeout=60).json()
    assert got.version == want["version"] == 2
    assert [(m.role, m.content) for m in got.messages] == [(m["role"], m["content"]) for m in want["messages"]]
    assert [m.content for m in got.messages] == [
        "first", first.choices[0].message.content, "second", second.choices[0].message.content
    ]
    assert stub.DeleteSession(pb.DeleteSessionRequest(id=session.id), metadata=APP, timeout=60).deleted
    for call in (
        lambda: stub.GetSession(pb.GetSessionRequest(id=session.id), metadata=APP, timeout=60),
        lambda: stub.ChatCompletion(chat("third", max_tokens=2, session_id=session.id), metadata=APP, timeout=60),
    ):
        with pytest.raises(grpc.RpcError) as e:
            call()
        assert e.value.code() == grpc.StatusCode.NOT_FOUND and trailing(e.value)["llm-error-code"] == "session_not_found"
    with pytest.raises(grpc.RpcError) as e:
        stub.GetSession(pb.GetSessionRequest(id="not-a-session"), metadata=APP, timeout=60)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and trailing(e.value)["llm-error-param"] == "session_id"


def long_stream(stub, logprobs=None):
    """A stream of the context's length; its max_tokens and the worker's token count
    before it. ``logprobs``: that many alternatives in each chunk (larger chunks)."""
    max_len = stub.ListModels(pb.ListModelsRequest(), metadata=APP, timeout=60).data[0].max_model_len
    assert max_len > 64
    max_tokens = max_len - 8
    before = worker_stats().num_generated_tokens
    extra = struct_pb2.Struct()
    extra.update({"ignore_eos": True})
    call = stub.CompletionStream(
        pb.CompletionRequest(
            model="tiny-llama", prompt_token_ids=[13] * 8, max_tokens=max_tokens, extra=extra, logprobs=logprobs
        ),
        metadata=APP, timeout=120,
    )
    return call, max_tokens, before


def test_a_cancelled_stream_stops_its_generation(served_app, stub):
    call, max_tokens, before = long_stream(stub)
    got = [next(call) for _ in range(3)]
    assert any(c.choices and c.choices[0].text for c in got)
    call.cancel()
    stats = idle_worker_stats()
    assert stats.num_running == 0
    # Not stopped, the request would have generated max_tokens tokens before leaving.
    assert stats.num_generated_tokens - before < max_tokens // 2, (before, stats.num_generated_tokens)
    assert stub.ChatCompletion(chat("after", max_tokens=2), metadata=APP, timeout=60).usage.completion_tokens == 2


def test_a_stream_cancelled_while_the_proxy_waits_to_write_stops_its_generation(served_app, grpc_port):
    # A client that stops reading fills its stream's HTTP/2 window (1 KiB here, BDP probing
    # off so that it stays so), so the proxy is waiting in a write when the cancel lands:
    # the case that Ray Serve 2.60's Python proxy did not cancel (app/grpc_api/proxy_fix.py;
    # scripts/test.sh runs this module behind it, the suite behind HAProxy).
    # Chunks with MAX_LOGPROBS alternatives each (hundreds of bytes) fill that window in a
    # few chunks: with one token's text each it took dozens, and a proxy that lagged
    # behind the worker on a loaded machine was sometimes still writing those (not
    # blocked) when the cancel came, which Ray's own path then took (CI, 2026-12-07).
    options = [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 1024)]
    channel = grpc.insecure_channel(f"127.0.0.1:{grpc_port}", options=options)
    try:
        call, max_tokens, before = long_stream(llm_pb2_grpc.LLMStub(channel), logprobs=MAX_LOGPROBS)
        assert next(call).choices
        # Read nothing more until the worker is well past what the window holds.
        deadline = time.monotonic() + 60
        while (generated := worker_stats().num_generated_tokens - before) < 200:
            assert time.monotonic() < deadline, generated
            time.sleep(0.1)
        assert generated < max_tokens // 2, "the generation ended before the test could cancel it"
        call.cancel()
        stats = idle_worker_stats()
        assert stats.num_running == 0
        assert stats.num_generated_tokens - before < max_tokens // 2, (before, stats.num_generated_tokens)
    finally:
        channel.close()
    if suite_ingress() != "serve-proxy":
        return  # HAProxy carried the stream, not Serve's proxy: the fix below is the proxy's
    deadline = time.monotonic() + 90  # the fix counts what it cancelled
    while not any(line.startswith("ray_llm_grpc_proxy_cancels_total") and float(line.split()[-1]) >= 1
                  for line in httpx.get(served_app.base_url + "/metrics", timeout=60).text.splitlines()):
        # On a failure, whether the fix ran (its line in the proxy's log) tells a cancel
        # that took Ray's own path from a count that did not reach /metrics.
        assert time.monotonic() < deadline, proxy_fix_lines()
        time.sleep(1)


def proxy_fix_lines() -> list[str]:
    """The proxy fix's lines in the proxy's log (app/grpc_api/proxy_fix.py)."""
    return [line.strip() for path in serve_logs_dir().glob("proxy_*.log")
            for line in path.read_text(errors="replace").splitlines() if "gRPC stream closed mid-write" in line]


def test_grpc_calls_are_counted_by_method_and_code(served_app, stub):
    stub.ListModels(pb.ListModelsRequest(), metadata=APP, timeout=60)
    with pytest.raises(grpc.RpcError):
        stub.GetSession(pb.GetSessionRequest(id="sess_" + "0" * 32), metadata=APP, timeout=60)
    wanted = ('method="ListModels"', 'code="OK"'), ('method="GetSession"', 'code="NOT_FOUND"')
    deadline = time.monotonic() + 90
    while True:
        lines = [l for l in httpx.get(served_app.base_url + "/metrics", timeout=60).text.splitlines()
                 if l.startswith("ray_llm_grpc_requests_total")]
        if all(any(all(p in line for p in parts) for line in lines) for parts in wanted):
            break
        assert time.monotonic() < deadline, lines
        time.sleep(1)
