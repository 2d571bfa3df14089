"""The OpenAI API through a real Serve application (Ingress → Router → ComputeWorker) on a
local Ray, with the offline tiny model, driven by the official `openai` client and raw HTTP.
"""

from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest

from tests.fixtures.engines import logprob_token_text, logprob_token_texts
from tests.fixtures.serve_app import TEST_MAX_QUEUE_DEPTH, idle_worker_stats, worker_stats

pytestmark = pytest.mark.integration

CHAT = [{"role": "user", "content": "Tell me a story about a quiet river."}]


def chat_text(client, model, **kw) -> tuple[str, object]:
    r = client.chat.completions.create(model=model, messages=CHAT, **kw)
    return r.choices[0].message.content, r


def stream_chat_text(client, model, **kw) -> tuple[str, list]:
    chunks = list(client.chat.completions.create(model=model, messages=CHAT, stream=True, **kw))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return text, chunks


def test_health_ready_models(served_app):
    base = served_app.base_url
    assert httpx.get(base + "/health").json() == {"status": "ok"}
    ready = httpx.get(base + "/ready")
    assert ready.status_code == 200 and ready.json()["status"] == "ready"
    # Every data-plane replica (the shared app runs two) answers, each with Redis up (an
    # earlier module may have killed one: Serve's replacement joins within seconds).
    want = {"degraded": 0, "refusing_writes": 0, "ok": 2, "unanswered": 0}
    deadline = time.monotonic() + 30
    while (body := httpx.get(base + "/ready").json()).get("dataplane_replicas") != want:
        assert time.monotonic() < deadline, body
        time.sleep(0.5)
    assert body["dataplane"] == "ok"
    models = served_app.client().models.list()
    assert [m.id for m in models.data] == ["tiny-llama"]


def test_chat_non_streamed_shape_and_usage(served_app):
    client = served_app.client()
    text, r = chat_text(client, served_app.model_id, max_tokens=12, temperature=0)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.completion_tokens >= 1 and r.usage.prompt_tokens > 5
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert text


def test_streamed_text_equals_non_streamed_at_temperature_zero(served_app):
    client = served_app.client()
    full, r = chat_text(client, served_app.model_id, max_tokens=24, temperature=0)
    streamed, chunks = stream_chat_text(
        client, served_app.model_id, max_tokens=24, temperature=0, stream_options={"include_usage": True}
    )
    assert streamed == full
    assert chunks[0].choices[0].delta.role == "assistant"
    finishing = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finishing) == 1 and finishing[0].choices[0].finish_reason == r.choices[0].finish_reason
    # include_usage: a last chunk with no choices and the usage.
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == r.usage.completion_tokens


def test_an_assistant_prefill_is_continued_as_its_prompt_ids_are(served_app):
    """continue_final_message (vLLM's): the reply continues the final assistant message,
    exactly as a completion of the ids /tokenize gives for that rendering, and holds the
    new text only; streamed the same. add_generation_prompt false leaves the assistant's
    header out, and the reply takes the role of the message it continues. Neither goes
    in a session turn, which ends with a reply of its own."""
    client = served_app.client()
    messages = [{"role": "user", "content": "name three colours"}, {"role": "assistant", "content": "Red, green"}]
    prefill = dict(add_generation_prompt=False, continue_final_message=True)
    r = client.chat.completions.create(model=served_app.model_id, messages=messages, max_tokens=8, temperature=0,
                                       extra_body=prefill)
    ids = httpx.post(served_app.base_url + "/tokenize", json={"messages": messages, **prefill}, timeout=30).json()
    plain = client.completions.create(model=served_app.model_id, prompt=ids["tokens"], max_tokens=8, temperature=0)
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == plain.choices[0].text and r.usage.prompt_tokens == ids["count"]
    closed = client.chat.completions.create(model=served_app.model_id, messages=messages, max_tokens=8,
                                            temperature=0)  # a new reply after the finished message
    assert closed.usage.prompt_tokens > r.usage.prompt_tokens
    chunks = list(client.chat.completions.create(model=served_app.model_id, messages=messages, max_tokens=8,
                                                 temperature=0, stream=True, extra_body=prefill))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == r.choices[0].message.content and chunks[0].choices[0].delta.role == "assistant"
    as_user = client.chat.completions.create(model=served_app.model_id, messages=messages[:1], max_tokens=2,
                                             temperature=0, extra_body={"add_generation_prompt": False})
    assert as_user.choices[0].message.role == "user"
    r = post(served_app, "/v1/chat/completions", chat_body(served_app, continue_final_message=True))
    assert_openai_error(r, 400, "continue_final_message")
    sid = httpx.post(served_app.base_url + "/v1/sessions", timeout=30).json()["id"]
    r = httpx.post(served_app.base_url + "/v1/chat/completions", headers={"X-Session-Id": sid}, timeout=30,
                   json={**chat_body(served_app, messages=messages), **prefill})
    assert_openai_error(r, 400, "continue_final_message")
    assert httpx.get(f"{served_app.base_url}/v1/sessions/{sid}", timeout=30).json()["version"] == 0


