"""OpenAI-compatible request and response schemas (the client-facing surface).

Requests are validated here; out-of-range values fail with a message that names the field
(turned into a 400 by the ingress). Unknown extra fields are accepted and ignored, as the
OpenAI API does for forward compatibility; a known field that would change the answer but
that no engine applies is named instead (``unsupported_field``), unless it holds its
neutral default.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from typing import Any, ClassVar, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, field_validator, model_validator

from app.errors import InvalidRequestError
from deployments.compute.engines.bad_words import MAX_BAD_WORD_SEQUENCES
from deployments.compute.engines.protocol import MAX_LOGPROBS

# OpenAI's limit on the entries of logit_bias.
MAX_LOGIT_BIAS_TOKENS = 300
# At most this many ids in allowed_token_ids (a request body holds them all anyway).
MAX_ALLOWED_TOKENS = 4096
# OpenAI's limit on the tools of a request, and the form of a function's name.
MAX_TOOLS = 128
# Prompts in one completion request (a batch of them, as OpenAI's legacy API and vLLM take).
MAX_PROMPTS = 128
_TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


class _Request(BaseModel):
    # Strict types, as OpenAI's API checks them: `"max_tokens": true` or `"5"`, `"n": 2.0`
    # or `"stream": "yes"` are 400s naming the field, not 1, 5, 2 and True. (A whole
    # number is still a valid float.)
    model_config = ConfigDict(extra="allow", strict=True)

    model: str = Field(min_length=1)
    max_tokens: Optional[int] = Field(default=None, ge=1)
    max_completion_tokens: Optional[int] = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    stop: list[str] = Field(default_factory=list)
    seed: Optional[int] = Field(default=None, ge=-(2**63), le=2**63 - 1)
    n: int = Field(default=1, ge=1, le=128)
    stream: bool = False
    stream_options: Optional["StreamOptions"] = None
    user: Optional[str] = Field(default=None, max_length=256)
    # vLLM-compatible extension used by benchmarks for fixed output lengths.
    ignore_eos: bool = False
    frequency_penalty: Optional[float] = Field(default=None, ge=-2.0, le=2.0)
    presence_penalty: Optional[float] = Field(default=None, ge=-2.0, le=2.0)
    # Token id (as a string, JSON keys are) -> bias added to its logit.
    logit_bias: Optional[dict[str, float]] = None
    # vLLM's extensions, with vLLM's meaning (protocol.SamplingParams).
    repetition_penalty: Optional[float] = Field(default=None, gt=0.0, le=2.0)
    top_k: Optional[int] = Field(default=None, ge=-1)  # -1 or 0: no limit
    min_p: Optional[float] = Field(default=None, ge=0.0, le=1.0)
    min_tokens: Optional[int] = Field(default=None, ge=0)
    stop_token_ids: Optional[list[int]] = Field(default=None, max_length=64)
    # False: special tokens' text stays in the reply (vLLM's default is True as well).
    skip_special_tokens: bool = True
    # vLLM's: the stop string that ended the reply (or stop token's text) is part of it.
    include_stop_str_in_output: bool = False
    # vLLM's: the prompt's ids and each choice's generated ids in the reply (in a stream,
    # each chunk's own), for a client that must not tokenise the text again.
    return_token_ids: bool = False
    # vLLM's: with logprobs, each token written "token_id:<id>" (text that is not valid
    # UTF-8 on its own stays identifiable).
    return_tokens_as_token_ids: Optional[bool] = None
    # vLLM's: only these tokens may be picked.
    allowed_token_ids: Optional[list[int]] = Field(default=None, min_length=1, max_length=MAX_ALLOWED_TOKENS)
    # vLLM's: words the reply may not contain (deployments/compute/engines/bad_words.py).
    bad_words: Optional[list[str]] = Field(default=None, max_length=MAX_BAD_WORD_SEQUENCES)
    # vLLM's prompt options: keep only this many of the prompt's tokens (-1: as many as
    # the context takes, less one for the reply), from the side given (default the
    # tokenizer's, as vLLM's); and special tokens (a BOS) added when tokenizing the
    # prompt (default: yes for a completion's text, no on top of a chat template's).
    truncate_prompt_tokens: Optional[int] = Field(default=None, ge=-1)
    truncation_side: Optional[Literal["left", "right"]] = None
    add_special_tokens: Optional[bool] = None
    # vLLM's: each prompt token's log-probability, rank and this many alternatives (the
    # reply's prompt_logprobs). Not in a stream, as vLLM's server refuses it there.
    prompt_logprobs: Optional[int] = Field(default=None, ge=0, le=MAX_LOGPROBS)
    # vLLM's: under engine.scheduling_policy priority, lower starts sooner (the ingress
    # refuses a value other than 0 under fcfs).
    priority: Optional[int] = Field(default=None, ge=-(2**63), le=2**63 - 1)
    # vLLM's: cached KV (every tier, both engines) is reused only by requests of the same
    # tenant that send the same salt (kv.block_hashes); a secret of the client's.
    cache_salt: Optional[str] = Field(default=None, min_length=1, max_length=1024)

    @field_validator("prompt_logprobs")
    @classmethod
    def _prompt_logprobs_whole(cls, value, info):
        if value is not None and info.data.get("stream"):
            raise ValueError("prompt_logprobs are not available when stream is true")
        return value

    def requested_prompt_logprobs(self) -> Optional[int]:
        return self.prompt_logprobs

    @field_validator("bad_words")
    @classmethod
    def _words(cls, value):
        if value and any(not w for w in value):
            raise ValueError("bad_words cannot contain an empty string")
        return value

    @field_validator("truncate_prompt_tokens")
    @classmethod
    def _keep_some(cls, value):
        if value == 0:
            raise ValueError("must be -1 (as many as the context takes) or at least 1")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _bias_by_token_id(cls, value):
        if not value:
            return value
        if len(value) > MAX_LOGIT_BIAS_TOKENS:
            raise ValueError(f"at most {MAX_LOGIT_BIAS_TOKENS} tokens may be biased")
        for key, bias in value.items():
            if not (key.isascii() and key.isdigit()):  # "²" is a digit to isdigit, not to int
                raise ValueError(f"keys must be token ids, got {key[:40]!r}")
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"biases must be in [-100, 100], got {bias} for token {key}")
        return value

    # Structured output: OpenAI's response_format ({"type": "text" | "json_object" |
    # "json_schema", "json_schema": {"name", "schema", "strict"}}) or vLLM's
    # structured_outputs ({"json" | "regex" | "choice" | "json_object": ...}).
    response_format: Optional[dict] = None
    structured_outputs: Optional[dict] = None

    @field_validator("response_format")
    @classmethod
    def _response_format(cls, value):
        if value is None:
            return value
        kind = value.get("type")
        if kind not in ("text", "json_object", "json_schema"):
            raise ValueError(f"type must be 'text', 'json_object' or 'json_schema', got {str(kind)[:40]!r}")
        if kind == "json_schema":
            spec = value.get("json_schema")
            if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
                raise ValueError("json_schema must be an object whose 'schema' is a JSON schema object")
        return value

    @field_validator("structured_outputs")
    @classmethod
    def _structured_outputs(cls, value, info):
        if value is None:
            return value
        if (info.data.get("response_format") or {}).get("type", "text") != "text":
            raise ValueError("set response_format or structured_outputs, not both")
        given = [k for k in ("json", "regex", "choice", "json_object") if value.get(k) not in (None, False)]
        unknown = [k for k in ("grammar", "structural_tag") if value.get(k) is not None]
        if unknown:
            raise ValueError(f"'{unknown[0]}' is not supported by this server; use json, regex, choice or json_object")
        if len(given) != 1:
            raise ValueError("exactly one of json, regex, choice or json_object must be set")
        kind = given[0]
        spec = value[kind]
        if kind == "json" and not isinstance(spec, (dict, str)):
            raise ValueError("json must be a JSON schema (an object, or its text)")
        if kind == "regex" and not (isinstance(spec, str) and spec):
            raise ValueError("regex must be a non-empty string")
        if kind == "choice" and not (
            isinstance(spec, list) and spec and all(isinstance(c, str) and c for c in spec)
        ):
            raise ValueError("choice must be a non-empty list of non-empty strings")
        return value

    def structured_output(self) -> Optional[tuple]:
        """SamplingParams.structured_output of this request (engines/structured.py)."""
        rf = self.response_format
        if rf is not None and rf["type"] == "json_object":
            return ("json_object", None)
        if rf is not None and rf["type"] == "json_schema":
            return ("json", schema_text(rf["json_schema"]["schema"]))
        so = self.structured_outputs
        if not so:
            return None
        if so.get("json") is not None:
            return ("json", schema_text(so["json"]))
        if so.get("regex") is not None:
            return ("regex", so["regex"])
        if so.get("choice") is not None:
            return ("choice", list(so["choice"]))
        return ("json_object", None)

    def sampling_extras(self) -> dict:
        """SamplingParams' fields beyond temperature, top_p and the like, as set here."""
        return {
            "top_k": max(self.top_k or 0, 0),
            "min_p": self.min_p or 0.0,
            "presence_penalty": self.presence_penalty or 0.0,
            "frequency_penalty": self.frequency_penalty or 0.0,
            "repetition_penalty": 1.0 if self.repetition_penalty is None else self.repetition_penalty,
            "logit_bias": {int(k): v for k, v in self.logit_bias.items()} if self.logit_bias else None,
            "min_tokens": self.min_tokens or 0,
            "stop_token_ids": list(self.stop_token_ids or ()),
            "logprobs": self.requested_logprobs(),
            "prompt_logprobs": self.requested_prompt_logprobs(),
            "structured_output": self.structured_output(),
            "skip_special_tokens": self.skip_special_tokens,
            "include_stop_str_in_output": self.include_stop_str_in_output,
            "allowed_token_ids": list(self.allowed_token_ids) if self.allowed_token_ids else None,
            "bad_words": list(self.bad_words) if self.bad_words else None,
        }

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_strings(cls, value):
        if value is None:
            return []
        stops = [value] if isinstance(value, str) else value
        if isinstance(stops, list) and any(not isinstance(s, str) or not s for s in stops):
            raise ValueError("stop sequences must be non-empty strings")
        return stops

    def requested_max_tokens(self) -> Optional[int]:
        # max_completion_tokens is the newer name; it wins when both are sent.
        return self.max_completion_tokens or self.max_tokens

    def include_usage_in_stream(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def unsupported_field(self) -> Optional[tuple[str, str]]:
        """The first field the client set to a value that would change what it gets back
        (sampling, output shape or format) but that this server does not implement, as
        ``(name, what is accepted)``; None when there is none. Such a field must not be
        ignored the way unknown fields are: the client would get an answer it did not ask
        for (logprobs null, free text instead of JSON, unpenalised tokens) with a 200.
        Neutral values (the defaults clients often send explicitly) pass."""
        return unsupported_in(self.model_extra, _UNSUPPORTED_ANY, self._UNSUPPORTED)

    _UNSUPPORTED: ClassVar[dict] = {}

    def requested_logprobs(self) -> Optional[int]:
        return None


def unsupported_in(extra: Optional[dict], *tables: dict) -> Optional[tuple[str, str]]:
    """The first of ``extra``'s fields (a request's unknown ones) that ``tables`` (name ->
    (is the value neutral, what is accepted)) list with a value that is not neutral, as
    ``(name, what is accepted)``; None when there is none."""
    extra = extra or {}
    for table in tables:
        for name, (neutral, accepted) in table.items():
            if name in extra and not neutral(extra[name]):
                return name, accepted
    return None


def invalid_body(e: ValidationError, *, field_only: bool = False) -> InvalidRequestError:
    """The 400 of a body its schema refused: the first error, naming its field by its
    path (``field_only``: the top-level field alone, where a union's errors would name
    the branch tried, "input.str")."""
    first = e.errors()[0]
    loc = first["loc"][:1] if field_only else first["loc"]
    param = ".".join(str(p) for p in loc) or None
    msg = first["msg"].removeprefix("Value error, ")
    where = f"'{param}'" if param else "request"
    return InvalidRequestError(f"Invalid {where}: {msg}", param=param)


def refuse_unsupported(req) -> None:
    """A 400 naming the first field ``req`` sets that would change the answer and is not
    served (its ``unsupported_field``)."""
    unsupported = req.unsupported_field()
    if unsupported is not None:
        name, accepted = unsupported
        raise InvalidRequestError(
            f"'{name}' is not supported by this server: leave it out or send {accepted}.", param=name
        )


def schema_text(schema) -> str:
    """A JSON schema as the compact JSON text the engines compile (a text stays as sent)."""
    return schema if isinstance(schema, str) else json.dumps(schema, separators=(",", ":"))


def _unset(value) -> bool:
    return value is None


def _empty(value) -> bool:
    return value is None or value == {} or value == []


def _false(value) -> bool:
    return value is None or value is False


def _one_of(*allowed):
    return lambda value: value is None or any(value == a and type(value) is type(a) for a in allowed)


# OpenAI's fields, and vLLM's extensions that clients of a vLLM server send, that are set
# per request and that no engine here applies yet: name -> (is the value neutral, what is
# accepted, for the message).
_UNSUPPORTED_ANY = {
    "use_beam_search": (_false, "false"),
    "length_penalty": (_one_of(1, 1.0), "1.0 (it weighs beam search's candidates)"),
    "guided_json": (_unset, "null"),
    "guided_regex": (_unset, "null"),
    "guided_choice": (_unset, "null"),
    "guided_grammar": (_unset, "null"),
    "spaces_between_special_tokens": (_one_of(True), "true"),
    "logprob_token_ids": (_unset, "null"),
    "thinking_token_budget": (_unset, "null"),
    "watermarking": (_unset, "null"),
    "repetition_detection": (_unset, "null"),
    "return_token_offsets": (_false, "false"),
    "return_prompt_text": (_false, "false"),
    "return_mm_kwargs": (_false, "false"),
    "routed_experts_prompt_start": (_unset, "null"),
    "prompt_embeds": (_unset, "null"),
    "media_io_kwargs": (_empty, "null"),
    "mm_processor_kwargs": (_empty, "null"),
    "mm_payload": (_unset, "null"),
    "kv_transfer_params": (_unset, "null"),
    "ec_transfer_params": (_unset, "null"),
    "vllm_xargs": (_empty, "null"),
}
# vLLM's request fields that change nothing a client gets back, accepted as unknown
# fields are: its own request id (ours is X-Request-Id), and how many tokens a streamed
# chunk batches (the worker's stream pacing decides that here).
IGNORED_VLLM_FIELDS = frozenset({"request_id", "stream_interval"})


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True)

    include_usage: bool = False
    # vLLM's: the usage so far in every chunk too (with include_usage).
    continuous_usage_stats: bool = False


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[dict], None] = None

    def tool_fields(self) -> dict:
        """An assistant's ``tool_calls`` (arguments as objects, as chat templates take
        them) or a tool message's ``tool_call_id`` and ``name``; {} for other messages."""
        extra = self.model_extra or {}
        if self.role == "assistant" and extra.get("tool_calls"):
            calls = extra["tool_calls"]
            if not isinstance(calls, list) or not all(
                isinstance(c, dict) and isinstance(c.get("function"), dict) for c in calls
            ):
                raise ValueError("tool_calls must be a list of {'id', 'type', 'function': {'name', 'arguments'}}")
            out = []
            for call in calls:
                fn = dict(call["function"])
                if isinstance(fn.get("arguments"), str):
                    try:
                        fn["arguments"] = json.loads(fn["arguments"])
                    except ValueError:
                        pass  # left as sent
                out.append({**call, "function": fn})
            return {"tool_calls": out}
        if self.role == "tool":
            return {k: extra[k] for k in ("tool_call_id", "name") if isinstance(extra.get(k), str)}
        return {}

    def text(self) -> str:
        """The content as the chat template gets it: text parts joined by newlines, as
        vLLM renders them for templates that take a string."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError("only text content parts are supported")
            parts.append(part["text"])
        return "\n".join(parts)


# vLLM's two prompt flags (chat requests and /tokenize) set against each other.
BOTH_PROMPT_FLAGS = (
    "add_generation_prompt and continue_final_message cannot both be true: set add_generation_prompt to false "
    "to continue the final message"
)

# What the ingress passes to the chat template itself (transformers' apply_chat_template
# arguments and the template variables it sets), which chat_template_kwargs cannot set.
_TEMPLATE_ARGUMENTS = frozenset({
    "messages", "conversation", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors",
    "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs", "bos_token", "eos_token",
})


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    # Server-side context: the stored history goes in front of `messages` (also settable
    # with the X-Session-Id header).
    session_id: Optional[str] = Field(default=None, max_length=128)
    # vLLM's: false leaves a reasoning model's reasoning out of the reply
    # (model.reasoning_parser).
    include_reasoning: bool = True
    # vLLM's: variables for the model's chat template ({"enable_thinking": false} for
    # Qwen3, say), which the reasoning parser reads too.
    chat_template_kwargs: Optional[dict[str, Any]] = Field(default=None, max_length=32)
    # vLLM's: false leaves the template's assistant header out; continue_final_message
    # renders the last message open-ended (no end of turn), so the reply continues it (an
    # assistant prefill: the reply holds the new text only, as vLLM's does).
    add_generation_prompt: bool = True
    continue_final_message: bool = False

    @field_validator("continue_final_message")
    @classmethod
    def _continue_or_generate(cls, value, info):
        if value and info.data.get("add_generation_prompt", True):
            raise ValueError(BOTH_PROMPT_FLAGS)
        return value

    def reply_role(self) -> str:
        """The reply message's role: the assistant's, or without a generation prompt the
        role of the message it continues (vLLM's)."""
        return "assistant" if self.add_generation_prompt else self.messages[-1].role

    # vLLM's chat echo: the reply starts with the last message's content when that
    # message has the reply's role (an assistant prefill, continue_final_message).
    echo: Optional[bool] = None

    def requested_prompt_logprobs(self) -> Optional[int]:
        # vLLM's chat echo asks for the prompt's logprobs too (top_logprobs alternatives,
        # default 0), so the reply carries them, and the prompt is prefilled whole.
        if self.prompt_logprobs is None and self.echo:
            return self.top_logprobs or 0
        return self.prompt_logprobs

    def echo_text(self) -> str:
        """What ``echo`` puts in front of each choice's content ("" for none)."""
        last = self.messages[-1] if self.messages else None
        if not self.echo or last is None or last.role != self.reply_role():
            return ""
        return last.text()

    # OpenAI's, as vLLM serves it: a variable of the chat template (gpt-oss's), which
    # also turns thinking on ("none": off) for templates that take enable_thinking
    # (Qwen3's, Gemma's) unless chat_template_kwargs sets that itself.
    reasoning_effort: Optional[Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]] = None

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_kwargs(cls, value):
        taken = sorted(set(value or ()) & _TEMPLATE_ARGUMENTS)
        if taken:
            raise ValueError(f"{', '.join(taken)} cannot be set here: the server passes it to the template itself")
        return value or None

    @model_validator(mode="after")
    def _effort_to_template(self):
        # Folded into the template's variables once, where the prompt and the reasoning
        # parser read them (vLLM's build_chat_params).
        if self.reasoning_effort is not None:
            kwargs = dict(self.chat_template_kwargs or {})
            kwargs.setdefault("enable_thinking", self.reasoning_effort != "none")
            kwargs["reasoning_effort"] = self.reasoning_effort
            self.chat_template_kwargs = kwargs
        return self

    # Each output token's log-probability in the reply, and that many alternatives.
    logprobs: Optional[bool] = False
    top_logprobs: Optional[int] = Field(default=None, ge=0, le=MAX_LOGPROBS)

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs_need_logprobs(cls, value, info):
        # A field check (logprobs is validated before it), so the 400 names the field.
        if value and not info.data.get("logprobs"):
            raise ValueError("top_logprobs needs logprobs set to true")
        return value

    def requested_logprobs(self) -> Optional[int]:
        return (self.top_logprobs or 0) if self.logprobs else None

    # Function calling. The reply is held to the arguments' JSON schema (a named
    # function) or to vLLM's schema of a list of calls ("required"), the way vLLM serves
    # those two without a model-specific parser; "auto" needs such a parser (the model
    # decides whether to call, in its own format): model.tool_call_parser, one of vLLM's
    # (app/reply_parser.py).
    tools: Optional[list[dict]] = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: Optional[Union[str, dict]] = None
    parallel_tool_calls: Optional[bool] = None

    @field_validator("tools")
    @classmethod
    def _tools(cls, value):
        names = set()
        for i, tool in enumerate(value or ()):
            fn = tool.get("function") if isinstance(tool, dict) else None
            if not isinstance(fn, dict) or tool.get("type") != "function":
                raise ValueError(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ...}}}}")
            name = fn.get("name")
            if not isinstance(name, str) or not _TOOL_NAME.fullmatch(name):
                raise ValueError(f"tools[{i}].function.name must be 1-64 letters, digits, '_' or '-'")
            if name in names:
                raise ValueError(f"two tools are named {name!r}")
            names.add(name)
            params = fn.get("parameters")
            if params is not None and not isinstance(params, dict):
                raise ValueError(f"tools[{i}].function.parameters must be a JSON schema object")
            if params and not isinstance(params.get("$defs", {}), dict):
                raise ValueError(f"tools[{i}].function.parameters.$defs must be an object")
        return value or None

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice(cls, value):
        if value is None or value in ("none", "auto", "required"):
            return value
        fn = value.get("function") if isinstance(value, dict) else None
        if isinstance(fn, dict) and value.get("type") == "function" and isinstance(fn.get("name"), str):
            return value
        raise ValueError(
            "tool_choice must be 'none', 'auto', 'required' or {'type': 'function', 'function': {'name': ...}}"
        )

    def tool_problem(self, auto_parser: bool = False) -> Optional[str]:
        """Why this request's tool_choice cannot be served (a 400 naming tool_choice);
        ``auto_parser``: the server has a tool-call parser for "auto"."""
        choice, tools = self.tool_choice, self.tools
        named = choice if isinstance(choice, dict) else None
        if not tools:
            return None if choice in (None, "none", "auto") else "tool_choice needs tools"
        if choice in (None, "auto"):
            # The reply is free text (a grammar of the request's own, if any) that the
            # parser reads, as vLLM serves "auto".
            return None if auto_parser else (
                "tool_choice 'auto' (the default with tools) needs a tool-call parser for this "
                "model, which this server is not configured with (model.tool_call_parser); "
                "send 'required', name a function ({'type': 'function', 'function': {'name': ...}}) "
                "or 'none'"
            )
        if named and named["function"]["name"] not in {t["function"]["name"] for t in tools}:
            return f"tool_choice names {named['function']['name']!r}, which is not among the tools"
        if choice == "required":
            # One schema holds every tool's parameters, so their $defs share one namespace.
            defs: dict = {}
            for tool in tools:
                for name, schema in ((tool["function"].get("parameters") or {}).get("$defs") or {}).items():
                    if defs.setdefault(name, schema) != schema:
                        return f"two tools define $defs {name!r} differently, which 'required' cannot hold at once"
        if choice != "none" and (self.structured_outputs or (self.response_format or {}).get("type", "text") != "text"):
            return "a tool_choice that calls a tool cannot be combined with response_format or structured_outputs"
        return None

    # How the reply is read by vLLM's parsers (app/reply_parser.py: tool calls under
    # "auto", reasoning), set by the ingress when one applies; None otherwise.
    _reply_parsing: Any = PrivateAttr(default=None)

    @property
    def reply_parsing(self) -> Any:
        return self._reply_parsing

    @reply_parsing.setter
    def reply_parsing(self, value: Any) -> None:
        self._reply_parsing = value

    # Messages that go in front of ``messages`` when no session is named: a Responses
    # request's instructions and the conversation of its previous response
    # (app/responses.py), in the form templates take, a reply with its generated ids.
    _history: Optional[list] = PrivateAttr(default=None)

    @property
    def history(self) -> Optional[list]:
        return self._history

    @history.setter
    def history(self, value: Optional[list]) -> None:
        self._history = value

    def auto_tool_choice(self) -> bool:
        """The model decides whether its reply calls a tool ("auto", the default with tools)."""
        return bool(self.tools) and self.tool_choice in (None, "auto")

    def tool_call_mode(self) -> Optional[str]:
        """"named" or "required" when the reply is a tool call, else None."""
        if not self.tools or self.tool_choice in (None, "none", "auto"):
            return None
        return "required" if self.tool_choice == "required" else "named"

    def called_function(self) -> Optional[str]:
        return self.tool_choice["function"]["name"] if self.tool_call_mode() == "named" else None

    def tool_schema(self) -> Optional[dict]:
        """The JSON schema the reply is held to when it is a tool call (vLLM's
        ``get_json_schema_from_tools``)."""
        mode = self.tool_call_mode()
        if mode is None:
            return None
        params = {t["function"]["name"]: t["function"].get("parameters") for t in self.tools}
        if mode == "named":
            return params[self.called_function()] or {"type": "object", "properties": {}}
        defs: dict = {}
        options = []
        for name, schema in params.items():
            if schema:
                schema = dict(schema)
                defs.update(schema.pop("$defs", None) or {})
            options.append({
                "properties": {
                    "name": {"type": "string", "enum": [name]},
                    "parameters": schema or {"type": "object", "properties": {}},
                },
                "required": ["name", "parameters"],
            })
        schema = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": options}}
        if self.parallel_tool_calls is False:
            schema["maxItems"] = 1
        if defs:
            schema["$defs"] = defs
        return schema

    def structured_output(self) -> Optional[tuple]:
        schema = self.tool_schema()
        return ("json", schema_text(schema)) if schema is not None else super().structured_output()

    _UNSUPPORTED: ClassVar[dict] = {
        "functions": (_empty, "[]"),
        "function_call": (_one_of("none", "auto"), '"none" or "auto" without functions'),
        "modalities": (_one_of(["text"]), '["text"]'),
        "audio": (_unset, "null"),
        "prediction": (_unset, "null"),
        # vLLM's chat extensions that change the prompt or the reply's shape.
        "chat_template": (_unset, "null (the model's own template)"),
        "documents": (_unset, "null"),
    }


