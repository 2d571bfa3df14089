"""A request's ``priority`` (vLLM's field) at the ingress: refused with a 400 naming it
under ``engine.scheduling_policy: fcfs`` (the default), handed to the engine under
``priority``. The engines' orders are tested on the real engines
(test_torch_engine.py, test_vllm_engine.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from app.config import AppConfig
from app.errors import InvalidRequestError
from app.ingress import Ingress, request_features
from app.schemas import ChatCompletionRequest, CompletionRequest


def ingress(policy: str) -> Ingress:
    ing = Ingress.__new__(Ingress)
    ing._config = AppConfig.model_validate({"engine": {"scheduling_policy": policy}})
    ing._reply_parser = None
    ing._tokenizer = [None] * 100  # a vocabulary of 100 ids (len() is all it is asked)
    ing._max_model_len = 64
    return ing


def bodies(ing, **fields):
    model = ing._config.model.id
    return [
        (CompletionRequest, {"model": model, "prompt": "hi", **fields}),
        (ChatCompletionRequest, {"model": model, "messages": [{"role": "user", "content": "hi"}], **fields}),
    ]


def test_a_priority_other_than_0_is_a_400_naming_it_under_fcfs():
    ing = ingress("fcfs")
    for schema, body in bodies(ing, priority=3):
        with pytest.raises(InvalidRequestError) as e:
            ing._validate(schema, body)
        assert e.value.param == "priority" and "scheduling_policy" in e.value.message
    for neutral in (0, None):
        for schema, body in bodies(ing, priority=neutral):
            req = ing._validate(schema, body)
            assert ing._generation_request(req, [1, 2, 3]).priority == 0


@pytest.mark.parametrize("priority", [-(2**63), -5, 0, 7, 2**63 - 1])
def test_the_priority_policy_hands_the_requests_priority_to_the_engine(priority):
    ing = ingress("priority")
    for schema, body in bodies(ing, priority=priority):
        req = ing._validate(schema, body)
        assert ing._generation_request(req, [1, 2, 3]).priority == priority
        sampling = SimpleNamespace(logprobs=None, structured_output=None, top_k=None, min_p=None,
                                   presence_penalty=None, frequency_penalty=None, repetition_penalty=1.0,
                                   logit_bias=None, min_tokens=None, stop_token_ids=None, allowed_token_ids=None,
                                   prompt_logprobs=None, bad_words=None)
        assert ("priority" in request_features(req, sampling)) == (priority != 0)


@pytest.mark.parametrize("bad", [2**63, 1.5, "1", True])
def test_a_priority_that_is_not_a_64_bit_integer_is_a_400_naming_it(bad):
    ing = ingress("priority")
    for schema, body in bodies(ing, priority=bad):
        with pytest.raises(InvalidRequestError) as e:
            ing._validate(schema, body)
        assert e.value.param == "priority"
