"""A chat reply read by vLLM's parsers (app/reply_parser.py): tool calls under
tool_choice "auto" and reasoning. A reply read whole and the same reply read as it streams
give the same calls and reasoning; a parser whose format is made of special tokens keeps
them in the text; an unknown parser name is an error naming the known ones; what a parser
does not apply to is left alone. Then the ingress's SSE body and whole answer: calls as
vLLM streams them, finish_reason tool_calls, reasoning in ``reasoning``, plain text as
content, and a parser that fails leaves the reply as text."""

import asyncio
import json
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm.parser.parser_manager")

from app.reply_parser import ReplyParser, StreamedReply  # noqa: E402
from app.schemas import ChatCompletionRequest  # noqa: E402
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


def chat(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate(
        {"model": "tiny-llama", "messages": [{"role": "user", "content": "weather?"}], **fields})


def streamed(parsing, tokenizer, text: str):
    """(reasoning, content, {index: {id, name, arguments}}, called) as a client assembles
    a stream of ``text`` fed one token at a time."""
    s = parsing.stream()
    reasoning, content, calls = "", "", {}
    ids = tokenizer.encode(text, add_special_tokens=False)
    for n, i in enumerate(ids):
        r, c, deltas = s.feed(tokenizer.decode([i], skip_special_tokens=False), [i], n == len(ids) - 1)
        reasoning, content = reasoning + r, content + c
        for d in deltas:
            entry = calls.setdefault(d["index"], {"id": None, "name": None, "arguments": ""})
            entry["id"] = d.get("id", entry["id"])
            fn = d.get("function", {})
            entry["name"] = fn.get("name", entry["name"])
            entry["arguments"] += fn.get("arguments", "")
    return reasoning, content, calls, s.called


def test_an_unknown_parser_is_refused_naming_the_known_ones(tokenizer):
    with pytest.raises(ValueError) as e:
        ReplyParser(tokenizer, tool_parser="no_such_parser")
    assert "'no_such_parser'" in str(e.value) and "hermes" in str(e.value) and "pythonic" in str(e.value)
    with pytest.raises(ValueError) as e:
        ReplyParser(tokenizer, reasoning_parser="no_such_parser")
    assert "model.reasoning_parser" in str(e.value) and "qwen3" in str(e.value)
    # A parser that cannot read this tokenizer fails at start too, with vLLM's reason.
    with pytest.raises(ValueError, match="python_tag"):
        ReplyParser(tokenizer, tool_parser="llama3_json")


def test_what_a_parser_applies_to(tokenizer):
    both = ReplyParser(tokenizer, tool_parser="pythonic", reasoning_parser="qwen3")
    p = both.for_request(chat(tools=[WEATHER]))
    assert p.tools and p.reasoning
    p = both.for_request(chat())  # no tools: reasoning only
    assert not p.tools and p.reasoning
    # A reply held to a grammar of the request's own has no reasoning to split off.
    p = both.for_request(chat(tools=[WEATHER], structured_outputs={"regex": "a+"}))
    assert p.tools and not p.reasoning
    assert both.for_request(chat(structured_outputs={"regex": "a+"})) is None
    # A named or "required" tool_choice: the reply is held to a schema, read elsewhere.
    assert both.for_request(chat(tools=[WEATHER], tool_choice="required")) is None
    tools_only = ReplyParser(tokenizer, tool_parser="pythonic")
    assert tools_only.for_request(chat()) is None and tools_only.for_request(chat(tools=[WEATHER], tool_choice="none")) is None


def test_pythonic_calls_whole_and_streamed_are_the_same(tokenizer):
    parsing = ReplyParser(tokenizer, tool_parser="pythonic").for_request(chat(tools=[WEATHER, CLOCK]))
    assert parsing.skip_special_tokens
    text = '[get_weather(city="Paris"), get_time()]'
    whole = parsing.parse(text)
    assert whole.content is None and whole.reasoning is None
    made = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in whole.tool_calls]
    assert made == [("get_weather", {"city": "Paris"}), ("get_time", {})]
    assert all(c["type"] == "function" and c["id"] for c in whole.tool_calls)
    reasoning, content, calls, called = streamed(parsing, tokenizer, text)
    assert called and not content and not reasoning
    assert [(calls[i]["name"], json.loads(calls[i]["arguments"])) for i in sorted(calls)] == made
    assert all(calls[i]["id"] for i in calls)
    # Plain text is content, whole and streamed.
    assert parsing.parse("It is sunny.").tool_calls == [] and parsing.parse("It is sunny.").content == "It is sunny."
    assert streamed(parsing, tokenizer, "It is sunny.")[1:] == ("It is sunny.", {}, False)