def test_vllms_prompt_options_truncate_and_add_special_tokens(served_app):
    """truncate_prompt_tokens keeps that many of the prompt's tokens (the tokenizer's side,
    the right one, unless truncation_side says), as a completion of the kept ids gives;
    -1 keeps what the context takes less one token for the reply. add_special_tokens
    false leaves a completion's BOS out; true adds one on top of a chat template's."""
    client = served_app.client()
    ids = list(range(100, 140))

    def complete(prompt, **extra):
        return client.completions.create(model=served_app.model_id, prompt=prompt, max_tokens=6, temperature=0,
                                         extra_body=extra)

    for side, kept in ((None, ids[:10]), ("right", ids[:10]), ("left", ids[-10:])):
        cut = complete(ids, truncate_prompt_tokens=10, **({"truncation_side": side} if side else {}))
        same = complete(kept)
        assert cut.usage.prompt_tokens == 10 and cut.choices[0].text == same.choices[0].text, side
    assert complete(ids, truncate_prompt_tokens=100).usage.prompt_tokens == len(ids)  # nothing to cut
    models_max_len = client.models.list().data[0].model_extra["max_model_len"]
    long = [100 + i % 200 for i in range(models_max_len + 50)]
    r = client.completions.create(model=served_app.model_id, prompt=long, max_tokens=1, temperature=0,
                                  extra_body={"truncate_prompt_tokens": -1, "truncation_side": "left"})
    assert r.usage.prompt_tokens == models_max_len - 1
    text = "the quick brown fox"
    with_bos, without = complete(text), complete(text, add_special_tokens=False)
    assert with_bos.usage.prompt_tokens == without.usage.prompt_tokens + 1
    chat = chat_body(served_app)
    plain = post(served_app, "/v1/chat/completions", chat).json()["usage"]["prompt_tokens"]
    bos = post(served_app, "/v1/chat/completions", {**chat, "add_special_tokens": True}).json()
    assert bos["usage"]["prompt_tokens"] == plain + 1
    for extra, param in (({"truncate_prompt_tokens": models_max_len + 1}, "truncate_prompt_tokens"),
                         ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
                         ({"truncation_side": "middle"}, "truncation_side")):
        assert_openai_error(post(served_app, "/v1/completions", {"model": served_app.model_id, "prompt": ids,
                                                                 "max_tokens": 2, **extra}), 400, param)
    sid = httpx.post(served_app.base_url + "/v1/sessions", timeout=30).json()["id"]
    r = httpx.post(served_app.base_url + "/v1/chat/completions", headers={"X-Session-Id": sid}, timeout=30,
                   json={**chat, "truncate_prompt_tokens": 8})
    assert_openai_error(r, 400, "truncate_prompt_tokens")


def test_return_token_ids_gives_the_prompt_and_reply_ids_as_vllm_does(served_app):
    """vLLM's return_token_ids: the prompt's ids (what /tokenize gives for the same body)
    and each choice's generated ids, which decode to its text; streamed, each chunk's own
    ids, which add up to the whole reply's, and the prompt's in the first chunk only."""
    client = served_app.client()
    kw = dict(model=served_app.model_id, max_tokens=10, temperature=0)
    ids_on = {"return_token_ids": True, "ignore_eos": True}
    r = client.chat.completions.create(messages=CHAT, extra_body=ids_on, **kw)
    prompt = httpx.post(served_app.base_url + "/tokenize", json={"messages": CHAT}, timeout=30).json()["tokens"]
    assert r.model_extra["prompt_token_ids"] == prompt and len(prompt) == r.usage.prompt_tokens
    ids = r.choices[0].model_extra["token_ids"]
    assert len(ids) == r.usage.completion_tokens == 10
    text = httpx.post(served_app.base_url + "/detokenize", json={"tokens": ids}, timeout=30).json()["prompt"]
    assert text == r.choices[0].message.content
    chunks = list(client.chat.completions.create(messages=CHAT, stream=True, extra_body=ids_on, **kw))
    assert [c.model_extra.get("prompt_token_ids") for c in chunks] == [prompt] + [None] * (len(chunks) - 1)
    assert [t for c in chunks for t in c.choices[0].model_extra["token_ids"]] == ids
    # Completions: the prompt's ids on the choice, as vLLM's completions put them.
    plain = client.completions.create(prompt="the quick brown fox", extra_body=ids_on, **kw).choices[0]
    assert plain.model_extra["prompt_token_ids"] == httpx.post(
        served_app.base_url + "/tokenize", json={"prompt": "the quick brown fox"}, timeout=30).json()["tokens"]
    streamed = list(client.completions.create(prompt="the quick brown fox", stream=True, extra_body=ids_on, **kw))
    assert [t for c in streamed for t in c.choices[0].model_extra["token_ids"]] == plain.model_extra["token_ids"]
    assert streamed[0].choices[0].model_extra["prompt_token_ids"] == plain.model_extra["prompt_token_ids"]
    assert "prompt_token_ids" not in streamed[1].choices[0].model_extra
    # Off by default.
    assert "token_ids" not in client.chat.completions.create(messages=CHAT, **kw).choices[0].model_extra


def test_continuous_usage_stats_put_the_usage_so_far_in_every_chunk(served_app):
    client = served_app.client()
    _, r = chat_text(client, served_app.model_id, max_tokens=12, temperature=0)
    chunks = list(client.chat.completions.create(
        model=served_app.model_id, messages=CHAT, max_tokens=12, temperature=0, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True}))
    assert all(c.usage is not None and c.usage.prompt_tokens == r.usage.prompt_tokens for c in chunks)
    counts = [c.usage.completion_tokens for c in chunks]
    assert counts[0] == 0 and counts == sorted(counts) and counts[-1] == r.usage.completion_tokens
    assert all(c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens for c in chunks)
    # Without it, the usage is in the last chunk alone.
    plain = list(client.chat.completions.create(model=served_app.model_id, messages=CHAT, max_tokens=4, stream=True,
                                                stream_options={"include_usage": True}))
    assert [c.usage is not None for c in plain] == [False] * (len(plain) - 1) + [True]


def test_completions_streamed_and_not(served_app):
    client = served_app.client()
    r = client.completions.create(model=served_app.model_id, prompt="Once upon a time", max_tokens=10, temperature=0)
    assert r.object == "text_completion"
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 10
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(
            model=served_app.model_id, prompt="Once upon a time", max_tokens=10, temperature=0, stream=True
        )
        if c.choices
    )
    assert streamed == r.choices[0].text


def test_greedy_through_service_equals_direct_transformers_generate(served_app):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(served_app.model_path)
    model = AutoModelForCausalLM.from_pretrained(served_app.model_path, dtype=torch.float32)
    prompt_ids = tok.encode("The old lighthouse keeper said")
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt_ids]),
            attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
            do_sample=False,
            max_new_tokens=20,
            min_new_tokens=20,
        )
    expected = tok.decode(out[0, len(prompt_ids):].tolist())
    r = served_app.client().completions.create(
        model=served_app.model_id, prompt=prompt_ids, max_tokens=20, temperature=0, extra_body={"ignore_eos": True}
    )
    assert r.usage.completion_tokens == 20
    assert r.choices[0].text == expected


