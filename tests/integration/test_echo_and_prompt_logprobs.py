"""A completion's ``echo`` and vLLM's ``prompt_logprobs`` through the real Serve
application on both engines: what evaluation harnesses (lm-evaluation-harness's
``local-completions``) send to score a text's log-likelihood: ``echo`` with ``logprobs``
and ``max_tokens`` 1 or 0. And against vLLM's own server on the same checkpoint."""

from __future__ import annotations

import json
import math
import time

import httpx
import pytest

from tests.fixtures.serve_app import vllm_server_replies

pytestmark = pytest.mark.integration

CHAT = [{"role": "user", "content": "Name three rivers of Europe."}]
PREFILLED = CHAT + [{"role": "assistant", "content": "The Rhine,"}]
TEXT = "The quiet river runs past the old mill and into the sea"


def post(served_app, path: str, body: dict) -> httpx.Response:
    return httpx.post(served_app.base_url + path, json={"model": served_app.model_id, **body}, timeout=120)


def ok(served_app, path: str, body: dict) -> dict:
    r = post(served_app, path, body)
    assert r.status_code == 200, r.text
    return r.json()


def tokenize(served_app, text: str) -> list[int]:
    return ok(served_app, "/tokenize", {"prompt": text})["tokens"]


def test_an_echo_with_logprobs_scores_the_prompt_as_a_harness_asks(served_app):
    """lm-evaluation-harness's loglikelihood request: token ids, echo, logprobs 1,
    max_tokens 1, greedy. The reply's tokens are the prompt's and then the reply's; the
    first has no logprob; the prompt's logprobs are the choice's prompt_logprobs; the text
    is the prompt's followed by the reply's."""
    ids = tokenize(served_app, TEXT)
    r = ok(served_app, "/v1/completions", {"prompt": [ids], "echo": True, "logprobs": 1, "max_tokens": 1,
                                           "temperature": 0})
    choice = r["choices"][0]
    plain = ok(served_app, "/v1/completions", {"prompt": ids, "max_tokens": 1, "temperature": 0, "logprobs": 1})
    reply = plain["choices"][0]
    detok = ok(served_app, "/detokenize", {"tokens": ids})["prompt"]
    assert choice["text"] == detok + reply["text"]
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(ids) + 1
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert all(v is not None and v <= 0 for v in lp["token_logprobs"][1:])
    # Each echoed position lists the top one and the prompt's own token (1 or 2 entries).
    assert all(1 <= len(t) <= 2 for t in lp["top_logprobs"][1:])
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:j]) for j in range(len(lp["tokens"]))]
    assert lp["tokens"][-1] == reply["logprobs"]["tokens"][0]
    assert lp["token_logprobs"][-1] == pytest.approx(reply["logprobs"]["token_logprobs"][0], abs=1e-4)
    # The prompt_logprobs beside it (vLLM's): the same numbers, with ranks.
    plp = choice["prompt_logprobs"]
    assert len(plp) == len(ids) and plp[0] is None
    for j in range(1, len(ids)):
        mine = plp[j][str(ids[j])]
        assert mine["logprob"] == pytest.approx(lp["token_logprobs"][j], abs=1e-6)
        assert mine["rank"] >= 1 and isinstance(mine["decoded_token"], str)
        ranks = sorted(e["rank"] for t, e in plp[j].items() if t != str(ids[j]))
        assert ranks in ([1], []) if mine["rank"] == 1 else ranks == [1]
    # The same prompt, scored after a plain request cached its KV: the same numbers (no
    # cached prefix is used for them).
    again = ok(served_app, "/v1/completions", {"prompt": ids, "echo": True, "logprobs": 1, "max_tokens": 1,
                                               "temperature": 0})
    assert again["choices"][0]["logprobs"]["token_logprobs"][1:] == pytest.approx(lp["token_logprobs"][1:], abs=1e-4)
    assert r["usage"] == {**r["usage"], "prompt_tokens": len(ids), "completion_tokens": 1}


