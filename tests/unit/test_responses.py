"""The Responses API's logic (app/responses.py): input items to chat messages, the chat
request it becomes, the reply as output items, stream events from chat chunks, and the
ingress's Responses stream when the engine or the store fails mid-way."""

import json

import pytest
from pydantic import ValidationError

from app import responses
from app.errors import InvalidRequestError
from app.ingress import _Call, _Responding
from app.schemas import ChatCompletionRequest, invalid_body
from app.sessions import TOKEN_IDS_KEY
from deployments.compute.engines.protocol import EngineDeadError, TokenDelta
from tests.unit.test_ingress_stream import FakeStream, _NoMetric, make_ingress


def req(**body) -> responses.ResponsesRequest:
    return responses.parse_request({"model": "tiny-llama", **body})


def test_input_items_become_chat_messages_in_the_templates_form():
    r = req(input=[
        {"role": "system", "content": "be brief"},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "a"},
                                                        {"type": "input_text", "text": "b"}]},
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": '{"x": 1}'},
        {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "not json"},
        {"type": "function_call_output", "call_id": "c1", "output": "one"},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "two"}]},
        {"role": "assistant", "content": [{"type": "output_text", "text": "done"}]},
    ])
    assert responses.input_messages(r) == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "ab"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": {"x": 1}}},
            {"id": "c2", "type": "function", "function": {"name": "g", "arguments": "not json"}},
        ]},
        {"role": "tool", "tool_call_id": "c1", "content": "one"},
        {"role": "tool", "tool_call_id": "c2", "content": "two"},
        {"role": "assistant", "content": "done"},
    ]
    assert responses.input_messages(req(input="hi")) == [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("items, param", [
    ([{"role": "tool", "content": "x"}], "input[0].role"),
    ([{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}], "input[0].content"),
    ([{"role": "user", "content": 5}], "input[0]"),
    ([{"type": "function_call", "name": "f", "arguments": "{}"}], "input[0]"),
    ([{"type": "function_call_output", "output": "x"}], "input[0]"),
    ([{"type": "file_search_call", "id": "x"}], "input[0].type"),
    (["just a string"], "input"),
    ([{"type": "reasoning", "summary": []}], "input"),
])
def test_input_items_this_server_cannot_take_are_400s_naming_them(items, param):
    with pytest.raises(InvalidRequestError) as e:
        responses.input_messages(req(input=items))
    assert e.value.param == param


@pytest.mark.parametrize("body, param", [
    ({"background": True}, "background"),
    ({"truncation": "auto"}, "truncation"),
    ({"include": ["message.output_text.logprobs"]}, "include"),
    ({"reasoning": {"effort": "high", "summary": "auto"}}, "reasoning"),
    ({"reasoning": {"budget": 3}}, "reasoning"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"top_logprobs": 3}, "top_logprobs"),
    ({"store": "yes"}, "store"),
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"metadata": {"k": "v" * 513}}, "metadata"),
])
def test_fields_that_would_change_the_answer_and_are_not_served_are_refused(body, param):
    with pytest.raises(InvalidRequestError) as e:
        req(input="x", **body)
    assert e.value.param == param


def test_neutral_values_of_unserved_fields_pass():
    req(input="x", background=False, truncation="disabled", include=[], reasoning=None, top_logprobs=0,
        service_tier="auto", prompt_cache_key="k", store=False)
    req(input="x", include=["reasoning.encrypted_content"])


