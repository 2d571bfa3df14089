"""Config validation, request schemas and the mapping of failures to OpenAI errors."""

import asyncio
import pickle

import pytest
import yaml
from pydantic import ValidationError

from app.config import AppConfig
from app.errors import (
    APIError,
    GatewayTimeoutError,
    InvalidRequestError,
    RateLimitError,
    ServiceUnavailableError,
    to_api_error,
)
from app.metrics_export import merge_exposition
from app.schemas import ChatCompletionRequest, CompletionRequest
from deployments.compute.engines.protocol import EngineDeadError, RequestRejected


def test_serve_config_yaml_args_validate():
    doc = yaml.safe_load(open("serve_config.yaml"))
    cfg = AppConfig.model_validate(doc["applications"][0]["args"])
    assert cfg.model.id == "tiny-llama"
    assert cfg.router.max_batch_size == 8
    # KV blocks on their own cache server, sessions on the durable one.
    assert cfg.dataplane.kv_redis is not None
    assert cfg.dataplane.kv_redis.url != cfg.dataplane.redis.url


@pytest.mark.parametrize(
    "args, field, bound",
    [
        ({"router": {"max_batch_size": 0}}, "router.max_batch_size", "greater than or equal to 1"),
        ({"router": {"batch_wait_timeout_ms": -1}}, "router.batch_wait_timeout_ms", "greater than or equal to 0"),
        ({"engine": {"max_num_seqs": 5000}}, "engine.max_num_seqs", "less than or equal to 4096"),
        ({"engine": {"name": "tensorrt"}}, "engine.name", "'torch' or 'vllm'"),
        ({"engine": {"cpu_nice": 20}}, "engine.cpu_nice", "less than or equal to 19"),
        ({"compute": {"num_replicas": 0}}, "compute.num_replicas", "greater than or equal to 1"),
    ],
)
def test_bad_config_names_field_and_range(args, field, bound):
    with pytest.raises(ValidationError) as e:
        AppConfig.model_validate(args)
    text = str(e.value)
    assert field in text and bound in text


def test_unknown_config_key_is_named():
    with pytest.raises(ValidationError) as e:
        AppConfig.model_validate({"router": {"max_batch": 4}})
    assert "router.max_batch" in str(e.value)


def test_cross_field_check():
    with pytest.raises(ValidationError, match="max_batch_size"):
        AppConfig.model_validate({"router": {"max_batch_size": 64}, "compute": {"max_ongoing_requests": 8}})


@pytest.mark.parametrize(
    "field, value",
    [("temperature", 2.5), ("temperature", -0.1), ("top_p", 0), ("top_p", 1.5), ("max_tokens", -1), ("max_tokens", 0), ("n", 0), ("n", 129)],
)
def test_out_of_range_sampling_fields_rejected(field, value):
    with pytest.raises(ValidationError):
        ChatCompletionRequest.model_validate(
            {"model": "m", "messages": [{"role": "user", "content": "hi"}], field: value}
        )


def test_request_defaults_and_aliases():
    r = ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "max_completion_tokens": 7, "stop": "x"}
    )
    assert r.requested_max_tokens() == 7
    assert r.stop == ["x"]
    assert r.temperature == 1.0 and r.top_p == 1.0 and not r.include_usage_in_stream()


def test_completion_prompt_forms():
    assert CompletionRequest.model_validate({"model": "m", "prompt": [1, 2]}).prompt == [1, 2]
    assert CompletionRequest.model_validate({"model": "m", "prompt": ["hi"]}).prompt == "hi"
    assert CompletionRequest.model_validate({"model": "m", "prompt": [[1, 2]]}).prompt_list() == [[1, 2]]
    # A batch of prompts: texts or lists of ids, each prompt's choices in order.
    assert CompletionRequest.model_validate({"model": "m", "prompt": ["a", "b"]}).prompt_list() == ["a", "b"]
    assert CompletionRequest.model_validate({"model": "m", "prompt": [[1], [2, 3]]}).prompt_list() == [[1], [2, 3]]
    assert CompletionRequest.model_validate({"model": "m", "prompt": "a"}).prompt_list() == ["a"]
    for bad in ("", [], ["a", ""], [[1], []], [[1], [-2]], ["a"] * 129, ["a", [1]]):
        with pytest.raises(ValidationError):
            CompletionRequest.model_validate({"model": "m", "prompt": bad})


