"""tool_choice "auto" through vLLM's tool-call parsers (app/tool_calls.py): a reply read
whole and the same reply read as it streams give the same calls; a parser whose format is
made of special tokens keeps them in the text; an unknown parser name is an error naming
the known ones. Then the ingress's SSE body and whole answer for "auto": calls as vLLM
streams them, finish_reason tool_calls, plain text as content, and a parser that fails
leaves the reply as text."""

import asyncio
import json
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm.tool_parsers")

from app.tool_calls import ToolCallParser  # noqa: E402
from tests.fixtures.models import get_model_path  # noqa: E402

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}
CLOCK = {"type": "function", "function": {"name": "get_time"}}


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(get_model_path("tiny")))


@pytest.fixture(scope="module")
def hermes_tokenizer():
    """The tiny model's tokenizer with Hermes's (and Qwen's) tool-call tokens added."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(get_model_path("tiny")))
    tok.add_special_tokens({"additional_special_tokens": ["<tool_call>", "</tool_call>"]})
    return tok


def streamed(parser: ToolCallParser, request, tokenizer, text: str):
    """(content, {index: {id, name, arguments}}) as a client assembles a stream of
    ``text`` fed one token at a time."""
    s = parser.stream(request)
    content, calls = "", {}
    ids = tokenizer.encode(text, add_special_tokens=False)
    for n, i in enumerate(ids):
        piece, deltas = s.feed(tokenizer.decode([i], skip_special_tokens=False), [i])
        if n == len(ids) - 1:
            deltas += s.finish()
        content += piece
        for d in deltas:
            entry = calls.setdefault(d["index"], {"id": None, "name": None, "arguments": ""})
            entry["id"] = d.get("id", entry["id"])
            fn = d.get("function", {})
            entry["name"] = fn.get("name", entry["name"])
            entry["arguments"] += fn.get("arguments", "")
    return content, calls, s.called


def test_an_unknown_parser_is_refused_naming_the_known_ones(tokenizer):
    with pytest.raises(ValueError) as e:
        ToolCallParser("no_such_parser", tokenizer)
    assert "'no_such_parser'" in str(e.value) and "hermes" in str(e.value) and "pythonic" in str(e.value)
    # A parser that cannot read this tokenizer fails at start too, with its reason.
    with pytest.raises(ValueError, match="python_tag"):
        ToolCallParser("llama3_json", tokenizer)


def test_pythonic_calls_whole_and_streamed_are_the_same(tokenizer):
    parser = ToolCallParser("pythonic", tokenizer)
    request = parser.request([WEATHER, CLOCK], None)
    assert parser.skip_special_tokens(request)
    text = '[get_weather(city="Paris"), get_time()]'
    whole = parser.parse(text, request)
    assert whole.content is None
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in whole.tool_calls] == [
        ("get_weather", {"city": "Paris"}), ("get_time", {})]
    assert all(c["type"] == "function" and c["id"] for c in whole.tool_calls)
    content, calls, called = streamed(parser, request, tokenizer, text)
    assert called and not content
    assert [(calls[i]["name"], json.loads(calls[i]["arguments"])) for i in sorted(calls)] == [
        ("get_weather", {"city": "Paris"}), ("get_time", {})]
    assert all(calls[i]["id"] for i in calls)
    # Plain text is content, whole and streamed.
    assert parser.parse("It is sunny.", request).tool_calls == []
    content, calls, called = streamed(parser, request, tokenizer, "It is sunny.")
    assert content == "It is sunny." and not calls and not called


def test_hermes_keeps_its_special_tokens_and_content_before_a_call(hermes_tokenizer):
    parser = ToolCallParser("hermes", hermes_tokenizer)
    request = parser.request([WEATHER], None)
    # Its format is made of special tokens: the engine must leave them in the text.
    assert parser.skip_special_tokens(request) is False
    text = 'Let me look. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    whole = parser.parse(text, request)
    assert whole.content.strip() == "Let me look."
    (call,) = whole.tool_calls
    assert call["function"]["name"] == "get_weather" and json.loads(call["function"]["arguments"]) == {"city": "Oslo"}
    content, calls, called = streamed(parser, request, hermes_tokenizer, text)
    assert called and content.strip() == "Let me look."
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [("get_weather", {"city": "Oslo"})]


# ---- the ingress's answers for "auto" -------------------------------------------------


class _Count:
    def __init__(self):
        self.seen = []

    def inc(self, *a, tags=None, **k):
        self.seen.append(tags)

    observe = inc


def auto_ingress(tokenizer, parser_name="pythonic"):
    from app.config import AppConfig
    from app.ingress import Ingress
    from app.telemetry import Every

    ing = Ingress.__new__(Ingress)
    ing._config = AppConfig()
    ing._stopping = set()
    names = ("requests", "ttft", "tpot", "e2e", "prompt_tokens", "output_tokens", "tool_parses")
    ing._m = SimpleNamespace(**{k: _Count() for k in names})
    ing._tool_parser = ToolCallParser(parser_name, tokenizer)
    ing._tool_log = Every(60.0)
    ing._sessions = None
    return ing


def auto_request(ing, stream: bool):
    from app.schemas import ChatCompletionRequest

    req = ChatCompletionRequest.model_validate({
        "model": "tiny-llama", "messages": [{"role": "user", "content": "weather?"}], "stream": stream,
        "tools": [WEATHER, CLOCK]})
    assert req.auto_tool_choice()
    req.parser_request = ing._tool_parser.request(req.tools, req.parallel_tool_calls)
    return req


def deltas_of(tokenizer, text: str, finish="stop"):
    from deployments.compute.engines.protocol import TokenDelta

    ids = tokenizer.encode(text, add_special_tokens=False)
    return [TokenDelta(tokenizer.decode([i]), [i], finish if n == len(ids) - 1 else None, 5, n + 1)
            for n, i in enumerate(ids)]


async def stream_events(ing, req, deltas):
    from app.ingress import _Call
    from tests.unit.test_ingress_stream import FakeStream, events

    call = _Call("chat", "r1", 5)
    call.on_delta(deltas[0])
    return events([c async for c in ing._stream_body(req, [call], [deltas[0]], [FakeStream(deltas[1:])])])


def test_the_sse_body_streams_auto_calls_and_ends_with_tool_calls(tokenizer):
    ing = auto_ingress(tokenizer)
    req = auto_request(ing, stream=True)
    out = asyncio.run(stream_events(ing, req, deltas_of(tokenizer, '[get_weather(city="Rome")]')))
    chunks = [e for e in out if e != "[DONE]"]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    parts = [tc for e in chunks[1:] for tc in e["choices"][0]["delta"].get("tool_calls", [])]
    assert parts[0]["id"] and parts[0]["type"] == "function" and parts[0]["function"]["name"] == "get_weather"
    assert all(p["index"] == 0 for p in parts)
    assert json.loads("".join(p["function"].get("arguments", "") for p in parts)) == {"city": "Rome"}
    assert not any(e["choices"][0]["delta"].get("content") for e in chunks[1:])
    assert [e["choices"][0]["finish_reason"] for e in chunks if e["choices"][0]["finish_reason"]] == ["tool_calls"]
    assert ing._m.tool_parses.seen == [{"parser": "pythonic", "outcome": "called"}]
    # Text that calls nothing streams as content and ends as the engine ended it.
    ing = auto_ingress(tokenizer)
    out = asyncio.run(stream_events(ing, req, deltas_of(tokenizer, "No tools needed here.", finish="length")))
    chunks = [e for e in out if e != "[DONE]"]
    assert "".join(e["choices"][0]["delta"].get("content") or "" for e in chunks) == "No tools needed here."
    assert [e["choices"][0]["finish_reason"] for e in chunks if e["choices"][0]["finish_reason"]] == ["length"]
    assert ing._m.tool_parses.seen == [{"parser": "pythonic", "outcome": "text"}]


def test_a_parser_that_fails_leaves_the_reply_as_text(tokenizer, monkeypatch):
    from app.tool_calls import StreamedToolCalls

    def boom(self, text, token_ids):  # passes "Weather" through, holds back the rest, fails at "fine"
        self._text += text
        if "fine" in self._text:
            raise RuntimeError("parser bug")
        return (text, []) if "Weather" in text else ("", [])

    monkeypatch.setattr(StreamedToolCalls, "feed", boom)
    ing = auto_ingress(tokenizer)
    req = auto_request(ing, stream=True)
    out = asyncio.run(stream_events(ing, req, deltas_of(tokenizer, "Weather in Oslo is fine, and more.")))
    chunks = [e for e in out if e != "[DONE]"]
    # What the parser held back before it failed comes too: the whole reply, once.
    assert "".join(e["choices"][0]["delta"].get("content") or "" for e in chunks) == "Weather in Oslo is fine, and more."
    assert [e["choices"][0]["finish_reason"] for e in chunks if e["choices"][0]["finish_reason"]] == ["stop"]
    assert ing._m.tool_parses.seen == [{"parser": "pythonic", "outcome": "failed"}]
    # Whole: the same.
    monkeypatch.setattr(ToolCallParser, "parse", lambda *a: (_ for _ in ()).throw(RuntimeError("parser bug")))
    ing = auto_ingress(tokenizer)
    assert ing._parse_tools(req, "Weather in Oslo is fine.") is None
    assert ing._m.tool_parses.seen == [{"parser": "pythonic", "outcome": "failed"}]