def test_reasoning_effort_is_the_chat_requests_and_the_response_says_it():
    """As vLLM's Responses endpoint passes it: the chat request's reasoning_effort (the
    template's variables); a bad effort is a 400 naming reasoning.effort."""
    r = req(input="x", reasoning={"effort": "low", "summary": None})
    chat = ChatCompletionRequest.model_validate(responses.to_chat(r, responses.input_messages(r)))
    assert chat.reasoning_effort == "low"
    assert chat.chat_template_kwargs == {"enable_thinking": True, "reasoning_effort": "low"}
    obj = responses.response_object(r, "resp_x", 0, status="completed", output=[])
    assert obj["reasoning"] == {"effort": "low", "summary": None}
    assert responses.response_object(req(input="x"), "resp_x", 0, status="completed", output=[])["reasoning"] is None
    bad = req(input="x", reasoning={"effort": "extreme"})
    with pytest.raises(ValidationError) as e:
        ChatCompletionRequest.model_validate(responses.to_chat(bad, responses.input_messages(bad)))
    err = responses.responses_error(invalid_body(e.value))
    assert err.param == "reasoning.effort" and "'reasoning.effort'" in err.message


def test_the_chat_request_it_becomes_validates_as_one():
    tool = {"type": "function", "name": "f", "description": "d", "parameters": {"type": "object"}, "strict": True}
    r = req(input="x", stream=True, max_output_tokens=7, temperature=0.5, top_p=0.9, tools=[tool],
            tool_choice={"type": "function", "name": "f"}, parallel_tool_calls=False, user="u")
    body = responses.to_chat(r, responses.input_messages(r))
    chat = ChatCompletionRequest.model_validate(body)
    assert chat.tools == [{"type": "function", "function": {"name": "f", "description": "d",
                                                            "parameters": {"type": "object"}, "strict": True}}]
    assert chat.called_function() == "f" and chat.parallel_tool_calls is False
    assert chat.requested_max_tokens() == 7 and chat.temperature == 0.5 and chat.top_p == 0.9
    assert chat.include_usage_in_stream()  # the usage chunk ends the stream's events
    fmt = {"type": "json_schema", "name": "n", "schema": {"type": "object"}, "strict": True}
    r = req(input="x", text={"format": fmt})
    chat = ChatCompletionRequest.model_validate(responses.to_chat(r, responses.input_messages(r)))
    assert chat.structured_output() == ("json", '{"type":"object"}')
    # A tool call of the input goes to the chat API with its arguments as text.
    r = req(input=[{"type": "function_call", "call_id": "c", "name": "f", "arguments": '{"a":1}'}])
    assert responses.to_chat(r, responses.input_messages(r))["messages"][0]["tool_calls"][0]["function"] == {
        "name": "f", "arguments": '{"a": 1}'}
    with pytest.raises(InvalidRequestError) as e:
        responses.to_chat(req(input="x", tools=[{"type": "web_search"}]), [])
    assert e.value.param == "tools[0].type"
    assert responses.responses_param("max_tokens") == "max_output_tokens"
    assert responses.responses_param("messages.0.content") == "input"
    assert responses.responses_param("tool_choice") == "tool_choice"


def chunk(delta=None, finish=None):
    return {"choices": [{"index": 0, "delta": delta or {}, "finish_reason": finish}], "usage": None}


