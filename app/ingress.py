"""Ingress: the OpenAI-compatible HTTP API (FastAPI behind Serve's HTTP proxy).

It owns everything about the wire: body limits, JSON and schema validation, the chat
template and tokenisation (so limits are checked in tokens before any compute), the OpenAI
response and SSE shapes, and the mapping of every failure to the OpenAI error JSON.
Streams check for a failure before answering, so an error that happens before the first
token gets its real status code; an error after that ends the stream with an error event
and ``[DONE]``.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import functools
import json
import logging
import os
import re
import sys
import time
import uuid
from typing import AsyncIterator, Optional, Sequence

import jinja2
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import ValidationError
from ray import serve
from ray.serve.handle import DeploymentHandle
from ray.util import metrics
from starlette.exceptions import HTTPException as StarletteHTTPException

from app import responses, serve_context, telemetry
from app.auth import DEFAULT_TENANT, ApiKeys
from app.config import AppConfig
from app.errors import (
    APIError,
    AuthenticationError,
    InvalidRequestError,
    NotFoundError,
    PayloadTooLargeError,
    to_api_error,
)
from app.grpc_api.service import GrpcIngress
from app.metrics_export import collect_cluster_metrics
from app.rate_limits import Grant, RateLimiter
from app.reply_parser import Parsed, ReplyParser
from app.responses import ResponsesRequest
from app.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    invalid_body,
    new_id,
    now,
    refuse_unsupported,
)
from app.sessions import (
    TOKEN_IDS_KEY,
    PendingTurn,
    SessionClient,
    check_writable,
    exact_prompt_ids,
    fit_history,
    reply_token_ids,
    session_create_ttl,
    session_json,
)
from app.telemetry import LATENCY_BUCKETS_S, TOKEN_LATENCY_BUCKETS_S
from deployments.compute.engines.bad_words import bad_words_token_ids
from deployments.compute.engines.lora import adapter_of
from deployments.compute.engines.protocol import GenerationRequest, SamplingParams, TokenDelta
from deployments.router.deployment import Router, SessionLookup

logger = logging.getLogger("ray.serve")

# How long a finished stream may take to end after its last delta (Ingress._drain).
DRAIN_TIMEOUT_S = 5.0

fastapi_app = FastAPI(title="LLM serving (OpenAI-compatible)", docs_url="/docs")


def error_response(err: APIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status_code, headers=err.headers)


@fastapi_app.exception_handler(StarletteHTTPException)
async def _http_error(request: Request, exc: StarletteHTTPException):
    cls = NotFoundError if exc.status_code == 404 else InvalidRequestError
    err = cls(str(exc.detail))
    return JSONResponse(err.body(), status_code=exc.status_code)


@fastapi_app.exception_handler(Exception)
async def _unexpected_error(request: Request, exc: Exception):
    return error_response(to_api_error(exc))


def _sse(payload: dict) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"
SEED_MAX = 2**63 - 1

# JSON may escape a UTF-16 surrogate alone ("\ud800"), which decodes to a str that no
# UTF-8 encoder takes (the tokenizer, Redis, the reply): a 500 until a fuzz pass found it.
# Only a body with such an escape is walked (a pair, "\ud83d\ude00", decodes to one
# character and passes).
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


# How deep a body's JSON may nest. OpenAI's request bodies nest a few levels (a tool's
# JSON-schema parameters some more); Python's json parser, and every walk of the parsed
# value (``lone_surrogate_at``), recurse once per level and raised RecursionError (a 500)
# on a small body of ~1000 brackets.
MAX_JSON_DEPTH = 100


def json_depth_exceeds(value, limit: int = MAX_JSON_DEPTH) -> bool:
    """Whether ``value`` (parsed JSON) nests containers deeper than ``limit``; iterative."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            item = item.values()
        elif not isinstance(item, list):
            continue
        if depth > limit:
            return True
        stack.extend((child, depth + 1) for child in item if isinstance(child, (dict, list)))
    return False