CHAT_REQ = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
COMPLETION_REQ = {"model": "m", "prompt": "hi"}


@pytest.mark.parametrize(
    "base, field, value",
    [
        (CHAT_REQ, "guided_json", {"type": "object"}),
        (CHAT_REQ, "use_beam_search", True),
        (COMPLETION_REQ, "best_of", 3),
        (COMPLETION_REQ, "suffix", "tail"),
        (CHAT_REQ, "documents", [{"text": "d"}]),
        (CHAT_REQ, "chat_template", "{{ messages }}"),
    ],
)
def test_a_field_that_would_change_the_answer_but_is_not_implemented_is_named(base, field, value):
    """Ignored like an unknown field, these gave a 200 the client did not ask for."""
    schema = ChatCompletionRequest if "messages" in base else CompletionRequest
    name, accepted = schema.model_validate({**base, field: value}).unsupported_field()
    assert name == field and accepted


@pytest.mark.parametrize(
    "base, extra",
    [
        (CHAT_REQ, {"logprobs": False, "top_logprobs": None, "frequency_penalty": 0, "presence_penalty": 0.0,
                    "logit_bias": {}, "tools": [], "tool_choice": "none",
                    "top_k": -1, "repetition_penalty": 1.0, "min_p": 0, "metadata": {"a": "b"}, "store": False,
                    "add_generation_prompt": True, "continue_final_message": False, "echo": False}),
        (COMPLETION_REQ, {"logprobs": None, "best_of": 1, "suffix": "", "logit_bias": None, "user": "u"}),
    ],
)
def test_neutral_values_and_unknown_fields_pass(base, extra):
    """The defaults that clients send explicitly, and fields that change nothing here."""
    schema = ChatCompletionRequest if "messages" in base else CompletionRequest
    assert schema.model_validate({**base, **extra}).unsupported_field() is None


@pytest.mark.parametrize(
    "field, value",
    [
        ("frequency_penalty", 2.5), ("presence_penalty", -3), ("repetition_penalty", 0), ("top_k", -2),
        ("min_p", 1.5), ("min_tokens", -1), ("logit_bias", {"x": 1}), ("logit_bias", {"-3": 1}), ("logit_bias", {"\u00b2": 1}),
        ("logit_bias", {"5": 101}), ("logit_bias", {str(i): 1 for i in range(301)}),
    ],
)
def test_out_of_range_extra_sampling_fields_are_named(field, value):
    with pytest.raises(ValidationError) as e:
        ChatCompletionRequest.model_validate({**CHAT_REQ, field: value})
    assert e.value.errors()[0]["loc"][0] == field


@pytest.mark.parametrize(
    "base, field, value",
    [
        (CHAT_REQ, "max_tokens", True), (CHAT_REQ, "max_tokens", "5"), (CHAT_REQ, "max_tokens", 5.0),
        (CHAT_REQ, "n", True), (CHAT_REQ, "seed", "7"), (CHAT_REQ, "temperature", "0.5"),
        (CHAT_REQ, "top_p", True), (CHAT_REQ, "stream", "true"), (CHAT_REQ, "stream", 1),
        (CHAT_REQ, "logprobs", 1), ({**CHAT_REQ, "logprobs": True}, "top_logprobs", "2"), (CHAT_REQ, "ignore_eos", "1"),
        (CHAT_REQ, "stream_options", {"include_usage": "yes"}),
        (CHAT_REQ, "messages", [{"role": "user", "content": 5}]),
        (COMPLETION_REQ, "logprobs", True), (COMPLETION_REQ, "prompt", [1.0, 2.0]),
    ],
)
def test_a_value_of_the_wrong_json_type_is_refused_not_coerced(base, field, value):
    """As OpenAI's API: `true` is not 1 token, nor "5" five, nor 1 a stream."""
    schema = ChatCompletionRequest if "messages" in base else CompletionRequest
    with pytest.raises(ValidationError) as e:
        schema.model_validate({**base, field: value})
    assert e.value.errors()[0]["loc"][0] == field