def test_stream_events_of_reasoning_text_and_two_calls():
    events = responses.StreamEvents(req(input="x"), "resp_" + "0" * 32)
    out = events.start()
    for c in (
        chunk({"role": "assistant", "content": ""}),
        chunk({"reasoning": "think"}), chunk({"reasoning": "ing"}),
        chunk({"content": "Hel"}), chunk({"content": "lo"}),
        chunk({"tool_calls": [{"index": 0, "id": "c0", "type": "function", "function": {"name": "f", "arguments": ""}}]}),
        chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"a":'}}]}),
        chunk({"tool_calls": [{"index": 0, "function": {"arguments": "1}"}}]}),
        chunk({"tool_calls": [{"index": 1, "id": "c1", "type": "function", "function": {"name": "g", "arguments": "{}"}}]}),
        chunk(finish="tool_calls"),
    ):
        out += events.chunk(c)
    out += events.end("completed")
    final = responses.response_object(events._req, events.response_id, events.created_at, status="completed",
                                      output=events.output)
    out += events.final(final)
    assert [e["sequence_number"] for e in out] == list(range(len(out)))
    assert [e["type"] for e in out] == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added",
        "response.reasoning_text.delta", "response.reasoning_text.delta", "response.reasoning_text.done",
        "response.output_item.done",
        "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta", "response.output_text.done",
        "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.delta", "response.function_call_arguments.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done",
        "response.completed",
    ]
    items = out[-1]["response"]["output"]
    assert [(i["type"], i["status"]) for i in items] == [
        ("reasoning", "completed"), ("message", "completed"), ("function_call", "completed"),
        ("function_call", "completed")]
    assert items[0]["content"] == [{"type": "reasoning_text", "text": "thinking"}]
    assert items[1]["content"][0]["text"] == "Hello"
    assert [(i["call_id"], i["name"], i["arguments"]) for i in items[2:]] == [("c0", "f", '{"a":1}'), ("c1", "g", "{}")]
    # Added items show no content yet; done ones show it whole, as the final response does.
    added = [e["item"] for e in out if e["type"] == "response.output_item.added"]
    assert added[0]["content"] == [] and added[1]["content"] == [] and added[2]["arguments"] == ""
    assert [e["item"] for e in out if e["type"] == "response.output_item.done"] == items
    # The whole reply's items are the streamed ones (ids aside).
    whole = responses.output_from_message(
        {"reasoning": "thinking", "content": "Hello", "tool_calls": [
            {"id": "c0", "function": {"name": "f", "arguments": '{"a":1}'}},
            {"id": "c1", "function": {"name": "g", "arguments": "{}"}}]}, incomplete=False)
    strip = [{k: v for k, v in i.items() if k != "id"} for i in items]
    assert [{k: v for k, v in i.items() if k != "id"} for i in whole] == strip


def test_an_empty_reply_is_one_empty_message_and_a_cut_one_is_incomplete():
    events = responses.StreamEvents(req(input="x"), "resp_" + "0" * 32)
    out = events.chunk(chunk(finish="stop")) + events.end("completed")
    assert [e["type"] for e in out] == ["response.output_item.added", "response.content_part.added",
                                        "response.output_text.done", "response.content_part.done",
                                        "response.output_item.done"]
    assert events.output[0]["content"][0]["text"] == "" and events.output[0]["status"] == "completed"
    assert responses.output_from_message({"content": ""}, False)[0]["content"][0]["text"] == ""
    assert [i["type"] for i in responses.output_from_message({"reasoning": "r", "content": ""}, False)] == [
        "reasoning"]
    events = responses.StreamEvents(req(input="x"), "resp_" + "0" * 32)
    events.chunk(chunk({"content": "ab"}, finish="length"))
    events.end("incomplete")
    obj = responses.response_object(events._req, events.response_id, 0, status="incomplete", output=events.output)
    assert obj["incomplete_details"] == {"reason": "max_output_tokens"} and obj["output"][0]["status"] == "incomplete"


def test_the_stored_reply_keeps_its_ids_and_calls_and_history_drops_the_object():
    output = [responses.message_item("hi"), responses.call_item("c", "f", '{"a": 1}')]
    reply = responses.reply_message(output, [5, 6], TOKEN_IDS_KEY)
    assert reply == {"role": "assistant", "content": "hi", TOKEN_IDS_KEY: [5, 6], "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": {"a": 1}}}]}
    reply[responses.RESPONSE_KEY] = {"id": "resp_x"}
    assert responses.history_messages([reply]) == [{k: v for k, v in reply.items() if k != responses.RESPONSE_KEY}]



