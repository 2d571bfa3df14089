"""A chat reply read by vLLM's parsers in a real Serve application whose
model.tool_call_parser is ``pythonic`` and model.reasoning_parser ``qwen3``, over the
openai client and a real socket, whole and streamed: tool_choice "auto" (the default when
a chat request sends tools), and reasoning. The tiny model has random weights, so the
tool tests hold its reply to a regex (structured output, which "auto" leaves to the
request, as vLLM does; reasoning is not split off a reply held to a grammar) of a call or
of plain text; its free reply has no reasoning markers, which the qwen3 parser reads as
reasoning that never ended. Each engine in turn; the app runs beside the shared one."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.fixtures.models import get_model_path
from tests.fixtures.serve_app import ENGINE_ARGS, app_args, deployed_app, openai_client, vllm_importable, wait_for

APP_NAME = "tools"
ROUTE_PREFIX = "/tools"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CLOCK = {"type": "function", "function": {"name": "get_time"}}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris, and the time?"}]
CALLS = r'\[get_weather\(city="Paris"\), get_time\(\)\]'


@pytest.fixture(scope="module", params=sorted(ENGINE_ARGS))
def tools_app(request, ray_cluster, redis_server, http_port):
    engine = request.param
    if engine == "vllm" and not vllm_importable():
        pytest.skip("vLLM is not installed here")
    args = app_args(get_model_path("tiny"), redis_server.url, engine=ENGINE_ARGS[engine])
    args["model"] = {**args["model"], "tool_call_parser": "pythonic", "reasoning_parser": "qwen3"}
    with deployed_app(args, APP_NAME, ROUTE_PREFIX, http_port) as base_url:
        yield base_url


def wait_counted(base_url: str, *outcomes: str) -> None:
    """Until /metrics counts replies of each outcome (the nodes export every second)."""

    def counted(text: str) -> bool:
        lines = [line for line in text.splitlines() if line.startswith("ray_llm_reply_parses_total{")]
        return all(any(f'outcome="{o}"' in line for line in lines) for o in outcomes)

    wait_for(lambda: counted(httpx.get(base_url + "/metrics", timeout=60).text), 90, f"{outcomes} in /metrics")


def ask(base_url, regex: str, **kw):
    client = openai_client(base_url)
    return client.chat.completions.create(
        model="tiny-llama", messages=MESSAGES, tools=[WEATHER, CLOCK], max_tokens=40, temperature=0,
        extra_body={"structured_outputs": {"regex": regex}}, **kw)


def test_auto_reads_the_models_calls_whole_and_streamed(tools_app):
    r = ask(tools_app, CALLS)  # no tool_choice: "auto", the default with tools
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content, choice
    made = [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls]
    assert made == [("get_weather", {"city": "Paris"}), ("get_time", {})]
    assert all(c.type == "function" and c.id for c in choice.message.tool_calls)

    chunks = list(ask(tools_app, CALLS, tool_choice="auto", stream=True))
    assembled: dict = {}  # as a client assembles the calls: by index, arguments appended
    for c in chunks:
        for tc in (c.choices[0].delta.tool_calls or []) if c.choices else []:
            entry = assembled.setdefault(tc.index, {"id": None, "name": None, "arguments": ""})
            entry["id"] = tc.id or entry["id"]
            entry["name"] = (tc.function.name if tc.function else None) or entry["name"]
            entry["arguments"] += (tc.function.arguments if tc.function else None) or ""
    assert [(e["name"], json.loads(e["arguments"])) for _, e in sorted(assembled.items())] == made
    assert all(e["id"] for e in assembled.values())
    assert not any(c.choices[0].delta.content for c in chunks if c.choices)
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["tool_calls"]
    wait_counted(tools_app, "tool_calls")


def test_a_reply_that_calls_nothing_is_content(tools_app):
    r = ask(tools_app, "It is sunny in Paris")
    choice = r.choices[0]
    assert choice.message.content == "It is sunny in Paris" and not choice.message.tool_calls
    assert choice.finish_reason == "stop"
    chunks = list(ask(tools_app, "It is sunny in Paris", stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "It is sunny in Paris"
    assert not any(c.choices[0].delta.tool_calls for c in chunks if c.choices)
    wait_counted(tools_app, "text")


def test_a_free_reply_goes_to_reasoning_as_the_parser_reads_it(tools_app, grpc_port):
    """The same greedy reply as /v1/completions gives for the chat prompt (no parser
    there) comes back in ``reasoning``, whole and streamed, over REST and gRPC;
    include_reasoning false leaves it out."""
    import grpc

    from app.grpc_api import llm_pb2 as pb
    from app.grpc_api import llm_pb2_grpc
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(get_model_path("tiny")))
    prompt = tok.encode(tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False),
                        add_special_tokens=False)
    client = openai_client(tools_app)
    kw = dict(model="tiny-llama", max_tokens=12, temperature=0)
    raw = client.completions.create(prompt=prompt, **kw).choices[0].text
    assert raw and "think>" not in raw
    r = client.chat.completions.create(messages=MESSAGES, **kw)
    message = r.choices[0].message
    assert message.model_extra.get("reasoning") == raw and not message.content, message
    # vLLM's count of the reply's reasoning tokens (all of them: it never left reasoning).
    counted = r.usage.completion_tokens_details.reasoning_tokens
    assert 0 < counted <= r.usage.completion_tokens, r.usage
    chunks = list(client.chat.completions.create(messages=MESSAGES, stream=True, **kw,
                                                 stream_options={"include_usage": True}))
    assert chunks[-1].usage.completion_tokens_details.reasoning_tokens == counted
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(d.model_extra.get("reasoning") or "" for d in deltas) == raw
    assert not "".join(d.content or "" for d in deltas)
    request = pb.ChatCompletionRequest(model="tiny-llama", messages=[pb.ChatMessage(**m) for m in MESSAGES],
                                       max_tokens=12, temperature=0)
    metadata = (("application", APP_NAME),)
    with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
        stub = llm_pb2_grpc.LLMStub(channel)
        reply = stub.ChatCompletion(request, metadata=metadata, timeout=60)
        assert reply.choices[0].message.reasoning == raw and not reply.choices[0].message.content
        assert reply.usage.completion_tokens_details.reasoning_tokens == counted
        chunks = list(stub.ChatCompletionStream(request, metadata=metadata, timeout=60))
        assert "".join(c.choices[0].delta.reasoning for c in chunks if c.choices) == raw
    quiet = client.chat.completions.create(messages=MESSAGES, extra_body={"include_reasoning": False}, **kw)
    assert "reasoning" not in (quiet.choices[0].message.model_extra or {}) and not quiet.choices[0].message.content
    # Thinking off in the template (Qwen3's enable_thinking, which the parser reads too):
    # the same reply is the answer.
    off = client.chat.completions.create(messages=MESSAGES, extra_body={"chat_template_kwargs": {"enable_thinking": False}},
                                         **kw).choices[0].message
    assert off.content == raw and not off.model_extra.get("reasoning")
    # OpenAI's reasoning_effort "none" turns thinking off the same way, as vLLM passes it.
    effortless = client.chat.completions.create(messages=MESSAGES, reasoning_effort="none", **kw).choices[0].message
    assert effortless.content == raw and not effortless.model_extra.get("reasoning")
    wait_counted(tools_app, "reasoning")


def test_a_responses_reply_gives_its_reasoning_as_a_reasoning_item(tools_app):
    """/v1/responses reads the reply with the same parsers: the free greedy reply that
    chat gives as ``reasoning`` is one reasoning item, whole and streamed."""
    client = openai_client(tools_app)
    chat = client.chat.completions.create(model="tiny-llama", messages=MESSAGES, max_tokens=12, temperature=0)
    reasoning = chat.choices[0].message.model_extra.get("reasoning")
    assert reasoning
    kw = dict(model="tiny-llama", input=MESSAGES[0]["content"], max_output_tokens=12, temperature=0)
    whole = client.responses.create(**kw)
    [item] = whole.output
    assert item.type == "reasoning" and [c.text for c in item.content] == [reasoning], whole.output
    assert whole.usage.output_tokens_details.reasoning_tokens == chat.usage.completion_tokens_details.reasoning_tokens > 0
    assert whole.output_text == ""
    events = list(client.responses.create(stream=True, **kw))
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == reasoning
    [done] = [e for e in events if e.type == "response.reasoning_text.done"]
    assert done.text == reasoning
    assert [i.type for i in events[-1].response.output] == ["reasoning"]
    assert not any(e.type == "response.output_text.delta" for e in events)
    assert events[-1].response.usage.output_tokens_details.reasoning_tokens == (
        whole.usage.output_tokens_details.reasoning_tokens)
    # reasoning.effort "none" turns the template's thinking off, as chat's reasoning_effort:
    # the same reply is the answer, one message item.
    quiet = client.responses.create(reasoning={"effort": "none"}, **kw)
    assert [i.type for i in quiet.output] == ["message"] and quiet.output_text == reasoning
    assert quiet.reasoning.effort == "none"


def test_a_responses_request_under_auto_gets_the_models_calls_as_function_call_items(tools_app):
    client = openai_client(tools_app)
    tools = [{"type": "function", **t["function"]} for t in (WEATHER, CLOCK)]
    kw = dict(model="tiny-llama", input=MESSAGES[0]["content"], tools=tools, max_output_tokens=40, temperature=0,
              extra_body={"structured_outputs": {"regex": CALLS}})
    whole = client.responses.create(**kw)
    assert [(i.type, i.name, json.loads(i.arguments)) for i in whole.output] == [
        ("function_call", "get_weather", {"city": "Paris"}), ("function_call", "get_time", {})]
    assert all(i.call_id and i.status == "completed" for i in whole.output)
    events = list(client.responses.create(stream=True, **kw))
    done = [e.item for e in events if e.type == "response.output_item.done"]
    assert [(i.name, json.loads(i.arguments)) for i in done] == [("get_weather", {"city": "Paris"}), ("get_time", {})]
    assert [i.model_dump() for i in events[-1].response.output] == [i.model_dump() for i in done]


def test_without_a_parser_auto_stays_a_400_that_names_the_setting(served_app):
    r = httpx.post(f"{served_app.base_url}/v1/chat/completions", timeout=60, json={
        "model": served_app.model_id, "messages": MESSAGES, "tools": [WEATHER], "max_tokens": 4})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"
    assert "model.tool_call_parser" in r.json()["error"]["message"]
