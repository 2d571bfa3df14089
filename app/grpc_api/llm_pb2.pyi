from google.protobuf import struct_pb2 as _struct_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ChatMessage(_message.Message):
    __slots__ = ("role", "content", "name", "tool_call_id", "tool_calls", "reasoning")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALL_ID_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    REASONING_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    name: str
    tool_call_id: str
    tool_calls: _struct_pb2.ListValue
    reasoning: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ..., name: _Optional[str] = ..., tool_call_id: _Optional[str] = ..., tool_calls: _Optional[_Union[_struct_pb2.ListValue, _Mapping]] = ..., reasoning: _Optional[str] = ...) -> None: ...

class ChatCompletionRequest(_message.Message):
    __slots__ = ("model", "messages", "max_tokens", "temperature", "top_p", "seed", "stop", "n", "presence_penalty", "frequency_penalty", "logprobs", "top_logprobs", "session_id", "max_completion_tokens", "extra", "prompt_logprobs")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    MAX_COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    EXTRA_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    model: str
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    max_tokens: int
    temperature: float
    top_p: float
    seed: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    n: int
    presence_penalty: float
    frequency_penalty: float
    logprobs: bool
    top_logprobs: int
    session_id: str
    max_completion_tokens: int
    extra: _struct_pb2.Struct
    prompt_logprobs: int
    def __init__(self, model: _Optional[str] = ..., messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., seed: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., n: _Optional[int] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., logprobs: _Optional[bool] = ..., top_logprobs: _Optional[int] = ..., session_id: _Optional[str] = ..., max_completion_tokens: _Optional[int] = ..., extra: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ..., prompt_logprobs: _Optional[int] = ...) -> None: ...

class CompletionRequest(_message.Message):
    __slots__ = ("model", "prompt", "prompt_token_ids", "max_tokens", "temperature", "top_p", "seed", "stop", "n", "presence_penalty", "frequency_penalty", "logprobs", "extra", "echo", "prompt_logprobs")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    EXTRA_FIELD_NUMBER: _ClassVar[int]
    ECHO_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    model: str
    prompt: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    max_tokens: int
    temperature: float
    top_p: float
    seed: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    n: int
    presence_penalty: float
    frequency_penalty: float
    logprobs: int
    extra: _struct_pb2.Struct
    echo: bool
    prompt_logprobs: int
    def __init__(self, model: _Optional[str] = ..., prompt: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., seed: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., n: _Optional[int] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., logprobs: _Optional[int] = ..., extra: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ..., echo: _Optional[bool] = ..., prompt_logprobs: _Optional[int] = ...) -> None: ...

class PromptTokensDetails(_message.Message):
    __slots__ = ("cached_tokens",)
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    cached_tokens: int
    def __init__(self, cached_tokens: _Optional[int] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "total_tokens", "prompt_tokens_details", "completion_tokens_details")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_DETAILS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_DETAILS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails
    completion_tokens_details: CompletionTokensDetails
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., total_tokens: _Optional[int] = ..., prompt_tokens_details: _Optional[_Union[PromptTokensDetails, _Mapping]] = ..., completion_tokens_details: _Optional[_Union[CompletionTokensDetails, _Mapping]] = ...) -> None: ...

class CompletionTokensDetails(_message.Message):
    __slots__ = ("reasoning_tokens",)
    REASONING_TOKENS_FIELD_NUMBER: _ClassVar[int]
    reasoning_tokens: int
    def __init__(self, reasoning_tokens: _Optional[int] = ...) -> None: ...

class Error(_message.Message):
    __slots__ = ("message", "type", "param", "code")
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    TYPE_FIELD_NUMBER: _ClassVar[int]
    PARAM_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    message: str
    type: str
    param: str
    code: str
    def __init__(self, message: _Optional[str] = ..., type: _Optional[str] = ..., param: _Optional[str] = ..., code: _Optional[str] = ...) -> None: ...

class ChatChoice(_message.Message):
    __slots__ = ("index", "message", "finish_reason", "logprobs", "token_ids")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    index: int
    message: ChatMessage
    finish_reason: str
    logprobs: _struct_pb2.Struct
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, index: _Optional[int] = ..., message: _Optional[_Union[ChatMessage, _Mapping]] = ..., finish_reason: _Optional[str] = ..., logprobs: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ..., token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ChatCompletionResponse(_message.Message):
    __slots__ = ("id", "created", "model", "choices", "usage", "prompt_token_ids", "prompt_logprobs")
    ID_FIELD_NUMBER: _ClassVar[int]
    CREATED_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    CHOICES_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    id: str
    created: int
    model: str
    choices: _containers.RepeatedCompositeFieldContainer[ChatChoice]
    usage: Usage
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    prompt_logprobs: _struct_pb2.ListValue
    def __init__(self, id: _Optional[str] = ..., created: _Optional[int] = ..., model: _Optional[str] = ..., choices: _Optional[_Iterable[_Union[ChatChoice, _Mapping]]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., prompt_logprobs: _Optional[_Union[_struct_pb2.ListValue, _Mapping]] = ...) -> None: ...

class ChatDelta(_message.Message):
    __slots__ = ("role", "content", "tool_calls", "reasoning")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    REASONING_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    tool_calls: _struct_pb2.ListValue
    reasoning: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ..., tool_calls: _Optional[_Union[_struct_pb2.ListValue, _Mapping]] = ..., reasoning: _Optional[str] = ...) -> None: ...

