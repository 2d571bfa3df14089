"""A model's chat template that refuses the messages (its ``raise_exception``: roles that
do not alternate, a system role it does not take) is the request's fault: a 400 naming
``messages`` with the template's own words, never a 500. The tiny model's tokenizer with
such a template (as Mistral's and Gemma's templates do), through the ingress's prompt
building, stateless and in a session (the reply ids spliced in)."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from app.errors import InvalidRequestError
from app.ingress import Ingress
from app.sessions import TOKEN_IDS_KEY

STRICT = (
    "{% for m in messages %}"
    "{% if m['role'] == 'system' and not loop.first %}"
    "{{ raise_exception('System role not supported past the first message') }}{% endif %}"
    "{% if loop.index0 > 0 and m['role'] == messages[loop.index0 - 1]['role'] %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}"
    "<|{{ m['role'] }}|>{{ m['content'] }}"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


@pytest.fixture
def ingress(tiny_model_path):
    ing = Ingress.__new__(Ingress)
    ing._tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_path))
    ing._tokenizer.chat_template = STRICT
    return ing


def test_messages_the_template_takes_are_rendered(ingress):
    ids = ingress._chat_prompt_ids([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"},
                                    {"role": "user", "content": "and?"}])
    assert ingress._tokenizer.decode(ids) == "<|user|>hi<|assistant|>yo<|user|>and?<|assistant|>"


@pytest.mark.parametrize(
    "messages, says",
    [
        ([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}], "roles must alternate"),
        ([{"role": "user", "content": "a"}, {"role": "system", "content": "b"}], "System role not supported"),
        # A session's history with a stored reply's ids, then a message out of turn.
        ([{"role": "user", "content": "a"}, {"role": "assistant", "content": "x", TOKEN_IDS_KEY: [5, 6]},
          {"role": "assistant", "content": "again"}], "roles must alternate"),
    ],
)
def test_messages_the_template_refuses_are_a_400_in_its_words(ingress, messages, says):
    with pytest.raises(InvalidRequestError) as e:
        ingress._chat_prompt_ids(messages)
    assert e.value.status_code == 400 and e.value.param == "messages"
    assert e.value.message.startswith("The model's chat template rejects these messages: ") and says in e.value.message


def test_a_model_without_a_chat_template_says_so_for_chat(ingress):
    ingress._tokenizer.chat_template = None
    with pytest.raises(InvalidRequestError) as e:
        ingress._chat_prompt_ids([{"role": "user", "content": "hi"}])
    assert e.value.param == "messages" and "no chat template" in e.value.message
    assert "/v1/completions" in e.value.message


def test_chat_template_kwargs_reach_the_template(ingress):
    """vLLM's chat_template_kwargs: variables of the template (Qwen3's enable_thinking)."""
    ingress._tokenizer.chat_template = (
        "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% if enable_thinking is defined and not enable_thinking %}"
        "<think></think>{% endif %}{% endif %}"
    )
    messages = [{"role": "user", "content": "hi"}]
    assert ingress._tokenizer.decode(ingress._chat_prompt_ids(messages)) == "<|user|>hi<|assistant|>"
    off = ingress._chat_prompt_ids(messages, template_kwargs={"enable_thinking": False})
    assert ingress._tokenizer.decode(off) == "<|user|>hi<|assistant|><think></think>"
    # A value the template cannot render is the request's: a 400 naming the field.
    ingress._tokenizer.chat_template = "{{ messages[0]['content'] + depth }}"
    with pytest.raises(InvalidRequestError) as e:
        ingress._chat_prompt_ids(messages, template_kwargs={"depth": {"a": 1}})
    assert e.value.status_code == 400 and e.value.param == "chat_template_kwargs"


def test_a_session_turn_renders_its_history_with_its_tools_and_template_variables(ingress):
    """A session turn's prompt (``_session_prompt``) is its stored history and new messages
    (a tool's answer), rendered with the turn's tools and template variables, the stored
    reply's ids spliced in; the pending turn keeps the tool message's call id."""
    from types import SimpleNamespace

    from app.schemas import ChatCompletionRequest

    ingress._tokenizer.chat_template = (
        "{% if tools %}<|tools|>{{ tools | map(attribute='function.name') | join(',') }}{% endif %}"
        "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}"
        "{% if m['tool_call_id'] is defined %}#{{ m['tool_call_id'] }}{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% if brief is defined %}(brief){% endif %}{% endif %}"
    )
    ingress._max_model_len = 512
    ingress._config = SimpleNamespace(limits=SimpleNamespace(default_max_tokens=16))
    sessions = SimpleNamespace(config=SimpleNamespace(overflow_policy="error"), tenant="default")
    reply_ids = ingress._tokenizer.encode("called", add_special_tokens=False)
    record = SimpleNamespace(
        version=1, num_tokens=20, writes_refused=False,
        messages=[{"role": "user", "content": "weather?"},
                  {"role": "assistant", "content": "called", TOKEN_IDS_KEY: reply_ids}],
    )
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    req = ChatCompletionRequest.model_validate({
        "model": "m", "messages": [{"role": "tool", "tool_call_id": "c1", "content": "sunny"}],
        "tools": [tool], "tool_choice": "none", "chat_template_kwargs": {"brief": True},
    })
    from app.ingress import template_messages

    ids, turn = ingress._session_prompt(req, sessions, "sess_" + "0" * 32, template_messages(req), record)
    assert ingress._tokenizer.decode(ids) == (
        "<|tools|>get_weather<|user|>weather?<|assistant|>called<|tool|>sunny#c1<|assistant|>(brief)")
    assert turn.new_messages == [{"role": "tool", "content": "sunny", "tool_call_id": "c1"}]
    assert turn.expected_version == 1
