"""OpenAI's Responses API (POST/GET/DELETE /v1/responses) through the real Serve
application, a real DataPlane and a real Redis, with the `openai` client over a real
socket, on both engines: a response and its continuations (previous_response_id), the
stream's events, stored and unstored responses, function calls, and bad input."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.fixtures.serve_app import wait_for, worker_handle

pytestmark = pytest.mark.integration


def create(served_app, **body) -> httpx.Response:
    return httpx.post(served_app.base_url + "/v1/responses", json={"model": served_app.model_id, **body}, timeout=60)


def stored(served_app, response_id) -> httpx.Response:
    return httpx.get(f"{served_app.base_url}/v1/responses/{response_id}", timeout=30)


def new_session(served_app) -> str:
    r = httpx.post(served_app.base_url + "/v1/sessions", timeout=30)
    assert r.status_code == 201, r.text
    return r.json()["id"]


def session_turn(served_app, sid, text, **kw):
    return served_app.client().chat.completions.create(
        model=served_app.model_id, messages=[{"role": "user", "content": text}],
        extra_headers={"X-Session-Id": sid}, temperature=0, **kw,
    )


def test_a_response_chain_answers_what_a_session_answers_and_is_stored(served_app):
    """Two responses chained by previous_response_id give the replies (and prompt sizes)
    of two turns of a session with the same messages: both put the first reply's
    generated ids back in the second prompt. Each response is stored as returned."""
    client = served_app.client()
    first = client.responses.create(model=served_app.model_id, input="the first question", temperature=0,
                                    max_output_tokens=12)
    assert first.id.startswith("resp_") and first.object == "response"
    assert first.status in ("completed", "incomplete") and first.store is True
    second = client.responses.create(model=served_app.model_id, input="and a second one", temperature=0,
                                     max_output_tokens=12, previous_response_id=first.id)
    assert second.previous_response_id == first.id

    sid = new_session(served_app)
    turn1 = session_turn(served_app, sid, "the first question", max_tokens=12)
    turn2 = session_turn(served_app, sid, "and a second one", max_tokens=12)
    for resp, turn in ((first, turn1), (second, turn2)):
        assert resp.output_text == turn.choices[0].message.content
        assert resp.usage.input_tokens == turn.usage.prompt_tokens
        assert resp.usage.output_tokens == turn.usage.completion_tokens
        assert resp.usage.total_tokens == turn.usage.total_tokens
        assert resp.status == ("incomplete" if turn.choices[0].finish_reason == "length" else "completed")
        if resp.status == "incomplete":
            assert resp.incomplete_details.reason == "max_output_tokens"
        [item] = resp.output
        assert item.type == "message" and item.role == "assistant" and item.content[0].type == "output_text"
        r = stored(served_app, resp.id)
        assert r.status_code == 200, r.text
        assert r.json()["output"] == [i.model_dump(mode="json", exclude_unset=True) for i in resp.output]
        assert r.json()["usage"] == resp.usage.model_dump(mode="json", exclude_unset=True)
    # The second prompt holds the first prompt, its reply and the new message.
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens


def test_instructions_are_not_carried_over_to_a_continuation(served_app):
    client = served_app.client()
    with_instr = client.responses.create(model=served_app.model_id, input="hello there", temperature=0,
                                         max_output_tokens=4, instructions="You are terse. " * 8)
    plain = client.responses.create(model=served_app.model_id, input="hello there", temperature=0, max_output_tokens=4)
    assert with_instr.instructions.startswith("You are terse.")
    assert with_instr.usage.input_tokens > plain.usage.input_tokens
    # Continued without instructions: the prompt is the stored conversation alone, which
    # holds no system message (the same size as continuing the plain one, whose reply
    # has the same length only if the two replies do).
    a = client.responses.create(model=served_app.model_id, input="next", temperature=0, max_output_tokens=4,
                                previous_response_id=with_instr.id)
    b = client.responses.create(model=served_app.model_id, input="next", temperature=0, max_output_tokens=4,
                                previous_response_id=plain.id)
    assert a.usage.input_tokens - with_instr.usage.output_tokens == b.usage.input_tokens - plain.usage.output_tokens


def stream_events(served_app, **body) -> list[dict]:
    """The raw server-sent events of a streamed response: each one's ``event:`` line must
    name its data's type."""
    events = []
    with httpx.stream("POST", served_app.base_url + "/v1/responses", timeout=60,
                      json={"model": served_app.model_id, "stream": True, **body}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        name = None
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line[len("event: "):]
            elif line.startswith("data: "):
                event = json.loads(line[len("data: "):])
                assert event["type"] == name, (name, event)
                events.append(event)
    return events


def test_the_stream_sends_the_responses_events_and_what_it_streams_is_stored(served_app):
    body = {"input": "stream this please", "temperature": 0, "max_output_tokens": 16}
    whole = create(served_app, **body).json()
    events = stream_events(served_app, **body)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    final = events[-1]
    assert final["type"] == ("response.incomplete" if whole["status"] == "incomplete" else "response.completed")
    deltas = [e["delta"] for e in events if e["type"] == "response.output_text.delta"]
    assert [e["type"] for e in events] == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        *["response.output_text.delta"] * len(deltas),
        "response.output_text.done", "response.content_part.done", "response.output_item.done", final["type"],
    ]
    assert events[0]["response"]["status"] == "in_progress" and events[0]["response"]["output"] == []
    text = whole["output"][0]["content"][0]["text"]
    assert "".join(deltas) == text == events[-4]["text"] == final["response"]["output"][0]["content"][0]["text"]
    assert events[-2]["item"] == final["response"]["output"][0]
    item_id = final["response"]["output"][0]["id"]
    assert {e["item_id"] for e in events if "item_id" in e} == {item_id}
    usage = final["response"]["usage"]
    assert (usage["input_tokens"], usage["output_tokens"]) == (whole["usage"]["input_tokens"],
                                                              whole["usage"]["output_tokens"])
    r = stored(served_app, final["response"]["id"])
    assert r.status_code == 200, r.text
    assert r.json() == final["response"]
    # The openai client reads the same stream into its typed events.
    sdk = list(served_app.client().responses.create(model=served_app.model_id, stream=True, **body))
    # (How the text is cut into deltas depends on the engine's stream pacing.)
    assert [e.type for e in sdk if e.type != "response.output_text.delta"] == [
        e["type"] for e in events if e["type"] != "response.output_text.delta"]
    assert "".join(e.delta for e in sdk if e.type == "response.output_text.delta") == text
    assert sdk[-1].response.output_text == text