def test_a_whole_number_is_a_valid_float():
    req = ChatCompletionRequest.model_validate({**CHAT_REQ, "temperature": 1, "top_p": 1, "logit_bias": {"5": 2}})
    assert req.temperature == 1.0 and req.logit_bias == {"5": 2.0}


def test_sampling_extras_map_to_the_engines_params():
    plain = ChatCompletionRequest.model_validate(CHAT_REQ).sampling_extras()
    assert plain == {"top_k": 0, "min_p": 0.0, "presence_penalty": 0.0, "frequency_penalty": 0.0,
                     "repetition_penalty": 1.0, "logit_bias": None, "min_tokens": 0, "logprobs": None,
                     "prompt_logprobs": None, "structured_output": None, "stop_token_ids": [], "skip_special_tokens": True,
                     "include_stop_str_in_output": False, "allowed_token_ids": None, "bad_words": None}
    r = ChatCompletionRequest.model_validate({**CHAT_REQ, "top_k": -1, "logit_bias": {"7": -100, "12": 5.5},
                                              "repetition_penalty": 1.1, "logprobs": True, "top_logprobs": 3,
                                              "skip_special_tokens": False, "include_stop_str_in_output": True,
                                              "allowed_token_ids": [5, 9], "bad_words": ["river", "sea"]})
    extras = r.sampling_extras()
    assert extras["include_stop_str_in_output"] is True and extras["allowed_token_ids"] == [5, 9]
    assert extras["bad_words"] == ["river", "sea"]
    assert extras["top_k"] == 0 and extras["logit_bias"] == {7: -100.0, 12: 5.5}
    assert extras["skip_special_tokens"] is False
    assert extras["repetition_penalty"] == 1.1 and extras["logprobs"] == 3
    assert CompletionRequest.model_validate({**COMPLETION_REQ, "logprobs": 0}).sampling_extras()["logprobs"] == 0


def test_echo_and_prompt_logprobs_map_to_the_engines_params_as_vllm_maps_them():
    def extras(**fields):
        req = CompletionRequest.model_validate({**COMPLETION_REQ, **fields})
        return req.sampling_extras()["prompt_logprobs"], req.requested_max_tokens()

    assert extras(echo=True) == (None, None)  # no logprobs: the prompt's text only, KV reuse kept
    assert extras(echo=True, logprobs=2) == (2, None)  # the echoed tokens' logprobs
    assert extras(echo=True, logprobs=2, prompt_logprobs=5) == (5, None)
    assert extras(prompt_logprobs=0, max_tokens=3) == (0, 3)
    # max_tokens 0 with echo: the engine makes one token, which the reply leaves out.
    assert extras(echo=True, max_tokens=0) == (None, 1)
    assert CompletionRequest.model_validate({**COMPLETION_REQ, "echo": True, "max_tokens": 0}).echo_only()
    assert CompletionRequest.model_validate({**COMPLETION_REQ, "max_tokens": 0}).max_tokens_problem()
    assert CompletionRequest.model_validate({**COMPLETION_REQ, "echo": True, "max_tokens": 0}).max_tokens_problem() is None
    chat = ChatCompletionRequest.model_validate({**CHAT_REQ, "prompt_logprobs": 4})
    assert chat.sampling_extras()["prompt_logprobs"] == 4
    for bad in ({"prompt_logprobs": 21}, {"prompt_logprobs": -1}, {"prompt_logprobs": 1, "stream": True},
                {"max_tokens": 0}):
        with pytest.raises(ValidationError) as e:
            ChatCompletionRequest.model_validate({**CHAT_REQ, **bad})
        assert e.value.errors()[0]["loc"][0] == ("max_tokens" if "max_tokens" in bad else "prompt_logprobs")


@pytest.mark.parametrize(
    "fields, expected",
    [
        ({"response_format": {"type": "text"}}, None),
        ({"response_format": {"type": "json_object"}}, ("json_object", None)),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "integer"}}}},
         ("json", '{"type":"integer"}')),
        ({"structured_outputs": {"json": '{"type": "boolean"}'}}, ("json", '{"type": "boolean"}')),
        ({"structured_outputs": {"regex": "[ab]+"}}, ("regex", "[ab]+")),
        ({"structured_outputs": {"choice": ["yes", "no"]}}, ("choice", ["yes", "no"])),
        ({"structured_outputs": {"json_object": True}}, ("json_object", None)),
    ],
)
def test_structured_output_requests_map_to_one_constraint(fields, expected):
    assert ChatCompletionRequest.model_validate({**CHAT_REQ, **fields}).structured_output() == expected
    assert CompletionRequest.model_validate({**COMPLETION_REQ, **fields}).structured_output() == expected