def test_logprobs_are_the_models_own_and_stream_as_they_are_sent_whole(served_app):
    """Each output token's logprob and the top ones at its position equal a direct forward
    pass of the checkpoint with transformers (log-softmax of the raw logits), on either
    engine; streamed, the chunks carry the same entries as the whole reply, in order."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(served_app.model_path)
    model = AutoModelForCausalLM.from_pretrained(served_app.model_path, dtype=torch.float32)
    prompt = tok.encode("The old lighthouse keeper said")
    steps, k = 8, 3
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            do_sample=False, max_new_tokens=steps, min_new_tokens=steps,
        )
        generated = out[0, len(prompt):].tolist()
        logits = model(out[:, :-1]).logits[0, len(prompt) - 1 :]
        expected = torch.log_softmax(logits.float(), dim=-1)
    client = served_app.client()
    kw = dict(model=served_app.model_id, prompt=prompt, max_tokens=steps, temperature=0, logprobs=k,
              extra_body={"ignore_eos": True})
    r = client.completions.create(**kw)
    lp = r.choices[0].logprobs
    # Each token decoded alone; one that is a piece of a UTF-8 character (alone, U+FFFD)
    # the way vLLM's logprobs show it: what it adds to the tokens before it, or "".
    expected_tokens = logprob_token_texts(tok, generated)
    assert [t if e is not None else None for t, e in zip(lp.tokens, expected_tokens)] == expected_tokens
    assert lp.token_logprobs == pytest.approx([float(expected[j, t]) for j, t in enumerate(generated)], abs=2e-3)
    for j, tops in enumerate(lp.top_logprobs):
        values, ids = expected[j].topk(k)
        assert sorted(tops.values(), reverse=True) == pytest.approx(values.tolist(), abs=2e-3)
        # Greedy: the chosen one is among them.
        texts = {logprob_token_text(tok, i, generated[:j]) for i in ids.tolist()}
        assert None in texts or set(tops) == texts
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:j]) for j in range(steps)]
    chunks = [c for c in client.completions.create(stream=True, **kw) if c.choices]
    streamed = [(t, v) for c in chunks if c.choices[0].logprobs for t, v in
                zip(c.choices[0].logprobs.tokens, c.choices[0].logprobs.token_logprobs)]
    assert [t for t, _ in streamed] == lp.tokens
    assert [v for _, v in streamed] == pytest.approx(lp.token_logprobs, abs=1e-4)
    offsets = [o for c in chunks if c.choices[0].logprobs for o in c.choices[0].logprobs.text_offset]
    assert offsets == lp.text_offset
    # n sampled choices: each streams its own entries (chunks interleave by index).
    n_kw = {**kw, "temperature": 1.0, "seed": 3, "n": 2, "logprobs": 1}
    whole = client.completions.create(**n_kw)
    by_index: dict[int, list] = {0: [], 1: []}
    for c in client.completions.create(stream=True, **n_kw):
        for choice in c.choices:
            by_index[choice.index] += choice.logprobs.tokens if choice.logprobs else []
    assert [by_index[c.index] for c in whole.choices] == [c.logprobs.tokens for c in whole.choices]
    assert [len(c.logprobs.top_logprobs[0]) in (1, 2) for c in whole.choices] == [True, True]

    # Chat: the chosen token and top_logprobs alternatives per token, whole and streamed.
    chat_kw = dict(model=served_app.model_id, messages=CHAT, max_tokens=steps, temperature=0, logprobs=True,
                   top_logprobs=2, extra_body={"ignore_eos": True})
    whole = client.chat.completions.create(**chat_kw)
    content = whole.choices[0].logprobs.content
    assert len(content) == whole.usage.completion_tokens == steps
    for e in content:
        assert len(e.top_logprobs) == 2 and e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob
        assert e.logprob == pytest.approx(e.top_logprobs[0].logprob, abs=1e-6)  # greedy
        assert e.bytes == list(e.token.encode("utf-8", "replace"))
    parts = [e for c in client.chat.completions.create(stream=True, **chat_kw)
             if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [e.token for e in parts] == [e.token for e in content]
    assert [e.logprob for e in parts] == pytest.approx([e.logprob for e in content], abs=1e-4)
    # Without the field the reply has none.
    assert client.chat.completions.create(**{**chat_kw, "logprobs": None, "top_logprobs": None}).choices[0].logprobs is None


def test_penalties_bias_top_k_min_p_and_min_tokens_mean_what_vllm_means(served_app):
    """The sampling controls beyond temperature and top_p, on either engine, against a
    greedy loop over the checkpoint with transformers that applies them as vLLM defines
    them (the vLLM engine passes them to vLLM itself, so it checks the loop too)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(served_app.model_path)
    model = AutoModelForCausalLM.from_pretrained(served_app.model_path, dtype=torch.float32)
    prompt = tok.encode("The old lighthouse keeper said")
    steps = 12

    def greedy(presence=0.0, frequency=0.0, repetition=1.0, bias=None):
        ids = list(prompt)
        with torch.inference_mode():
            for _ in range(steps):
                logits = model(torch.tensor([ids])).logits[0, -1].float()
                for token, value in (bias or {}).items():
                    logits[token] += value
                out = torch.tensor(ids[len(prompt):], dtype=torch.long)
                counts = torch.bincount(out, minlength=logits.shape[0])
                seen = (counts > 0) | (torch.bincount(torch.tensor(prompt), minlength=logits.shape[0]) > 0)
                rp = torch.where(seen, torch.tensor(repetition), torch.tensor(1.0))
                logits = torch.where(logits > 0, logits / rp, logits * rp)
                logits = logits - frequency * counts - presence * (counts > 0).float()
                ids.append(int(logits.argmax()))
        return tok.decode(ids[len(prompt):])

    client = served_app.client()

    def complete(**kw):
        body = dict(model=served_app.model_id, prompt=prompt, max_tokens=steps, temperature=0)
        extra = {"ignore_eos": True, **kw.pop("extra", {})}
        return client.completions.create(**{**body, **kw}, extra_body=extra).choices[0]

    plain = greedy()
    assert complete().text == plain
    # A bias of +100 picks its token every time (the logits here span about -19 to 19).
    assert complete(logit_bias={"77": 100}).text == tok.decode([77] * steps)
    # vLLM's allowed_token_ids: only those may be picked. One allowed token is every token;
    # of two, greedy picks the likelier, as the loop does with the others ruled out.
    assert complete(extra={"allowed_token_ids": [77]}).text == tok.decode([77] * steps)
    two = greedy(bias={t: -1e9 for t in range(len(tok)) if t not in (77, 90)})
    assert complete(extra={"allowed_token_ids": [77, 90]}).text == two
    # With a bias of +30 the penalties end the repetition after a few tokens.
    biased = greedy(bias={77: 30.0})
    penalised = greedy(presence=2.0, frequency=2.0, repetition=1.3, bias={77: 30.0})
    assert biased == tok.decode([77] * steps) and penalised != biased
    assert complete(logit_bias={"77": 30}).text == biased
    r = complete(logit_bias={"77": 30}, presence_penalty=2.0, frequency_penalty=2.0, extra={"repetition_penalty": 1.3})
    assert r.text == penalised
    # top_k 1 and min_p 1 leave only the most likely token: greedy though sampled hot.
    hot = dict(temperature=1.5, seed=11)
    assert complete(**hot).text != plain
    assert complete(**hot, extra={"top_k": 1}).text == plain
    assert complete(**hot, extra={"min_p": 1.0}).text == plain
    # min_tokens holds back an end of sequence the bias makes certain.
    eos = {"logit_bias": {str(tok.eos_token_id): 100}, "extra": {"ignore_eos": False}}
    early = complete(**eos)
    assert early.finish_reason == "stop" and early.text == ""
    held = client.completions.create(
        model=served_app.model_id, prompt=prompt, max_tokens=steps, temperature=0,
        logit_bias={str(tok.eos_token_id): 100}, extra_body={"min_tokens": 4},
    )
    assert held.choices[0].finish_reason == "stop"
    assert held.usage.completion_tokens == 5 and held.choices[0].text
    # skip_special_tokens off (vLLM's parameter; a tool-call parser's format may need it):
    # a special token's text stays in the reply, where it is left out by default; the
    # token that ends the reply stays out either way.
    header = tok.convert_tokens_to_ids("<|start_header_id|>")
    assert complete(logit_bias={str(header): 100}).text == ""
    kept = complete(logit_bias={str(header): 100}, extra={"skip_special_tokens": False})
    assert kept.text == "<|start_header_id|>" * steps
    ended = complete(**{**eos, "extra": {"ignore_eos": False, "skip_special_tokens": False}})
    assert ended.finish_reason == "stop" and ended.text == ""
    # stop_token_ids: the reply ends at the first of them, counted but not in the text.
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             do_sample=False, max_new_tokens=steps, min_new_tokens=steps)
    generated = out[0, len(prompt):].tolist()
    at = next(i for i in range(1, steps) if generated[i] not in generated[:i])
    r = client.completions.create(model=served_app.model_id, prompt=prompt, max_tokens=steps, temperature=0,
                                  extra_body={"ignore_eos": True, "stop_token_ids": [generated[at]]})
    assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens == at + 1
    assert r.choices[0].text == tok.decode(generated[:at])