def lone_surrogate_at(value, path: str = "") -> Optional[str]:
    """The dotted path of the first string (or key) in ``value`` holding a UTF-16
    surrogate that is not part of a pair ("" for ``value`` itself), or None."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path
        return None
    if isinstance(value, dict):
        items = value.items()
    elif isinstance(value, list):
        items = enumerate(value)
    else:
        return None
    for key, item in items:
        if isinstance(key, str) and lone_surrogate_at(key) is not None:
            key = key.encode("utf-8", "backslashreplace").decode()  # the path goes into an error
            return f"{path}.{key}" if path else key
        where = f"{path}.{key}" if path else str(key)
        found = lone_surrogate_at(item, where)
        if found is not None:
            return found
    return None


def _named_session(request: Request, req) -> Optional[str]:
    """The session a chat request names: its ``X-Session-Id`` header, else its body's
    ``session_id``; None if neither is there. An empty one is a name too (a malformed
    one, answered 400), not the absence of a session: a client that meant a session
    must not get a reply that was silently never stored. Both, naming different
    sessions, is a 400: the turn would go to one of them by a rule the client may not
    know (a proxy's header, say, beside the application's body field)."""
    header = request.headers.get("x-session-id")
    if header is not None and req.session_id is not None and header != req.session_id:
        # At most 80 characters of each, as check_session_id shows a malformed one.
        raise InvalidRequestError(
            f"The X-Session-Id header ({header[:80]!r}) and the body's session_id "
            f"({req.session_id[:80]!r}) name different sessions; send one, or the same in both.",
            param="session_id",
        )
    return header if header is not None else req.session_id


# The 404 of the sessions API, and of the stored-responses routes, while the data plane is off.
NO_SESSIONS = ("Sessions are disabled on this server (dataplane.enabled).", None)
NO_STORED_RESPONSES = ("This server stores no responses (dataplane.enabled is false).", "response_not_found")

# At most one log line about refused API keys this often (the metric counts each).
AUTH_LOG_INTERVAL_S = 10.0


# How long /ready waits for the data-plane replicas' answers (a probe's own timeout is
# usually a few seconds more).
READY_STATUS_TIMEOUT_S = 5.0
# A data-plane replica's state, worst first: what /ready's "dataplane" says for the pool.
DATAPLANE_STATES = ("degraded", "refusing_writes", "ok")


def dataplane_readiness(answers: Sequence) -> dict:
    """What /ready says of the data plane, from every replica's ``DataPlane.status`` (an
    exception in place of a replica that did not answer). The pool's state is its worst
    replica's: one replica still reconnecting after an outage keeps the pool "degraded",
    since the sessions it owns are still kept in its memory only. The roles named are
    those of any replica; ``dataplane_replicas`` counts the replicas in each state.
    "unavailable" when no replica answered."""
    counts = dict.fromkeys((*DATAPLANE_STATES, "unanswered"), 0)
    degraded: set[str] = set()
    refusing: set[str] = set()
    for answer in answers:
        if not isinstance(answer, dict):
            counts["unanswered"] += 1
            continue
        degraded.update(answer.get("degraded_servers") or ())
        refusing.update(answer.get("refusing_writes") or ())
        state = "degraded" if answer.get("degraded") else "refusing_writes" if answer.get("refusing_writes") else "ok"
        counts[state] += 1
    body = {"dataplane": next((s for s in DATAPLANE_STATES if counts[s]), "unavailable")}
    if degraded:
        body["dataplane_degraded"] = sorted(degraded)
    if refusing:
        body["dataplane_refusing_writes"] = sorted(refusing)
    body["dataplane_replicas"] = counts
    return body


def template_messages(req: ChatCompletionRequest) -> list[dict]:
    """The request's messages in the form chat templates take them: text content, and the
    tool fields (an assistant's calls with their arguments as objects, a tool message's
    call id); a 400 naming ``messages`` for content that is not text."""
    try:
        return [{"role": m.role, "content": m.text(), **m.tool_fields()} for m in req.messages]
    except ValueError as e:
        raise InvalidRequestError(str(e), param="messages") from None


def _refuse_session(request: Request, req, why: str) -> None:
    """A 400 (``why``) for a request that names a session (header or body) where sessions
    do not apply: a completion (sessions hold chat turns; ignoring the name would give a
    reply the client takes to be stored), /tokenize and /detokenize."""
    if request.headers.get("x-session-id") is not None or (req.model_extra or {}).get("session_id") is not None:
        raise InvalidRequestError(why, param="session_id")


class _Metrics:
    def __init__(self):
        tags = ("endpoint",)
        self.requests = metrics.Counter(
            "llm_requests", "Requests by endpoint and HTTP status.", tag_keys=("endpoint", "status")
        )
        self.ttft = metrics.Histogram(
            "llm_ttft_seconds",
            "Time to first token, from the ingress taking the request (its parsing, session "
            "history and tokenising included).",
            boundaries=LATENCY_BUCKETS_S,
            tag_keys=tags,
        )
        self.tpot = metrics.Histogram(
            "llm_tpot_seconds",
            "Time per output token after the first.",
            boundaries=TOKEN_LATENCY_BUCKETS_S,
            tag_keys=tags,
        )
        self.e2e = metrics.Histogram(
            "llm_e2e_latency_seconds",
            "End-to-end request latency.",
            boundaries=LATENCY_BUCKETS_S,
            tag_keys=tags,
        )
        # By tenant too (the API key's; "default" without keys): what each one used.
        self.prompt_tokens = metrics.Counter(
            "llm_prompt_tokens", "Prompt tokens, by endpoint, tenant and model (the base model's id or a "
            "LoRA adapter's name).", tag_keys=("endpoint", "tenant", "model")
        )
        self.output_tokens = metrics.Counter(
            "llm_generation_tokens", "Generated tokens, by endpoint, tenant and model.",
            tag_keys=("endpoint", "tenant", "model"),
        )
        self.cached_tokens = metrics.Counter(
            "llm_prompt_cached_tokens",
            "Prompt tokens whose KV was reused (an engine's prefix cache, the data plane's "
            "L2/L3) instead of prefilled, by endpoint, tenant and model; over "
            "llm_prompt_tokens: the cache's hit rate.",
            tag_keys=("endpoint", "tenant", "model"),
        )
        self.auth_failures = metrics.Counter(
            "llm_auth_failures",
            "Requests refused 401 by API key: reason=missing (no Bearer key) or invalid (no "
            "such key).",
            tag_keys=("reason",),
        )
        self.features = metrics.Counter(
            "llm_request_features",
            "Requests taken for generation that asked for more than plain text, by feature: "
            "logprobs, structured_output (response_format or structured_outputs), tool_call "
            "(tool_choice named or required), tool_call_auto (tools with tool_choice auto, "
            "read by model.tool_call_parser), sampling_controls (penalties, logit_bias, "
            "top_k, min_p, min_tokens, stop_token_ids, allowed_token_ids, bad_words), prompt_logprobs "
            "(a whole prefill, no cached prefix), echo (a completion's prompt, or vLLM's chat "
            "echo of the message a reply continues, in front of the reply), "
            "priority (a priority other than 0, engine.scheduling_policy priority), "
            "cache_salt (KV reused only with the same salt), lora (a LoRA adapter named "
            "as the model).",
            tag_keys=("endpoint", "feature"),
        )
        self.reply_parses = metrics.Counter(
            "llm_reply_parses",
            "Chat replies read by vLLM's parsers (model.tool_call_parser under tool_choice "
            "auto, model.reasoning_parser), by outcome: tool_calls (the reply called a tool), "
            "reasoning (it reasoned and called none), text (neither), failed (a parser raised; "
            "the reply went out as text).",
            tag_keys=("outcome",),
        )
        self.responses = metrics.Counter(
            "llm_responses_store_ops",
            "Stored responses of POST /v1/responses (store: true) by op (store, read: a "
            "previous_response_id or a GET, delete) and result (ok, not_found, failed: the "
            "data plane's error reached the client).",
            tag_keys=("op", "result"),
        )
        self.session_cache = metrics.Counter(
            "llm_session_turns",
            "Session turns by where their history came from: hit (this ingress's record of "
            "the session, which the store's matched), stale (the store's was newer: prompt "
            "built again), miss (waited for the store's read).",
            tag_keys=("result",),
        )


@dataclasses.dataclass(slots=True)
class _Responding:
    """A Responses request on its way (app/responses.py): the request as sent, its id,
    the stored conversation it continues (as its record will hold it), its own input as
    chat messages and as input items, and the tenant's store (None: this response is
    not stored)."""

    req: ResponsesRequest
    response_id: str
    history: list[dict]
    new_messages: list[dict]
    input_items: list[dict]
    store: Optional[SessionClient]

    @property
    def kv_owner(self) -> Optional[str]:
        """A stored response lists the KV blocks computed for it under its id, so its
        DELETE erases them (as a session's does); an unstored one leaves them to age out."""
        return self.response_id if self.store is not None else None


class _SessionMoved(Exception):
    """The store's record of a session is newer than the one this ingress built a turn's
    prompt from (another ingress replica appended a turn since)."""

    def __init__(self, record):
        super().__init__(f"session {record.id} is at version {record.version}")
        self.record = record


REPLACEMENT_CHAR = "\ufffd"  # what a token that is part of a UTF-8 character decodes to alone

# JSON has no -inf: OpenAI and vLLM send this floor for a token the model rules out.
LOGPROB_FLOOR = -9999.0


def json_logprob(value: float) -> float:
    return value if value >= LOGPROB_FLOOR else LOGPROB_FLOOR  # (NaN too)


def token_id_text(token_id: int) -> str:
    """A token in a logprobs entry under vLLM's ``return_tokens_as_token_ids``."""
    return f"token_id:{token_id}"


def chat_logprob(token_text, token_id: int, logprob: float, top: list) -> dict:
    """One entry of a chat choice's ``logprobs.content``."""

    def entry(i: int, value: float) -> dict:
        token = token_text(i)
        return {"token": token, "logprob": json_logprob(value), "bytes": list(token.encode("utf-8", "replace"))}

    return {**entry(token_id, logprob), "top_logprobs": [entry(i, v) for i, v in top]}


def _prompt_tokens(calls: list["_Call"]) -> int:
    """A request's prompt tokens: each prompt's once, however many choices it has (as
    OpenAI counts them for n > 1)."""
    return sum(c.num_prompt_tokens for c in calls if c.head is c)


def _cached_tokens(calls: list["_Call"]) -> int:
    """Of those, the ones whose KV was reused (each prompt's once, as its tokens)."""
    return sum(c.num_cached_tokens for c in calls if c.head is c)


def _joined(head: dict, tail: dict) -> dict:
    """Two completions ``logprobs`` objects of consecutive tokens as one."""
    return {key: head[key] + tail[key] for key in head}


def tool_reply(mode: str, function: Optional[str], text: str, finish: str) -> tuple[Optional[str], list[dict], str]:
    """(content, tool_calls, finish_reason) of a chat choice whose reply was held to a
    tool call's schema (``ChatCompletionRequest.tool_schema``). A named function's reply
    is its arguments (finish ``stop``, as OpenAI gives a forced call); "required"'s is a
    list of {name, parameters} (finish ``tool_calls``). A reply cut short (``length``)
    that does not parse stays text."""
    if mode == "named":
        return None, [_tool_call(function, text)], finish
    try:
        calls = json.loads(text)
        tool_calls = [_tool_call(c["name"], json.dumps(c["parameters"], ensure_ascii=False)) for c in calls]
    except (ValueError, TypeError, KeyError):
        return text, [], finish
    return None, tool_calls, "tool_calls" if finish == "stop" else finish


def _tool_call(name: str, arguments: str) -> dict:
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": {"name": name, "arguments": arguments}}


def request_features(req, sampling, lora: Optional[str] = None) -> list[str]:
    """The llm_request_features a request counts toward (``lora``: the adapter it runs
    with)."""
    features = []
    if sampling.logprobs is not None:
        features.append("logprobs")
    tool_call = isinstance(req, ChatCompletionRequest) and req.tool_call_mode() is not None
    if tool_call:
        features.append("tool_call")
    elif isinstance(req, ChatCompletionRequest) and req.reply_parsing is not None and req.reply_parsing.tools:
        features.append("tool_call_auto")
    elif sampling.structured_output is not None:
        features.append("structured_output")
    if (
        sampling.top_k or sampling.min_p or sampling.presence_penalty or sampling.frequency_penalty
        or sampling.repetition_penalty != 1.0 or sampling.logit_bias or sampling.min_tokens
        or sampling.stop_token_ids or sampling.allowed_token_ids or sampling.bad_words
    ):
        features.append("sampling_controls")
    if sampling.prompt_logprobs is not None:
        features.append("prompt_logprobs")
    if getattr(req, "echo", False):
        features.append("echo")
    if req.priority:
        features.append("priority")
    if req.cache_salt:
        features.append("cache_salt")
    if lora:
        features.append("lora")
    return features


class _Call:
    """Bookkeeping of one generation call: timings, tokens, and the final record."""

    def __init__(self, endpoint: str, request_id: str, num_prompt_tokens: int, tenant: str = DEFAULT_TENANT):
        self.endpoint = endpoint
        self.tenant = tenant
        self.request_id = request_id
        self.num_prompt_tokens = num_prompt_tokens
        # When the handler took the request, and when it handed it to the router (after
        # parsing, the session's history and tokenising): TTFT and e2e count from the
        # first, the log line splits the two.
        self.received = self.started = time.monotonic()
        self.first_token_at: Optional[float] = None
        self.num_output_tokens = 0
        self.num_cached_tokens = 0
        self.finish_reason: Optional[str] = None
        self.trace_id = telemetry.trace_id_hex()
        self.turn: Optional[PendingTurn] = None
        # A session turn's cache_salt (its blocks' hashes cover it; never logged) and LoRA
        # adapter (ditto).
        self.cache_salt: Optional[str] = None
        self.lora: Optional[str] = None
        # What the usage metrics count it under: the base model's id or the adapter's name.
        self.model = ""
        # A session turn's prompt ids, and its generated ids (stored with the reply, see
        # sessions.py).
        self.prompt_ids: Optional[list[int]] = None
        self.output_ids: Optional[list[int]] = None
        self.streamed = True
        # (token id, TokenLogprobs) of every output token, for a reply sent whole that
        # asked for logprobs (a stream hands each delta's own to its chunk).
        self.logprob_items: Optional[list] = None
        # The request's rate-limit charge (app/rate_limits.py), settled at its end.
        self.grant: Optional[Grant] = None
        # The prompt's logprobs (protocol.PromptLogprob per token, the first None), from
        # the first delta of a request that asked for them (choice 0's: the choices share
        # one prompt), with the ids they are of.
        self.prompt_logprobs: Optional[list] = None
        self.prompt_logprob_ids: Optional[list[int]] = None
        # A completion's echo: the prompt's text in front of the reply; echo_only (echo
        # with max_tokens 0): the one token the engine made is not the client's.
        self.echo_text: Optional[str] = None
        self.echo_only = False
        # The first choice of this call's prompt (a completion may batch several prompts):
        # the one that holds the prompt's ids, logprobs and counts.
        self.head: "_Call" = self

    def on_delta(self, delta: TokenDelta) -> None:
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs
        if delta.finish_reason:
            self.finish_reason = delta.finish_reason
        self.num_cached_tokens = max(self.num_cached_tokens, delta.num_cached_tokens)
        if self.echo_only:
            return
        if self.first_token_at is None and delta.token_ids:
            self.first_token_at = time.monotonic()
        if self.output_ids is not None:
            self.output_ids.extend(delta.token_ids)
        if self.logprob_items is not None and delta.logprobs:
            self.logprob_items.extend(zip(delta.token_ids, delta.logprobs))
        self.num_output_tokens = max(
            self.num_output_tokens + len(delta.token_ids), delta.num_output_tokens
        )


class _LocalStream:
    """The router's stream of deltas (an async generator in this process) with the
    ``cancel()`` the response paths call when the client leaves or a call fails:
    closing the generator runs the router's cleanup, which cancels the worker call,
    which aborts the sequence in the engine."""

    __slots__ = ("_gen", "_closing")

    def __init__(self, gen: AsyncIterator[TokenDelta]):
        self._gen = gen
        self._closing: Optional[asyncio.Task] = None

    def __aiter__(self):
        return self

    def __anext__(self):
        return self._gen.__anext__()

    def cancel(self) -> None:
        if self._closing is None:
            # Kept on the object so the task is not collected before it ran.
            self._closing = asyncio.ensure_future(self._gen.aclose())


class Ingress:
    # LoRA adapters a request's model may name (model.lora_modules; set per instance),
    # and the tenants each is for (None: all).
    _lora_names: tuple[str, ...] = ()
    _lora_tenants: dict[str, Optional[frozenset[str]]] = {}

    def __init__(
        self, worker: DeploymentHandle, config: dict, dataplane: Optional[DeploymentHandle] = None
    ):
        from transformers import AutoTokenizer  # heavy; only the ingress needs it

        self._config = AppConfig.model_validate(config)
        self._dataplane = dataplane
        self._keys = ApiKeys.from_config(self._config.security)
        self._auth_refusals: collections.Counter = collections.Counter()
        self._auth_log = telemetry.Every(AUTH_LOG_INTERVAL_S)
        self._sessions = (
            SessionClient(dataplane, self._config.dataplane.sessions, direct_calls=self._config.dataplane.direct_calls)
            if dataplane else None
        )
        limits = self._config.security.rate_limits
        self._limiter = RateLimiter(limits, self._config.dataplane.redis) if limits.any else None
        telemetry.setup(self._config.telemetry, "ingress")
        self._tracer = telemetry.tracer(__name__)
        # The router runs in this process (not as a deployment of its own), so a token
        # crosses one Serve hop (worker → ingress) instead of two.
        self._router = Router(worker, config, dataplane)
        model_path = self._config.model.resolved_path()
        self._lora_names = tuple(m.name for m in self._config.model.lora_modules)
        self._lora_tenants = self._config.model.lora_tenants()
        self._tokenizer = AutoTokenizer.from_pretrained(str(model_path))
        self._special_ids = frozenset(self._tokenizer.all_special_ids)
        # One output token's text in a logprobs entry (vLLM's: the token decoded alone).
        self._token_text = functools.lru_cache(maxsize=1 << 17)(lambda i: self._tokenizer.decode([i]))
        # Such a token's text after the tokens before it (_logprob_text): an echoed
        # prompt's are written twice (its logprobs and its prompt_logprobs).
        self._piece_text = functools.lru_cache(maxsize=1 << 14)(self._piece_text_uncached)
        tools, reasoning = self._config.model.tool_call_parser, self._config.model.reasoning_parser
        # vLLM's parsers of the reply: tool calls under "auto", reasoning (an unknown name
        # fails the start here).
        self._reply_parser = ReplyParser(self._tokenizer, tools, reasoning) if tools or reasoning else None
        self._parse_log = telemetry.Every(60.0)  # a parser failing on every reply: a line a minute
        if self._reply_parser is not None:
            logger.info("replies read by vLLM's parsers: tool calls %r, reasoning %r", tools, reasoning)
        self._max_model_len = self._config.model.checkpoint_max_len()
        self._created = now()
        self._m = _Metrics()
        self._stopping: set[asyncio.Future] = set()  # held until done (the loop keeps weak refs)

    # ---- plumbing -------------------------------------------------------------------

    def _authenticate(self, request: Request, span=None) -> str:
        """The tenant of ``request``'s API key (``default`` while keys are off); a 401
        (``AuthenticationError``) when keys are on and it names none (app/auth.py)."""
        try:
            tenant = self._keys.tenant(request.headers.get("authorization"))
        except AuthenticationError as e:
            reason = "missing" if e.code == "missing_api_key" else "invalid"
            self._m.auth_failures.inc(tags={"reason": reason})
            self._auth_refusals[reason] += 1
            if self._auth_log.due():  # a flood of bad keys is one line per interval
                client = request.client.host if request.client else "?"
                logger.info(
                    "401: %d request(s) with a missing and %d with an unknown API key since the last "
                    "such line; the latest %s %s from %s",
                    self._auth_refusals["missing"], self._auth_refusals["invalid"],
                    request.method, request.url.path, client,
                )
                self._auth_refusals = collections.Counter()
            raise
        if span is not None:
            span.set_attribute("llm.tenant", tenant)
        return tenant

    def _sessions_of(self, tenant: str) -> Optional[SessionClient]:
        """The sessions client of ``tenant`` (None while sessions are off)."""
        return None if self._sessions is None else self._sessions.for_tenant(tenant)

    async def _read_json(self, request: Request, allow_empty: bool = False) -> dict:
        """The request's body, a JSON object (``allow_empty``: no body at all is ``{}``)."""
        limit = self._config.limits.max_request_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise PayloadTooLargeError(
                f"Request body of {declared} bytes exceeds the limit of {limit} bytes."
            )
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                raise PayloadTooLargeError(f"Request body exceeds the limit of {limit} bytes.")
        if allow_empty and not body.strip():
            return {}
        too_deep = f"Request body nests JSON deeper than {MAX_JSON_DEPTH} levels."
        try:
            data = json.loads(body)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise InvalidRequestError(f"Request body is not valid JSON: {e}") from None
        except ValueError:
            # Python refuses to convert an integer of more than sys.get_int_max_str_digits()
            # digits (4300 by default, a guard against quadratic-time parsing): valid JSON,
            # but a number no field here could hold. It was a 500.
            raise InvalidRequestError(
                "Request body holds an integer longer than "
                f"{sys.get_int_max_str_digits()} digits, more than any field takes."
            ) from None
        except RecursionError:
            raise InvalidRequestError(too_deep) from None
        if not isinstance(data, dict):
            raise InvalidRequestError("Request body must be a JSON object.")
        # Only a body with that many brackets can nest that deep (a C-speed count first).
        if body.count(b"[") + body.count(b"{") > MAX_JSON_DEPTH and json_depth_exceeds(data):
            raise InvalidRequestError(too_deep)
        if _SURROGATE_ESCAPE.search(body):
            where = lone_surrogate_at(data)
            if where is not None:
                raise InvalidRequestError(
                    f"Invalid '{where}': a UTF-16 surrogate escape (\\ud800-\\udfff) that is "
                    "not part of a pair is not Unicode text.",
                    param=where,
                )
        return data

    def _logprob_text(self, token_id: int, context: list[int]) -> str:
        """A token's text in a logprobs entry, as vLLM's: the token decoded alone, unless
        that ends in U+FFFD (a piece of a multi-byte character, which byte-level
        tokenizers split across tokens): then what it adds to up to four tokens before it
        at its position (``context``: the prompt's, or the reply's sampled ones), or ""
        when the character is still incomplete (vLLM's ``_correct_decoded_token``)."""
        text = self._token_text(token_id)
        if not text.endswith(REPLACEMENT_CHAR):
            return text
        return self._piece_text(token_id, tuple(context[-4:]))

    def _piece_text_uncached(self, token_id: int, context: tuple) -> str:
        """``_logprob_text`` of a token that decodes alone to a piece of a character."""
        decode = self._tokenizer.decode
        context = list(context)
        for n in range(1, min(len(context), 4) + 1):
            before = context[-n:]
            full = decode(before + [token_id])
            if full.endswith(REPLACEMENT_CHAR):
                continue
            # The context's own trailing pieces printed nothing: their bytes are this text's.
            clean = len(before)
            while clean > 0 and self._token_text(before[clean - 1]).endswith(REPLACEMENT_CHAR):
                clean -= 1
            prefix = decode(before[:clean]) if clean else ""
            if full.startswith(prefix):
                return full[len(prefix):]
            return full[len(os.path.commonprefix([prefix, full])):]
        return ""

    def _logprobs_json(
        self, chat: bool, items: Optional[list], offset: int = 0, context: Optional[list[int]] = None,
        as_ids: bool = False,
    ) -> tuple[Optional[dict], int]:
        """A choice's ``logprobs`` object for (token id, TokenLogprobs) items, in the chat
        or the completions API's form (None when none were asked for), and the text offset
        after them (completions: each token's offset in the choice's text). ``context``:
        the tokens before the items (a stream's earlier chunks'), which a token's text
        may need (``_logprob_text``); extended in place by the items' own. ``as_ids``
        (vLLM's ``return_tokens_as_token_ids``): every token written ``token_id:<id>``,
        offsets counted in those strings; a chat entry's own ``bytes`` stay its text's
        (vLLM's, which its top entries' do not)."""
        if items is None:
            return None, offset
        context = [] if context is None else context

        def texts(token_id: int):
            if as_ids:
                return token_id_text
            at = context[-4:]
            return lambda i: self._logprob_text(i, at)

        def advance(token_id: int) -> None:
            context.append(token_id)
            del context[:-4]

        if chat:
            content = []
            for t, (lp, top) in items:
                content.append(chat_logprob(texts(t), t, lp, top))
                if as_ids:
                    content[-1]["bytes"] = list(self._logprob_text(t, context[-4:]).encode("utf-8", "replace"))
                advance(t)
            return {"content": content}, offset
        tokens, token_logprobs, top_logprobs, text_offset = [], [], [], []
        for token_id, entry in items:
            # An echoed prompt's first token has no entry (nothing before it): vLLM
            # decodes it alone, and it is nobody's context.
            text = texts(token_id) if entry is not None or as_ids else self._token_text
            token = text(token_id)
            tokens.append(token)
            text_offset.append(offset)
            offset += len(token)
            if entry is None:  # an echoed prompt's first token: nothing before it
                token_logprobs.append(None)
                top_logprobs.append(None)
                continue
            lp, top = entry
            token_logprobs.append(json_logprob(lp))
            # The legacy API lists the chosen token among the top ones too (up to k + 1).
            tops = {text(i): json_logprob(v) for i, v in top}
            tops.setdefault(token, json_logprob(lp))
            top_logprobs.append(tops)
            advance(token_id)
        body = {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs, "text_offset": text_offset}
        return body, offset

    def _prompt_logprobs_json(self, call: "_Call") -> Optional[list]:
        """vLLM's ``prompt_logprobs`` of ``call``'s prompt: per token, null (the first) or
        {token id: {logprob, rank, decoded_token}}, the prompt's token first, then the
        most likely ones ranked 1..k (a top one that is the prompt's token keeps its place
        and takes that rank, as vLLM's dict does)."""
        if call.prompt_logprobs is None:
            return None
        ids, out = call.prompt_logprob_ids, [None]
        for j, (lp, rank, top) in enumerate(call.prompt_logprobs[1:], 1):
            ranked = {ids[j]: (lp, rank)}
            for r, (i, v) in enumerate(top, 1):
                ranked[i] = (v, r)
            before = ids[max(1, j - 4):j]  # the first token has no entry: not context (vLLM's)
            out.append({
                str(i): {"logprob": json_logprob(v), "rank": r, "decoded_token": self._logprob_text(i, before)}
                for i, (v, r) in ranked.items()
            })
        return out

    def _echo_logprob_items(self, req, call: "_Call") -> Optional[list]:
        """An echoed prompt's (token id, TokenLogprobs or None) items, in front of the
        reply's in a completion's logprobs (None when it asked for none)."""
        k = req.requested_logprobs()
        if k is None or call.prompt_logprobs is None:
            return None
        ids = call.prompt_logprob_ids
        return [(ids[0], None)] + [(t, (lp, top[:k])) for t, (lp, _, top) in zip(ids[1:], call.prompt_logprobs[1:])]

    def _validate(self, schema, data: dict, tenant: str = DEFAULT_TENANT):
        try:
            req = schema.model_validate(data)
        except ValidationError as e:
            raise invalid_body(e) from None
        chat = isinstance(req, ChatCompletionRequest)
        parser = self._reply_parser
        problem = req.tool_problem(auto_parser=parser is not None and parser.tool_parser is not None) if chat else None
        if problem is not None:
            raise InvalidRequestError(problem, param="tool_choice")
        if chat and parser is not None:
            try:
                req.reply_parsing = parser.for_request(req)
            except ValidationError as e:  # tools ours took and vLLM's request model did not
                first = e.errors()[0]
                raise InvalidRequestError(f"Invalid 'tools': {first['msg']}", param="tools") from None
        refuse_unsupported(req)
        self._check_model(req.model, tenant)
        if req.bad_words:
            # As vLLM checks them (a word that makes no token, too many sequences), with
            # the engines' tokenizer: a 400 before any engine sees the request.
            try:
                bad_words_token_ids(lambda text: self._tokenizer.encode(text, add_special_tokens=False), req.bad_words)
            except ValueError as e:
                raise InvalidRequestError(str(e), param="bad_words") from None
        if req.priority and self._config.engine.scheduling_policy != "priority":
            raise InvalidRequestError(
                f"'priority' ({req.priority}) needs engine.scheduling_policy: priority; this server "
                "starts requests in arrival order (fcfs). Leave it out or send 0.",
                param="priority",
            )
        if len(req.stop) > self._config.limits.max_stop_sequences:
            raise InvalidRequestError(
                f"At most {self._config.limits.max_stop_sequences} stop sequences are allowed.",
                param="stop",
            )
        return req

    def _adapters_of(self, tenant: str) -> tuple[str, ...]:
        """The LoRA adapters ``tenant`` may use (model.lora_modules' ``tenants``)."""
        allowed = self._lora_tenants
        return tuple(n for n in self._lora_names if allowed.get(n) is None or tenant in allowed[n])

    def _check_model(self, model: str, tenant: str = DEFAULT_TENANT) -> Optional[str]:
        """The LoRA adapter ``model`` names (None: the base model); a 404 for a model this
        server does not serve to ``tenant`` (an adapter for other tenants included: as
        another tenant's session, it does not exist for this one)."""
        names = self._adapters_of(tenant)
        try:
            return adapter_of(model, self._config.model.id, names)
        except KeyError:
            served = ", ".join(repr(m) for m in (self._config.model.id, *names))
            raise NotFoundError(
                f"The model '{model}' does not exist; this server serves {served}.",
                param="model",
                code="model_not_found",
            ) from None

    def _max_tokens(self, req, num_prompt: int) -> int:
        """The request's ``max_tokens``, or the default that the context leaves room for;
        a 400 when the prompt and it do not fit the context."""
        requested = req.requested_max_tokens()
        room = self._max_model_len - num_prompt
        if requested is None:
            if room < 1:
                raise InvalidRequestError(
                    f"This model's maximum context length is {self._max_model_len} tokens; "
                    f"the prompt has {num_prompt} tokens, leaving no room to generate.",
                    param="messages" if isinstance(req, ChatCompletionRequest) else "prompt",
                    code="context_length_exceeded",
                )
            return min(self._config.limits.default_max_tokens, room)
        if num_prompt + requested > self._max_model_len:
            raise InvalidRequestError(
                f"This model's maximum context length is {self._max_model_len} tokens. "
                f"However, you requested {num_prompt + requested} tokens "
                f"({num_prompt} in the prompt, {requested} for the completion).",
                param="max_tokens",
                code="context_length_exceeded",
            )
        return requested

    def _generation_request(self, req, prompt_ids: list[int], tenant: str = DEFAULT_TENANT) -> GenerationRequest:
        num_prompt = len(prompt_ids)
        vocab = len(self._tokenizer)
        if any(t >= vocab for t in prompt_ids):
            raise InvalidRequestError(
                f"Prompt token ids must be below the vocabulary size {vocab}.", param="prompt"
            )
        max_tokens = self._max_tokens(req, num_prompt)
        return GenerationRequest(
            request_id=uuid.uuid4().hex,
            prompt_token_ids=prompt_ids,
            sampling=SamplingParams(
                max_tokens=max_tokens,
                temperature=req.temperature,
                top_p=req.top_p,
                seed=req.seed,
                stop=list(req.stop),
                ignore_eos=req.ignore_eos,
                **{**req.sampling_extras(), **self._parser_sampling(req, prompt_ids)},
            ),
            trace_headers=telemetry.inject_context(),
            tenant=tenant,
            priority=req.priority or 0,
            cache_salt=req.cache_salt,
            lora=self._check_model(req.model, tenant),
        )

    @staticmethod
    def _parser_sampling(req, prompt_ids: list[int]) -> dict:
        """What the reply's parsers change in how it is made: their format's special tokens
        kept in the text (``hermes``'s ``<tool_call>``, for one). Hands them the prompt."""
        parsing = getattr(req, "reply_parsing", None)
        if parsing is None:
            return {}
        parsing.prompt_ids = prompt_ids
        return {} if parsing.skip_special_tokens else {"skip_special_tokens": False}

    def _parse_reply(self, req, text: str) -> Optional[Parsed]:
        """A whole reply read by its parsers; None when one failed (it goes out as text)."""
        try:
            parsed = req.reply_parsing.parse(text)
        except Exception:  # noqa: BLE001 - a parser's failure must not fail the request
            self._reply_parse_failed()
            return None
        self._count_parse(bool(parsed.tool_calls), bool(parsed.reasoning))
        return parsed

    def _count_parse(self, called: bool, reasoned: bool) -> None:
        outcome = "tool_calls" if called else "reasoning" if reasoned else "text"
        self._m.reply_parses.inc(tags={"outcome": outcome})

    def _reply_parse_failed(self) -> None:
        self._m.reply_parses.inc(tags={"outcome": "failed"})
        if self._parse_log.due():
            logger.warning("a parser of vLLM's (tool calls %r, reasoning %r) failed on a reply; it goes out "
                           "as text (llm_reply_parses_total{outcome=\"failed\"} counts each)",
                           self._reply_parser.tool_parser, self._reply_parser.reasoning_parser, exc_info=True)

    def _chat_prompt_ids(
        self,
        messages: list[dict],
        tools: Optional[list[dict]] = None,
        template_kwargs: Optional[dict] = None,
        *,
        generation_prompt: bool = True,
        continue_final: bool = False,
        special_tokens: bool = False,
    ) -> list[int]:
        """The prompt ids of chat ``messages``, rendered by the model's template (as
        vLLM renders them: text, then tokenized without special tokens by default); a
        400 when the template refuses them. The keywords are /tokenize's."""
        if not self._tokenizer.chat_template:
            # A base model's checkpoint: transformers has no default template to fall back on.
            raise InvalidRequestError(
                "This model has no chat template (its tokenizer_config.json sets none), so it "
                "cannot take chat messages; send a prompt to /v1/completions instead.",
                param="messages",
            )
        try:
            if any(TOKEN_IDS_KEY in m for m in messages):
                return exact_prompt_ids(self._tokenizer, messages, tools, template_kwargs)
            text = self._tokenizer.apply_chat_template(
                messages, tools=tools, add_generation_prompt=generation_prompt, continue_final_message=continue_final,
                tokenize=False, **(template_kwargs or {}),
            )
        except jinja2.TemplateError as e:
            # The template's own refusal (its raise_exception: roles that do not alternate,
            # a system role it does not take...) or a value it cannot render: the
            # messages' fault, not the server's.
            raise InvalidRequestError(
                f"The model's chat template rejects these messages: {str(e)[:500]}", param="messages"
            ) from None
        except Exception as e:  # noqa: BLE001 - the tool fields the template was given
            if continue_final and isinstance(e, ValueError):
                # transformers' own check: the final message is not where the template
                # put it, so it cannot be continued.
                raise InvalidRequestError(f"The final message cannot be continued: {str(e)[:500]}",
                                          param="continue_final_message") from None
            if template_kwargs:
                raise InvalidRequestError(f"The chat template cannot render these messages with "
                                          f"chat_template_kwargs: {str(e)[:500]}",
                                          param="chat_template_kwargs") from None
            if not tools and not any("tool_calls" in m for m in messages):
                raise
            raise InvalidRequestError(f"The chat template cannot render these tools or tool calls: {e}",
                                      param="messages") from None
        return self._tokenizer.encode(text, add_special_tokens=special_tokens)

    def _start_session_read(self, schema, request: Request, sessions: Optional[SessionClient]) -> Optional[asyncio.Task]:
        """The read of the session a chat request names in its ``X-Session-Id`` header,
        started before the body is read: under Serve the body is a call back to the HTTP
        proxy (~2.5 ms here) and the read a call to the data plane (~4.5 ms), so the two
        overlap. ``_chat_prompt`` awaits it, after the body's own checks, so errors keep
        their order; the header names the session even when the body does too."""
        session_id = request.headers.get("x-session-id")
        if not session_id or sessions is None or schema is not ChatCompletionRequest:
            return None
        # Its own Serve request id: the router's KV lookup for this request may be in
        # flight beside it, to the same deployment (see app/serve_context.py).
        task = serve_context.spawn(sessions.get(session_id))
        # Retrieved here, so a read that fails unawaited (the body was bad) is not logged
        # as a never-retrieved exception; an awaited one still raises to its caller.
        task.add_done_callback(lambda t: t.cancelled() or t.exception())
        return task

    def _start_session_lookup(self, sessions: Optional[SessionClient], session_id: Optional[str]) -> Optional[SessionLookup]:
        """The KV lookup of the blocks of session ``session_id``'s last turn, when this
        ingress appended it (``_commit_turn``), started as the request arrives: from the
        ``X-Session-Id`` header before the body is read (a call back to the HTTP proxy,
        ~2.5 ms, during which Serve's router, on this event loop, gets the call on its
        way), else from the body's ``session_id`` once it is checked. Its assignment to a
        data-plane replica then overlaps the body's read and the prompt's build (the
        history's template and tokenising, ~5-8 ms for 2k tokens here) instead of
        following them. ``_start`` hands it on if the prompt was built on the version
        that turn left; the router, if the prompt extends that turn
        (``Router.start_session_lookup``)."""
        if not session_id or sessions is None:
            return None
        cached = sessions.cached(session_id)
        return self._router.start_session_lookup(
            sessions.tenant, session_id, version=None if cached is None else cached.version
        )

    async def _chat_prompt(
        self,
        req: ChatCompletionRequest,
        request: Request,
        sessions: Optional[SessionClient],
        early_session: Optional[asyncio.Task] = None,
    ):
        """Prompt token ids of a chat request, with the session's history in front when it
        names one; also returns the turn to append once the reply is done, and the check
        to pass before the turn may reach a worker (None: nothing to check).
        ``early_session``: the read of the header's session, already started.

        A session this ingress holds a record of (``SessionClient.cached``) does not wait
        for the read: its prompt is built from that record at once, and the check (the
        read compared with it) gates the worker call in the router, so the read overlaps
        the prompt's build, the router and the KV lookup's start. Once the read shows a
        newer record, the prompt is built again from it (see ``_serve``)."""
        new_messages = template_messages(req)
        session_id = _named_session(request, req)
        if session_id is None:
            if req.history:  # a Responses request's (app/responses.py)
                new_messages = req.history + new_messages
            ids = self._chat_prompt_ids(
                new_messages, req.tools, req.chat_template_kwargs,
                generation_prompt=req.add_generation_prompt, continue_final=req.continue_final_message,
                special_tokens=bool(req.add_special_tokens),
            )
            return self._truncated(req, ids), None, None
        if not req.add_generation_prompt or req.continue_final_message:
            # The turn appended is the new messages and a reply of its own.
            raise InvalidRequestError(
                "A session turn ends with the assistant's reply: add_generation_prompt must be true and "
                "continue_final_message false; send the conversation without a session to continue a message.",
                param="continue_final_message" if req.continue_final_message else "add_generation_prompt")
        for name, value in (("truncate_prompt_tokens", req.truncate_prompt_tokens),
                            ("add_special_tokens", req.add_special_tokens or None)):
            if value is not None:
                # A session's prompt is its history rendered as every turn renders it (the
                # reply ids spliced in); what does not fit is dealt with by its overflow
                # policy (dataplane.sessions.overflow_policy).
                raise InvalidRequestError(
                    f"{name} does not apply to a session turn: the session's overflow policy fits its "
                    "history to the context.", param=name)
        if sessions is None:
            raise InvalidRequestError("Sessions are disabled on this server.", param="session_id")
        if early_session is not None and session_id == request.headers.get("x-session-id"):
            cached = sessions.cached(session_id)
            if cached is not None:
                try:
                    prompt_ids, turn = self._session_prompt(req, sessions, session_id, new_messages, cached)
                except APIError:
                    pass  # an answer the store's copy must give: built from it below
                else:
                    return prompt_ids, turn, self._session_check(early_session, cached)
            record = await early_session
        else:
            record = await sessions.get(session_id)
        return (*self._session_prompt(req, sessions, session_id, new_messages, record), None)

    def _session_check(self, read: asyncio.Task, cached) -> asyncio.Future:
        """Done when the store's record (``read``) is the one the prompt was built from;
        raises ``_SessionMoved`` when the store's is newer (and the read's own error, 404
        for a session deleted or expired meanwhile; 503 when its store refuses writes)."""

        async def check() -> None:
            record = await asyncio.shield(read)  # the caller may still need the read
            check_writable(record)
            if record.version != cached.version:
                raise _SessionMoved(record)

        task = asyncio.ensure_future(check())
        # Retrieved here: a start that failed before the router awaited it leaves it alone.
        task.add_done_callback(lambda t: t.cancelled() or t.exception())
        return task

    def _session_prompt(
        self, req: ChatCompletionRequest, sessions: SessionClient, session_id: str, new_messages: list[dict], record
    ):
        """Prompt ids and the pending turn of a session turn, on ``record``'s history."""
        check_writable(record)
        built: list[list[int]] = []

        def count_tokens(msgs: list[dict]) -> int:
            # With this turn's tools and template variables: a turn that changes them
            # changes the rendering of the history too, and reuses less KV (the router's
            # session lookup sees the mismatch), never a wrong prompt.
            built.append(self._chat_prompt_ids(msgs, req.tools, req.chat_template_kwargs))
            return len(built[-1])

        # fit_history counts the messages it returns last, so those ids are the prompt's
        # (built once, not again here: ~1 ms of templating per 2k-token history).
        fit_history(
            record.messages,
            new_messages,
            count_tokens=count_tokens,
            max_new_tokens=req.requested_max_tokens() or self._config.limits.default_max_tokens,
            max_model_len=self._max_model_len,
            policy=sessions.config.overflow_policy,
        )
        turn = PendingTurn(session_id, record.version, new_messages, record.num_tokens, tenant=sessions.tenant)
        return built[-1], turn

    async def _commit_turn(self, call: "_Call", text: str) -> None:
        """Append the finished turn (user messages + reply) in one compare-and-set."""
        if call.turn is None:
            return
        reply = {"role": "assistant", "content": text}
        ids = reply_token_ids(call.output_ids, call.finish_reason, self._special_ids)
        if ids is not None:
            reply[TOKEN_IDS_KEY] = ids
        messages = call.turn.new_messages + [reply]
        sessions = self._sessions_of(call.turn.tenant)
        record = await sessions.append(
            call.turn, messages, call.num_prompt_tokens + call.num_output_tokens
        )
        if ids is not None and call.prompt_ids is not None:
            # The next turn's prompt repeats this prompt and these reply ids exactly: its
            # KV lookup of them may start before that prompt is built (the router's).
            self._router.remember_session_turn(
                sessions.tenant, call.turn.session_id, record.version, call.prompt_ids + ids, call.cache_salt,
                call.lora,
            )

    def _completion_prompt_ids(self, req: CompletionRequest, prompt) -> list[int]:
        """The ids of one of ``req``'s prompts (a text or token ids)."""
        if isinstance(prompt, list):
            return self._truncated(req, list(prompt))
        special = req.add_special_tokens is not False  # a BOS unless told not to, as vLLM's
        return self._truncated(req, self._tokenizer.encode(prompt, add_special_tokens=special))

    def _truncated(self, req, ids: list[int]) -> list[int]:
        """``ids`` cut to the request's ``truncate_prompt_tokens`` (vLLM's: -1 is the
        context less one token for the reply; a value over the context is a 400), from
        ``truncation_side``, else the tokenizer's side."""
        keep = req.truncate_prompt_tokens
        if keep is None:
            return ids
        if keep > self._max_model_len:
            raise InvalidRequestError(
                f"truncate_prompt_tokens={keep} cannot be greater than this model's context of "
                f"{self._max_model_len} tokens.", param="truncate_prompt_tokens")
        if keep < 0:
            keep = self._max_model_len - 1
        if len(ids) <= keep:
            return ids
        side = req.truncation_side or getattr(self._tokenizer, "truncation_side", "right")
        return ids[-keep:] if side == "left" else ids[:keep]

    @staticmethod
    async def _next(stream) -> TokenDelta:
        # No deadline of its own: the router bounds every wait of the request (queue,
        # session check, each delta) by limits.request_timeout_s and answers 504.
        return await stream.__anext__()

    @staticmethod
    async def _drain(streams) -> None:
        """Read finished choices' streams to their end, in this task. Nothing comes after
        a finish delta, but the generators behind it (the router's, and in one process
        with its worker the worker's) then run their own code after their last yield: the
        router's cleanup and root index, the worker's token count and trace span. A stream
        left at its last yield is closed later by the garbage collector, in a task of its
        own, where none of that runs (and OpenTelemetry cannot detach the span's context)."""
        for stream in streams:
            try:
                # Bounded: the reply is complete, and its connection ends only after this.
                async with asyncio.timeout(DRAIN_TIMEOUT_S):
                    async for delta in stream:
                        logger.warning("a delta after the finish: %r", delta)
            except TimeoutError:
                logger.warning("a finished stream did not end within %.0fs; cancelled", DRAIN_TIMEOUT_S)
                stream.cancel()
            except Exception as e:  # noqa: BLE001 - the reply is complete; its tail only logs
                logger.debug("stream ended with %r after its finish", e)

    def _record(self, calls: list[_Call], status: int) -> None:
        """One request's metrics and log line; ``calls`` are its choices (``n``)."""
        call = calls[0]
        num_prompt = _prompt_tokens(calls)
        if call.grant is not None:  # what it did not generate goes back to its bucket
            self._refund(call.grant, call.grant.tokens - num_prompt - sum(c.num_output_tokens for c in calls))
        tags = {"endpoint": call.endpoint}
        self._m.requests.inc(tags={"endpoint": call.endpoint, "status": str(status)})
        if status != 200:
            return
        end = time.monotonic()
        num_output = sum(c.num_output_tokens for c in calls)
        self._m.e2e.observe(end - call.received, tags=tags)
        usage_tags = {"endpoint": call.endpoint, "tenant": call.tenant, "model": call.model}
        self._m.prompt_tokens.inc(num_prompt, tags=usage_tags)
        num_cached = _cached_tokens(calls)
        if num_cached:
            self._m.cached_tokens.inc(num_cached, tags=usage_tags)
        if num_output:
            self._m.output_tokens.inc(num_output, tags=usage_tags)
        # Only a streamed request has a first token the client sees (a buffered one gets
        # its deltas from the router at the end).
        firsts = [c.first_token_at for c in calls if c.first_token_at is not None]
        if firsts and call.streamed:
            self._m.ttft.observe(min(firsts) - call.received, tags=tags)
            for c in calls:  # per sequence: each choice decodes its own tokens
                if c.first_token_at is not None and c.num_output_tokens > 1:
                    self._m.tpot.observe(
                        (end - c.first_token_at) / (c.num_output_tokens - 1), tags=tags
                    )
        logger.info(
            "request done: id=%s endpoint=%s tenant=%s n=%d prompt_tokens=%d cached_tokens=%d "
            "output_tokens=%d finish=%s prompt_ms=%.1f ttft_ms=%.1f e2e_ms=%.1f trace=%s",
            call.request_id,
            call.endpoint,
            call.tenant,
            len(calls),
            num_prompt,
            num_cached,
            num_output,
            ",".join(str(c.finish_reason) for c in calls),
            1000 * (call.started - call.received),
            1000 * ((min(firsts) if firsts else end) - call.received),
            1000 * (end - call.received),
            call.trace_id,
        )

    def _usage(self, calls: list[_Call], req=None) -> dict:
        # Each prompt is counted once, as OpenAI does for n > 1; so are its cached tokens
        # (OpenAI's prompt caching field: KV reused instead of prefilled).
        prompt = _prompt_tokens(calls)
        completion = sum(c.num_output_tokens for c in calls)
        usage = {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": _cached_tokens(calls)},
        }
        if isinstance(req, ChatCompletionRequest) and self._reasoning_tokens_counted():
            # As vLLM's chat server reports them with a reasoning parser: every chat
            # request's usage has the field (0 where the parser does not apply).
            parsing = req.reply_parsing
            counted = sum(parsing.count_reasoning_tokens(c.output_ids or []) for c in calls) if parsing else 0
            usage["completion_tokens_details"] = {"reasoning_tokens": counted}
        return usage

    def _reasoning_tokens_counted(self) -> bool:
        return self._reply_parser is not None and self._reply_parser.reasoning_parser is not None

    # ---- generation -------------------------------------------------------------------

    def _choice_requests(self, req, first: GenerationRequest) -> list[GenerationRequest]:
        """``n`` independent sequences of one prompt. Choice i samples with ``seed + i``, so
        a seeded request with n choices gives what n single requests seeded seed, seed+1,
        ... give."""
        out = [first]
        for i in range(1, req.n):
            seed = first.sampling.seed
            if seed is not None:
                seed += i
                if seed > SEED_MAX:  # wrap within the signed 64-bit range
                    seed -= 1 << 64
            out.append(
                dataclasses.replace(
                    first,
                    request_id=uuid.uuid4().hex,
                    # The prompt's logprobs are choice 0's to compute (one prompt); the
                    # others keep their cached prefix.
                    sampling=dataclasses.replace(
                        first.sampling, seed=seed, stop=list(first.sampling.stop), prompt_logprobs=None
                    ),
                )
            )
        return out

    async def _stop(self, tasks: list[asyncio.Future], streams: list[_LocalStream]) -> None:
        """Stop every choice: cancel the tasks reading them, then close their streams (which
        aborts the sequences in the engine)."""
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        for s in streams:
            s.cancel()

    async def _each_choice(self, coros: list, streams: list[_LocalStream]) -> list:
        """Await one coroutine per choice, concurrently (in place when there is one, as on
        the hot path); on any failure stop every choice, then re-raise."""
        if len(coros) == 1:
            try:
                return [await coros[0]]
            except BaseException:
                streams[0].cancel()
                raise
        # Each with its own Serve request id: the choices' calls to the workers (and to
        # the data plane) are in flight side by side (see app/serve_context.py).
        tasks = [serve_context.spawn(c) for c in coros]
        try:
            return list(await asyncio.gather(*tasks))
        except BaseException:
            await self._stop(tasks, streams)
            raise

    async def _serve(self, endpoint: str, request: Request, schema) -> Response:
        received = time.monotonic()
        with self._tracer.start_as_current_span(f"ingress.{endpoint}") as span:
            early_session = session_lookup = grant = responding = None
            try:
                tenant = self._authenticate(request, span)
                sessions = self._sessions_of(tenant)
                self._router.reject_if_full(tenant)
                early_session = self._start_session_read(schema, request, sessions)
                if early_session is not None:
                    session_lookup = self._start_session_lookup(sessions, request.headers.get("x-session-id"))
                if schema is ResponsesRequest:
                    req, responding = await self._responses_request(
                        request, await self._read_json(request), sessions, tenant
                    )
                else:
                    req = self._validate(schema, await self._read_json(request), tenant)
                turn = check = None
                more_prompts: list[list[int]] = []
                places = self._router.max_tenant_places
                num_prompts = len(req.prompt_list()) if isinstance(req, CompletionRequest) else 1
                if req.n * num_prompts > places:
                    # Each choice takes a place in the router's queue (of the tenant's
                    # share of it): a request with more choices could never get in.
                    share = "" if places == self._config.router.max_queue_depth else " (one API key's share of it)"
                    what = f"n={req.n}" if num_prompts == 1 else f"n={req.n} times {num_prompts} prompts"
                    raise InvalidRequestError(
                        f"{what} exceeds this server's queue depth of {places}{share}.",
                        param="n" if num_prompts == 1 else "prompt",
                    )
                if isinstance(req, ChatCompletionRequest):
                    if req.n > 1 and _named_session(request, req) is not None:
                        raise InvalidRequestError(
                            "n must be 1 in a session turn: one reply is appended to the session.",
                            param="n",
                        )
                    if session_lookup is None and not request.headers.get("x-session-id"):
                        session_lookup = self._start_session_lookup(sessions, req.session_id)
                    prompt_ids, turn, check = await self._chat_prompt(req, request, sessions, early_session)
                else:
                    _refuse_session(request, req, "Sessions hold chat turns: name one (X-Session-Id header or "
                                    "session_id) in a request to /v1/chat/completions, not /v1/completions.")
                    if (problem := req.max_tokens_problem()) is not None:
                        raise InvalidRequestError(problem, param="max_tokens")
                    prompts = [self._completion_prompt_ids(req, p) for p in req.prompt_list()]
                    prompt_ids, more_prompts = prompts[0], prompts[1:]
                if self._limiter is not None:
                    grant = await self._limiter.acquire(tenant, sum(
                        len(ids) + req.n * self._max_tokens(req, len(ids)) for ids in [prompt_ids, *more_prompts]
                    ))
                started = time.monotonic()
                try:
                    calls, streams, firsts = await self._start(
                        endpoint, req, span, tenant, prompt_ids, turn, check, received, started, session_lookup,
                        more_prompts, kv_owner=responding.kv_owner if responding is not None else None,
                    )
                except Exception as e:
                    if check is None:
                        raise
                    # Started on this ingress's record of the session: the store's record
                    # decides. Its 404 stands, and so does any error of a turn whose
                    # history was the store's; else the turn starts again on the store's.
                    record = await early_session
                    if record.version == turn.expected_version and not isinstance(e, _SessionMoved):
                        raise
                    check = None
                    self._count_session_turn(span, "stale")
                    logger.debug(
                        "session %s: this ingress held version %d, the store %d; prompt built again",
                        turn.session_id, turn.expected_version, record.version,
                    )
                    prompt_ids, turn = self._session_prompt(req, sessions, turn.session_id, turn.new_messages, record)
                    calls, streams, firsts = await self._start(
                        endpoint, req, span, tenant, prompt_ids, turn, None, received, started, session_lookup
                    )
                else:
                    if turn is not None:
                        self._count_session_turn(span, "hit" if check is not None else "miss")
                calls[0].grant = grant
            except Exception as e:  # noqa: BLE001 - every failure becomes an OpenAI error
                if grant is not None:  # it generated nothing
                    self._refund(grant, grant.tokens)
                err = to_api_error(e)
                if schema is ResponsesRequest:
                    err = responses.responses_error(err)
                span.set_attribute("http.status_code", err.status_code)
                self._m.requests.inc(tags={"endpoint": endpoint, "status": str(err.status_code)})
                return error_response(err)
            finally:
                if early_session is not None:
                    early_session.cancel()  # unused (the request failed first): a read only
                if session_lookup is not None:
                    session_lookup.task.cancel()  # the router took it before the worker call, or never will
            limit_headers = {} if grant is None else grant.headers
            if req.stream:
                body = self._stream_body(req, calls, firsts, streams) if responding is None else (
                    self._responses_stream(responding, req, calls, firsts, streams))
                return StreamingResponse(
                    body,
                    media_type="text/event-stream",
                    headers={"Cache-Control": "no-cache", "X-Request-Id": calls[0].request_id, **limit_headers},
                )
            render = None if responding is None else functools.partial(self._responses_render, responding)
            response = await self._complete_body(req, calls, firsts, streams, render)
            response.headers.update(limit_headers)
            return response

    def _refund(self, grant: Grant, unused_tokens: int) -> None:
        """Give ``unused_tokens`` back to ``grant``'s bucket, in the background."""
        if grant.tokens and unused_tokens > 0:
            refund = asyncio.ensure_future(self._limiter.refund(grant, unused_tokens))
            self._stopping.add(refund)  # held until done (the loop keeps weak refs)
            refund.add_done_callback(self._stopping.discard)

    def _count_session_turn(self, span, result: str) -> None:
        self._m.session_cache.inc(tags={"result": result})
        span.set_attribute("llm.session_cache", result)

    async def _start(
        self,
        endpoint: str,
        req,
        span,
        tenant: str,
        prompt_ids: list[int],
        turn,
        check,
        received: float,
        started: float,
        session_lookup: Optional[SessionLookup] = None,
        more_prompts: Sequence[list[int]] = (),
        kv_owner: Optional[str] = None,
    ):
        """Hand the request's choices to the router and wait for each one's first delta
        (so that a rejection keeps its status code). ``check``: what the router awaits
        before the worker call (see ``_chat_prompt``); ``session_lookup``: see
        ``_start_session_lookup``; ``more_prompts``: a completion's further prompts, whose
        choices follow the first prompt's (``n`` each); ``kv_owner``: a stored response's
        id, which lists the blocks computed for it (``GenerationRequest.kv_owner``).
        Returns the calls, their streams and their first deltas."""
        gen_request = self._generation_request(req, prompt_ids, tenant)
        if kv_owner is not None:
            gen_request.kv_owner = kv_owner
            span.set_attribute("llm.kv_owner", kv_owner)
        # A non-streaming client sees nothing before the end, so the router may
        # run it again if its worker dies mid-way (see Router._stream_with_retry).
        gen_request.buffered = not req.stream
        if turn is not None:
            gen_request.session_id = turn.session_id
            gen_request.session_continues = turn.expected_version > 0
            span.set_attribute("llm.session_id", turn.session_id)
        gen_requests, calls = [], []
        sent = req.prompt_list() if isinstance(req, CompletionRequest) else [None]
        echo = isinstance(req, CompletionRequest) and req.echo  # (a chat echo is the reply's, _completion_json)
        for ids, prompt in zip([prompt_ids, *more_prompts], sent):
            first = gen_request if ids is prompt_ids else self._generation_request(req, ids, tenant)
            first.buffered = gen_request.buffered
            group = self._choice_requests(req, first)
            group_calls = [_Call(endpoint, g.request_id, len(ids), tenant) for g in group]
            head = group_calls[0]
            if req.return_token_ids:
                head.prompt_ids = ids
            if first.sampling.prompt_logprobs is not None:
                head.prompt_logprob_ids = ids
            # The text as sent (vLLM's), or the ids' text where ids were sent or cut.
            echo_text = None if not echo else (
                prompt if isinstance(prompt, str) and req.truncate_prompt_tokens is None else self._tokenizer.decode(ids))
            for c in group_calls:
                c.head = head
                if echo:
                    c.echo_text, c.echo_only = echo_text, req.echo_only()
            gen_requests += group
            calls += group_calls
        for c in calls:
            c.streamed = bool(req.stream)
            c.received, c.started = received, started
            c.model = gen_request.lora or self._config.model.id
            if not req.stream and gen_request.sampling.logprobs is not None:
                c.logprob_items = []
        call = calls[0]
        call.turn = turn
        if turn is not None:
            call.output_ids = []
            call.prompt_ids = prompt_ids
            call.cache_salt = req.cache_salt
            call.lora = gen_request.lora
        elif getattr(req, "history", None) is not None:
            call.output_ids = []  # a Responses reply, stored with its ids
        parsing = getattr(req, "reply_parsing", None)
        if (parsing is not None and parsing.reasoning) or req.return_token_ids:
            # Their reasoning tokens are counted from them (_usage); or the reply returns them.
            for c in calls:
                if c.output_ids is None:
                    c.output_ids = []
        if gen_request.sampling.prompt_logprobs is not None:
            span.set_attribute("llm.prompt_logprobs", gen_request.sampling.prompt_logprobs)
        early = None
        if session_lookup is not None:
            if turn is not None and turn.expected_version == session_lookup.version:
                early = session_lookup.task
            else:
                # Built on a later record (turns appended elsewhere since, or a rebuild on
                # the store's): that lookup would miss their blocks.
                self._router.drop_session_lookup(session_lookup)
        span.set_attribute("llm.request_id", call.request_id)
        span.set_attribute("llm.prompt_tokens", _prompt_tokens(calls))
        if more_prompts:
            span.set_attribute("llm.prompts", 1 + len(more_prompts))
        span.set_attribute("llm.stream", req.stream)
        span.set_attribute("llm.n", req.n)
        sampling = gen_request.sampling  # what the schema's methods gave, computed once
        for feature in request_features(req, sampling, gen_request.lora):
            self._m.features.inc(tags={"endpoint": endpoint, "feature": feature})
        if gen_request.lora:
            span.set_attribute("llm.lora", gen_request.lora)
        if sampling.logprobs is not None:
            span.set_attribute("llm.logprobs", sampling.logprobs)
        if sampling.structured_output is not None:
            span.set_attribute("llm.structured_output", sampling.structured_output[0])
        if req.priority:
            span.set_attribute("llm.priority", req.priority)
        streams = [
            _LocalStream(self._router.generate(g, gate=check, session_lookup=early if i == 0 else None))
            for i, g in enumerate(gen_requests)
        ]
        firsts = await self._each_choice([self._next(s) for s in streams], streams)
        for c, first in zip(calls, firsts):
            c.on_delta(first)
        return calls, streams, firsts

    async def _rest_of_choice(self, call: _Call, first: TokenDelta, stream) -> str:
        parts = [first.text]
        delta = first
        while delta.finish_reason is None:
            delta = await self._next(stream)
            call.on_delta(delta)
            parts.append(delta.text)
        await self._drain([stream])
        return "".join(parts)

    async def _complete_body(self, req, calls: list[_Call], firsts, streams, render=None) -> Response:
        """The whole reply. ``render``: turns the chat completion's body into another
        API's (a Responses request's, which it also stores); its error is the request's."""
        try:
            texts = await self._each_choice(
                [self._rest_of_choice(c, f, s) for c, f, s in zip(calls, firsts, streams)], streams
            )
            await self._commit_turn(calls[0], texts[0])
            body = self._completion_json(req, calls, texts)
            if render is not None:
                body = await render(body, calls)
        except BaseException as e:
            for s in streams:  # (a failed choice has stopped them all already)
                s.cancel()
            if not isinstance(e, Exception):
                raise
            err = to_api_error(e)
            self._record(calls, err.status_code)
            return error_response(err)
        self._record(calls, 200)
        return JSONResponse(body, headers={"X-Request-Id": calls[0].request_id})

    def _completion_json(self, req, calls: list[_Call], texts: list[str]) -> dict:
        chat = isinstance(req, ChatCompletionRequest)
        choices = []
        tool_mode = req.tool_call_mode() if chat else None
        role = req.reply_role() if chat else None
        prompt_logprobs = None  # the current prompt's (its head comes first among its choices)
        as_ids = bool(req.return_tokens_as_token_ids)
        chat_echo = req.echo_text() if chat else ""
        for i, (c, text) in enumerate(zip(calls, texts)):
            if chat:
                message = {"role": role, "content": text}
                finish = c.finish_reason
                if tool_mode:
                    content, tool_calls, finish = tool_reply(tool_mode, req.called_function(), text, finish)
                    message = {"role": role, "content": content}
                    if tool_calls:
                        message["tool_calls"] = tool_calls
                elif req.reply_parsing is not None and (parsed := self._parse_reply(req, text)) is not None:
                    message = {"role": role, "content": parsed.content}
                    if parsed.reasoning is not None:
                        message["reasoning"] = parsed.reasoning
                    if parsed.tool_calls:
                        # vLLM's finish reason for a reply that called a tool under "auto".
                        message["tool_calls"] = parsed.tool_calls
                        finish = "tool_calls"
                if req.echo:  # vLLM's: in front of the content, whatever it is
                    message["content"] = chat_echo + (message["content"] or "")
                choices.append(
                    {
                        "index": i,
                        "message": message,
                        "logprobs": self._logprobs_json(chat, c.logprob_items, as_ids=as_ids)[0],
                        "finish_reason": finish,
                    }
                )
            else:
                logprobs = self._logprobs_json(chat, c.logprob_items, as_ids=as_ids)[0]
                if c.echo_text is not None:
                    text = c.echo_text + ("" if c.echo_only else text)
                    echoed = self._echo_logprob_items(req, c.head)
                    if echoed is not None:
                        # In front; the reply's own tokens' texts have only the reply's
                        # tokens before them as context, as vLLM's.
                        head, offset = self._logprobs_json(chat, echoed, as_ids=as_ids)
                        logprobs = _joined(
                            head, self._logprobs_json(chat, c.logprob_items or [], offset, as_ids=as_ids)[0]
                        )
                choices.append({"index": i, "text": text, "logprobs": logprobs, "finish_reason": c.finish_reason})
                if c.head.prompt_logprobs is not None:  # vLLM's: on each choice, its prompt's
                    if c.head is c:  # written once per prompt, shared by its choices
                        prompt_logprobs = self._prompt_logprobs_json(c)
                    choices[-1]["prompt_logprobs"] = prompt_logprobs
                if req.return_token_ids:  # vLLM's: a completion's choices carry the prompt's
                    choices[-1]["prompt_token_ids"] = c.head.prompt_ids
            if req.return_token_ids:
                choices[-1]["token_ids"] = list(c.output_ids)
        body = {
            "id": new_id("chatcmpl" if chat else "cmpl"),
            "object": "chat.completion" if chat else "text_completion",
            "created": now(),
            "model": req.model,
            "choices": choices,
            "usage": self._usage(calls, req),
        }
        if chat and req.return_token_ids:
            body["prompt_token_ids"] = calls[0].prompt_ids
        if chat and calls[0].prompt_logprobs is not None:
            body["prompt_logprobs"] = self._prompt_logprobs_json(calls[0])
        return body

    async def _stream_body(self, req, calls: list[_Call], firsts, streams) -> AsyncIterator[bytes]:
        async with contextlib.aclosing(self._stream_payloads(req, calls, firsts, streams)) as payloads:
            async for payload in payloads:
                yield SSE_DONE if payload is None else _sse(payload)

    async def _stream_payloads(
        self, req, calls: list[_Call], firsts, streams, on_end=None
    ) -> AsyncIterator[Optional[dict]]:
        """The chat (or completions) stream's chunks, then None where ``[DONE]`` goes; an
        error event's body in place of the rest when the request fails mid-way.
        ``on_end``: awaited with the usage once every choice has ended, before the usage
        chunk (a Responses request's store); its error is the stream's."""
        chat = isinstance(req, ChatCompletionRequest)
        chunk_id = new_id("chatcmpl" if chat else "cmpl")
        created = now()
        base = {
            "id": chunk_id,
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": created,
            "model": req.model,
        }
        include_usage = req.include_usage_in_stream()
        continuous = include_usage and req.stream_options.continuous_usage_stats
        want_logprobs = req.requested_logprobs() is not None
        as_ids = bool(req.return_tokens_as_token_ids)
        reply_role = req.reply_role() if chat else None
        # Per choice: (token id, TokenLogprobs) of tokens whose deltas sent no chunk yet (no
        # text yet: a character split across tokens), and the completions API's text offset.
        carried: list[list] = [[] for _ in calls]
        offsets = [0] * len(calls)
        # Per choice: the reply's last tokens sent, context of the next ones' texts
        # (_logprob_text); an echoed prompt's logprobs, ahead of its first chunk's own.
        recent: list[list[int]] = [[] for _ in calls]
        echo_head: list[Optional[dict]] = [None] * len(calls)
        # return_token_ids (vLLM's): each choice's token ids not sent in a chunk yet, and
        # whether its prompt's ids went out (a chat stream's first chunk carries them, a
        # completion's each choice's first).
        want_ids = req.return_token_ids
        unsent_ids: list[list[int]] = [[] for _ in calls]
        prompt_sent = [False] * len(calls)

        def chunk(
            index: int, text: Optional[str], finish: Optional[str], role: bool = False, tool_calls=None,
            reasoning: Optional[str] = None,
        ) -> dict:
            logprobs = None
            if want_logprobs and not role:
                logprobs, offsets[index] = self._logprobs_json(
                    chat, carried[index], offsets[index], recent[index], as_ids=as_ids
                )
                carried[index] = []
                if echo_head[index] is not None:
                    logprobs, echo_head[index] = _joined(echo_head[index], logprobs), None
            if chat:
                delta = {"role": reply_role, "content": text or ""} if role else (
                    {"content": text} if text else {}
                )
                if reasoning:
                    delta["reasoning"] = reasoning
                if tool_calls:
                    delta["tool_calls"] = [{"index": j, **c} for j, c in enumerate(tool_calls)]
                choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
            else:
                choice = {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish}
            payload = {**base, "choices": [choice]}
            if want_ids:
                choice["token_ids"], unsent_ids[index] = unsent_ids[index], []
                if not prompt_sent[index] and (index == 0 or not chat):
                    (payload if chat else choice)["prompt_token_ids"] = calls[index].head.prompt_ids
                prompt_sent[index] = True
            if continuous:
                # vLLM's continuous_usage_stats: this choice's tokens so far (none yet in
                # the chunk that opens it).
                prompt, done = calls[index].head.num_prompt_tokens, 0 if role else calls[index].num_output_tokens
                payload["usage"] = {"prompt_tokens": prompt, "completion_tokens": done, "total_tokens": prompt + done}
            elif include_usage:
                payload["usage"] = None
            return payload

        # A reply held to a tool call goes out as tool_calls: a named function's arguments
        # as they come (the call's id and name in its first chunk, as vLLM streams them);
        # "required"'s list whole when its choice ends (its calls are known only parsed).
        tool_mode = req.tool_call_mode() if chat else None
        texts: list[list[str]] = [[] for _ in calls]
        opened = [False] * len(calls)
        # Read by vLLM's parsers as the reply comes (tool calls under "auto", reasoning),
        # one per choice; None once a parser failed (the rest of that reply goes out as text).
        parsing = req.reply_parsing if chat and not tool_mode else None
        parsed: list = [parsing.stream() for _ in calls] if parsing is not None else []
        sent = [""] * len(parsed)  # per choice: the content sent so far

        def parsed_chunks(index: int, delta: TokenDelta) -> list[dict]:
            text, finish, parser = delta.text, delta.finish_reason, parsed[index]
            out, reasoning, content, tool_calls = [], "", text, []
            if parser is not None:
                try:
                    reasoning, content, tool_calls = parser.feed(text, delta.token_ids, finish is not None)
                except Exception:  # noqa: BLE001 - a parser's failure must not fail the request
                    self._reply_parse_failed()
                    parsed[index], reasoning, tool_calls = None, "", []
                    # The rest of the reply goes out as text: from what the parser held
                    # back, while all it had passed on was content; after reasoning or a
                    # call it began (the client's to drop), from this delta.
                    held = parser.text
                    content = held[len(sent[index]):] if (
                        not (parser.called or parser.reasoned) and held.startswith(sent[index])) else text
            if reasoning or content or tool_calls:
                sent[index] += content
                out.append(chunk(index, content or None, None, tool_calls=tool_calls or None, reasoning=reasoning))
            if finish:
                if parser is not None and parsed[index] is not None:
                    self._count_parse(parser.called, parser.reasoned)
                    finish = "tool_calls" if parser.called else finish
                out.append(chunk(index, None, finish))
            return out

        echoing = calls[0].echo_text is not None  # a completion's echo: every choice's
        echo_open = [echoing] * len(calls)  # its first chunk carries the prompt

        def echoed(index: int, delta: TokenDelta) -> TokenDelta:
            """Choice ``index``'s delta as an echo sends it: the prompt in front of the
            first (its logprobs ahead of the chunk's own), the engine's one token out of
            an echo with max_tokens 0."""
            first = echo_open[index]
            if first:
                echo_open[index] = False
                items = self._echo_logprob_items(req, calls[index].head) if want_logprobs else None
                if items is not None:
                    echo_head[index], offsets[index] = self._logprobs_json(chat, items, as_ids=as_ids)
            if calls[index].echo_only:  # the engine's one token is not the client's
                delta = dataclasses.replace(delta, text="", token_ids=[], logprobs=None)
            if first:
                delta = dataclasses.replace(delta, text=calls[index].echo_text + delta.text)
            return delta

        def chunks(index: int, delta: TokenDelta) -> list[dict]:
            """The SSE chunks of choice ``index``'s delta (none for a delta with no text and
            no end: its logprobs go with the next chunk)."""
            if echoing:
                delta = echoed(index, delta)
            if want_logprobs and delta.logprobs:
                carried[index].extend(zip(delta.token_ids, delta.logprobs))
            if want_ids:
                unsent_ids[index].extend(delta.token_ids)
            text, finish = delta.text, delta.finish_reason
            if parsed:
                return parsed_chunks(index, delta)
            if not tool_mode:
                return [chunk(index, text, finish)] if text or finish else []
            if tool_mode == "named":
                out = []
                if text or (finish and not opened[index]):
                    if opened[index]:
                        part = {"function": {"arguments": text}}
                    else:
                        opened[index] = True
                        part = _tool_call(req.called_function(), text)
                    out.append(chunk(index, None, None, tool_calls=[part]))
                if finish:
                    out.append(chunk(index, None, finish))
                return out
            texts[index].append(text)
            if finish is None:
                return []
            content, tool_calls, reason = tool_reply(tool_mode, req.called_function(), "".join(texts[index]), finish)
            return [chunk(index, content, None, tool_calls=tool_calls), chunk(index, None, reason)]

        chat_echo = req.echo_text() if chat else ""

        def opening(index: int) -> list[dict]:
            """A chat choice's first chunks: its role, then (vLLM's echo) the last
            message's content, without logprobs."""
            out = [chunk(index, "", None, role=True)]
            if chat_echo:
                out.append(chunk(index, chat_echo, None))
                out[-1]["choices"][0]["logprobs"] = None
                if continuous:  # nothing generated in it
                    out[-1]["usage"] = {**out[-1]["usage"], "completion_tokens": 0,
                                        "total_tokens": out[-1]["usage"]["prompt_tokens"]}
            return out

        status = 200
        tasks: list[asyncio.Future] = []
        try:
            if len(calls) == 1:
                call, stream = calls[0], streams[0]
                parts: list[str] = []
                if chat:
                    for c in opening(0):
                        yield c
                delta = firsts[0]
                while True:
                    parts.append(delta.text)
                    if delta.finish_reason is not None:
                        # The turn is stored before the final chunk, so a client that saw
                        # finish_reason knows its turn is in the session (or gets the 409).
                        await self._commit_turn(call, "".join(parts))
                    for c in chunks(0, delta):
                        yield c
                    if delta.finish_reason is not None:
                        break
                    delta = await self._next(stream)
                    call.on_delta(delta)
            else:
                # n choices: one reader per choice feeds a queue; chunks go out in the
                # order their deltas arrive, each with its choice's index.
                queue: asyncio.Queue = asyncio.Queue()

                async def read(i: int) -> None:
                    delta = firsts[i]
                    try:
                        while delta.finish_reason is None:
                            delta = await self._next(streams[i])
                            calls[i].on_delta(delta)
                            queue.put_nowait((i, delta))
                    except Exception as e:  # noqa: BLE001 - handed to the writer
                        queue.put_nowait((i, e))

                for i, first in enumerate(firsts):
                    if chat:
                        for c in opening(i):
                            yield c
                    for c in chunks(i, first):
                        yield c
                open_choices = sum(1 for f in firsts if f.finish_reason is None)
                tasks = [asyncio.ensure_future(read(i)) for i, f in enumerate(firsts) if f.finish_reason is None]
                while open_choices:
                    i, item = await queue.get()
                    if isinstance(item, Exception):
                        raise item
                    for c in chunks(i, item):
                        yield c
                    if item.finish_reason is not None:
                        open_choices -= 1
            usage = self._usage(calls, req) if on_end is not None or include_usage else None
            if on_end is not None:
                await on_end(usage)
            if include_usage:
                yield {**base, "choices": [], "usage": usage}
        except Exception as e:  # noqa: BLE001 - the stream ends with an error event
            await self._stop(tasks, streams)
            err = to_api_error(e)
            status = err.status_code
            yield err.body()
        except BaseException:
            # The client went away (cancellation): stop the work behind this stream. With
            # readers, in a task of its own that lets them end before closing the streams
            # (this generator cannot await any more).
            if tasks:
                stopping = asyncio.ensure_future(self._stop(tasks, streams))
                self._stopping.add(stopping)
                stopping.add_done_callback(self._stopping.discard)
            else:
                for s in streams:
                    s.cancel()
            status = 499
            raise
        finally:
            self._record(calls, status)
        yield None
        if status == 200:
            await self._drain(streams)

    # ---- the Responses API (app/responses.py) ------------------------------------------

    async def _responses_request(
        self, request: Request, body: dict, sessions: Optional[SessionClient], tenant: str = DEFAULT_TENANT
    ):
        """The chat request that serves a Responses request's body, with the previous
        response's conversation (read from the store) and the instructions in front."""
        rreq = responses.parse_request(body)
        if request.headers.get("x-session-id") is not None or "session_id" in (rreq.model_extra or {}):
            raise InvalidRequestError(
                "A response continues another with previous_response_id, not a session; sessions "
                "hold /v1/chat/completions turns.", param="session_id",
            )
        if rreq.previous_response_id is not None and sessions is None:
            raise InvalidRequestError(
                "previous_response_id needs stored responses, and this server stores none "
                "(dataplane.enabled is false).", param="previous_response_id",
            )
        history: list[dict] = []
        if rreq.previous_response_id is not None:
            self._m.features.inc(tags={"endpoint": "responses", "feature": "previous_response"})
            with self._tracer.start_as_current_span("responses.read_previous"):
                try:
                    record = await sessions.get_response(rreq.previous_response_id)
                except Exception as e:
                    if self._count_store_error("read", to_api_error(e)) == "not_found":
                        raise NotFoundError(
                            f"Previous response with id '{rreq.previous_response_id}' not found.",
                            param="previous_response_id", code="previous_response_not_found",
                        ) from None
                    raise
            self._m.responses.inc(tags={"op": "read", "result": "ok"})
            if rreq.store:
                # Read while its store refuses writes: so would this response's store be,
                # after its reply was generated; refused now, as a session turn is.
                check_writable(record)
            history = record.messages
        new_messages = responses.input_messages(rreq)
        # (Its errors name chat fields: _serve names the Responses ones, responses_error.)
        req = self._validate(ChatCompletionRequest, responses.to_chat(rreq, new_messages), tenant)
        req.history = responses.instruction_messages(rreq) + responses.history_messages(history)
        if rreq.store and sessions is None:
            rreq.store = False  # what the response object says: nothing here stores it
        store = sessions if rreq.store else None
        return req, _Responding(
            rreq, responses.new_response_id(), responses.carried_history(history), new_messages,
            responses.input_items(rreq), store,
        )

    # ---- /tokenize and /detokenize (vLLM's) ------------------------------------------------

    async def _tokenizer_endpoint(self, endpoint: str, request: Request, work) -> Response:
        """``work`` (the request and its body → the answer) for /tokenize and /detokenize:
        the tokenizer's work alone, no worker call. The body is checked as a generation
        request's is (API key, size, JSON, model; no session), counted in
        ``llm_requests_total`` and traced."""
        with self._tracer.start_as_current_span(f"ingress.{endpoint}") as span:
            try:
                tenant = self._authenticate(request, span)
                answer = JSONResponse(work(request, await self._read_json(request), tenant))
            except Exception as e:  # noqa: BLE001 - every failure becomes an OpenAI error
                answer = error_response(to_api_error(e))
            span.set_attribute("http.status_code", answer.status_code)
            self._m.requests.inc(tags={"endpoint": endpoint, "status": str(answer.status_code)})
        return answer

    def _tokenizer_body(self, schema, request: Request, body: dict, tenant: str = DEFAULT_TENANT):
        try:
            req = schema.model_validate(body)
        except ValidationError as e:
            raise invalid_body(e) from None
        _refuse_session(request, req, "A session's history is not tokenized here: GET /v1/sessions/{id} gives "
                                      "its size in tokens.")
        refuse_unsupported(req)
        if req.model is not None:  # optional here, as in vLLM's
            self._check_model(req.model, tenant)
        return req

    def _tokenize(self, request: Request, body: dict, tenant: str = DEFAULT_TENANT) -> dict:
        """The prompt ids a completion (``prompt``) or a chat (``messages``) request would
        have here, as vLLM's /tokenize gives them."""
        req = self._tokenizer_body(TokenizeRequest, request, body, tenant)
        req.check_form()
        if req.prompt is not None:
            ids = self._tokenizer.encode(req.prompt, add_special_tokens=req.special_tokens())
        else:
            # The chat fields checked as a chat request's (roles, content parts, tools,
            # template variables), and rendered as its prompt is.
            chat = {"model": self._config.model.id, "messages": req.messages}
            for name in ("tools", "chat_template_kwargs"):
                if getattr(req, name):
                    chat[name] = getattr(req, name)
            try:
                creq = ChatCompletionRequest.model_validate(chat)
            except ValidationError as e:
                raise invalid_body(e) from None
            ids = self._chat_prompt_ids(
                template_messages(creq), creq.tools, creq.chat_template_kwargs,
                generation_prompt=req.add_generation_prompt, continue_final=req.continue_final_message,
                special_tokens=req.special_tokens(),
            )
        strs = self._tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None
        return {"count": len(ids), "max_model_len": self._max_model_len, "tokens": ids, "token_strs": strs}

    def _detokenize(self, request: Request, body: dict, tenant: str = DEFAULT_TENANT) -> dict:
        req = self._tokenizer_body(DetokenizeRequest, request, body, tenant)
        vocab = len(self._tokenizer)
        for i, t in enumerate(req.tokens):
            if t >= vocab:
                raise InvalidRequestError(
                    f"Invalid 'tokens[{i}]': token id {t} is outside this model's vocabulary of {vocab}.",
                    param="tokens",
                )
        return {"prompt": self._tokenizer.decode(req.tokens)}

    def _count_store_error(self, op: str, err: APIError) -> Optional[str]:
        """Count a stored response's read or delete that did not succeed, as not_found or
        failed (the store's fault, 5xx), and return which; a bad id or key is the
        client's and not counted (None)."""
        if err.status_code != 404 and err.status_code < 500:
            return None
        result = "not_found" if err.status_code == 404 else "failed"
        self._m.responses.inc(tags={"op": op, "result": result})
        return result

    async def _store_response(self, responding: _Responding, response: dict, call: "_Call") -> None:
        """Store ``response`` with its conversation (the previous response's, this
        request's input, the reply with its ids), if it is to be stored."""
        if responding.store is None:
            return
        ids = reply_token_ids(call.output_ids, call.finish_reason, self._special_ids)
        reply = responses.reply_message(response["output"], ids, TOKEN_IDS_KEY)
        reply[responses.RESPONSE_KEY] = response
        reply[responses.INPUT_ITEMS_KEY] = responding.input_items
        messages = responding.history + responding.new_messages + [reply]
        with self._tracer.start_as_current_span(
            "responses.store", attributes={"llm.response_id": responding.response_id, "llm.messages": len(messages)}
        ):
            try:
                await responding.store.store_response(
                    responding.response_id, messages, call.num_prompt_tokens + call.num_output_tokens,
                    self._config.dataplane.sessions.response_ttl_s,
                )
            except Exception as e:
                self._m.responses.inc(tags={"op": "store", "result": "failed"})
                logger.warning("response %s: not stored (%s); the request fails with it",
                               responding.response_id, type(e).__name__)
                raise
        self._m.responses.inc(tags={"op": "store", "result": "ok"})

    async def _responses_render(self, responding: _Responding, chat: dict, calls: list["_Call"]) -> dict:
        """A whole chat completion as the Responses API's response object, stored."""
        choice = chat["choices"][0]
        incomplete = choice["finish_reason"] == "length"
        output = responses.output_from_message(choice["message"], incomplete)
        response = responses.response_object(
            responding.req, responding.response_id, chat["created"],
            status="incomplete" if incomplete else "completed", output=output,
            usage_=responses.usage(chat["usage"]),
        )
        await self._store_response(responding, response, calls[0])
        return response

    async def _responses_stream(self, responding: _Responding, req, calls: list["_Call"], firsts, streams):
        """The chat stream's chunks as the Responses API's events; the response is stored
        once the reply ended, before ``response.completed`` (a client that saw it can
        continue it), and a store that fails ends the stream with ``response.failed``."""
        events = responses.StreamEvents(responding.req, responding.response_id)
        done: list[dict] = []

        async def on_end(usage: dict) -> None:
            status = "incomplete" if events.finish_reason == "length" else "completed"
            done.extend(events.end(status))
            response = responses.response_object(
                responding.req, responding.response_id, events.created_at, status=status,
                output=events.output, usage_=responses.usage(usage),
            )
            await self._store_response(responding, response, calls[0])
            done.extend(events.final(response))

        for event in events.start():
            yield responses.sse_event(event)
        payloads = self._stream_payloads(req, calls, firsts, streams, on_end=on_end)
        async with contextlib.aclosing(payloads):
            async for payload in payloads:
                if payload is None:
                    continue
                if "error" in payload:
                    out = done + events.failed(payload["error"])
                elif payload.get("usage"):
                    out = done
                else:
                    out = events.chunk(payload)
                for event in out:
                    yield responses.sse_event(event)

    # ---- routes -----------------------------------------------------------------------


@serve.ingress(fastapi_app)
class IngressDeployment(Ingress, GrpcIngress):
    @fastapi_app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request) -> Response:
        return await self._serve("chat", request, ChatCompletionRequest)

    @fastapi_app.post("/v1/completions")
    async def completions(self, request: Request) -> Response:
        return await self._serve("completions", request, CompletionRequest)

    @fastapi_app.post("/v1/responses")
    async def create_response(self, request: Request) -> Response:
        return await self._serve("responses", request, ResponsesRequest)

    # Before the route below, whose path parameter would take "{id}/input_items" whole.
    @fastapi_app.get("/v1/responses/{response_id}/input_items")
    async def response_input_items(self, response_id: str, request: Request) -> Response:
        """The items a stored response was generated from (OpenAI's list, paged)."""
        try:
            record = await self._read_stored_response(request, response_id)
            page = responses.items_page(responses.conversation_items(record.messages),
                                        request.query_params.multi_items())
        except APIError as e:
            return error_response(e)
        return JSONResponse(page)

    @fastapi_app.get("/v1/responses/{response_id:path}")
    async def get_response(self, response_id: str, request: Request) -> Response:
        try:
            record = await self._read_stored_response(request, response_id)
        except APIError as e:
            return error_response(e)
        return JSONResponse(record.messages[-1][responses.RESPONSE_KEY])

    async def _read_stored_response(self, request: Request, response_id: str):
        """A stored response's record, its read counted; or the error to answer."""
        try:
            record = await self._require_sessions(request, NO_STORED_RESPONSES).get_response(response_id)
        except Exception as e:  # noqa: BLE001
            err = to_api_error(e)
            self._count_store_error("read", err)
            raise err from None
        self._m.responses.inc(tags={"op": "read", "result": "ok"})
        return record

    @fastapi_app.delete("/v1/responses/{response_id:path}")
    async def delete_response(self, response_id: str, request: Request) -> Response:
        try:
            await self._require_sessions(request, NO_STORED_RESPONSES).delete_response(response_id)
        except Exception as e:  # noqa: BLE001
            err = to_api_error(e)
            self._count_store_error("delete", err)
            return error_response(err)
        self._m.responses.inc(tags={"op": "delete", "result": "ok"})
        return JSONResponse({"id": response_id, "object": "response", "deleted": True})

    @fastapi_app.post("/tokenize")
    async def tokenize(self, request: Request) -> Response:
        return await self._tokenizer_endpoint("tokenize", request, self._tokenize)

    @fastapi_app.post("/detokenize")
    async def detokenize(self, request: Request) -> Response:
        return await self._tokenizer_endpoint("detokenize", request, self._detokenize)

    @fastapi_app.get("/v1/models")
    async def models(self, request: Request) -> Response:
        try:
            tenant = self._authenticate(request)
        except APIError as e:
            return error_response(e)
        return JSONResponse(self._models(tenant))

    def _models(self, tenant: str = DEFAULT_TENANT) -> dict:
        """The base model, then each LoRA adapter ``tenant`` may use, with the base as its
        ``parent`` (vLLM's cards; ``root`` is the base's id, not a path on the server)."""
        base = self._config.model.id
        card = {"object": "model", "created": self._created, "owned_by": "llm-serving", "max_model_len": self._max_model_len}
        return {
            "object": "list",
            "data": [
                {"id": base, **card, "root": base, "parent": None},
                *({"id": name, **card, "root": base, "parent": base} for name in self._adapters_of(tenant)),
            ],
        }

    @fastapi_app.get("/v1/models/{model_id:path}")
    async def model(self, model_id: str, request: Request) -> Response:
        try:
            tenant = self._authenticate(request)
        except APIError as e:
            return error_response(e)
        card = next((c for c in self._models(tenant)["data"] if c["id"] == model_id), None)
        if card is None:
            return error_response(
                NotFoundError(f"The model '{model_id}' does not exist.", code="model_not_found")
            )
        return JSONResponse(card)

    def _require_sessions(self, request: Request, missing: tuple[str, Optional[str]] = NO_SESSIONS) -> SessionClient:
        """The sessions client of ``request``'s tenant (its API key checked first); a 404
        of ``missing`` (message, code) while sessions are off (stored responses too)."""
        sessions = self._sessions_of(self._authenticate(request))
        if sessions is None:
            message, code = missing
            raise NotFoundError(message, code=code)
        return sessions

    @fastapi_app.post("/v1/sessions")
    async def create_session(self, request: Request) -> Response:
        try:
            sessions = self._require_sessions(request)
            # A body sent without a content-length (chunked) is read too: it was
            # ignored, and its ttl_s with it.
            body = await self._read_json(request, allow_empty=True)
            record = await sessions.create(session_create_ttl(body))
        except Exception as e:  # noqa: BLE001
            return error_response(to_api_error(e))
        return JSONResponse(session_json(record), status_code=201)

    @fastapi_app.get("/v1/sessions/{session_id:path}")
    async def get_session(self, session_id: str, request: Request) -> Response:
        try:
            record = await self._require_sessions(request).get(session_id)
        except Exception as e:  # noqa: BLE001
            return error_response(to_api_error(e))
        return JSONResponse(session_json(record))

    @fastapi_app.delete("/v1/sessions/{session_id:path}")
    async def delete_session(self, session_id: str, request: Request) -> Response:
        try:
            await self._require_sessions(request).delete(session_id)
        except Exception as e:  # noqa: BLE001
            return error_response(to_api_error(e))
        return JSONResponse({"id": session_id, "object": "session.deleted", "deleted": True})

    @fastapi_app.get("/health")
    async def health(self) -> dict:
        return {"status": "ok"}

    @fastapi_app.get("/ready")
    async def ready(self) -> Response:
        try:
            await asyncio.wait_for(self._router.ready(), timeout=5.0)
        except Exception as e:  # noqa: BLE001 - not ready, whatever the reason
            logger.info("not ready: %s", type(e).__name__)
            return JSONResponse({"status": "not_ready"}, status_code=503)
        body = {"status": "ready", "model": self._config.model.id}
        if self._dataplane is not None:
            # Redis being down degrades the data plane to memory only; still ready.
            body.update(await self._dataplane_readiness())
        return JSONResponse(body)

    async def _dataplane_readiness(self) -> dict:
        """:func:`dataplane_readiness` of every data-plane replica (Serve's broadcast: one
        call each, a probe's rate). One replica's answer alone said "ok" while another
        still kept sessions in memory after an outage, and a probe that polled /ready
        until "ok" went on too early. A broadcast that fails as a whole (the pool's
        answers not all in within READY_STATUS_TIMEOUT_S) is "unavailable", counted as
        one replica unanswered: Serve's broadcast gives no partial answers."""
        with self._tracer.start_as_current_span("ingress.ready.dataplane") as span:
            try:
                answers = await self._dataplane.broadcast("status").results_async(
                    timeout_s=READY_STATUS_TIMEOUT_S, return_exceptions=True
                )
            except Exception as e:  # noqa: BLE001 - the pool as a whole did not answer in time
                answers = [e]
            for failed in (a for a in answers if not isinstance(a, dict)):
                logger.info("data plane status unavailable from a replica: %s", type(failed).__name__)
            body = dataplane_readiness(answers)
            span.set_attribute("llm.dataplane.state", body["dataplane"])
            return body

    @fastapi_app.get("/metrics")
    async def metrics(self) -> Response:
        try:
            text = await collect_cluster_metrics()
        except Exception as e:  # noqa: BLE001 - a scrape gets a clear 503, never a 500
            logger.exception("metrics: collecting the nodes' exports failed")
            return JSONResponse(
                {"error": {"message": f"metrics unavailable: {type(e).__name__}: {e}"[:500],
                           "type": "service_unavailable", "param": None, "code": "metrics_unavailable"}},
                status_code=503,
            )
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")


def ingress_deployment(config: AppConfig):
    ic = config.ingress
    return serve.deployment(IngressDeployment).options(
        name="Ingress",
        num_replicas=ic.num_replicas,
        max_ongoing_requests=config.router.max_queue_depth * 2,
        ray_actor_options={"num_cpus": ic.num_cpus},
    )