def test_one_response_continued_twice_gives_two_independent_branches(served_app):
    client = served_app.client()
    root = client.responses.create(model=served_app.model_id, input="root", temperature=0, max_output_tokens=6)
    a = client.responses.create(model=served_app.model_id, input="branch a", temperature=0, max_output_tokens=6,
                                previous_response_id=root.id)
    b = client.responses.create(model=served_app.model_id, input="branch b is longer than a", temperature=0,
                                max_output_tokens=6, previous_response_id=root.id)
    assert a.id != b.id
    assert b.usage.input_tokens > a.usage.input_tokens  # each on root's conversation alone
    again = client.responses.create(model=served_app.model_id, input="branch a", temperature=0, max_output_tokens=6,
                                    previous_response_id=root.id)
    assert again.output_text == a.output_text and again.usage.input_tokens == a.usage.input_tokens


def test_input_items_list_what_each_response_was_generated_from(served_app):
    """GET /v1/responses/{id}/input_items through the openai client: a continuation's
    items are the earlier input and output, then its own input, with stable ids that
    page; another tenant's, a deleted or an absent response is a 404."""
    client = served_app.client()
    first = client.responses.create(model=served_app.model_id, input="the first question", temperature=0,
                                    max_output_tokens=6, instructions="not an item")
    second = client.responses.create(
        model=served_app.model_id, previous_response_id=first.id, temperature=0, max_output_tokens=6,
        input=[{"role": "developer", "content": "answer briefly"},
               {"role": "user", "content": [{"type": "input_text", "text": "and "}, {"type": "input_text", "text": "then?"}]}],
    )
    [only] = client.responses.input_items.list(first.id).data
    assert (only.type, only.role, only.content[0].text) == ("message", "user", "the first question")
    items = client.responses.input_items.list(second.id, order="asc").data
    assert [(i.type, i.role) for i in items] == [("message", "user"), ("message", "assistant"),
                                                 ("message", "developer"), ("message", "user")]
    assert items[0].id == only.id  # the first response's input, as listed there
    assert items[1].model_dump(mode="json", exclude_unset=True) == first.output[0].model_dump(mode="json", exclude_unset=True)
    assert [i.content[0].text for i in items[2:]] == ["answer briefly", "and then?"]
    # Newest first by default; pages of one, following "after" (the client's auto-paging).
    newest = client.responses.input_items.list(second.id, limit=1)
    assert [i.id for i in newest.data] == [items[-1].id] and newest.has_more
    assert [i.id for i in client.responses.input_items.list(second.id, limit=1)] == [i.id for i in items[::-1]]
    url = f"{served_app.base_url}/v1/responses/{second.id}/input_items"
    for query, param in (({"limit": 0}, "limit"), ({"order": "sideways"}, "order"), ({"after": "msg_x"}, "after")):
        r = httpx.get(url, params=query, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert httpx.get(f"{served_app.base_url}/v1/responses/nope/input_items", timeout=30).status_code == 400
    assert httpx.get(f"{served_app.base_url}/v1/responses/resp_{'e' * 32}/input_items", timeout=30).status_code == 404
    client.responses.delete(first.id)
    r = httpx.get(f"{served_app.base_url}/v1/responses/{first.id}/input_items", timeout=30)
    assert r.status_code == 404 and r.json()["error"]["code"] == "response_not_found", r.text
    assert len(client.responses.input_items.list(second.id).data) == 4  # a record of its own


def test_store_false_and_delete_leave_nothing_to_read_or_continue(served_app):
    client = served_app.client()
    unstored = create(served_app, input="not kept", store=False, max_output_tokens=4)
    assert unstored.status_code == 200 and unstored.json()["store"] is False
    kept = client.responses.create(model=served_app.model_id, input="kept", max_output_tokens=4)
    assert stored(served_app, kept.id).status_code == 200
    r = httpx.delete(f"{served_app.base_url}/v1/responses/{kept.id}", timeout=30)
    assert r.status_code == 200 and r.json() == {"id": kept.id, "object": "response", "deleted": True}
    for rid in (unstored.json()["id"], kept.id):
        r = stored(served_app, rid)
        assert r.status_code == 404 and r.json()["error"]["code"] == "response_not_found", r.text
        r = create(served_app, input="more", previous_response_id=rid, max_output_tokens=4)
        assert r.status_code == 404, r.text
        assert r.json()["error"]["param"] == "previous_response_id"
        assert r.json()["error"]["code"] == "previous_response_not_found"
    assert httpx.delete(f"{served_app.base_url}/v1/responses/{kept.id}", timeout=30).status_code == 404

    def counted(text: str) -> bool:
        lines = [line for line in text.splitlines() if line.startswith("ray_llm_responses_store_ops_total{")]
        return all(any(f'op="{op}"' in line and f'result="{result}"' in line for line in lines)
                   for op, result in (("store", "ok"), ("read", "ok"), ("read", "not_found"), ("delete", "ok"),
                                      ("delete", "not_found")))

    # The nodes export every second.
    wait_for(lambda: counted(httpx.get(served_app.base_url + "/metrics", timeout=60).text), 90,
             "the stored responses' ops in /metrics")


def test_deleting_a_stored_response_erases_the_kv_blocks_computed_for_it(served_app, redis_client):
    """A stored response lists the KV blocks its request computed under its id, as a
    session turn does, and its DELETE erases them from L3 (and L2, and the torch
    workers' L1); an unstored response lists none (nothing can delete it)."""
    import random

    from deployments.dataplane import keys

    rng = random.Random()

    def text() -> str:  # blocks no other test has
        return " ".join(f"w{rng.randrange(10**6)}" for _ in range(40))

    unstored = create(served_app, input=text(), store=False, max_output_tokens=4)
    assert unstored.status_code == 200, unstored.text
    kept = create(served_app, input=text(), max_output_tokens=4)
    assert kept.status_code == 200, kept.text
    rid = kept.json()["id"]
    listed = keys.session_blocks_key("default", rid)
    wait_for(lambda: redis_client.scard(listed), 30, "the response's blocks listed under it")
    # The prompt's whole blocks at least (40 words: several blocks of 16 tokens).
    members = [m.decode() for m in redis_client.smembers(listed)]
    assert len(members) >= 3, members
    payloads = [keys.block_key("default", keys.split_session_block_member(m)[1]) for m in members]
    # Written behind to L3 (the torch engine's blocks reach Redis through L2).
    wait_for(lambda: redis_client.exists(*payloads) == len(payloads), 30, "the response's blocks in L3")
    # Exported before the stored one's (one worker, in order): listed under nothing.
    assert not redis_client.exists(keys.session_blocks_key("default", unstored.json()["id"]))

    worker = worker_handle("llm") if served_app.engine == "torch" else None
    dropped_before = worker.kv_stats.remote().result(timeout_s=30)["l1_dropped_blocks"] if worker else 0
    r = httpx.delete(f"{served_app.base_url}/v1/responses/{rid}", timeout=30)
    assert r.status_code == 200, r.text
    assert not redis_client.exists(listed)
    assert redis_client.exists(*payloads) == 0
    if worker is not None:
        dropped = worker.kv_stats.remote().result(timeout_s=30)["l1_dropped_blocks"] - dropped_before
        assert dropped >= len(members), (dropped, len(members))


def test_a_named_function_call_and_its_output_continue_the_response(served_app):
    tool = {"type": "function", "name": "get_weather", "description": "Weather of a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                           "required": ["city"], "additionalProperties": False}}
    client = served_app.client()
    called = client.responses.create(model=served_app.model_id, input="weather in Paris?", tools=[tool],
                                     tool_choice={"type": "function", "name": "get_weather"}, temperature=0,
                                     max_output_tokens=40)
    [call] = [i for i in called.output if i.type == "function_call"]
    assert call.name == "get_weather" and call.call_id
    assert set(json.loads(call.arguments)) == {"city"}
    after = client.responses.create(
        model=served_app.model_id, previous_response_id=called.id, tools=[tool], tool_choice="none", temperature=0,
        max_output_tokens=6,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"}],
    )
    assert after.status in ("completed", "incomplete")
    assert after.usage.input_tokens > called.usage.input_tokens + called.usage.output_tokens
    # The stream of a call: its item added, its arguments in deltas, then done, whole.
    events = list(client.responses.create(
        model=served_app.model_id, input="weather in Paris?", tools=[tool], temperature=0, max_output_tokens=40,
        tool_choice={"type": "function", "name": "get_weather"}, stream=True,
    ))
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    [done] = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert args == done.arguments == call.arguments
    assert [i.type for i in events[-1].response.output] == ["function_call"]
    assert [e.type for e in events[2:4]] == ["response.output_item.added", "response.function_call_arguments.delta"]


@pytest.mark.parametrize("served_app", ["torch"], indirect=True)
def test_a_continuation_reuses_the_kv_of_the_conversation_it_continues(served_app):
    """The continuation's prompt starts with the first prompt and the first reply's ids
    exactly: the engine reuses their KV (or counts one import it judged slower than a
    prefill)."""
    client = served_app.client()
    worker = worker_handle("llm")
    first = client.responses.create(model=served_app.model_id, input="a long first question " * 12,
                                    temperature=0, max_output_tokens=16)
    before = worker.kv_stats.remote().result(timeout_s=30)
    second = client.responses.create(model=served_app.model_id, input="a follow-up", temperature=0,
                                     max_output_tokens=4, previous_response_id=first.id)
    after = worker.kv_stats.remote().result(timeout_s=30)
    # Full blocks of the first prompt and its reply (the reply's last id may be the one the
    # template writes again: not counted).
    blocks = (first.usage.input_tokens + first.usage.output_tokens - 1) // 16
    reused = second.usage.input_tokens_details.cached_tokens
    assert reused >= blocks * 16 or after["fetch_skipped"] - before["fetch_skipped"] == 1, (reused, before, after)


def test_bad_responses_requests_are_clear_4xx_errors(served_app):
    cases = [
        ({"input": "x", "previous_response_id": "resp_nothex"}, 400, "previous_response_id"),
        ({"input": "x", "previous_response_id": "resp_" + "0" * 32}, 404, "previous_response_id"),
        ({"input": ""}, 400, "input"),
        ({"input": []}, 400, "input"),
        ({"input": "x", "background": True}, 400, "background"),
        ({"input": "x", "truncation": "auto"}, 400, "truncation"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]}, 400,
         "input[0].content"),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, 400, "input[0].type"),
        ({"input": "x", "tools": [{"type": "web_search"}]}, 400, "tools[0].type"),
        ({"input": "x", "max_output_tokens": 0}, 400, "max_output_tokens"),
        ({"input": "x", "max_output_tokens": 10**6}, 400, "max_output_tokens"),
        ({"input": "x", "text": {"format": {"type": "yaml"}}}, 400, "text.format"),
        ({"input": "x", "tool_choice": "required"}, 400, "tool_choice"),
        ({"input": "x", "model": "no-such-model"}, 404, "model"),
        ({"input": "x", "metadata": {str(i): "v" for i in range(17)}}, 400, "metadata"),
    ]
    for body, status, param in cases:
        r = create(served_app, **body)
        assert r.status_code == status, (body, r.text)
        err = r.json()["error"]
        assert err["param"] == param and err["message"], (body, err)
    r = httpx.post(served_app.base_url + "/v1/responses", json={"model": served_app.model_id, "input": "x"},
                   headers={"X-Session-Id": new_session(served_app)}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "session_id", r.text
    for rid, status in (("nope", 400), ("resp_" + "f" * 32, 404)):
        assert stored(served_app, rid).status_code == status
        assert httpx.delete(f"{served_app.base_url}/v1/responses/{rid}", timeout=30).status_code == status