def test_structured_output_holds_the_reply_to_its_grammar(served_app):
    """response_format (json_schema, json_object) and vLLM's structured_outputs (regex,
    choice) on either engine: greedy, the reply equals a transformers loop that masks the
    logits with xgrammar as the engines compile the grammar (compact JSON); sampled, it
    still parses; a grammar that does not compile is a 400."""
    import json
    import re

    import torch
    import xgrammar as xgr
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(served_app.model_path)
    model = AutoModelForCausalLM.from_pretrained(served_app.model_path, dtype=torch.float32)
    vocab = model.config.vocab_size
    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab))
    schema = {
        "type": "object",
        "properties": {"color": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"}},
        "required": ["color", "ok"],
        "additionalProperties": False,
    }
    prompt = tok.encode("The old lighthouse keeper said")

    def oracle(grammar, steps=40):
        matcher, mask, ids = xgr.GrammarMatcher(grammar), xgr.allocate_token_bitmask(1, vocab), list(prompt)
        with torch.inference_mode():
            while not matcher.is_terminated() and len(ids) - len(prompt) < steps:
                logits = model(torch.tensor([ids])).logits[0, -1:].float()
                matcher.fill_next_token_bitmask(mask)
                xgr.apply_token_bitmask_inplace(logits, mask)
                ids.append(int(logits.argmax()))
                assert matcher.accept_token(ids[-1])
        return tok.decode(ids[len(prompt):], skip_special_tokens=True)

    client = served_app.client()
    base = dict(model=served_app.model_id, prompt=prompt, max_tokens=40, temperature=0)
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}
    expected = oracle(compiler.compile_json_schema(json.dumps(schema), any_whitespace=False, separators=(",", ":")))
    r = client.completions.create(**base, extra_body={"response_format": fmt}).choices[0]
    assert r.finish_reason == "stop" and r.text == expected
    value = json.loads(r.text)
    assert value["color"] in ("red", "green", "blue") and isinstance(value["ok"], bool)
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        **base, stream=True, extra_body={"response_format": fmt}) if c.choices)
    assert streamed == expected
    # Chat, sampled: each of three choices parses and obeys the schema.
    chat = client.chat.completions.create(model=served_app.model_id, messages=CHAT, max_tokens=40, temperature=1.0,
                                          seed=3, n=3, response_format=fmt)
    for choice in chat.choices:
        value = json.loads(choice.message.content)
        assert set(value) == {"color", "ok"} and value["color"] in ("red", "green", "blue"), choice.message.content
    # vLLM's structured_outputs: a regex, and a choice among strings that need escapes.
    pattern = "[0-9]{3}-[a-z]{2}"
    r = client.completions.create(**base, extra_body={"structured_outputs": {"regex": pattern}}).choices[0]
    assert re.fullmatch(pattern, r.text) and r.text == oracle(compiler.compile_regex(pattern))
    choices = ['say "yes"', "no\tway"]
    r = client.completions.create(**{**base, "temperature": 1.0, "seed": 1},
                                  extra_body={"structured_outputs": {"choice": choices}}).choices[0]
    assert r.text in choices and r.finish_reason == "stop"
    # Any JSON object: an object as far as the reply goes.
    r = client.completions.create(**base, extra_body={"response_format": {"type": "json_object"}}).choices[0]
    assert r.text.startswith("{")
    if r.finish_reason == "stop":
        assert isinstance(json.loads(r.text), dict)
    for spec in ({"regex": "("}, {"json": {"$ref": "#/nope"}}):
        bad = post(served_app, "/v1/completions", {**base, "structured_outputs": spec})
        err = assert_openai_error(bad, 400, "response_format")
        assert "grammar" in err["message"] or "compile" in err["message"]
        assert ".cc:" not in err["message"]  # xgrammar's source position left out