def test_a_replys_logprobs_are_its_prompt_logprobs_when_echoed_back(served_app):
    """The same distributions two ways: a greedy reply's logprobs (decoded step by step
    over the cache) and, with echo and max_tokens 0, the logprobs of the prompt followed
    by that reply (one prefill). max_tokens 0 returns the prompt alone."""
    ids = tokenize(served_app, TEXT)
    gen = ok(served_app, "/v1/completions", {"prompt": ids, "max_tokens": 8, "temperature": 0, "logprobs": 0,
                                             "ignore_eos": True, "return_token_ids": True})
    out_ids = gen["choices"][0]["token_ids"]
    scored = ok(served_app, "/v1/completions", {"prompt": ids + out_ids, "echo": True, "max_tokens": 0,
                                                "logprobs": 0})
    choice = scored["choices"][0]
    assert choice["text"] == ok(served_app, "/detokenize", {"tokens": ids + out_ids})["prompt"]
    assert len(choice["logprobs"]["tokens"]) == len(ids) + len(out_ids)  # nothing generated after it
    assert choice["logprobs"]["token_logprobs"][len(ids):] == pytest.approx(
        gen["choices"][0]["logprobs"]["token_logprobs"], abs=1e-3)
    assert scored["usage"]["completion_tokens"] == 0 and scored["usage"]["prompt_tokens"] == len(ids) + len(out_ids)
    # Greedy: each reply token was the most likely one.
    plp = choice["prompt_logprobs"]
    assert [plp[len(ids) + j][str(t)]["rank"] for j, t in enumerate(out_ids)] == [1] * len(out_ids)


def test_echo_streams_the_prompt_in_each_choices_first_chunk(served_app):
    body = {"prompt": TEXT, "echo": True, "max_tokens": 6, "temperature": 0, "logprobs": 1, "ignore_eos": True}
    whole = ok(served_app, "/v1/completions", body)["choices"][0]
    assert whole["text"].startswith(TEXT) and len(whole["text"]) > len(TEXT)
    with httpx.stream("POST", served_app.base_url + "/v1/completions",
                      json={"model": served_app.model_id, "stream": True, **body}, timeout=120) as r:
        assert r.status_code == 200
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    texts = [c["choices"][0]["text"] for c in chunks if c["choices"]]
    assert texts[0].startswith(TEXT) and "".join(texts) == whole["text"]
    tokens = [t for c in chunks if c["choices"] and c["choices"][0]["logprobs"] for t in c["choices"][0]["logprobs"]["tokens"]]
    values = [v for c in chunks if c["choices"] and c["choices"][0]["logprobs"]
              for v in c["choices"][0]["logprobs"]["token_logprobs"]]
    assert tokens == whole["logprobs"]["tokens"] and values[0] is None
    assert values[1:] == pytest.approx(whole["logprobs"]["token_logprobs"][1:], abs=1e-4)
    # n choices: each starts with the prompt.
    two = ok(served_app, "/v1/completions", {**body, "n": 2, "temperature": 1.0, "seed": 5, "logprobs": None})
    assert [c["text"].startswith(TEXT) for c in two["choices"]] == [True, True]
    # echo with max_tokens 0, streamed: the prompt, and nothing generated.
    with httpx.stream("POST", served_app.base_url + "/v1/completions",
                      json={"model": served_app.model_id, "stream": True, "prompt": TEXT, "echo": True,
                            "max_tokens": 0, "stream_options": {"include_usage": True}}, timeout=120) as r:
        lines = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert "".join(c["choices"][0]["text"] for c in lines if c["choices"]) == TEXT
    assert lines[-1]["usage"]["completion_tokens"] == 0
    # Without logprobs an echo keeps KV reuse: a prompt served before is cached (counted
    # in the usage, as for any request; the engines export its blocks as it ends).
    long_text = " ".join([TEXT] * 4)
    ok(served_app, "/v1/completions", {"prompt": long_text, "max_tokens": 1})
    for _ in range(20):
        usage = ok(served_app, "/v1/completions", {"prompt": long_text, "echo": True, "max_tokens": 0})["usage"]
        if usage["prompt_tokens_details"]["cached_tokens"]:
            break
        time.sleep(0.25)
    assert usage["prompt_tokens_details"]["cached_tokens"] > 0 and usage["completion_tokens"] == 0


