"""OpenAI's Responses API (``POST /v1/responses``) over the chat path, with stored responses.

A Responses request becomes a chat request (``to_chat``): its ``input`` items become chat
messages, ``instructions`` a system message in front, ``tools``, ``tool_choice`` and
``text.format`` the chat API's forms. The ingress runs that request as any other chat
request (prompt, router, engine, vLLM's reply parsers) and turns the reply into the
Responses shape: whole (``output_from_message``, ``response_object``) or as stream events
(``StreamEvents``).

A response stored (``store``, the default) is a record of the data plane's session store
under its own id (``resp_`` and 32 hex digits): the conversation up to and including this
response's reply (with the reply's generated token ids, as a session keeps them), and the
response object itself. A request naming it as ``previous_response_id`` puts that
conversation in front of its own input. The reply's stored ids make the next prompt repeat
this one token for token, so its KV blocks are found again (L1, L2 or L3), as a session
turn's are; and unlike a session, any number of requests may continue one response (a
response is never changed after it is stored, so there is nothing to race on).

As OpenAI's API does, a previous response's ``instructions`` are not carried over: each
request's own go in front of the stored conversation.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any, ClassVar, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from app.errors import APIError, InvalidRequestError
from app.schemas import (
    MAX_TOOLS, _empty, _false, _one_of, _unset, invalid_body, now, refuse_unsupported, unsupported_in,
)

RESPONSE_ID_RE = re.compile(r"^resp_[0-9a-f]{32}$")
# The stored response object rides on the conversation's last message (the reply) under
# this key, never sent to a chat template (``history_messages`` drops it).
RESPONSE_KEY = "_response"
# The request's own input items (``input_items``), stored beside it on the reply, as
# ``GET /v1/responses/{id}/input_items`` lists them; a continuation's record keeps them
# on each earlier reply, with that reply's output items (not its whole response object).
INPUT_ITEMS_KEY, OUTPUT_ITEMS_KEY = "_input_items", "_output_items"
_STORED_ONLY = (RESPONSE_KEY, INPUT_ITEMS_KEY, OUTPUT_ITEMS_KEY)
# GET .../input_items: OpenAI's page sizes, and the includes it takes. None of those adds
# anything to the items listed here (text messages and function calls), so each is
# accepted as asked and changes nothing.
MAX_ITEMS_PAGE, DEFAULT_ITEMS_PAGE = 100, 20
_ITEM_INCLUDES = frozenset({
    "message.input_image.image_url", "computer_call_output.output.image_url", "file_search_call.results",
    "web_search_call.results", "web_search_call.action.sources", "code_interpreter_call.outputs",
    "reasoning.encrypted_content", "message.output_text.logprobs",
})
# OpenAI's limits on metadata.
MAX_METADATA_KEYS, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512

_INPUT_ROLES = ("user", "system", "developer", "assistant")
_TEXT_PARTS = ("input_text", "output_text", "text")


def new_response_id() -> str:
    return f"resp_{uuid.uuid4().hex}"


def check_response_id(response_id: str, param: Optional[str] = None) -> str:
    if not RESPONSE_ID_RE.match(response_id or ""):
        raise InvalidRequestError(
            f"Malformed response id {response_id[:80]!r}: expected 'resp_' and 32 hex digits.", param=param
        )
    return response_id


class ResponsesRequest(BaseModel):
    """The fields of ``POST /v1/responses`` this server serves (strict types, as the chat
    schema's); fields that would change the answer and are not served are refused by
    name (``unsupported_field``), others are ignored as OpenAI's unknown fields are."""

    model_config = ConfigDict(extra="allow", strict=True)

    model: str = Field(min_length=1)
    input: Union[str, list[dict]]
    instructions: Optional[str] = None
    previous_response_id: Optional[str] = Field(default=None, max_length=128)
    store: bool = True
    stream: bool = False
    max_output_tokens: Optional[int] = Field(default=None, ge=1)
    temperature: Optional[float] = Field(default=None, ge=0.0, le=2.0)
    top_p: Optional[float] = Field(default=None, gt=0.0, le=1.0)
    tools: Optional[list[dict]] = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: Optional[Union[str, dict]] = None
    parallel_tool_calls: Optional[bool] = None
    metadata: Optional[dict[str, str]] = None
    user: Optional[str] = Field(default=None, max_length=256)
    text: Optional[dict] = None
    # {"effort": ...}: the chat request's reasoning_effort (the template's variables, as
    # vLLM's Responses endpoint passes them). Summaries are not written here.
    reasoning: Optional[dict] = None

    @field_validator("reasoning")
    @classmethod
    def _reasoning(cls, value):
        if not value:
            return None
        for name in ("summary", "generate_summary"):
            if value.get(name) is not None:
                raise ValueError(f"{name} is not supported by this server: reasoning comes back as a "
                                 "reasoning item with its text, not summarised; leave it out or send null")
        unknown = sorted(set(value) - {"effort", "summary", "generate_summary"})
        if unknown:
            raise ValueError(f"unknown field {unknown[0][:40]!r}; reasoning takes effort")
        return value

    @field_validator("input")
    @classmethod
    def _input(cls, value):
        if isinstance(value, str) and not value:
            raise ValueError("input must not be empty")
        if isinstance(value, list) and not value:
            raise ValueError("input must hold at least one item")
        return value

    @field_validator("metadata")
    @classmethod
    def _metadata(cls, value):
        if value is None:
            return value
        if len(value) > MAX_METADATA_KEYS:
            raise ValueError(f"at most {MAX_METADATA_KEYS} keys")
        for k, v in value.items():
            if len(k) > MAX_METADATA_KEY or len(v) > MAX_METADATA_VALUE:
                raise ValueError(f"keys are at most {MAX_METADATA_KEY} characters and values {MAX_METADATA_VALUE}")
        return value

    _UNSUPPORTED: ClassVar[dict] = {
        "background": (_false, "false"),
        "conversation": (_unset, "null (continue a response with previous_response_id)"),
        "prompt": (_unset, "null"),
        # Encrypted reasoning is for carrying reasoning across stateless requests; there is
        # none here to encrypt (reasoning items come with their text), and input reasoning
        # items are dropped: asking for it changes nothing.
        "include": (lambda v: _empty(v) or v == ["reasoning.encrypted_content"],
                    '[] or ["reasoning.encrypted_content"]'),
        "truncation": (_one_of("disabled"), '"disabled"'),
        "top_logprobs": (_one_of(0), "0"),
        "max_tool_calls": (_unset, "null"),
        # vLLM's: the prompt's and the reply's messages in the response object, and messages
        # to put in front of the input.
        "enable_response_messages": (_false, "false"),
        "previous_input_messages": (_empty, "null (continue a response with previous_response_id)"),
    }

    def unsupported_field(self) -> Optional[tuple[str, str]]:
        return unsupported_in(self.model_extra, self._UNSUPPORTED)


def parse_request(body: dict) -> ResponsesRequest:
    """The request, or a 400 naming the first field that is wrong."""
    try:
        req = ResponsesRequest.model_validate(body)
    except ValidationError as e:
        raise invalid_body(e, field_only=True) from None
    refuse_unsupported(req)
    if req.previous_response_id is not None:
        check_response_id(req.previous_response_id, "previous_response_id")
    return req


# ---- request → chat ----------------------------------------------------------------------


def _item_text(content, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidRequestError(f"{where}.content must be a string or a list of content parts", param=where)
    parts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in _TEXT_PARTS or not isinstance(part.get("text"), str):
            raise InvalidRequestError(
                f"{where}.content[{j}]: only text parts ({', '.join(_TEXT_PARTS)}) are supported, got "
                f"{str(kind)[:40]!r}", param=f"{where}.content",
            )
        parts.append(part["text"])
    return "".join(parts)


def input_messages(req: ResponsesRequest) -> list[dict]:
    """The request's input items as chat messages in the form chat templates take (a
    call's arguments as an object, when they are JSON): messages, function calls (one
    assistant message per run of calls) and their outputs (tool messages). Reasoning
    items are dropped, as vLLM's server drops them; anything else is a 400 naming it."""
    if isinstance(req.input, str):
        return [{"role": "user", "content": req.input}]
    out: list[dict] = []
    for i, item in enumerate(req.input):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise InvalidRequestError(f"{where} must be an object", param=where)
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in _INPUT_ROLES:
                raise InvalidRequestError(f"{where}.role must be one of {', '.join(_INPUT_ROLES)}", param=f"{where}.role")
            out.append({"role": role, "content": _item_text(item.get("content"), where)})
        elif kind == "function_call":
            call_id, name, arguments = item.get("call_id"), item.get("name"), item.get("arguments")
            if not all(isinstance(v, str) and v for v in (call_id, name)) or not isinstance(arguments, str):
                raise InvalidRequestError(f"{where}: a function_call needs call_id, name and arguments (strings)",
                                          param=where)
            try:
                args: Any = json.loads(arguments)
            except ValueError:
                args = arguments
            call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}
            if out and out[-1]["role"] == "assistant" and out[-1].get("tool_calls") and not out[-1]["content"]:
                out[-1]["tool_calls"].append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            call_id, output = item.get("call_id"), item.get("output")
            if not isinstance(call_id, str) or not call_id:
                raise InvalidRequestError(f"{where}: a function_call_output needs its call_id", param=where)
            out.append({"role": "tool", "tool_call_id": call_id, "content": _item_text(output, where)})
        elif kind == "reasoning":
            continue
        else:
            raise InvalidRequestError(
                f"{where}: input items of type {str(kind)[:40]!r} are not supported; send messages, "
                "function_call and function_call_output items", param=f"{where}.type",
            )
    if not out:
        raise InvalidRequestError("input holds no message or function call", param="input")
    return out


def _chat_message(m: dict) -> dict:
    """A template-form message as the chat API takes it (a call's arguments as text)."""
    if not m.get("tool_calls"):
        return m
    calls = [
        {**c, "function": {"name": c["function"]["name"], "arguments": c["function"]["arguments"]
                           if isinstance(c["function"]["arguments"], str) else json.dumps(c["function"]["arguments"])}}
        for c in m["tool_calls"]
    ]
    return {**m, "tool_calls": calls}


def _chat_tools(tools: Optional[list[dict]]) -> Optional[list[dict]]:
    if not tools:
        return None
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else None
            raise InvalidRequestError(
                f"tools[{i}]: only function tools are supported, got {str(kind)[:40]!r}", param=f"tools[{i}].type"
            )
        fn = {k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}
        out.append({"type": "function", "function": fn})
    return out


def _chat_tool_choice(choice):
    if isinstance(choice, dict):
        if choice.get("type") == "function" and isinstance(choice.get("name"), str):
            return {"type": "function", "function": {"name": choice["name"]}}
        raise InvalidRequestError(
            "tool_choice must be 'none', 'auto', 'required' or {'type': 'function', 'name': ...}", param="tool_choice"
        )
    return choice


def _response_format(text: Optional[dict]) -> Optional[dict]:
    fmt = (text or {}).get("format")
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind in ("text", "json_object"):
        return {"type": kind}
    if kind == "json_schema":
        spec = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": spec}
    raise InvalidRequestError(
        f"text.format.type must be 'text', 'json_object' or 'json_schema', got {str(kind)[:40]!r}",
        param="text.format",
    )


# vLLM's extensions that its own Responses endpoint takes too (vllm/entrypoints/openai/
# responses/protocol.py), passed on to the chat request as sent (its schema checks them).
_PASSED_ON = (
    "logit_bias", "top_k", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "seed", "stop",
    "stop_token_ids", "ignore_eos", "skip_special_tokens", "include_reasoning", "structured_outputs",
    "chat_template_kwargs", "include_stop_str_in_output",
    # Served or refused by name there (app/schemas.py's table), as on the chat endpoint.
    "priority", "cache_salt", "watermarking", "media_io_kwargs", "mm_processor_kwargs", "mm_payload",
    "return_mm_kwargs", "kv_transfer_params", "ec_transfer_params", "vllm_xargs",
)
# vLLM's Responses fields that change nothing a client gets back here: OpenAI's cache key
# and service tier (hints), vLLM's request id.
IGNORED_VLLM_FIELDS = frozenset({"prompt_cache_key", "service_tier", "request_id"})


def to_chat(req: ResponsesRequest, new_messages: list[dict]) -> dict:
    """The chat request that serves ``req`` (its new messages only: the ingress puts the
    instructions and the previous response's conversation in front)."""
    body: dict = {
        "model": req.model,
        "messages": [_chat_message(m) for m in new_messages],
        "stream": req.stream,
    }
    if req.stream:
        body["stream_options"] = {"include_usage": True}
    for name, value in (
        ("max_tokens", req.max_output_tokens),
        ("temperature", req.temperature),
        ("top_p", req.top_p),
        ("tools", _chat_tools(req.tools)),
        ("tool_choice", _chat_tool_choice(req.tool_choice)),
        ("parallel_tool_calls", req.parallel_tool_calls),
        ("user", req.user),
        ("response_format", _response_format(req.text)),
        ("reasoning_effort", (req.reasoning or {}).get("effort")),
    ):
        if value is not None:
            body[name] = value
    extra = req.model_extra or {}
    body.update({name: extra[name] for name in _PASSED_ON if name in extra})
    return body


# The chat field an error names → the Responses field it came from.
_CHAT_PARAMS = {"max_tokens": "max_output_tokens", "response_format": "text.format", "messages": "input",
                "reasoning_effort": "reasoning.effort"}


def responses_param(param: Optional[str]) -> Optional[str]:
    """The Responses field behind a chat request's field named in an error."""
    if not param:
        return param
    head = param.split(".")[0].split("[")[0]
    return _CHAT_PARAMS.get(head, param)


def responses_error(err: APIError) -> APIError:
    """``err`` (of the chat request that serves a Responses request, or of the Responses
    request itself) naming the Responses fields: its param, the field in its message,
    and the Responses form of a named tool where a hint shows one."""
    param = responses_param(err.param)
    if param != err.param:
        err.message = err.message.replace(f"'{err.param}'", f"'{param}'")
        err.param = param
    err.message = err.message.replace("{'type': 'function', 'function': {'name': ...}}",
                                      "{'type': 'function', 'name': ...}")
    return err


def history_messages(stored: list[dict]) -> list[dict]:
    """A stored conversation's messages as the next prompt takes them (the response
    object and items each reply carries left out)."""
    return [{k: v for k, v in m.items() if k not in _STORED_ONLY} for m in stored]


def carried_history(stored: list[dict]) -> list[dict]:
    """A stored conversation as a continuation's record holds it in front of its own
    input: the reply that carries its response object keeps that response's output
    items alone (``conversation_items`` lists them)."""
    out = []
    for m in stored:
        if RESPONSE_KEY in m:
            response = m[RESPONSE_KEY]
            m = {k: v for k, v in m.items() if k != RESPONSE_KEY}
            m[OUTPUT_ITEMS_KEY] = response["output"]
        out.append(m)
    return out


def input_items(req: ResponsesRequest) -> list[dict]:
    """The request's input as the items ``GET /v1/responses/{id}/input_items`` lists,
    each with an id of its own: messages (a user, system or developer message with
    ``input_text``, an assistant one with ``output_text``), function calls and their
    outputs. Reasoning items are left out: the prompt did not take them. Called after
    ``input_messages`` accepted the input."""
    if isinstance(req.input, str):
        return [_input_message_item("user", req.input)]
    items = []
    for item in req.input:
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            text = _item_text(item.get("content"), "input")
            role = item["role"]
            items.append(message_item(text) if role == "assistant" else _input_message_item(role, text))
        elif kind == "function_call":
            items.append(call_item(item["call_id"], item["name"], item["arguments"]))
        elif kind == "function_call_output":
            items.append({"id": _item_id("fco"), "type": "function_call_output", "status": "completed",
                          "call_id": item["call_id"], "output": _item_text(item.get("output"), "input")})
    return items


def _input_message_item(role: str, text: str) -> dict:
    return {"id": _item_id("msg"), "type": "message", "status": "completed", "role": role,
            "content": [{"type": "input_text", "text": text}]}


def conversation_items(stored: list[dict]) -> list[dict]:
    """The items a stored response was generated from, oldest first: each response it
    continues, its input items then its output; then the response's own input items.
    (Instructions are not items, and are not carried over.)"""
    items: list[dict] = []
    for m in stored:
        items += m.get(INPUT_ITEMS_KEY, [])
        items += m.get(OUTPUT_ITEMS_KEY, [])  # an earlier response's (its own is not input)
    return items


def items_page(items: list[dict], query: list[tuple[str, str]]) -> dict:
    """A page of ``items`` (oldest first) for the query (its pairs) of ``GET
    /v1/responses/{id}/input_items``: ``order`` (``desc``, the default, newest first, or
    ``asc``), ``after`` or ``before`` (an item's id: the page starts after it, or ends
    before it, in that order), ``limit`` (1-100, default 20) and ``include`` (accepted,
    adds nothing here); a 400 naming the parameter that is wrong."""
    params: dict[str, list[str]] = {}
    for name, value in query:
        params.setdefault(name.removesuffix("[]") if name == "include[]" else name, []).append(value)
    for name, values in params.items():  # others are ignored, as unknown body fields are
        if name in ("order", "after", "before", "limit") and len(values) > 1:
            raise InvalidRequestError(f"'{name}' is given {len(values)} times; give it once.", param=name)
    order = params.get("order", ["desc"])[0]
    if order not in ("asc", "desc"):
        raise InvalidRequestError(f"Invalid 'order': {order[:40]!r}; expected 'asc' or 'desc'.", param="order")
    raw = params.get("limit", [str(DEFAULT_ITEMS_PAGE)])[0]
    if not (raw.isascii() and raw.isdigit() and len(raw) <= 3 and 1 <= int(raw) <= MAX_ITEMS_PAGE):
        raise InvalidRequestError(f"Invalid 'limit': {raw[:40]!r}; expected an integer from 1 to {MAX_ITEMS_PAGE}.",
                                  param="limit")
    limit = int(raw)
    for value in params.get("include", []):
        if value not in _ITEM_INCLUDES:
            raise InvalidRequestError(f"Invalid 'include': {value[:80]!r} is not an includable field.",
                                      param="include")
    ordered = items if order == "asc" else items[::-1]
    ids = [item["id"] for item in ordered]

    def cursor(name: str) -> Optional[int]:
        value = params.get(name, [None])[0]
        if value is None:
            return None
        if value not in ids:
            raise InvalidRequestError(f"Invalid '{name}': no input item {value[:80]!r} in this response.",
                                      param=name)
        return ids.index(value)

    after, before = cursor("after"), cursor("before")
    if after is not None and before is not None:
        raise InvalidRequestError("Give 'after' or 'before', not both.", param="before")
    if before is not None:
        start = max(0, before - limit)
        page, more = ordered[start:before], start > 0
    else:
        start = 0 if after is None else after + 1
        page, more = ordered[start : start + limit], start + limit < len(ordered)
    return {
        "object": "list",
        "data": page,
        "first_id": page[0]["id"] if page else None,
        "last_id": page[-1]["id"] if page else None,
        "has_more": more,
    }


def instruction_messages(req: ResponsesRequest) -> list[dict]:
    return [{"role": "system", "content": req.instructions}] if req.instructions else []


# ---- reply → response ----------------------------------------------------------------------


def _item_id(kind: str) -> str:
    return f"{kind}_{uuid.uuid4().hex}"


def message_item(text: str, status: str = "completed", item_id: Optional[str] = None) -> dict:
    return {
        "id": item_id or _item_id("msg"),
        "type": "message",
        "status": status,
        "role": "assistant",
        "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}],
    }


def reasoning_item(text: str, status: str = "completed", item_id: Optional[str] = None) -> dict:
    return {
        "id": item_id or _item_id("rs"),
        "type": "reasoning",
        "status": status,
        "summary": [],
        "content": [{"type": "reasoning_text", "text": text}],
    }


def call_item(call_id: str, name: str, arguments: str, status: str = "completed", item_id: Optional[str] = None) -> dict:
    return {
        "id": item_id or _item_id("fc"),
        "type": "function_call",
        "status": status,
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
    }


def output_from_message(message: dict, incomplete: bool) -> list[dict]:
    """The output items of a chat reply's message: its reasoning, its text, its calls
    (an empty message when it has none of them, as the stream sends)."""
    status = "incomplete" if incomplete else "completed"
    items = []
    if message.get("reasoning"):
        items.append(reasoning_item(message["reasoning"], status))
    calls = message.get("tool_calls") or []
    if message.get("content") or not (calls or items):
        items.append(message_item(message.get("content") or "", status))
    for call in calls:
        items.append(call_item(call["id"], call["function"]["name"], call["function"]["arguments"], status))
    return items


def usage(chat_usage: dict) -> dict:
    reasoning_tokens = (chat_usage.get("completion_tokens_details") or {}).get("reasoning_tokens", 0)
    return {
        "input_tokens": chat_usage["prompt_tokens"],
        "input_tokens_details": {"cached_tokens": chat_usage.get("prompt_tokens_details", {}).get("cached_tokens", 0)},
        "output_tokens": chat_usage["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
        "total_tokens": chat_usage["total_tokens"],
    }


def response_object(
    req: ResponsesRequest,
    response_id: str,
    created_at: int,
    *,
    status: str,
    output: list[dict],
    usage_: Optional[dict] = None,
    error: Optional[dict] = None,
) -> dict:
    """The response object of ``req`` (OpenAI's fields, with what this request set)."""
    fmt = (req.text or {}).get("format") or {"type": "text"}
    return {
        "id": response_id,
        "object": "response",
        "created_at": created_at,
        "completed_at": now() if status in ("completed", "incomplete") else None,
        "status": status,
        "error": error,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens,
        "model": req.model,
        "output": output,
        "parallel_tool_calls": req.parallel_tool_calls is not False,
        "previous_response_id": req.previous_response_id,
        "reasoning": {"effort": req.reasoning.get("effort"), "summary": None} if req.reasoning else None,
        "store": req.store,
        "temperature": 1.0 if req.temperature is None else req.temperature,
        "text": {"format": fmt},
        "tool_choice": req.tool_choice or "auto",
        "tools": req.tools or [],
        "top_p": 1.0 if req.top_p is None else req.top_p,
        "truncation": "disabled",
        "usage": usage_,
        "user": req.user,
        "metadata": req.metadata or {},
    }


def reply_message(output: list[dict], token_ids: Optional[list[int]], key: str) -> dict:
    """The reply as the stored conversation keeps it: its text and calls in the chat
    templates' form, and the generated ids (under ``key``) that the next prompt splices
    in (app/sessions.py)."""
    text = "".join(p["text"] for item in output if item["type"] == "message" for p in item["content"])
    calls = [
        {"id": item["call_id"], "type": "function",
         "function": {"name": item["name"], "arguments": _maybe_json(item["arguments"])}}
        for item in output if item["type"] == "function_call"
    ]
    message: dict = {"role": "assistant", "content": text}
    if calls:
        message["tool_calls"] = calls
    if token_ids is not None:
        message[key] = token_ids
    return message


def _maybe_json(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return text


class StreamEvents:
    """Chat stream chunks (one choice) → the Responses API's stream events: the response
    created and in progress; per output item (reasoning, the message, each function call)
    its ``output_item.added``, its deltas and its ``done`` events; then
    ``response.completed`` (``incomplete`` when the reply ran out of tokens), or
    ``error`` and ``response.failed`` when the request failed mid-way. Each event has
    its ``sequence_number``. ``output`` is the items as streamed, for the stored object."""

    def __init__(self, req: ResponsesRequest, response_id: str):
        self._req = req
        self.response_id = response_id
        self.created_at = now()
        self._seq = 0
        self.output: list[dict] = []
        self._open: Optional[tuple[str, int]] = None  # (kind, output index) of the open item
        self._calls: dict[int, int] = {}  # the chat delta's call index → output index
        self.finish_reason: Optional[str] = None

    def _event(self, kind: str, **fields) -> dict:
        event = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return event

    def _snapshot(self, status: str, **kw) -> dict:
        return response_object(self._req, self.response_id, self.created_at, status=status,
                               output=[_copy_item(i) for i in self.output], **kw)

    def start(self) -> list[dict]:
        snapshot = self._snapshot("in_progress")
        return [self._event("response.created", response=snapshot),
                self._event("response.in_progress", response=snapshot)]

    def _close(self, status: str = "completed") -> list[dict]:
        if self._open is None:
            return []
        kind, index = self._open
        self._open = None
        item = self.output[index]
        item["status"] = status
        events = []
        if kind == "message":
            part = item["content"][0]
            events += [
                self._event("response.output_text.done", item_id=item["id"], output_index=index, content_index=0,
                            text=part["text"], logprobs=[]),
                self._event("response.content_part.done", item_id=item["id"], output_index=index, content_index=0,
                            part=part),
            ]
        elif kind == "reasoning":
            part = item["content"][0]
            events.append(self._event("response.reasoning_text.done", item_id=item["id"], output_index=index,
                                      content_index=0, text=part["text"]))
        else:
            events.append(self._event("response.function_call_arguments.done", item_id=item["id"],
                                      output_index=index, name=item["name"], arguments=item["arguments"]))
        events.append(self._event("response.output_item.done", output_index=index, item=_copy_item(item)))
        return events

    def _open_item(self, kind: str, item: dict) -> list[dict]:
        events = self._close()
        self.output.append(item)
        index = len(self.output) - 1
        self._open = (kind, index)
        shown = _copy_item(item)
        if kind == "message":
            shown["content"] = []
        elif kind == "reasoning":
            shown["content"] = []
        events.append(self._event("response.output_item.added", output_index=index, item=shown))
        if kind == "message":
            events.append(self._event("response.content_part.added", item_id=item["id"], output_index=index,
                                      content_index=0, part={**item["content"][0], "text": ""}))
        elif kind == "reasoning":
            events.append(self._event("response.content_part.added", item_id=item["id"], output_index=index,
                                      content_index=0, part={"type": "reasoning_text", "text": ""}))
        return events

    def _text(self, kind: str, text: str) -> list[dict]:
        events = []
        if self._open is None or self._open[0] != kind:
            events += self._open_item(kind, message_item("", "in_progress") if kind == "message"
                                      else reasoning_item("", "in_progress"))
        index = self._open[1]
        item = self.output[index]
        item["content"][0]["text"] += text
        name = "response.output_text.delta" if kind == "message" else "response.reasoning_text.delta"
        extra = {"logprobs": []} if kind == "message" else {}
        events.append(self._event(name, item_id=item["id"], output_index=index, content_index=0, delta=text, **extra))
        return events

    def chunk(self, payload: dict) -> list[dict]:
        """The events of one chat chunk (the usage chunk and role-only chunks give none)."""
        events: list[dict] = []
        for choice in payload.get("choices") or ():
            delta = choice.get("delta") or {}
            if delta.get("reasoning"):
                events += self._text("reasoning", delta["reasoning"])
            if delta.get("content"):
                events += self._text("message", delta["content"])
            for call in delta.get("tool_calls") or ():
                index = self._calls.get(call.get("index", 0))
                fn = call.get("function") or {}
                if index is None:
                    item = call_item(call.get("id") or _item_id("call"), fn.get("name") or "", "", "in_progress")
                    events += self._open_item("function_call", item)
                    index = self._calls[call.get("index", 0)] = self._open[1]
                item = self.output[index]
                if fn.get("arguments"):
                    item["arguments"] += fn["arguments"]
                    events.append(self._event("response.function_call_arguments.delta", item_id=item["id"],
                                              output_index=index, delta=fn["arguments"]))
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]
        return events

    def end(self, status: str) -> list[dict]:
        """Close the open item; the items' status once the reply ended as ``status``. A
        reply with no text and no call is one empty message, as the whole response has."""
        events = [] if self.output else self._open_item("message", message_item("", "in_progress"))
        events += self._close("incomplete" if status == "incomplete" else "completed")
        for item in self.output:
            item["status"] = "incomplete" if status == "incomplete" else "completed"
        return events

    def final(self, stored: dict) -> list[dict]:
        kind = "response.incomplete" if stored["status"] == "incomplete" else "response.completed"
        return [self._event(kind, response=stored)]

    def failed(self, error: dict) -> list[dict]:
        events = self.end("incomplete")
        events.append(self._event("error", code=error.get("code"), message=error.get("message", ""),
                                  param=error.get("param")))
        events.append(self._event("response.failed", response=self._snapshot(
            "failed", error={"code": error.get("code") or error.get("type") or "server_error",
                             "message": error.get("message", "")})))
        return events


def _copy_item(item: dict) -> dict:
    out = dict(item)
    if "content" in out:
        out["content"] = [dict(p) for p in out["content"]]
    return out


def sse_event(event: dict) -> bytes:
    """One Responses stream event as server-sent events send it (its type named)."""
    return b"event: " + event["type"].encode() + b"\ndata: " + json.dumps(event, separators=(",", ":")).encode() + b"\n\n"