def _is_batch(prompt) -> bool:
    return isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], (str, list))


class CompletionRequest(_Request):
    prompt: Union[str, list[int], list[str], list[list[int]]]
    # The prompt in front of each choice's text (and, with logprobs, its tokens in front
    # of the choice's logprobs, the first one's null); with max_tokens 0 the prompt alone:
    # how evaluation harnesses score a text's log-likelihood.
    echo: bool = False
    # 0 only with echo (OpenAI's and vLLM's: the prompt, nothing generated).
    max_tokens: Optional[int] = Field(default=None, ge=0)
    # Each output token's log-probability, and the top `logprobs` tokens at its position
    # (plus the chosen one, as OpenAI's legacy API returns them).
    logprobs: Optional[int] = Field(default=None, ge=0, le=MAX_LOGPROBS)

    def requested_logprobs(self) -> Optional[int]:
        return self.logprobs

    def echo_only(self) -> bool:
        """The reply is the prompt alone (echo with max_tokens 0). The engine still makes
        one token (it makes at least one, as vLLM's does); the reply leaves it out."""
        return self.echo and self.max_tokens == 0 and not self.max_completion_tokens

    def requested_max_tokens(self) -> Optional[int]:
        return 1 if self.echo_only() else super().requested_max_tokens()

    def requested_prompt_logprobs(self) -> Optional[int]:
        # An echo with logprobs lists the prompt's tokens with theirs (vLLM's).
        if self.prompt_logprobs is None and self.echo:
            return self.logprobs
        return self.prompt_logprobs

    _UNSUPPORTED: ClassVar[dict] = {
        "suffix": (_one_of(""), '""'),
        "best_of": (_one_of(1), "1"),
    }

    @field_validator("prompt")
    @classmethod
    def _prompts(cls, value):
        # One prompt (a text or token ids) or a batch of them (texts, or lists of ids); a
        # batch of one is that prompt.
        if isinstance(value, list) and not value:
            raise ValueError("prompt must not be empty")
        batch = _is_batch(value)
        prompts = value if batch else [value]
        if len(prompts) > MAX_PROMPTS:
            raise ValueError(f"at most {MAX_PROMPTS} prompts per request")
        for p in prompts:
            if not p:
                raise ValueError("a prompt must not be empty")
            if isinstance(p, list) and any(t < 0 for t in p):
                raise ValueError("token ids must be non-negative")
        return prompts[0] if batch and len(prompts) == 1 else value

    def prompt_list(self) -> list:
        """The request's prompts (texts or lists of token ids), in order: its choices are
        those of the first prompt, then the second's, ... (``n`` each)."""
        return self.prompt if _is_batch(self.prompt) else [self.prompt]

    def max_tokens_problem(self) -> Optional[str]:
        """Why max_tokens 0 is refused (without echo), else None; the ingress's 400 names
        max_tokens (a field check could not: echo comes after it)."""
        if self.max_tokens == 0 and not self.echo:
            return "max_tokens must be at least 1 (0 only with echo, which returns the prompt alone)"
        return None