def test_input_items_keep_the_input_as_items_with_ids_of_their_own():
    r = req(input=[
        {"role": "developer", "content": "be brief"},
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "a"},
                                                        {"type": "text", "text": "b"}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": '{"x": 1}'},
        {"type": "function_call_output", "call_id": "c1", "output": [{"type": "input_text", "text": "one"}]},
        {"role": "assistant", "content": "done"},
    ])
    items = responses.input_items(r)
    assert [i["type"] for i in items] == ["message", "message", "function_call", "function_call_output", "message"]
    assert len({i["id"] for i in items}) == 5 and all(i["status"] == "completed" for i in items)
    assert items[0]["role"] == "developer" and items[0]["content"] == [{"type": "input_text", "text": "be brief"}]
    assert items[1]["content"] == [{"type": "input_text", "text": "ab"}]
    assert (items[2]["call_id"], items[2]["name"], items[2]["arguments"]) == ("c1", "f", '{"x": 1}')
    assert (items[3]["call_id"], items[3]["output"]) == ("c1", "one")
    assert items[4]["role"] == "assistant" and items[4]["content"][0]["type"] == "output_text"
    [only] = responses.input_items(req(input="hello"))
    assert only["role"] == "user" and only["content"] == [{"type": "input_text", "text": "hello"}]


def stored_turn(history: list[dict], text: str, answer: str) -> list[dict]:
    """The record a response to ``text`` (on the stored ``history``) is stored as."""
    r = req(input=text)
    reply = responses.reply_message([responses.message_item(answer)], [7], TOKEN_IDS_KEY)
    reply[responses.RESPONSE_KEY] = {"id": responses.new_response_id(), "output": [responses.message_item(answer)]}
    reply[responses.INPUT_ITEMS_KEY] = responses.input_items(r)
    return responses.carried_history(history) + responses.input_messages(r) + [reply]


def test_a_continuations_items_are_the_chain_s_inputs_and_outputs_then_its_own_input():
    first = stored_turn([], "one", "uno")
    second = stored_turn(first, "two", "dos")
    third = stored_turn(second, "three", "tres")
    texts = [i["content"][0]["text"] for i in responses.conversation_items(third)]
    assert texts == ["one", "uno", "two", "dos", "three"]
    assert [i["role"] for i in responses.conversation_items(third)] == ["user", "assistant"] * 2 + ["user"]
    # Only the last reply carries its whole response object; the prompt sees none of it.
    assert [responses.RESPONSE_KEY in m for m in third if m["role"] == "assistant"] == [False, False, True]
    for m in responses.history_messages(third):
        assert set(m) <= {"role", "content", TOKEN_IDS_KEY}, m


def test_items_pages_follow_order_limit_and_the_cursors():
    items = [{"id": f"msg_{i}"} for i in range(5)]

    def ids(**query):
        page = responses.items_page(items, [(k, str(v)) for k, v in query.items()])
        return [i["id"] for i in page["data"]], page["has_more"], page["first_id"], page["last_id"]

    assert ids() == (["msg_4", "msg_3", "msg_2", "msg_1", "msg_0"], False, "msg_4", "msg_0")
    assert ids(order="asc", limit=2) == (["msg_0", "msg_1"], True, "msg_0", "msg_1")
    assert ids(order="asc", limit=2, after="msg_1") == (["msg_2", "msg_3"], True, "msg_2", "msg_3")
    assert ids(order="asc", limit=2, after="msg_3") == (["msg_4"], False, "msg_4", "msg_4")
    assert ids(order="asc", limit=2, after="msg_2") == (["msg_3", "msg_4"], False, "msg_3", "msg_4")  # the last page
    assert ids(limit=5)[1] is False
    assert ids(order="asc", after="msg_4") == ([], False, None, None)
    assert ids(limit=2, after="msg_4") == (["msg_3", "msg_2"], True, "msg_3", "msg_2")
    assert ids(order="asc", limit=2, before="msg_4") == (["msg_2", "msg_3"], True, "msg_2", "msg_3")
    assert ids(order="asc", limit=3, before="msg_2") == (["msg_0", "msg_1"], False, "msg_0", "msg_1")
    assert ids(limit=100, include="message.input_image.image_url", unknown="x")[0][0] == "msg_4"
    # Twenty by default.
    many = [{"id": f"m{i}"} for i in range(25)]
    page = responses.items_page(many, [])
    assert len(page["data"]) == 20 and page["has_more"] and page["first_id"] == "m24"