def test_hermes_keeps_its_special_tokens_and_content_before_a_call(hermes_tokenizer):
    parsing = ReplyParser(hermes_tokenizer, tool_parser="hermes").for_request(chat(tools=[WEATHER]))
    # Its format is made of special tokens: the engine must leave them in the text.
    assert parsing.skip_special_tokens is False
    text = 'Let me look. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    whole = parsing.parse(text)
    assert whole.content.strip() == "Let me look."
    (call,) = whole.tool_calls
    assert call["function"]["name"] == "get_weather" and json.loads(call["function"]["arguments"]) == {"city": "Oslo"}
    _, content, calls, called = streamed(parsing, hermes_tokenizer, text)
    assert called and content.strip() == "Let me look."
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [("get_weather", {"city": "Oslo"})]


def test_reasoning_then_an_answer_or_a_call_whole_and_streamed(tokenizer):
    parser = ReplyParser(tokenizer, tool_parser="pythonic", reasoning_parser="qwen3")
    answer = parser.for_request(chat())
    text = "<think>Paris is in France.</think>It is sunny."
    whole = answer.parse(text)
    assert (whole.reasoning, whole.content, whole.tool_calls) == ("Paris is in France.", "It is sunny.", [])
    assert streamed(answer, tokenizer, text)[:3] == ("Paris is in France.", "It is sunny.", {})
    # Calls are read from what follows the reasoning.
    call = parser.for_request(chat(tools=[WEATHER]))
    text = '<think>I should ask the tool.</think>[get_weather(city="Paris")]'
    whole = call.parse(text)
    assert whole.reasoning == "I should ask the tool." and not whole.content
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in whole.tool_calls] == [
        ("get_weather", {"city": "Paris"})]
    reasoning, content, calls, called = streamed(call, tokenizer, text)
    assert reasoning == "I should ask the tool." and not content and called
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [("get_weather", {"city": "Paris"})]
    # Thinking off in the template (Qwen3's enable_thinking): the parser reads no reasoning.
    thinking_off = parser.for_request(chat(chat_template_kwargs={"enable_thinking": False}))
    assert thinking_off.parse("It is sunny.").content == "It is sunny."
    assert parser.for_request(chat()).parse("It is sunny.").reasoning == "It is sunny."  # on: all reasoning
    # include_reasoning false: the reasoning is left out, the answer stays.
    quiet = parser.for_request(chat(include_reasoning=False))
    assert quiet.parse("<think>x</think>It is sunny.").reasoning is None
    assert streamed(quiet, tokenizer, "<think>x</think>It is sunny.")[:2] == ("", "It is sunny.")


# ---- the ingress's answers --------------------------------------------------------------


class _Count:
    def __init__(self):
        self.seen = []

    def inc(self, *a, tags=None, **k):
        self.seen.append(tags)

    observe = inc


def parsing_ingress(tokenizer, **parsers):
    from app.config import AppConfig
    from app.ingress import Ingress
    from app.telemetry import Every

    ing = Ingress.__new__(Ingress)
    ing._config = AppConfig()
    ing._stopping = set()
    names = ("requests", "ttft", "tpot", "e2e", "prompt_tokens", "output_tokens", "reply_parses")
    ing._m = SimpleNamespace(**{k: _Count() for k in names})
    ing._reply_parser = ReplyParser(tokenizer, **parsers)
    ing._parse_log = Every(60.0)
    ing._sessions = None
    return ing


def parsed_request(ing, **fields):
    req = chat(stream=True, **fields)
    req.reply_parsing = ing._reply_parser.for_request(req)
    assert req.reply_parsing is not None
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
    out = events([c async for c in ing._stream_body(req, [call], [deltas[0]], [FakeStream(deltas[1:])])])
    return [e for e in out if e != "[DONE]"]


def joined(chunks, key) -> str:
    return "".join(e["choices"][0]["delta"].get(key) or "" for e in chunks[1:])


def finishes(chunks) -> list:
    return [e["choices"][0]["finish_reason"] for e in chunks if e["choices"][0]["finish_reason"]]


