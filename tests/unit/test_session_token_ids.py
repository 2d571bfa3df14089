"""Token-exact session history: a turn's prompt ids start with the previous turn's prompt
ids and generated ids exactly, so every KV block of the previous turn is reused.
Uses the real tiny tokenizer and chat template (built offline by tests/fixtures/models.py)."""

import random

import pytest

from app.sessions import TOKEN_IDS_KEY, exact_prompt_ids, reply_token_ids, session_json
from deployments.dataplane.types import SessionRecord


@pytest.fixture(scope="module")
def tokenizer(tiny_model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model_path))


def plain_ids(tokenizer, messages):
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)


def generated(tokenizer, rng, n):
    """Ids a random-weight model might produce: not the tokenizer's own split of their text."""
    normal = [i for i in range(tokenizer.vocab_size) if i not in set(tokenizer.all_special_ids)]
    return [rng.choice(normal) for _ in range(n)]


def test_prompt_grows_by_appending_over_turns(tokenizer):
    rng = random.Random(0)
    history: list[dict] = []
    previous = None
    for turn in range(4):
        history = history + [{"role": "user", "content": f"  question {turn}: tell me more about cats  "}]
        prompt = exact_prompt_ids(tokenizer, history)
        if turn == 0:
            assert prompt == plain_ids(tokenizer, history)
        if previous is not None:
            assert prompt[: len(previous)] == previous, f"turn {turn} does not extend turn {turn - 1}"
        # Generated text with surrounding blanks: the template trims message content, so
        # re-rendering the reply's text would not reproduce the ids the engine processed.
        ids = tokenizer.encode(" ok, ", add_special_tokens=False) + generated(tokenizer, rng, 20)
        text = tokenizer.decode(ids, skip_special_tokens=True)
        plain = plain_ids(tokenizer, history + [{"role": "assistant", "content": text}])
        assert plain[: len(prompt) + len(ids)] != prompt + ids
        history = history + [{"role": "assistant", "content": text, TOKEN_IDS_KEY: ids}]
        previous = prompt + ids
    # The last prompt carries every generated reply verbatim.
    assert exact_prompt_ids(tokenizer, history + [{"role": "user", "content": "bye"}])[: len(previous)] == previous


def test_without_stored_ids_it_is_the_plain_template(tokenizer):
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello there"},
        {"role": "user", "content": "again"},
    ]
    # Stored ids that equal the canonical split give the same prompt as no ids at all.
    canonical = tokenizer.encode("hello there", add_special_tokens=False)
    with_ids = [dict(m) for m in messages]
    with_ids[2][TOKEN_IDS_KEY] = canonical
    assert exact_prompt_ids(tokenizer, with_ids) == plain_ids(tokenizer, messages)


def test_a_template_that_drops_the_reply_falls_back_to_plain_text(tokenizer, monkeypatch):
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "yo", TOKEN_IDS_KEY: [5, 6, 7]},
    ]
    real = tokenizer.apply_chat_template

    def dropping(msgs, **kw):  # a template that ignores assistant messages
        return real([m for m in msgs if m["role"] != "assistant"], **kw)

    monkeypatch.setattr(tokenizer, "apply_chat_template", dropping)
    assert exact_prompt_ids(tokenizer, messages) == tokenizer.encode(
        dropping([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False),
        add_special_tokens=False,
    )


def test_reply_ids_match_the_text_the_client_got():
    special = {2, 3}
    assert reply_token_ids([10, 11, 2], "stop", special) == [10, 11]  # end-of-turn dropped
    assert reply_token_ids([10, 11, 12], "stop", special) is None  # a stop string cut the text
    assert reply_token_ids([10, 11, 12], "length", special) == [10, 11, 12]
    assert reply_token_ids([], "length", special) is None
    assert reply_token_ids(None, "length", special) is None


def test_the_api_never_shows_stored_ids():
    rec = SessionRecord(
        id="sess_" + "0" * 32,
        tenant="default",
        messages=[{"role": "user", "content": "a"}, {"role": "assistant", "content": "b", TOKEN_IDS_KEY: [1]}],
    )
    assert session_json(rec)["messages"] == [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