@pytest.mark.parametrize(
    "fields, field",
    [
        ({"response_format": {"type": "xml"}}, "response_format"),
        ({"response_format": {"type": "json_schema"}}, "response_format"),
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": "x"}}}, "response_format"),
        ({"structured_outputs": {}}, "structured_outputs"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
        ({"structured_outputs": {"choice": []}}, "structured_outputs"),
        ({"structured_outputs": {"grammar": "root ::= x"}}, "structured_outputs"),
        ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "structured_outputs"),
        ({"top_logprobs": 3}, "top_logprobs"),  # without logprobs
    ],
)
def test_malformed_structured_output_is_named(fields, field):
    with pytest.raises(ValidationError) as e:
        ChatCompletionRequest.model_validate({**CHAT_REQ, **fields})
    loc = e.value.errors()[0]["loc"]
    assert (loc[0] if loc else None) == field


WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"$ref": "#/$defs/city"}}, "required": ["city"],
    "$defs": {"city": {"enum": ["Paris", "Oslo"]}}}}}
NOOP = {"type": "function", "function": {"name": "noop"}}


@pytest.mark.parametrize(
    "fields, problem",
    [
        ({"tools": [WEATHER]}, "needs a tool-call parser"),  # "auto", the default with tools
        ({"tools": [WEATHER], "tool_choice": "auto"}, "needs a tool-call parser"),
        ({"tool_choice": "required"}, "needs tools"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "not among"),
        ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "cannot be combined"),
        ({"tools": [WEATHER], "tool_choice": "none"}, None),
        ({"tools": [WEATHER, NOOP], "tool_choice": "required"}, None),
        ({"tools": [WEATHER, {"type": "function", "function": {"name": "g", "parameters": {
            "type": "object", "$defs": {"city": {"type": "string"}}}}}], "tool_choice": "required"}, "$defs 'city'"),
        ({"tool_choice": "auto"}, None),
    ],
)
def test_a_tool_choice_this_server_cannot_serve_is_explained(fields, problem):
    found = ChatCompletionRequest.model_validate({**CHAT_REQ, **fields}).tool_problem()
    assert (problem is None and found is None) or (problem in found)


def test_chat_template_kwargs_cannot_set_what_the_server_passes():
    ok = ChatCompletionRequest.model_validate({**CHAT_REQ, "chat_template_kwargs": {"enable_thinking": False}})
    assert ok.chat_template_kwargs == {"enable_thinking": False}
    for taken in ("tools", "add_generation_prompt", "messages", "chat_template"):
        with pytest.raises(ValidationError) as e:
            ChatCompletionRequest.model_validate({**CHAT_REQ, "chat_template_kwargs": {taken: 1}})
        assert e.value.errors()[0]["loc"][0] == "chat_template_kwargs" and taken in str(e.value)
    with pytest.raises(ValidationError):  # a JSON object, strictly
        ChatCompletionRequest.model_validate({**CHAT_REQ, "chat_template_kwargs": "enable_thinking=false"})


@pytest.mark.parametrize(
    "fields, problem",
    [
        ({"tools": [WEATHER]}, None),
        ({"tools": [WEATHER], "tool_choice": "auto"}, None),
        # "auto" leaves the reply free: a grammar of the request's own holds it, as in vLLM.
        ({"tools": [WEATHER], "tool_choice": "auto", "structured_outputs": {"regex": "a+"}}, None),
        ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "cannot be combined"),
        ({"tool_choice": "required"}, "needs tools"),
    ],
)
def test_with_a_tool_call_parser_auto_is_served(fields, problem):
    req = ChatCompletionRequest.model_validate({**CHAT_REQ, **fields})
    found = req.tool_problem(auto_parser=True)
    assert (problem is None and found is None) or (problem in found)
    assert req.auto_tool_choice() == (fields.get("tool_choice", "auto") == "auto" and "tools" in fields)
    assert req.tool_call_mode() is None or not req.auto_tool_choice()