@pytest.mark.parametrize("query,param", [
    ([("order", "up")], "order"),
    ([("limit", "0")], "limit"),
    ([("limit", "101")], "limit"),
    ([("limit", "2.5")], "limit"),
    ([("limit", "9" * 5000)], "limit"),
    ([("limit", "1"), ("limit", "2")], "limit"),
    ([("after", "msg_9")], "after"),
    ([("before", "msg_9")], "before"),
    ([("after", "msg_0"), ("before", "msg_1")], "before"),
    ([("include", "message.secret")], "include"),
])
def test_a_bad_items_query_is_a_400_naming_its_parameter(query, param):
    with pytest.raises(InvalidRequestError) as e:
        responses.items_page([{"id": "msg_0"}, {"id": "msg_1"}], query)
    assert e.value.param == param and e.value.status_code == 400


class FailingStore:
    def __init__(self, error=None):
        self.error, self.stored = error, []

    async def store_response(self, response_id, messages, num_tokens, ttl_s):
        if self.error is not None:
            raise self.error
        self.stored.append((response_id, messages, num_tokens))


def responses_ingress():
    from opentelemetry import trace

    ing = make_ingress()
    ing._special_ids = frozenset({2})
    ing._tracer = trace.get_tracer(__name__)
    ing._m.responses = _NoMetric()
    return ing


async def run_stream(ing, store, stream, first):
    r = req(input="x", stream=True)
    chat = ChatCompletionRequest.model_validate(responses.to_chat(r, responses.input_messages(r)))
    call = _Call("responses", "r1", 3)
    call.output_ids = []
    call.on_delta(first)
    responding = _Responding(r, "resp_" + "1" * 32, [], responses.input_messages(r), responses.input_items(r), store)
    out = []
    async for raw in ing._responses_stream(responding, chat, [call], [first], [stream]):
        kind, data = raw.decode().strip().split("\n")
        event = json.loads(data.removeprefix("data: "))
        assert kind == "event: " + event["type"]
        out.append(event)
    return out


async def test_a_stream_stores_its_response_before_completed_and_a_store_failure_fails_it():
    from app.errors import ServiceUnavailableError

    ing = responses_ingress()
    store = FailingStore()
    stream = FakeStream([TokenDelta("b", [4], None, 3, 2), TokenDelta("", [2], "stop", 3, 3)])
    out = await run_stream(ing, store, stream, TokenDelta("a", [3], None, 3, 1))
    assert out[-1]["type"] == "response.completed"
    [(rid, messages, num_tokens)] = store.stored
    assert rid == out[-1]["response"]["id"] and num_tokens == 3 + 3
    assert messages[0] == {"role": "user", "content": "x"}
    assert messages[1]["content"] == "ab" and messages[1][TOKEN_IDS_KEY] == [3, 4]  # the end token left out
    assert messages[1][responses.RESPONSE_KEY] == out[-1]["response"]

    store = FailingStore(ServiceUnavailableError("the store refuses writes"))
    stream = FakeStream([TokenDelta("b", [4], None, 3, 2), TokenDelta("", [2], "stop", 3, 3)])
    out = await run_stream(ing, store, stream, TokenDelta("a", [3], None, 3, 1))
    kinds = [e["type"] for e in out]
    assert "response.completed" not in kinds and kinds[-2:] == ["error", "response.failed"]
    assert out[-1]["response"]["status"] == "failed" and "refuses writes" in out[-1]["response"]["error"]["message"]
    assert "response.output_item.done" in kinds  # the message's events still end


async def test_an_engine_failure_mid_stream_fails_the_response_and_stores_nothing():
    ing = responses_ingress()
    store = FailingStore()
    stream = FakeStream([TokenDelta("b", [4], None, 3, 2), EngineDeadError("boom")])
    out = await run_stream(ing, store, stream, TokenDelta("a", [3], None, 3, 1))
    kinds = [e["type"] for e in out]
    assert kinds[-2:] == ["error", "response.failed"] and store.stored == []
    assert out[-2]["message"] and out[-1]["response"]["output"][0]["status"] == "incomplete"
    assert stream.cancelled