def test_the_sse_body_streams_calls_and_reasoning(tokenizer):
    ing = parsing_ingress(tokenizer, tool_parser="pythonic")
    req = parsed_request(ing, tools=[WEATHER, CLOCK])
    chunks = asyncio.run(stream_events(ing, req, deltas_of(tokenizer, '[get_weather(city="Rome")]')))
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    parts = [tc for e in chunks[1:] for tc in e["choices"][0]["delta"].get("tool_calls", [])]
    assert parts[0]["id"] and parts[0]["type"] == "function" and parts[0]["function"]["name"] == "get_weather"
    assert all(p["index"] == 0 for p in parts)
    assert json.loads("".join(p["function"].get("arguments", "") for p in parts)) == {"city": "Rome"}
    assert not joined(chunks, "content") and finishes(chunks) == ["tool_calls"]
    assert ing._m.reply_parses.seen == [{"outcome": "tool_calls"}]
    # Text that calls nothing streams as content and ends as the engine ended it.
    ing = parsing_ingress(tokenizer, tool_parser="pythonic")
    chunks = asyncio.run(stream_events(ing, req, deltas_of(tokenizer, "No tools needed here.", finish="length")))
    assert joined(chunks, "content") == "No tools needed here." and finishes(chunks) == ["length"]
    assert ing._m.reply_parses.seen == [{"outcome": "text"}]
    # Reasoning, then the answer.
    ing = parsing_ingress(tokenizer, tool_parser="pythonic", reasoning_parser="qwen3")
    req = parsed_request(ing)
    chunks = asyncio.run(stream_events(ing, req, deltas_of(tokenizer, "<think>Rome is warm.</think>Take a hat.")))
    assert joined(chunks, "reasoning") == "Rome is warm." and joined(chunks, "content") == "Take a hat."
    assert finishes(chunks) == ["stop"] and ing._m.reply_parses.seen == [{"outcome": "reasoning"}]


def test_a_parser_that_needs_special_tokens_gets_them_from_the_engine(tokenizer):
    """qwen3's markers are special tokens in Qwen's vocabulary: its requests go to the
    engine with skip_special_tokens off, and the parser gets the prompt's ids."""
    ing = parsing_ingress(tokenizer, reasoning_parser="qwen3")
    ing._tokenizer, ing._max_model_len = tokenizer, 2048
    req = parsed_request(ing)
    assert not req.reply_parsing.skip_special_tokens
    gen = ing._generation_request(req, [1, 2, 3])
    assert gen.sampling.skip_special_tokens is False and req.reply_parsing.prompt_ids == [1, 2, 3]
    plain = chat()
    assert ing._generation_request(plain, [1, 2, 3]).sampling.skip_special_tokens is True


def test_the_whole_answer_carries_calls_and_reasoning(tokenizer):
    ing = parsing_ingress(tokenizer, tool_parser="pythonic", reasoning_parser="qwen3")
    req = parsed_request(ing, tools=[WEATHER])
    parsed = ing._parse_reply(req, '<think>Ask.</think>[get_weather(city="Rome")]')
    assert parsed.reasoning == "Ask." and parsed.tool_calls[0]["function"]["name"] == "get_weather"
    assert ing._m.reply_parses.seen == [{"outcome": "tool_calls"}]


def test_reasoning_tokens_are_counted_as_vllm_counts_them(tokenizer):
    """With a reasoning parser, every chat reply's usage has
    completion_tokens_details.reasoning_tokens, what vLLM's reasoning parser counts of
    the generated ids (streamed usage and whole answer alike); 0 where the parser does not
    apply; absent without a reasoning parser, as vLLM's server leaves it out."""
    from app.ingress import _Call
    from tests.unit.test_ingress_stream import FakeStream, events

    ing = parsing_ingress(tokenizer, tool_parser="pythonic", reasoning_parser="qwen3")
    text = "<think>Rome is warm today.</think>Take a hat."
    deltas = deltas_of(tokenizer, text)
    ids = [i for d in deltas for i in d.token_ids]
    from vllm.reasoning import ReasoningParserManager

    expected = ReasoningParserManager.get_reasoning_parser("qwen3")(tokenizer).count_reasoning_tokens(ids)
    assert 3 < expected < len(ids)

    req = parsed_request(ing, stream_options={"include_usage": True})
    call = _Call("chat", "r1", 5)
    call.output_ids = []
    call.on_delta(deltas[0])
    async def stream():
        return events([c async for c in ing._stream_body(req, [call], [deltas[0]], [FakeStream(deltas[1:])])])

    out = asyncio.run(stream())
    usage = [e for e in out if e != "[DONE]" and e.get("usage")][-1]["usage"]
    assert usage["completion_tokens_details"] == {"reasoning_tokens": expected}

    whole = parsed_request(ing)
    ing._parse_reply(whole, text)
    done = _Call("chat", "r2", 5)
    done.output_ids = list(ids)
    assert ing._usage([done], whole)["completion_tokens_details"] == {"reasoning_tokens": expected}
    # The parser does not apply (the request's own structured output): 0, still reported.
    held = chat(response_format={"type": "json_object"})
    assert ing._reply_parser.for_request(held) is None
    assert ing._usage([done], held)["completion_tokens_details"] == {"reasoning_tokens": 0}
    # No reasoning parser: no field.
    tools_only = parsing_ingress(tokenizer, tool_parser="pythonic")
    assert "completion_tokens_details" not in tools_only._usage([done], chat())


