"""vLLM's /tokenize and /detokenize through the real Serve application over a real
socket: the ids /tokenize gives are the prompts the generation endpoints run (their
usage counts them), the chat form's options render as the template renders them, and
bad bodies are clear 4xx errors. The tokenizer's work alone: one engine suffices."""

from __future__ import annotations


import httpx
import pytest

from tests.fixtures.serve_app import vllm_server_replies, wait_for

pytestmark = pytest.mark.integration

CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "what is a key-value cache?"}]


def post(served_app, path: str, **body) -> httpx.Response:
    return httpx.post(served_app.base_url + path, json=body, timeout=60)


def tokenize(served_app, **body) -> dict:
    r = post(served_app, "/tokenize", **body)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.parametrize("served_app", ["torch"], indirect=True)
def test_tokenize_gives_the_prompts_the_generation_endpoints_run(served_app):
    client = served_app.client()
    chat = tokenize(served_app, model=served_app.model_id, messages=CHAT)
    reply = client.chat.completions.create(model=served_app.model_id, messages=CHAT, max_tokens=1)
    assert chat["count"] == len(chat["tokens"]) == reply.usage.prompt_tokens
    assert chat["max_model_len"] == client.models.list().data[0].model_extra["max_model_len"]
    text = "the quick brown fox jumps over the lazy dog"
    plain = tokenize(served_app, prompt=text)  # model is optional, as in vLLM's
    completion = client.completions.create(model=served_app.model_id, prompt=text, max_tokens=1)
    assert plain["count"] == completion.usage.prompt_tokens
    # The same ids given as the prompt: the same usage, so the same prompt.
    by_ids = client.completions.create(model=served_app.model_id, prompt=plain["tokens"], max_tokens=1)
    assert by_ids.usage.prompt_tokens == plain["count"] and plain["token_strs"] is None
    # vLLM's defaults: a prompt gets the BOS, a chat's template writes its own and gets
    # no second one.
    bare = tokenize(served_app, prompt=text, add_special_tokens=False)
    assert plain["tokens"][1:] == bare["tokens"] and plain["count"] == bare["count"] + 1
    assert tokenize(served_app, messages=CHAT, add_special_tokens=True)["count"] == chat["count"] + 1
    # Back to text, and each id's own string.
    r = post(served_app, "/detokenize", model=served_app.model_id, tokens=bare["tokens"])
    assert r.status_code == 200 and r.json() == {"prompt": text}, r.text
    strs = tokenize(served_app, prompt=text, return_token_strs=True)["token_strs"]
    assert len(strs) == plain["count"] and all(isinstance(s, str) and s for s in strs)


@pytest.mark.parametrize("served_app", ["torch"], indirect=True)
def test_the_chat_form_renders_its_options_and_tools_as_the_template_does(served_app):
    with_prompt = tokenize(served_app, messages=CHAT)["tokens"]
    without = tokenize(served_app, messages=CHAT, add_generation_prompt=False)["tokens"]
    # The assistant's header is all that the generation prompt adds.
    assert len(without) < len(with_prompt) and with_prompt[: len(without)] == without
    prefill = CHAT + [{"role": "assistant", "content": "A cache of"}]
    continued = tokenize(served_app, messages=prefill, add_generation_prompt=False, continue_final_message=True)
    assert continued["tokens"][: len(with_prompt)] == with_prompt and continued["count"] > len(with_prompt)
    closed = tokenize(served_app, messages=prefill, add_generation_prompt=False)["tokens"]
    assert closed != continued["tokens"]  # the final message closed (its end-of-turn), not continued
    # Tool calls and their answers render as a chat request's do.
    calls = CHAT + [
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "lookup", "arguments": '{"q": "kv"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "a cache of attention keys and values"},
    ]
    counted = tokenize(served_app, messages=calls)["count"]
    reply = served_app.client().chat.completions.create(model=served_app.model_id, messages=calls, max_tokens=1)
    assert counted == reply.usage.prompt_tokens > len(with_prompt)