@pytest.mark.parametrize(
    "tools",
    [[{"type": "function"}], [{"type": "function", "function": {"name": "has space"}}], [NOOP, NOOP],
     [{"type": "function", "function": {"name": "f", "parameters": "x"}}], [{"type": "retrieval"}],
     [{"type": "function", "function": {"name": "f", "parameters": {"$defs": ["x"]}}}]],
)
def test_malformed_tools_are_named(tools):
    with pytest.raises(ValidationError) as e:
        ChatCompletionRequest.model_validate({**CHAT_REQ, "tools": tools})
    assert e.value.errors()[0]["loc"][0] == "tools"


@pytest.mark.parametrize("parallel", [None, False])
def test_the_schema_of_a_required_tool_call_is_vllms(parallel):
    """The reply of tool_choice "required" is held to what vLLM holds it to."""
    utils = pytest.importorskip("vllm.tool_parsers.utils")
    protocol = pytest.importorskip("vllm.entrypoints.openai.chat_completion.protocol")
    import copy

    tools = [WEATHER, NOOP]
    r = ChatCompletionRequest.model_validate(
        {**CHAT_REQ, "tools": copy.deepcopy(tools), "tool_choice": "required", "parallel_tool_calls": parallel})
    theirs = utils.get_json_schema_from_tools(
        "required", [protocol.ChatCompletionToolsParam(**copy.deepcopy(t)) for t in tools], parallel)
    assert r.tool_schema() == theirs
    named = ChatCompletionRequest.model_validate(
        {**CHAT_REQ, "tools": tools, "tool_choice": {"type": "function", "function": {"name": "noop"}}})
    assert named.tool_schema() == {"type": "object", "properties": {}} and named.called_function() == "noop"
    assert r.structured_output()[0] == "json"


def test_api_error_survives_pickling_with_fields():
    err = RateLimitError("full", code="queue_full", headers={"Retry-After": "2"})
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is RateLimitError
    assert back.headers == {"Retry-After": "2"} and back.code == "queue_full"
    assert back.body() == {"error": {"message": "full", "type": "rate_limit_error", "param": None, "code": "queue_full"}}


class _Wrapped(Exception):
    """Mimics Ray's RayTaskError, which carries the original exception as `cause`."""

    def __init__(self, cause):
        super().__init__("wrapped")
        self.cause = cause


def test_error_mapping_unwraps_causes():
    assert isinstance(to_api_error(_Wrapped(RequestRejected("too long", param="max_tokens"))), InvalidRequestError)
    assert to_api_error(_Wrapped(RequestRejected("x", param="max_tokens"))).param == "max_tokens"
    assert isinstance(to_api_error(_Wrapped(EngineDeadError("dead"))), ServiceUnavailableError)
    assert isinstance(to_api_error(asyncio.TimeoutError()), GatewayTimeoutError)
    rl = RateLimitError("full")
    assert to_api_error(_Wrapped(rl)) is rl


def test_unexpected_error_hides_details():
    err = to_api_error(KeyError("secret internal detail"))
    assert type(err) is APIError and err.status_code == 500
    assert "secret" not in err.message


def test_serve_transport_cap_admits_the_largest_body_the_config_allows():
    # With the proxy on Serve's gRPC transport a whole response is one message (a /metrics
    # answer over the 4 MiB default was a bare 500); the cap is also what a replica accepts
    # in one message, so it stays above the largest body the config admits.
    from app.builder import GRPC_MAX_MESSAGE_BYTES, SERVE_PROCESS_ENV
    from app.config import LimitsConfig

    largest_body = LimitsConfig.model_fields["max_request_body_bytes"].metadata
    le = next(m.le for m in largest_body if hasattr(m, "le"))
    assert int(SERVE_PROCESS_ENV["RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH"]) == GRPC_MAX_MESSAGE_BYTES
    assert GRPC_MAX_MESSAGE_BYTES > le + 64 * 1024


