"""tool_choice "auto" (the default when a chat request sends tools) through a real Serve
application whose model.tool_call_parser is vLLM's ``pythonic``: the reply is free text
that the parser reads, whole and streamed, over the openai client and a real socket. The
tiny model has random weights, so the tests hold its reply to a regex (structured output,
which "auto" leaves to the request, as vLLM does) of a call or of plain text. Each engine
in turn; the app runs beside the shared one."""

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
    args["model"] = {**args["model"], "tool_call_parser": "pythonic"}
    with deployed_app(args, APP_NAME, ROUTE_PREFIX, http_port) as base_url:
        yield base_url


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


def test_a_reply_that_calls_nothing_is_content(tools_app):
    r = ask(tools_app, "It is sunny in Paris")
    choice = r.choices[0]
    assert choice.message.content == "It is sunny in Paris" and not choice.message.tool_calls
    assert choice.finish_reason == "stop"
    chunks = list(ask(tools_app, "It is sunny in Paris", stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "It is sunny in Paris"
    assert not any(c.choices[0].delta.tool_calls for c in chunks if c.choices)

    def counted(text: str) -> bool:
        lines = [line for line in text.splitlines() if line.startswith("ray_llm_tool_call_parses_total{")]
        return any('outcome="called"' in line and 'parser="pythonic"' in line for line in lines) and any(
            'outcome="text"' in line for line in lines)

    wait_for(lambda: counted(httpx.get(tools_app + "/metrics", timeout=60).text), 90, "the parses in /metrics")


def test_without_a_parser_auto_stays_a_400_that_names_the_setting(served_app):
    r = httpx.post(f"{served_app.base_url}/v1/chat/completions", timeout=60, json={
        "model": served_app.model_id, "messages": MESSAGES, "tools": [WEATHER], "max_tokens": 4})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"
    assert "model.tool_call_parser" in r.json()["error"]["message"]
