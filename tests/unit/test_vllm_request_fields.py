"""Every field of vLLM's chat and completion requests is served here, refused with a 400
naming it (unless it holds its neutral value), or on a short list of fields that change
nothing a client gets back: none is ignored the way unknown fields are, which would
answer 200 without what the client asked for. Read from the installed vLLM's own request
models, so a field a vLLM upgrade adds fails this test until it is classified."""

from __future__ import annotations

import importlib.util

import pytest
from pydantic import ValidationError

from app.schemas import _UNSUPPORTED_ANY, IGNORED_VLLM_FIELDS, ChatCompletionRequest, CompletionRequest

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
COMPLETION = {"model": "m", "prompt": "hi"}
# Refused by the ingress rather than the schema: a completion that names a session.
REFUSED_BY_INGRESS = {"session_id"}

# A value of each refused field that is not its neutral one.
NOT_NEUTRAL = {
    "use_beam_search": True, "length_penalty": 0.5, "guided_json": {"type": "object"},
    "guided_regex": "a+", "guided_choice": ["a"], "guided_grammar": "root ::= 'a'",
    "spaces_between_special_tokens": False,
    "logprob_token_ids": [1], "thinking_token_budget": 10, "watermarking": {"key": 1},
    "repetition_detection": {"window": 3},
    "return_token_offsets": True,
    "return_prompt_text": True, "return_mm_kwargs": True, "routed_experts_prompt_start": 0,
    "prompt_embeds": "AAAA", "media_io_kwargs": {"image": {}}, "mm_processor_kwargs": {"a": 1},
    "mm_payload": {"a": 1}, "kv_transfer_params": {"a": 1}, "ec_transfer_params": {"a": 1},
    "vllm_xargs": {"a": 1},
}


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed")
@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_every_field_of_vllms_requests_is_served_refused_or_harmless(kind):
    if kind == "chat":
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest as Theirs

        ours = ChatCompletionRequest
    else:
        from vllm.entrypoints.openai.completion.protocol import CompletionRequest as Theirs

        ours = CompletionRequest
    classified = set(ours.model_fields) | set(_UNSUPPORTED_ANY) | set(ours._UNSUPPORTED) | IGNORED_VLLM_FIELDS
    unclassified = sorted(set(Theirs.model_fields) - classified - REFUSED_BY_INGRESS)
    assert not unclassified, f"vLLM's {kind} request fields neither served, refused nor harmless here: {unclassified}"


@pytest.mark.parametrize("name", sorted(_UNSUPPORTED_ANY))
def test_a_refused_field_is_named_unless_neutral(name):
    for base, schema in ((CHAT, ChatCompletionRequest), (COMPLETION, CompletionRequest)):
        req = schema.model_validate({**base, name: NOT_NEUTRAL[name]})
        assert req.unsupported_field()[0] == name
        assert schema.model_validate({**base, name: None}).unsupported_field() is None


def test_served_prompt_options_are_checked():
    req = CompletionRequest.model_validate({**COMPLETION, "truncate_prompt_tokens": -1, "truncation_side": "left",
                                            "add_special_tokens": False})
    assert (req.truncate_prompt_tokens, req.truncation_side, req.add_special_tokens) == (-1, "left", False)
    for bad in ({"truncate_prompt_tokens": 0}, {"truncate_prompt_tokens": -2}, {"truncation_side": "middle"},
                {"add_special_tokens": "yes"}, {"reasoning_effort": "extreme"}):
        schema = ChatCompletionRequest if "reasoning_effort" in bad else CompletionRequest
        with pytest.raises(ValidationError) as e:
            schema.model_validate({**(CHAT if schema is ChatCompletionRequest else COMPLETION), **bad})
        assert e.value.errors()[0]["loc"][0] == next(iter(bad))


def test_reasoning_effort_becomes_the_templates_variables_as_vllm_passes_them():
    """The effort, and thinking on unless it is "none", unless chat_template_kwargs sets
    enable_thinking itself (vLLM's build_chat_params)."""
    low = ChatCompletionRequest.model_validate({**CHAT, "reasoning_effort": "low"})
    assert low.chat_template_kwargs == {"enable_thinking": True, "reasoning_effort": "low"}
    none = ChatCompletionRequest.model_validate({**CHAT, "reasoning_effort": "none"})
    assert none.chat_template_kwargs == {"enable_thinking": False, "reasoning_effort": "none"}
    kept = ChatCompletionRequest.model_validate(
        {**CHAT, "reasoning_effort": "high", "chat_template_kwargs": {"enable_thinking": False, "x": 1}})
    assert kept.chat_template_kwargs == {"enable_thinking": False, "x": 1, "reasoning_effort": "high"}
    assert ChatCompletionRequest.model_validate(CHAT).chat_template_kwargs is None


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed")
def test_every_field_of_vllms_responses_request_is_served_refused_or_harmless():
    """The Responses request: served, refused by name, passed on to the chat request
    (which serves or refuses it), or harmless; ``session_id`` is refused by the ingress."""
    from vllm.entrypoints.openai.responses.protocol import ResponsesRequest as Theirs

    from app import responses

    ours = responses.ResponsesRequest
    classified = (set(ours.model_fields) | set(ours._UNSUPPORTED) | set(responses._PASSED_ON)
                  | responses.IGNORED_VLLM_FIELDS | REFUSED_BY_INGRESS)
    unclassified = sorted(set(Theirs.model_fields) - classified)
    assert not unclassified, f"vLLM's Responses request fields neither served, refused nor harmless here: {unclassified}"
    # What is passed on is the chat request's to serve or refuse.
    chat_known = set(ChatCompletionRequest.model_fields) | set(_UNSUPPORTED_ANY)
    assert set(responses._PASSED_ON) <= chat_known, set(responses._PASSED_ON) - chat_known


@pytest.mark.parametrize("name, value", [("vllm_xargs", {"a": 1}),
                                         ("enable_response_messages", True), ("previous_input_messages", [{}])])
def test_a_responses_request_refuses_what_the_chat_request_refuses(name, value):
    from app import responses
    from app.errors import InvalidRequestError
    from app.schemas import refuse_unsupported

    with pytest.raises(InvalidRequestError) as e:
        r = responses.parse_request({"model": "m", "input": "x", name: value})
        refuse_unsupported(ChatCompletionRequest.model_validate(responses.to_chat(r, responses.input_messages(r))))
    assert e.value.param == name
