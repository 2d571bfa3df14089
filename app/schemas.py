"""OpenAI-compatible request and response schemas (the client-facing surface).

Requests are validated here; out-of-range values fail with a message that names the field
(turned into a 400 by the ingress). Unknown extra fields are accepted and ignored, as the
OpenAI API does for forward compatibility.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import ClassVar, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from deployments.compute.engines.protocol import MAX_LOGPROBS

# OpenAI's limit on the entries of logit_bias.
MAX_LOGIT_BIAS_TOKENS = 300


class _Request(BaseModel):
    model_config = ConfigDict(extra="allow")

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

    @field_validator("logit_bias")
    @classmethod
    def _bias_by_token_id(cls, value):
        if not value:
            return value
        if len(value) > MAX_LOGIT_BIAS_TOKENS:
            raise ValueError(f"at most {MAX_LOGIT_BIAS_TOKENS} tokens may be biased")
        for key, bias in value.items():
            if not key.isdigit():
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
    def _structured_outputs(cls, value):
        if value is None:
            return value
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

    @model_validator(mode="after")
    def _one_structure(self):
        if self.structured_outputs and self.response_format and self.response_format.get("type") != "text":
            raise ValueError("set response_format or structured_outputs, not both")
        return self

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
            "structured_output": self.structured_output(),
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
        extra = self.model_extra or {}
        for table in (_UNSUPPORTED_ANY, self._UNSUPPORTED):
            for name, (neutral, accepted) in table.items():
                if name in extra and not neutral(extra[name]):
                    return name, accepted
        return None

    _UNSUPPORTED: ClassVar[dict] = {}

    def requested_logprobs(self) -> Optional[int]:
        return None


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
    "prompt_logprobs": (_unset, "null"),
    "guided_json": (_unset, "null"),
    "guided_regex": (_unset, "null"),
    "guided_choice": (_unset, "null"),
    "guided_grammar": (_unset, "null"),
}


class StreamOptions(BaseModel):
    include_usage: bool = False


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[dict], None] = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError("only text content parts are supported")
            parts.append(part["text"])
        return "".join(parts)


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    # Server-side context: the stored history goes in front of `messages` (also settable
    # with the X-Session-Id header).
    session_id: Optional[str] = Field(default=None, max_length=128)
    # Each output token's log-probability in the reply, and that many alternatives.
    logprobs: Optional[bool] = False
    top_logprobs: Optional[int] = Field(default=None, ge=0, le=MAX_LOGPROBS)

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self):
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs set to true")
        return self

    def requested_logprobs(self) -> Optional[int]:
        return (self.top_logprobs or 0) if self.logprobs else None

    _UNSUPPORTED: ClassVar[dict] = {
        "tools": (_empty, "[]"),
        "tool_choice": (_one_of("none", "auto"), '"none" or "auto" without tools'),
        "functions": (_empty, "[]"),
        "function_call": (_one_of("none", "auto"), '"none" or "auto" without functions'),
        "modalities": (_one_of(["text"]), '["text"]'),
        "audio": (_unset, "null"),
        "prediction": (_unset, "null"),
    }


class CompletionRequest(_Request):
    prompt: Union[str, list[int], list[str], list[list[int]]]
    echo: bool = False
    # Each output token's log-probability, and the top `logprobs` tokens at its position
    # (plus the chosen one, as OpenAI's legacy API returns them).
    logprobs: Optional[int] = Field(default=None, ge=0, le=MAX_LOGPROBS)

    def requested_logprobs(self) -> Optional[int]:
        return self.logprobs

    _UNSUPPORTED: ClassVar[dict] = {
        "suffix": (_one_of(""), '""'),
        "best_of": (_one_of(1), "1"),
    }

    @field_validator("prompt")
    @classmethod
    def _single_prompt(cls, value):
        if isinstance(value, list):
            if not value:
                raise ValueError("prompt must not be empty")
            if isinstance(value[0], (str, list)):
                if len(value) != 1:
                    raise ValueError("only one prompt per request is supported")
                value = value[0]
        if isinstance(value, list) and any(t < 0 for t in value):
            raise ValueError("token ids must be non-negative")
        if isinstance(value, str) and not value:
            raise ValueError("prompt must not be empty")
        return value

    @model_validator(mode="after")
    def _no_echo(self):
        if self.echo:
            raise ValueError("echo is not supported")
        return self


_Request.model_rebuild()


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())
