"""OpenAI-compatible request and response schemas (the client-facing surface).

Requests are validated here; out-of-range values fail with a message that names the field
(turned into a 400 by the ingress). Unknown extra fields are accepted and ignored, as the
OpenAI API does for forward compatibility.
"""

from __future__ import annotations

import time
import uuid
from typing import Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


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


class CompletionRequest(_Request):
    prompt: Union[str, list[int], list[str], list[list[int]]]
    echo: bool = False

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