def test_tokens_as_token_ids_are_the_ids_of_the_logprobs_tokens_whole_and_streamed(served_app):
    """vLLM's return_tokens_as_token_ids: each logprobs token (the echoed prompt's, the
    reply's, the top ones) is "token_id:<id>" of the ids the reply and the prompt have,
    offsets counted in those strings; streamed, the same tokens chunk by chunk."""
    body = {"prompt": TEXT, "echo": True, "max_tokens": 5, "temperature": 0, "logprobs": 2, "ignore_eos": True,
            "return_token_ids": True, "return_tokens_as_token_ids": True}
    whole = ok(served_app, "/v1/completions", body)["choices"][0]
    ids = whole["prompt_token_ids"] + whole["token_ids"]
    lp = whole["logprobs"]
    assert lp["tokens"] == [f"token_id:{i}" for i in ids]
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:k]) for k in range(len(ids))]
    assert all(t.startswith("token_id:") for top in lp["top_logprobs"][1:] for t in top)
    with httpx.stream("POST", served_app.base_url + "/v1/completions",
                      json={"model": served_app.model_id, "stream": True, **body}, timeout=120) as r:
        assert r.status_code == 200
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    streamed = [t for c in chunks if c["choices"] and c["choices"][0]["logprobs"]
                for t in c["choices"][0]["logprobs"]["tokens"]]
    assert streamed == lp["tokens"]
    chat = ok(served_app, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 4, "temperature": 0,
                                                   "logprobs": True, "top_logprobs": 2, "return_token_ids": True,
                                                   "return_tokens_as_token_ids": True})["choices"][0]
    content = chat["logprobs"]["content"]
    assert [e["token"] for e in content] == [f"token_id:{i}" for i in chat["token_ids"]]
    assert all(t["token"].startswith("token_id:") for e in content for t in e["top_logprobs"])
    # Without logprobs it changes nothing (as in vLLM).
    plain = ok(served_app, "/v1/completions", {"prompt": TEXT, "max_tokens": 3, "temperature": 0,
                                               "return_tokens_as_token_ids": True})["choices"][0]
    assert plain["logprobs"] is None and plain["text"] == whole["text"][len(TEXT):len(TEXT) + len(plain["text"])]


def test_chat_echo_puts_the_prefill_in_front_of_each_choice_whole_and_streamed(served_app):
    """vLLM's chat echo: the last message's content, when it has the reply's role (an
    assistant prefill continued), in front of each choice's content; streamed, as a chunk
    of its own after the role. With a generation prompt (the reply a new assistant
    message after a user's) there is nothing to echo."""
    body = {"messages": PREFILLED, "add_generation_prompt": False, "continue_final_message": True, "max_tokens": 5,
            "temperature": 0, "ignore_eos": True}
    plain = ok(served_app, "/v1/chat/completions", body)["choices"][0]["message"]["content"]
    echoed = ok(served_app, "/v1/chat/completions", {**body, "echo": True, "n": 2})["choices"]
    assert [c["message"]["content"] for c in echoed] == ["The Rhine," + plain] * 2
    with httpx.stream("POST", served_app.base_url + "/v1/chat/completions",
                      json={"model": served_app.model_id, "stream": True, "echo": True, **body}, timeout=120) as r:
        assert r.status_code == 200
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert deltas[0]["role"] == "assistant" and deltas[1] == {"content": "The Rhine,"}
    assert "".join(d.get("content") or "" for d in deltas) == "The Rhine," + plain
    fresh = ok(served_app, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 3, "temperature": 0, "echo": True})
    assert fresh["choices"][0]["message"]["content"] == ok(
        served_app, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 3, "temperature": 0})["choices"][0]["message"]["content"]