def _odd_value(rng, depth=0):
    """A JSON value of any shape, as a client's mistake might send."""
    kinds = ["str", "int", "float", "bool", "none", "list", "dict"] if depth < 3 else ["str", "int", "none"]
    kind = rng.choice(kinds)
    if kind == "str":
        return rng.choice(["", "x", "input_text", "function_call", "message", "user", "function", "json_schema",
                           "auto", "none", "required", "resp_" + "0" * 32, "{\"a\": 1}"])
    if kind == "int":
        return rng.choice([-1, 0, 1, 7, 10**9])
    if kind == "float":
        return rng.choice([0.5, -3.0, 1e300])
    if kind == "bool":
        return rng.choice([True, False])
    if kind == "none":
        return None
    if kind == "list":
        return [_odd_value(rng, depth + 1) for _ in range(rng.randrange(3))]
    keys = ["type", "role", "content", "text", "call_id", "name", "arguments", "output", "format", "schema",
            "parameters", "function"]
    return {rng.choice(keys): _odd_value(rng, depth + 1) for _ in range(rng.randrange(4))}


_VALID = {
    "input": [
        {"role": "user", "content": "hi"},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "a"}]},
        {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c", "output": "o"},
    ],
    "tools": [{"type": "function", "name": "f", "parameters": {"type": "object", "properties": {}}}],
    "tool_choice": {"type": "function", "name": "f"},
    "text": {"format": {"type": "text"}},  # (a named tool_choice takes no response format)
}


def _corrupt(rng, value):
    """``value`` with one member, at any depth, replaced by a value of any shape."""
    if isinstance(value, list) and value and rng.random() < 0.8:
        i = rng.randrange(len(value))
        return value[:i] + [_corrupt(rng, value[i])] + value[i + 1:]
    if isinstance(value, dict) and value and rng.random() < 0.8:
        key = rng.choice(list(value))
        return {**value, key: _corrupt(rng, value[key])}
    return _odd_value(rng)


async def test_any_malformed_body_is_an_api_error_never_a_crash():
    """Bodies valid but for one member, at any depth, of any shape, through the whole
    request path (parse, input items, the chat request and its validation): a chat
    request, or an APIError naming the field."""
    import copy
    import random
    from types import SimpleNamespace

    from app.errors import APIError

    ing = make_ingress()
    ing._reply_parser = None
    rng = random.Random(7)
    scalars = ["instructions", "metadata", "max_output_tokens", "temperature", "top_p", "parallel_tool_calls",
               "store", "stream", "previous_response_id", "user"]
    answered = refused = 0
    for _ in range(600):
        body = {"model": "tiny-llama", **copy.deepcopy(_VALID)}
        name = rng.choice([*_VALID, *scalars])
        body[name] = _corrupt(rng, body[name]) if name in _VALID else _odd_value(rng)
        try:
            req, _ = await ing._responses_request(SimpleNamespace(headers={}), body, None)
            assert isinstance(req, ChatCompletionRequest)
            answered += 1
        except APIError as e:
            assert e.status_code in (400, 404) and e.message, body
            refused += 1
    assert answered > 50 and refused > 200, (answered, refused)


def test_usage_is_the_chat_usage_under_the_responses_names():
    chat = {"prompt_tokens": 10, "completion_tokens": 4, "total_tokens": 14,
            "prompt_tokens_details": {"cached_tokens": 8}, "completion_tokens_details": {"reasoning_tokens": 3}}
    assert responses.usage(chat) == {
        "input_tokens": 10, "input_tokens_details": {"cached_tokens": 8}, "output_tokens": 4,
        "output_tokens_details": {"reasoning_tokens": 3}, "total_tokens": 14}
    del chat["completion_tokens_details"]  # (no reasoning parser)
    assert responses.usage(chat)["output_tokens_details"] == {"reasoning_tokens": 0}