def test_merge_exposition_groups_families_across_nodes():
    a = "# HELP x_total X.\n# TYPE x_total counter\nx_total{node=\"a\"} 1.0\n# HELP y Y.\n# TYPE y gauge\ny 2.5\n"
    b = "# HELP x_total X.\n# TYPE x_total counter\nx_total{node=\"b\"} 3.0\n"
    merged = merge_exposition([a, b])
    lines = merged.splitlines()
    assert lines.count("# TYPE x_total counter") == 1
    i = lines.index("# TYPE x_total counter")
    assert lines[i + 1 : i + 3] == ['x_total{node="a"} 1.0', 'x_total{node="b"} 3.0']
    assert "y 2.5" in lines


@pytest.mark.parametrize(
    "args, expected",
    [
        ({}, "ComputeWorker"),  # torch, apart by default
        ({"ingress": {"with_worker": True}}, "Server"),
        ({"engine": {"prefix_cache_bytes": 0}}, None),  # no L1
        ({"dataplane": {"kv_reuse": False}}, None),  # L1 is part of reuse
        ({"engine": {"name": "vllm"}}, None),  # vLLM's prefix cache cannot drop single blocks
    ],
)
def test_a_session_delete_reaches_the_l1_of_the_deployment_that_runs_torch_engines(args, expected):
    from app.builder import l1_worker_deployment

    assert l1_worker_deployment(AppConfig.model_validate(args)) == expected


def test_a_prefill_is_continued_only_without_the_generation_prompt_and_keeps_its_role():
    """vLLM's continue_final_message and add_generation_prompt: both true is a 400 naming
    the field; without the generation prompt the reply takes the last message's role."""
    from app.schemas import invalid_body

    with pytest.raises(ValidationError) as e:
        ChatCompletionRequest.model_validate({**CHAT_REQ, "continue_final_message": True})
    assert invalid_body(e.value).param == "continue_final_message"
    prefill = {**CHAT_REQ, "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "He"}]}
    req = ChatCompletionRequest.model_validate({**prefill, "add_generation_prompt": False, "continue_final_message": True})
    assert req.reply_role() == "assistant" and req.unsupported_field() is None
    assert ChatCompletionRequest.model_validate({**CHAT_REQ, "add_generation_prompt": False}).reply_role() == "user"
    assert ChatCompletionRequest.model_validate(CHAT_REQ).reply_role() == "assistant"


def test_text_parts_are_joined_by_newlines_and_chat_echo_takes_the_last_message_of_the_replys_role():
    """As vLLM renders a message of text parts for a template that takes a string; its
    chat echo repeats the last message when the reply continues it."""
    parts = {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}
    req = ChatCompletionRequest.model_validate({**CHAT_REQ, "messages": [parts], "echo": True})
    assert req.messages[0].text() == "a\nb"
    assert req.echo_text() == ""  # the reply is the assistant's, after a user's message
    prefill = {"role": "assistant", "content": "So far"}
    cont = {**CHAT_REQ, "messages": [parts, prefill], "add_generation_prompt": False, "continue_final_message": True}
    assert ChatCompletionRequest.model_validate({**cont, "echo": True}).echo_text() == "So far"
    assert ChatCompletionRequest.model_validate(cont).echo_text() == ""


def test_a_workers_reads_kept_for_their_promotion_take_at_most_a_quarter_of_its_kv_arena():
    """``dataplane.promote_hold_bytes`` as a torch worker's connector gets it: the reads'
    buffers are KV-arena buffers, so a quarter of the arena at most; 0 keeps none (the
    data plane reads Redis again); a negative value is refused."""
    from deployments.compute.deployment import promote_hold_bytes
    from deployments.dataplane.connector import PROMOTE_HOLD_BYTES

    def hold(dataplane: dict, arena: int) -> int:
        return promote_hold_bytes(AppConfig.model_validate({"dataplane": dataplane, "engine": {"kv_arena_bytes": arena}}))

    assert AppConfig().dataplane.promote_hold_bytes == PROMOTE_HOLD_BYTES == 64 << 20
    assert hold({}, 256 << 20) == 64 << 20
    assert hold({}, 128 << 20) == 32 << 20
    assert hold({"promote_hold_bytes": 8 << 20}, 256 << 20) == 8 << 20
    assert hold({}, 0) == 64 << 20  # no arena: the reads' buffers are malloc's
    assert hold({"promote_hold_bytes": 0}, 256 << 20) == 0
    with pytest.raises(ValidationError):
        AppConfig.model_validate({"dataplane": {"promote_hold_bytes": -1}})