class TokenizeRequest(BaseModel):
    """vLLM's ``POST /tokenize``: a ``prompt``, tokenized as /v1/completions tokenizes
    it, or chat ``messages`` (with ``tools`` and ``chat_template_kwargs``), rendered by
    the model's template as /v1/chat/completions renders them. The chat fields are
    checked as a chat request's are (the ingress validates them as one)."""

    model_config = ConfigDict(extra="allow", strict=True)

    model: Optional[str] = Field(default=None, min_length=1)
    prompt: Optional[str] = None
    messages: Optional[list] = Field(default=None, min_length=1)
    tools: Optional[list] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None
    # vLLM's defaults: the BOS a prompt is tokenized with, and none on top of what a
    # chat template writes.
    add_special_tokens: Optional[bool] = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    return_token_strs: Optional[bool] = False

    # The chat request's refusals of these (a session is refused by the ingress).
    _UNSUPPORTED: ClassVar[dict] = {
        "chat_template": ChatCompletionRequest._UNSUPPORTED["chat_template"],
        **{name: _UNSUPPORTED_ANY[name] for name in ("media_io_kwargs", "mm_processor_kwargs")},
    }

    def check_form(self) -> None:
        """A 400 naming the field for a body that is neither form, or mixes them."""
        if (self.prompt is None) == (self.messages is None):
            raise InvalidRequestError("Give 'prompt' (a text) or 'messages' (a chat), one of them.",
                                      param="messages" if self.prompt is None else "prompt")
        if self.prompt is not None:
            for name in ("tools", "chat_template_kwargs", "continue_final_message"):
                if getattr(self, name):
                    raise InvalidRequestError(f"'{name}' applies to 'messages', not to a 'prompt'.", param=name)
        if self.add_generation_prompt and self.continue_final_message:
            raise InvalidRequestError(f"{BOTH_PROMPT_FLAGS}.", param="continue_final_message")

    def unsupported_field(self) -> Optional[tuple[str, str]]:
        return unsupported_in(self.model_extra, self._UNSUPPORTED)

    def special_tokens(self) -> bool:
        return (self.prompt is not None) if self.add_special_tokens is None else self.add_special_tokens


class DetokenizeRequest(BaseModel):
    """vLLM's ``POST /detokenize``: token ids back to text."""

    model_config = ConfigDict(extra="allow", strict=True)

    model: Optional[str] = Field(default=None, min_length=1)
    tokens: list[int]

    @field_validator("tokens")
    @classmethod
    def _ids(cls, value):
        if any(t < 0 for t in value):
            raise ValueError("token ids must be non-negative")
        return value

    def unsupported_field(self) -> None:
        return None


_Request.model_rebuild()


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())