def test_function_calling_with_a_named_function_or_required(served_app):
    """tool_choice naming a function, or "required": the reply is a tool call whose
    arguments fit the function's schema, whole or streamed; "auto" is a 400 that says
    why; a conversation that carries earlier calls and their results goes on."""
    import json

    client = served_app.client()
    weather = {"type": "function", "function": {
        "name": "get_weather", "description": "Weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]},
                                                        "unit": {"enum": ["C", "F"]}},
                       "required": ["city", "unit"], "additionalProperties": False}}}
    clock = {"type": "function", "function": {"name": "get_time"}}
    kw = dict(model=served_app.model_id, messages=CHAT, max_tokens=60, temperature=0, tools=[weather, clock])

    named = client.chat.completions.create(**kw, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    choice = named.choices[0]
    assert choice.finish_reason == "stop" and not choice.message.content
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    args = json.loads(call.function.arguments)
    assert args["city"] in ("Paris", "Oslo") and args["unit"] in ("C", "F") and set(args) == {"city", "unit"}
    # Streamed: the same call, assembled from the chunks' tool_calls.
    chunks = list(client.chat.completions.create(**kw, stream=True,
                                                 tool_choice={"type": "function", "function": {"name": "get_weather"}}))
    assembled: dict = {}  # as a client assembles the calls: by index, arguments appended
    for c in chunks:
        for tc in (c.choices[0].delta.tool_calls or []) if c.choices else []:
            entry = assembled.setdefault(tc.index, {"name": None, "arguments": ""})
            entry["name"] = tc.function.name or entry["name"]
            entry["arguments"] += tc.function.arguments or ""
    assert assembled == {0: {"name": "get_weather", "arguments": call.function.arguments}}
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["stop"]

    required = client.chat.completions.create(**kw, tool_choice="required", parallel_tool_calls=False)
    choice = required.choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
    made = choice.message.tool_calls[0].function
    assert made.name in ("get_weather", "get_time") and isinstance(json.loads(made.arguments), dict)

    r = post(served_app, "/v1/chat/completions", {**kw, "messages": CHAT})
    err = assert_openai_error(r, 400, "tool_choice")
    assert "auto" in err["message"]

    # The call and its result in the history: the template renders them, the reply comes.
    history = CHAT + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call.id, "type": "function", "function": {"name": "get_weather", "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"temp": 3}'},
    ]
    r = client.chat.completions.create(model=served_app.model_id, messages=history, max_tokens=5, tools=[weather],
                                       tool_choice="none")
    assert r.choices[0].message.content and not r.choices[0].message.tool_calls


def test_n_choices_are_what_n_seeded_single_requests_give(served_app):
    client = served_app.client()
    prompt = list(range(20, 40))
    kw = dict(model=served_app.model_id, prompt=prompt, max_tokens=12, temperature=1.0, extra_body={"ignore_eos": True})
    started = time.monotonic()
    r = client.completions.create(n=3, seed=77, **kw)
    # A liveness bound, not a speed check (this takes ~0.2 s): the choices' worker calls
    # leave one request side by side, and with the request's Serve id on each, Serve's
    # router mistook them for each other and left one waiting ~10 s per choice
    # (app/serve_context.py).
    assert time.monotonic() - started < 8, "an n=3 request stalled"
    assert [c.index for c in r.choices] == [0, 1, 2]
    singles = [client.completions.create(seed=77 + i, **kw).choices[0].text for i in range(3)]
    assert [c.text for c in r.choices] == singles
    assert len(set(singles)) > 1  # the choices sample independently
    assert all(c.finish_reason == "length" for c in r.choices)
    # The prompt counts once, every choice's tokens count.
    assert r.usage.prompt_tokens == len(prompt) and r.usage.completion_tokens == 3 * 12
    assert r.usage.total_tokens == len(prompt) + 3 * 12


def test_a_batch_of_prompts_gives_each_prompts_choices_in_order(served_app):
    """A completion with several prompts (texts or token ids), as OpenAI's legacy API and
    vLLM take them: n choices per prompt, prompt by prompt (index = prompt * n + choice),
    each what a request of that prompt alone gives; the usage counts each prompt once;
    streamed, each chunk carries its choice's index."""
    client = served_app.client()
    prompts = ["The quiet river", "A cache of keys and values is", "one two three four"]
    kw = dict(model=served_app.model_id, max_tokens=5, temperature=0, extra_body={"ignore_eos": True})
    alone = [client.completions.create(prompt=p, **kw) for p in prompts]
    batch = client.completions.create(prompt=prompts, n=2, **kw)
    assert [c.index for c in batch.choices] == list(range(6))
    assert [c.text for c in batch.choices] == [r.choices[0].text for r in alone for _ in range(2)]
    assert batch.usage.prompt_tokens == sum(r.usage.prompt_tokens for r in alone)
    assert batch.usage.completion_tokens == 6 * 5
    by_index: dict[int, str] = {}
    for chunk in client.completions.create(prompt=prompts, n=2, stream=True, **kw):
        for c in chunk.choices:
            by_index[c.index] = by_index.get(c.index, "") + c.text
    assert [by_index[i] for i in range(6)] == [c.text for c in batch.choices]
    # Token ids, each choice with its own prompt's ids.
    ids = [r.json()["tokens"] for r in (httpx.post(served_app.base_url + "/tokenize", json={"prompt": p}, timeout=30)
                                        for p in prompts[:2])]
    r = post(served_app, "/v1/completions", {"model": served_app.model_id, "prompt": ids, "max_tokens": 2,
                                             "temperature": 0, "return_token_ids": True})
    assert r.status_code == 200, r.text
    assert [c["prompt_token_ids"] for c in r.json()["choices"]] == ids
    # A batch whose choices would not fit the queue, an empty prompt in it, too many.
    places = TEST_MAX_QUEUE_DEPTH
    for prompt, n, param in ((["x"] * (places + 1), 1, "prompt"), (["x", ""], 1, "prompt"),
                             (["x"] * 129, 1, "prompt"), (prompts, places, "prompt")):
        r = post(served_app, "/v1/completions", {"model": served_app.model_id, "prompt": prompt, "n": n})
        assert_openai_error(r, 400, param)


def test_n_choices_stream_by_index_and_match_the_non_streamed_reply(served_app):
    client = served_app.client()
    kw = dict(model=served_app.model_id, messages=CHAT, max_tokens=10, temperature=1.0, seed=5, n=2)
    full = client.chat.completions.create(**kw)
    chunks = list(
        client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw)
    )
    texts, finishes, roles = {0: "", 1: ""}, {0: [], 1: []}, {0: 0, 1: 0}
    for c in chunks:
        for choice in c.choices:
            texts[choice.index] += choice.delta.content or ""
            roles[choice.index] += choice.delta.role == "assistant"
            if choice.finish_reason:
                finishes[choice.index].append(choice.finish_reason)
    assert texts == {c.index: c.message.content for c in full.choices}
    assert roles == {0: 1, 1: 1} and all(len(f) == 1 for f in finishes.values())
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens


def test_seed_makes_sampling_reproducible(served_app):
    client = served_app.client()
    a, _ = chat_text(client, served_app.model_id, max_tokens=16, temperature=1.0, seed=1234)
    b, _ = chat_text(client, served_app.model_id, max_tokens=16, temperature=1.0, seed=1234)
    others = {chat_text(client, served_app.model_id, max_tokens=16, temperature=1.0, seed=s)[0] for s in (1, 2, 3)}
    assert a == b
    assert len(others | {a}) > 1  # different seeds do sample differently
    # A negative seed is a seed too (vLLM itself reads -1 as none: vllm_engine.vllm_seed).
    neg = [chat_text(client, served_app.model_id, max_tokens=16, temperature=1.0, seed=-1)[0] for _ in range(2)]
    assert neg[0] == neg[1]


def test_stop_string_truncates_and_finishes_with_stop(served_app):
    client = served_app.client()
    full, _ = chat_text(client, served_app.model_id, max_tokens=24, temperature=0, extra_body={"ignore_eos": True})
    assert len(full) > 6
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    cut = full[: full.index(stop)]
    text, r = chat_text(client, served_app.model_id, max_tokens=24, temperature=0, stop=[stop], extra_body={"ignore_eos": True})
    assert text == cut and r.choices[0].finish_reason == "stop"
    streamed, _ = stream_chat_text(client, served_app.model_id, max_tokens=24, temperature=0, stop=[stop], extra_body={"ignore_eos": True})
    assert streamed == cut
    # vLLM's include_stop_str_in_output: the same reply, ending with its stop string.
    kept = {"ignore_eos": True, "include_stop_str_in_output": True}
    text, r = chat_text(client, served_app.model_id, max_tokens=24, temperature=0, stop=[stop], extra_body=kept)
    assert text == cut + stop and r.choices[0].finish_reason == "stop"
    streamed, _ = stream_chat_text(client, served_app.model_id, max_tokens=24, temperature=0, stop=[stop],
                                   extra_body=kept)
    assert streamed == cut + stop


def test_32_concurrent_requests_succeed_and_greedy_is_batch_invariant(served_app):
    async def main():
        client = openai.AsyncOpenAI(base_url=served_app.base_url + "/v1", api_key="x", max_retries=0)
        prompts = [f"Request number {i % 4} asks about the weather" for i in range(32)]
        results = await asyncio.gather(
            *(
                client.completions.create(
                    model=served_app.model_id, prompt=p, max_tokens=16, temperature=0, extra_body={"ignore_eos": True}
                )
                for p in prompts
            )
        )
        await client.close()
        return prompts, results

    prompts, results = asyncio.run(main())
    by_prompt: dict[str, set[str]] = {}
    for p, r in zip(prompts, results):
        assert r.usage.completion_tokens == 16
        by_prompt.setdefault(p, set()).add(r.choices[0].text)
    # 8 identical requests per prompt landed in different batches: one text each.
    assert all(len(texts) == 1 for texts in by_prompt.values()), by_prompt
    assert len(by_prompt) == 4


# ---- bad input -------------------------------------------------------------------------


def post(served_app, path, body=None, content=None, headers=None):
    return httpx.post(served_app.base_url + path, json=body, content=content, headers=headers, timeout=60)


def assert_openai_error(r, status, param=None):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["message"] and "Traceback" not in err["message"]
    if param is not None:
        assert err["param"] == param
    return err


def chat_body(served_app, **kw):
    return {"model": served_app.model_id, "messages": CHAT, "max_tokens": 4, **kw}