@pytest.mark.parametrize("text", [
    "<think>Rome is warm today.</think>Take a hat.",
    "Rome is warm today, and the river runs < slow > past the mill.",  # reasoning left open by the prompt
    "Rome 🙂 is warm, café naïve 🙂🙂",  # characters in pieces: a delta with ids and no text yet
])
def test_a_streams_reasoning_count_does_not_depend_on_how_its_deltas_were_cut(tokenizer, text):
    """The worker coalesces tokens into fewer deltas when the reader falls behind, so one
    reply streams in different cuts; its usage's reasoning_tokens must be the same for
    every cut, and the whole reply's (vLLM's streaming parser counted what it had emitted
    as reasoning: one token less for some cuts)."""
    from app.ingress import _Call
    from deployments.compute.engines.protocol import TokenDelta
    from tests.unit.test_ingress_stream import FakeStream, events

    ing = parsing_ingress(tokenizer, tool_parser="pythonic", reasoning_parser="qwen3")
    ids = tokenizer.encode(text, add_special_tokens=False)
    # Each token's text as the engines' detokenizers give it: none while a character is
    # incomplete, then the whole character.
    single, sent = [], ""
    for n, i in enumerate(ids):
        so_far = tokenizer.decode(ids[: n + 1])
        new = "" if so_far.endswith("\ufffd") else so_far[len(sent):]
        sent += new
        single.append(TokenDelta(new, [i], "stop" if n == len(ids) - 1 else None, 5, n + 1))
    whole = _Call("chat", "w", 5)
    whole.output_ids = list(ids)
    expected = ing._usage([whole], parsed_request(ing))["completion_tokens_details"]["reasoning_tokens"]
    assert expected > 0
    counts = []
    for size in (1, 2, 3, 5, len(single)):
        cut = [TokenDelta("".join(d.text for d in single[i:i + size]), [t for d in single[i:i + size] for t in d.token_ids],
                          single[min(i + size, len(single)) - 1].finish_reason, 5, min(i + size, len(single)))
               for i in range(0, len(single), size)]
        req = parsed_request(ing, stream_options={"include_usage": True})
        call = _Call("chat", f"r{size}", 5)
        call.output_ids = []
        call.on_delta(cut[0])

        async def stream():
            return events([c async for c in ing._stream_body(req, [call], [cut[0]], [FakeStream(cut[1:])])])

        usage = [e for e in asyncio.run(stream()) if e != "[DONE]" and e.get("usage")][-1]["usage"]
        counts.append(usage["completion_tokens_details"]["reasoning_tokens"])
    assert counts == [expected] * len(counts)


def test_a_parser_that_fails_leaves_the_reply_as_text(tokenizer, monkeypatch):
    def boom(self, text, token_ids, finished):  # passes "Weather" through, holds the rest, fails at "fine"
        self.text += text
        if "fine" in self.text:
            raise RuntimeError("parser bug")
        return ("", text, []) if "Weather" in text else ("", "", [])

    monkeypatch.setattr(StreamedReply, "feed", boom)
    ing = parsing_ingress(tokenizer, tool_parser="pythonic")
    req = parsed_request(ing, tools=[WEATHER])
    chunks = asyncio.run(stream_events(ing, req, deltas_of(tokenizer, "Weather in Oslo is fine, and more.")))
    # What the parser held back before it failed comes too: the whole reply, once.
    assert joined(chunks, "content") == "Weather in Oslo is fine, and more." and finishes(chunks) == ["stop"]
    assert ing._m.reply_parses.seen == [{"outcome": "failed"}]
    # Whole: the same.
    from app.reply_parser import ReplyParsing

    monkeypatch.setattr(ReplyParsing, "parse", lambda *a: (_ for _ in ()).throw(RuntimeError("parser bug")))
    ing = parsing_ingress(tokenizer, tool_parser="pythonic")
    assert ing._parse_reply(req, "Weather in Oslo is fine.") is None
    assert ing._m.reply_parses.seen == [{"outcome": "failed"}]


def test_a_count_that_fails_is_zero_not_a_failed_reply(tokenizer, monkeypatch):
    parsing = ReplyParser(tokenizer, reasoning_parser="qwen3").for_request(chat())

    def boom(self, ids):
        raise RuntimeError("boom")

    monkeypatch.setattr(type(parsing._new()), "count_reasoning_tokens", boom)
    assert parsing.count_reasoning_tokens([1, 2, 3]) == 0