def test_chat_prompt_logprobs_cover_the_rendered_prompt(served_app):
    r = ok(served_app, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 2, "prompt_logprobs": 2,
                                                "return_token_ids": True})
    plp, ids = r["prompt_logprobs"], r["prompt_token_ids"]
    assert len(plp) == len(ids) == r["usage"]["prompt_tokens"] and plp[0] is None
    for j in range(1, len(ids)):
        entry = plp[j]
        assert str(ids[j]) in entry and 2 <= len(entry) <= 3
        tops = sorted((e for t, e in entry.items() if t != str(ids[j]) or e["rank"] <= 2), key=lambda e: e["rank"])
        assert [e["rank"] for e in tops][:2] == [1, 2] and tops[0]["logprob"] >= tops[1]["logprob"]
        assert all(math.isfinite(e["logprob"]) for e in entry.values())
    assert "prompt_logprobs" not in ok(served_app, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 2})


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/completions", {"prompt": "x", "max_tokens": 0}, "max_tokens"),
        ("/v1/completions", {"prompt": "x", "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
        ("/v1/completions", {"prompt": "x", "prompt_logprobs": 21}, "prompt_logprobs"),
        ("/v1/chat/completions", {"messages": CHAT, "prompt_logprobs": -1}, "prompt_logprobs"),
        ("/v1/chat/completions", {"messages": CHAT, "prompt_logprobs": "2"}, "prompt_logprobs"),
        ("/v1/chat/completions", {"messages": CHAT, "echo": "yes"}, "echo"),
    ],
)
def test_bad_echo_and_prompt_logprobs_are_400s_naming_the_field(served_app, path, body, param):
    r = post(served_app, path, body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text


# What the comparison with vLLM's own server sends to both: a harness's scoring requests.
SAME_AS_VLLM = [
    ("/v1/completions", {"prompt": TEXT, "echo": True, "logprobs": 1, "max_tokens": 1, "temperature": 0}),
    ("/v1/completions", {"prompt": TEXT, "echo": True, "logprobs": 3, "max_tokens": 3, "temperature": 0,
                         "prompt_logprobs": 2, "ignore_eos": True}),
    ("/v1/completions", {"prompt": TEXT, "echo": True, "max_tokens": 0, "logprobs": 0}),
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 2, "temperature": 0, "prompt_logprobs": 1}),
    # A batch of prompts (lm-evaluation-harness's batch_size > 1): each prompt's choices in order.
    ("/v1/completions", {"prompt": [TEXT, "A second prompt, shorter"], "echo": True, "logprobs": 1, "max_tokens": 2,
                         "temperature": 0}),
    # vLLM's return_tokens_as_token_ids: every logprobs token as "token_id:<id>".
    ("/v1/completions", {"prompt": TEXT, "echo": True, "logprobs": 2, "max_tokens": 3, "temperature": 0,
                         "ignore_eos": True, "return_tokens_as_token_ids": True}),
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 4, "temperature": 0, "ignore_eos": True,
                              "logprobs": True, "top_logprobs": 2, "return_tokens_as_token_ids": True}),
    # vLLM's chat echo: an assistant prefill in front of its continuation.
    ("/v1/chat/completions", {"messages": PREFILLED, "add_generation_prompt": False, "continue_final_message": True,
                              "echo": True, "max_tokens": 4, "temperature": 0, "ignore_eos": True}),
    # A message of several text parts: one text, joined by newlines (the prompt's size compared).
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": "Name three"},
                                                                        {"type": "text", "text": "rivers."}]}],
                              "max_tokens": 2, "temperature": 0, "prompt_logprobs": 1}),
]


def _same(ours, theirs, where="") -> None:
    """Equal JSON, floats within a tolerance (the two servers' numbers come from the same
    engine and weights, but not the same process)."""
    if isinstance(theirs, float) or isinstance(ours, float):
        assert ours == pytest.approx(theirs, abs=1e-4), where
    elif isinstance(theirs, dict):
        assert isinstance(ours, dict) and set(ours) == set(theirs), (where, set(ours) ^ set(theirs))
        for k in theirs:
            _same(ours[k], theirs[k], f"{where}.{k}")
    elif isinstance(theirs, list):
        assert isinstance(ours, list) and len(ours) == len(theirs), where
        for i, (a, b) in enumerate(zip(ours, theirs)):
            _same(a, b, f"{where}[{i}]")
    else:
        assert ours == theirs, where


def test_the_answers_are_those_of_vllms_own_server(served_app, tmp_path):
    """The same scoring bodies to ``vllm serve`` (its api_server, the same checkpoint and
    engine options), on either engine: the same text, tokens, logprobs, ranks and decoded
    tokens. Two differences, not compared: the usage where vLLM counts the token an echo
    with max_tokens 0 made and left out (OpenAI's usage counts what the client got:
    none), and an echo with return_token_ids, whose prompt text vLLM leaves out (ours
    echoes it still)."""
    theirs = vllm_server_replies(served_app.model_path, tmp_path / "vllm_server.log", SAME_AS_VLLM, name_model=True)
    for (path, body), their in zip(SAME_AS_VLLM, theirs):
        assert their.status_code == 200, (path, body, their.text)
        ours, their = ok(served_app, path, body), their.json()
        if "messages" in body:
            _same(ours.get("prompt_logprobs"), their.get("prompt_logprobs"), path)
            _same(ours["choices"][0]["message"]["content"], their["choices"][0]["message"]["content"], path)
            _same(ours["choices"][0]["logprobs"], their["choices"][0]["logprobs"], f"{path} {body} logprobs")
        else:
            assert [c["index"] for c in ours["choices"]] == [c["index"] for c in their["choices"]]
            keys = ("text", "logprobs", "prompt_logprobs", "finish_reason", "prompt_token_ids", "token_ids")
            for mine, their_choice in zip(ours["choices"], their["choices"]):
                for key in keys:
                    _same(mine.get(key), their_choice.get(key), f"{path} {body} {key}")
        if body.get("max_tokens") != 0:
            assert ours["usage"]["completion_tokens"] == their["usage"]["completion_tokens"]
        assert ours["usage"]["prompt_tokens"] == their["usage"]["prompt_tokens"]