def test_malformed_json_is_400(served_app):
    r = post(served_app, "/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert_openai_error(r, 400)


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/v1/sessions"])
@pytest.mark.parametrize("depth", [101, 20_000])  # 20,000: past the parser's own limit, under the 64 KiB body limit
def test_json_nested_too_deep_is_400_and_the_server_goes_on(served_app, path, depth):
    """A few kilobytes of brackets made Python's json parser (past ~1000 levels) or a walk
    of the parsed body raise RecursionError: a 500. Past MAX_JSON_DEPTH it is a 400."""
    nested = b"[" * (depth - 1) + b"]" * (depth - 1)
    body = b'{"model": "%s", "prompt": "hi", "max_tokens": 2, "metadata": %s}' % (served_app.model_id.encode(), nested)
    r = post(served_app, path, content=body, headers={"content-type": "application/json"})
    err = assert_openai_error(r, 400)
    assert "deeper than 100 levels" in err["message"]
    ok = post(served_app, "/v1/chat/completions", chat_body(served_app))
    assert ok.status_code == 200, ok.text


@pytest.mark.parametrize(
    "path, raw, param",
    [
        ("/v1/chat/completions", rb'"messages": [{"role": "user", "content": "lone \ud800 high"}]', "messages.0.content"),
        ("/v1/chat/completions", rb'"messages": [{"role": "user", "content": "hi"}], "stop": ["\uDC00"]', "stop.0"),
        ("/v1/completions", rb'"prompt": "tail \udfff"', "prompt"),
    ],
)
def test_a_lone_surrogate_escape_is_400_naming_where(served_app, path, raw, param):
    """JSON can escape half of a UTF-16 pair alone; that is no Unicode text, and the
    tokenizer could not encode it (a 500 before). A whole pair is a character."""
    body = b'{"model": "%s", "max_tokens": 2, %s}' % (served_app.model_id.encode(), raw)
    r = post(served_app, path, content=body, headers={"content-type": "application/json"})
    err = assert_openai_error(r, 400, param)
    assert "surrogate" in err["message"]
    pair = body.replace(rb"\ud800", rb"\ud83d\ude00").replace(rb"\uDC00", rb"\ud83d\ude00").replace(rb"\udfff", rb"\ud83d\ude00")
    ok = post(served_app, path, content=pair, headers={"content-type": "application/json"})
    assert ok.status_code == 200, ok.text


@pytest.mark.parametrize(
    "override, param",
    [
        ({"messages": None}, "messages"),
        ({"messages": "hello"}, "messages"),
        ({"temperature": 2.5}, "temperature"),
        ({"temperature": "hot"}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_p": 1.2}, "top_p"),
        ({"max_tokens": -3}, "max_tokens"),
        ({"n": 0}, "n"),
        ({"n": 129}, "n"),
        ({"n": TEST_MAX_QUEUE_DEPTH + 1}, "n"),  # more choices than the router's queue holds
        ({"min_tokens": 5}, "min_tokens"),  # more than max_tokens (4)
        ({"logit_bias": {"99999": 1}}, "logit_bias"),  # not a token of this vocabulary
        ({"allowed_token_ids": [99999]}, "allowed_token_ids"),
        ({"allowed_token_ids": []}, "allowed_token_ids"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        # Strict JSON types, as OpenAI's: not coerced to 1 token, 4 tokens, a stream.
        ({"max_tokens": True}, "max_tokens"),
        ({"max_tokens": "4"}, "max_tokens"),
        ({"stream": "true"}, "stream"),
        ({"reasoning_effort": "extreme"}, "reasoning_effort"),
        # Served under engine.scheduling_policy priority only (the shared app's is fcfs).
        ({"priority": 3}, "priority"),
    ],
)
def test_invalid_fields_are_400_naming_the_field(served_app, override, param):
    body = chat_body(served_app, **override)
    body = {k: v for k, v in body.items() if v is not None}
    err = assert_openai_error(post(served_app, "/v1/chat/completions", body), 400, param)
    assert err["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    "path, override, param",
    [
        ("/v1/chat/completions", {"use_beam_search": True}, "use_beam_search"),
        ("/v1/chat/completions", {"functions": [{"name": "f"}]}, "functions"),
        ("/v1/completions", {"best_of": 2}, "best_of"),
        # vLLM's fields no engine here applies (app/schemas.py's table).
        ("/v1/completions", {"thinking_token_budget": 10}, "thinking_token_budget"),
    ],
)
def test_a_set_field_the_server_does_not_implement_is_400_naming_it(served_app, path, override, param):
    """Ignored, these were a 200 without what was asked for (logprobs null, free text)."""
    body = chat_body(served_app, **override) if "chat" in path else {
        "model": served_app.model_id, "prompt": "hi", "max_tokens": 2, **override}
    err = assert_openai_error(post(served_app, path, body), 400, param)
    assert "not supported" in err["message"]
    r = post(served_app, path, {**body, param: None})  # the same request without it
    assert r.status_code == 200, r.text


def test_bad_words_rule_a_word_out_of_the_reply(served_app):
    """vLLM's bad_words: with a word of one token that the greedy reply has, the reply is
    the same up to it and then takes another token. A word that makes no token, or an
    empty one, is a 400 naming bad_words (as vLLM refuses them)."""
    from deployments.compute.engines.bad_words import bad_words_token_ids

    base = {"model": served_app.model_id, "prompt": "The quiet river runs", "max_tokens": 12, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True}
    r = post(served_app, "/v1/completions", base)
    assert r.status_code == 200, r.text
    plain = r.json()["choices"][0]["token_ids"]

    def ids(text: str) -> list[int]:
        return post(served_app, "/tokenize", {"prompt": text, "add_special_tokens": False}).json()["tokens"]

    for k, token in enumerate(plain):
        word = post(served_app, "/detokenize", {"tokens": [token]}).json()["prompt"].strip()
        # Its sequences as vLLM makes them (" more" is banned only where "more" is one
        # token too).
        if word and [token] in bad_words_token_ids(ids, [word]):
            break
    else:
        pytest.fail(f"no token of the reply {plain} is a word of one token")
    r = post(served_app, "/v1/completions", {**base, "bad_words": [word]})
    assert r.status_code == 200, r.text
    banned = r.json()["choices"][0]["token_ids"]
    assert banned[:k] == plain[:k] and banned[k] != plain[k] and plain[k] not in banned, (word, plain, banned)
    for words in (["   "], [""], ["ok", ""]):
        err = assert_openai_error(post(served_app, "/v1/completions", {**base, "bad_words": words}), 400, "bad_words")
        assert "bad_words" in err["message"]


def test_an_integer_longer_than_python_reads_is_400(served_app):
    """json.loads refuses integers of more than 4300 digits with a ValueError: a 500."""
    body = b'{"model": "%s", "prompt": "hi", "max_tokens": %s}' % (served_app.model_id.encode(), b"9" * 5000)
    r = post(served_app, "/v1/completions", content=body, headers={"content-type": "application/json"})
    err = assert_openai_error(r, 400)
    assert "digits" in err["message"]


def test_missing_model_field_is_400(served_app):
    r = post(served_app, "/v1/completions", {"prompt": "hi"})
    assert_openai_error(r, 400, "model")


def test_unknown_model_is_404(served_app):
    r = post(served_app, "/v1/chat/completions", chat_body(served_app, model="gpt-17"))
    err = assert_openai_error(r, 404, "model")
    assert err["code"] == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        served_app.client().chat.completions.create(model="gpt-17", messages=CHAT)


def test_context_overflow_is_400_with_both_numbers(served_app):
    max_len = served_app.client().models.list().data[0].model_extra["max_model_len"]
    r = post(served_app, "/v1/completions", {"model": served_app.model_id, "prompt": [11] * 100, "max_tokens": max_len})
    err = assert_openai_error(r, 400, "max_tokens")
    assert str(max_len) in err["message"] and str(max_len + 100) in err["message"]
    # Also for a stream: the status is the error's, not 200.
    r = post(served_app, "/v1/completions", {"model": served_app.model_id, "prompt": [11] * 100, "max_tokens": max_len, "stream": True})
    assert_openai_error(r, 400)


def test_body_over_limit_is_413(served_app):
    big = "word " * 20000  # > 64 KiB limit of the test app
    r = post(served_app, "/v1/completions", {"model": served_app.model_id, "prompt": big})
    assert_openai_error(r, 413)


def test_unknown_route_is_openai_404(served_app):
    r = httpx.get(served_app.base_url + "/v1/nothing-here")
    assert_openai_error(r, 404)


def test_queue_full_gets_429_with_retry_after(served_app):
    n = TEST_MAX_QUEUE_DEPTH + 24

    async def one(client):
        return await client.post(
            "/v1/completions",
            json={"model": served_app.model_id, "prompt": [12] * 8, "max_tokens": 64, "extra": 1, "ignore_eos": True},
        )

    async def main():
        limits = httpx.Limits(max_connections=n)
        async with httpx.AsyncClient(base_url=served_app.base_url, timeout=120, limits=limits) as client:
            return await asyncio.gather(*(one(client) for _ in range(n)))

    responses = asyncio.run(main())
    codes = [r.status_code for r in responses]
    assert set(codes) <= {200, 429}, codes
    rejected = [r for r in responses if r.status_code == 429]
    assert rejected, "no request was rejected although more than the queue depth were sent"
    assert codes.count(200) >= TEST_MAX_QUEUE_DEPTH // 2
    for r in rejected:
        assert int(r.headers["retry-after"]) >= 1
        assert_openai_error(r, 429)


def test_dropped_stream_aborts_generation_and_service_stays_healthy(served_app):
    max_len = served_app.client().models.list().data[0].model_extra["max_model_len"]
    max_tokens = max_len - 8
    before = worker_stats().num_generated_tokens
    body = {"model": served_app.model_id, "prompt": [13] * 8, "max_tokens": max_tokens, "stream": True, "ignore_eos": True}
    with httpx.Client(base_url=served_app.base_url, timeout=60) as client:
        with client.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            got = [next(lines) for _ in range(3)]
            assert any(line.startswith("data: ") for line in got)
        # leaving the block closes the connection mid-stream
    stats = idle_worker_stats()
    assert stats.num_running == 0
    # Not aborted, the request would have generated max_tokens tokens before leaving.
    assert stats.num_generated_tokens - before < max_tokens // 2, (before, stats.num_generated_tokens)
    text, _ = chat_text(served_app.client(), served_app.model_id, max_tokens=4, temperature=0)
    assert text is not None
    assert httpx.get(served_app.base_url + "/ready").status_code == 200


def test_metrics_endpoint_exposes_request_latency_and_router_figures(served_app):
    # Streamed: time to first token is recorded for requests whose client sees a first token.
    for _ in served_app.client().completions.create(
        model=served_app.model_id, prompt="metrics", max_tokens=4, stream=True
    ):
        pass
    served_app.client().completions.create(model=served_app.model_id, prompt="metrics", max_tokens=2, logprobs=1)
    # A stream long enough to be paced (the tiny model makes a token every few ms; the
    # worker waits 15 ms between messages): its last wait ends with the engine's signal.
    for _ in served_app.client().completions.create(
        model=served_app.model_id, prompt="metrics", max_tokens=24, stream=True, extra_body={"ignore_eos": True}
    ):
        pass
    wanted = [
        "ray_llm_request_features_total",
        "ray_llm_prompt_tokens_total",
        "ray_llm_requests_total",
        "ray_llm_ttft_seconds_bucket",
        "ray_llm_tpot_seconds_bucket",
        "ray_llm_e2e_latency_seconds_bucket",
        "ray_llm_router_queue_depth",
        "ray_llm_router_batch_size_bucket",
        "ray_llm_worker_stream_waits_ended_early_total",
    ]
    deadline = time.monotonic() + 90  # exports every second; a loaded node answers slowly
    missing = wanted
    while time.monotonic() < deadline and missing:
        r = httpx.get(served_app.base_url + "/metrics", timeout=60)
        missing = [m for m in wanted if m not in r.text]
        time.sleep(1)
    assert not missing, (missing, r.status_code, len(r.text), r.text[:300])
    text = r.text
    assert 'status="200"' in text
    assert any('feature="logprobs"' in line for line in text.splitlines() if "llm_request_features" in line)
    # Usage by tenant: "default" without API keys.
    assert any('tenant="default"' in line for line in text.splitlines() if "llm_prompt_tokens_total" in line)