class ChatChunkChoice(_message.Message):
    __slots__ = ("index", "delta", "finish_reason", "logprobs", "token_ids")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    DELTA_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    index: int
    delta: ChatDelta
    finish_reason: str
    logprobs: _struct_pb2.Struct
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, index: _Optional[int] = ..., delta: _Optional[_Union[ChatDelta, _Mapping]] = ..., finish_reason: _Optional[str] = ..., logprobs: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ..., token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ChatCompletionChunk(_message.Message):
    __slots__ = ("id", "created", "model", "choices", "usage", "error", "prompt_token_ids")
    ID_FIELD_NUMBER: _ClassVar[int]
    CREATED_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    CHOICES_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    id: str
    created: int
    model: str
    choices: _containers.RepeatedCompositeFieldContainer[ChatChunkChoice]
    usage: Usage
    error: Error
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, id: _Optional[str] = ..., created: _Optional[int] = ..., model: _Optional[str] = ..., choices: _Optional[_Iterable[_Union[ChatChunkChoice, _Mapping]]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., error: _Optional[_Union[Error, _Mapping]] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class CompletionChoice(_message.Message):
    __slots__ = ("index", "text", "finish_reason", "logprobs", "token_ids", "prompt_token_ids", "prompt_logprobs")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    index: int
    text: str
    finish_reason: str
    logprobs: _struct_pb2.Struct
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    prompt_logprobs: _struct_pb2.ListValue
    def __init__(self, index: _Optional[int] = ..., text: _Optional[str] = ..., finish_reason: _Optional[str] = ..., logprobs: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ..., token_ids: _Optional[_Iterable[int]] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., prompt_logprobs: _Optional[_Union[_struct_pb2.ListValue, _Mapping]] = ...) -> None: ...

class CompletionResponse(_message.Message):
    __slots__ = ("id", "created", "model", "choices", "usage")
    ID_FIELD_NUMBER: _ClassVar[int]
    CREATED_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    CHOICES_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    id: str
    created: int
    model: str
    choices: _containers.RepeatedCompositeFieldContainer[CompletionChoice]
    usage: Usage
    def __init__(self, id: _Optional[str] = ..., created: _Optional[int] = ..., model: _Optional[str] = ..., choices: _Optional[_Iterable[_Union[CompletionChoice, _Mapping]]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ...) -> None: ...

class CompletionChunk(_message.Message):
    __slots__ = ("id", "created", "model", "choices", "usage", "error")
    ID_FIELD_NUMBER: _ClassVar[int]
    CREATED_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    CHOICES_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    id: str
    created: int
    model: str
    choices: _containers.RepeatedCompositeFieldContainer[CompletionChoice]
    usage: Usage
    error: Error
    def __init__(self, id: _Optional[str] = ..., created: _Optional[int] = ..., model: _Optional[str] = ..., choices: _Optional[_Iterable[_Union[CompletionChoice, _Mapping]]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., error: _Optional[_Union[Error, _Mapping]] = ...) -> None: ...

class CreateSessionRequest(_message.Message):
    __slots__ = ("ttl_s",)
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    ttl_s: int
    def __init__(self, ttl_s: _Optional[int] = ...) -> None: ...

class GetSessionRequest(_message.Message):
    __slots__ = ("id",)
    ID_FIELD_NUMBER: _ClassVar[int]
    id: str
    def __init__(self, id: _Optional[str] = ...) -> None: ...

class DeleteSessionRequest(_message.Message):
    __slots__ = ("id",)
    ID_FIELD_NUMBER: _ClassVar[int]
    id: str
    def __init__(self, id: _Optional[str] = ...) -> None: ...

class Session(_message.Message):
    __slots__ = ("id", "created", "expires_at", "version", "num_tokens", "messages")
    ID_FIELD_NUMBER: _ClassVar[int]
    CREATED_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_AT_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    id: str
    created: int
    expires_at: int
    version: int
    num_tokens: int
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    def __init__(self, id: _Optional[str] = ..., created: _Optional[int] = ..., expires_at: _Optional[int] = ..., version: _Optional[int] = ..., num_tokens: _Optional[int] = ..., messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ...) -> None: ...

class DeleteSessionResponse(_message.Message):
    __slots__ = ("id", "deleted")
    ID_FIELD_NUMBER: _ClassVar[int]
    DELETED_FIELD_NUMBER: _ClassVar[int]
    id: str
    deleted: bool
    def __init__(self, id: _Optional[str] = ..., deleted: _Optional[bool] = ...) -> None: ...

class ListModelsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Model(_message.Message):
    __slots__ = ("id", "created", "owned_by", "max_model_len", "root", "parent")
    ID_FIELD_NUMBER: _ClassVar[int]
    CREATED_FIELD_NUMBER: _ClassVar[int]
    OWNED_BY_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    ROOT_FIELD_NUMBER: _ClassVar[int]
    PARENT_FIELD_NUMBER: _ClassVar[int]
    id: str
    created: int
    owned_by: str
    max_model_len: int
    root: str
    parent: str
    def __init__(self, id: _Optional[str] = ..., created: _Optional[int] = ..., owned_by: _Optional[str] = ..., max_model_len: _Optional[int] = ..., root: _Optional[str] = ..., parent: _Optional[str] = ...) -> None: ...

class ListModelsResponse(_message.Message):
    __slots__ = ("data",)
    DATA_FIELD_NUMBER: _ClassVar[int]
    data: _containers.RepeatedCompositeFieldContainer[Model]
    def __init__(self, data: _Optional[_Iterable[_Union[Model, _Mapping]]] = ...) -> None: ...