@pytest.mark.parametrize("served_app", ["torch"], indirect=True)
def test_bad_tokenize_and_detokenize_bodies_are_clear_4xx_errors(served_app):
    assert tokenize(served_app, prompt="x")["count"] == 2  # the BOS and "x"
    cases = [
        ("/tokenize", {}, 400, "messages"),
        ("/tokenize", {"prompt": "x", "messages": CHAT}, 400, "prompt"),
        ("/tokenize", {"prompt": 5}, 400, "prompt"),
        ("/tokenize", {"prompt": "x", "model": "no-such-model"}, 404, "model"),
        ("/tokenize", {"prompt": "x", "tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tools"),
        ("/tokenize", {"prompt": "x", "chat_template": "{{ messages }}"}, 400, "chat_template"),
        ("/tokenize", {"messages": CHAT, "continue_final_message": True}, 400, "continue_final_message"),
        ("/tokenize", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages.0.role"),
        ("/tokenize", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, "messages"),
        ("/tokenize", {"messages": CHAT, "chat_template_kwargs": {"add_generation_prompt": False}}, 400,
         "chat_template_kwargs"),
        ("/tokenize", {"messages": CHAT, "session_id": "s"}, 400, "session_id"),
        ("/detokenize", {"tokens": [1, -2]}, 400, "tokens"),
        ("/detokenize", {"tokens": [1, 10**9]}, 400, "tokens"),
        ("/detokenize", {"tokens": "1 2"}, 400, "tokens"),
        ("/detokenize", {"tokens": [1], "model": "no-such-model"}, 404, "model"),
    ]
    for path, body, status, param in cases:
        r = post(served_app, path, **body)
        assert r.status_code == status, (path, body, r.text)
        err = r.json()["error"]
        assert err["param"] == param and err["message"], (path, body, err)
    r = httpx.post(served_app.base_url + "/tokenize", content=b"{not json", timeout=30)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", r.text
    r = httpx.post(served_app.base_url + "/tokenize", json={"prompt": "x"}, headers={"X-Session-Id": "s"}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "session_id", r.text

    def counted(text: str) -> bool:
        lines = [line for line in text.splitlines() if line.startswith("ray_llm_requests_total{")]
        return all(any(f'endpoint="{e}"' in line and f'status="{s}"' in line for line in lines)
                   for e, s in (("tokenize", "200"), ("tokenize", "400"), ("detokenize", "404")))

    # The nodes export every second.
    wait_for(lambda: counted(httpx.get(served_app.base_url + "/metrics", timeout=60).text), 90,
             "the tokenizer endpoints' requests in /metrics")


# What the comparison with vLLM's own server sends to both.
SAME_AS_VLLM = [
    ("/tokenize", {"prompt": "the quick brown fox"}),
    ("/tokenize", {"prompt": "the quick brown fox", "add_special_tokens": False, "return_token_strs": True}),
    ("/tokenize", {"messages": CHAT}),
    ("/tokenize", {"messages": CHAT, "add_generation_prompt": False, "add_special_tokens": True}),
    ("/tokenize", {"messages": CHAT + [{"role": "assistant", "content": "A cache of"}],
                   "add_generation_prompt": False, "continue_final_message": True, "return_token_strs": True}),
    ("/tokenize", {"messages": CHAT + [
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "lookup", "arguments": '{"q": "kv"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "keys and values"}]}),
    # A message of text parts: joined by newlines, as vLLM renders it for this template.
    ("/tokenize", {"messages": [{"role": "user", "content": [{"type": "text", "text": "two"},
                                                             {"type": "text", "text": "parts"}]}]}),
    ("/detokenize", {"tokens": [0, 264, 81, 369, 818]}),
]


@pytest.mark.parametrize("served_app", ["torch"], indirect=True)
def test_the_answers_are_those_of_vllms_own_server(served_app, tmp_path):
    """The same bodies to ``vllm serve`` (its api_server, on the same checkpoint): the
    same ids, counts, token strings and text."""
    theirs = vllm_server_replies(served_app.model_path, tmp_path / "vllm_server.log", SAME_AS_VLLM)
    for (path, body), their in zip(SAME_AS_VLLM, theirs):
        assert their.status_code == 200, (path, body, their.text)
        ours = post(served_app, path, **body)
        assert ours.status_code == 200, (path, body, ours.text)
        assert ours.json() == their.json(), (path, body)
