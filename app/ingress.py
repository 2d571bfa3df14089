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
import json
import logging
import time
import uuid
from typing import AsyncIterator, Optional

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import ValidationError
from ray import serve
from ray.serve.handle import DeploymentHandle
from ray.util import metrics
from starlette.exceptions import HTTPException as StarletteHTTPException

from app import telemetry
from app.config import AppConfig
from app.errors import (
    APIError,
    InvalidRequestError,
    NotFoundError,
    PayloadTooLargeError,
    to_api_error,
)
from app.metrics_export import collect_cluster_metrics
from app.schemas import ChatCompletionRequest, CompletionRequest, new_id, now
from app.sessions import (
    TOKEN_IDS_KEY,
    PendingTurn,
    SessionClient,
    exact_prompt_ids,
    fit_history,
    reply_token_ids,
    session_json,
)
from app.telemetry import LATENCY_BUCKETS_S, TOKEN_LATENCY_BUCKETS_S
from deployments.compute.engines.protocol import GenerationRequest, SamplingParams, TokenDelta
from deployments.router.deployment import Router

logger = logging.getLogger("ray.serve")

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


class _Metrics:
    def __init__(self):
        tags = ("endpoint",)
        self.requests = metrics.Counter(
            "llm_requests", "Requests by endpoint and HTTP status.", tag_keys=("endpoint", "status")
        )
        self.ttft = metrics.Histogram(
            "llm_ttft_seconds", "Time to first token.", boundaries=LATENCY_BUCKETS_S, tag_keys=tags
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
        self.prompt_tokens = metrics.Counter("llm_prompt_tokens", "Prompt tokens.", tag_keys=tags)
        self.output_tokens = metrics.Counter(
            "llm_generation_tokens", "Generated tokens.", tag_keys=tags
        )


class _Call:
    """Bookkeeping of one generation call: timings, tokens, and the final record."""

    def __init__(self, endpoint: str, request_id: str, num_prompt_tokens: int):
        self.endpoint = endpoint
        self.request_id = request_id
        self.num_prompt_tokens = num_prompt_tokens
        self.started = time.monotonic()
        self.first_token_at: Optional[float] = None
        self.num_output_tokens = 0
        self.finish_reason: Optional[str] = None
        self.trace_id = telemetry.trace_id_hex()
        self.turn: Optional[PendingTurn] = None
        # A session turn's generated token ids, stored with the reply (see sessions.py).
        self.output_ids: Optional[list[int]] = None
        self.streamed = True

    def on_delta(self, delta: TokenDelta) -> None:
        if self.first_token_at is None and delta.token_ids:
            self.first_token_at = time.monotonic()
        if self.output_ids is not None:
            self.output_ids.extend(delta.token_ids)
        self.num_output_tokens = max(
            self.num_output_tokens + len(delta.token_ids), delta.num_output_tokens
        )
        if delta.finish_reason:
            self.finish_reason = delta.finish_reason

    def usage(self) -> dict:
        return {
            "prompt_tokens": self.num_prompt_tokens,
            "completion_tokens": self.num_output_tokens,
            "total_tokens": self.num_prompt_tokens + self.num_output_tokens,
        }


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
    def __init__(
        self, worker: DeploymentHandle, config: dict, dataplane: Optional[DeploymentHandle] = None
    ):
        from transformers import AutoTokenizer  # heavy; only the ingress needs it

        self._config = AppConfig.model_validate(config)
        self._dataplane = dataplane
        self._sessions = (
            SessionClient(dataplane, self._config.dataplane.sessions) if dataplane else None
        )
        telemetry.setup(self._config.telemetry, "ingress")
        self._tracer = telemetry.tracer(__name__)
        # The router runs in this process (not as a deployment of its own), so a token
        # crosses one Serve hop (worker → ingress) instead of two.
        self._router = Router(worker, config, dataplane)
        model_path = self._config.model.resolved_path()
        self._tokenizer = AutoTokenizer.from_pretrained(str(model_path))
        self._special_ids = frozenset(self._tokenizer.all_special_ids)
        self._max_model_len = self._config.model.checkpoint_max_len()
        self._created = now()
        self._m = _Metrics()

    # ---- plumbing -------------------------------------------------------------------

    async def _read_json(self, request: Request) -> dict:
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
        try:
            data = json.loads(body)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise InvalidRequestError(f"Request body is not valid JSON: {e}") from None
        if not isinstance(data, dict):
            raise InvalidRequestError("Request body must be a JSON object.")
        return data

    def _validate(self, schema, data: dict):
        try:
            req = schema.model_validate(data)
        except ValidationError as e:
            first = e.errors()[0]
            param = ".".join(str(p) for p in first["loc"]) or None
            msg = first["msg"].removeprefix("Value error, ")
            where = f"'{param}'" if param else "request"
            raise InvalidRequestError(f"Invalid {where}: {msg}", param=param) from None
        if req.model != self._config.model.id:
            raise NotFoundError(
                f"The model '{req.model}' does not exist; this server serves "
                f"'{self._config.model.id}'.",
                param="model",
                code="model_not_found",
            )
        if len(req.stop) > self._config.limits.max_stop_sequences:
            raise InvalidRequestError(
                f"At most {self._config.limits.max_stop_sequences} stop sequences are allowed.",
                param="stop",
            )
        return req

    def _generation_request(self, req, prompt_ids: list[int]) -> GenerationRequest:
        num_prompt = len(prompt_ids)
        vocab = len(self._tokenizer)
        if any(t >= vocab for t in prompt_ids):
            raise InvalidRequestError(
                f"Prompt token ids must be below the vocabulary size {vocab}.", param="prompt"
            )
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
            max_tokens = min(self._config.limits.default_max_tokens, room)
        elif num_prompt + requested > self._max_model_len:
            raise InvalidRequestError(
                f"This model's maximum context length is {self._max_model_len} tokens. "
                f"However, you requested {num_prompt + requested} tokens "
                f"({num_prompt} in the prompt, {requested} for the completion).",
                param="max_tokens",
                code="context_length_exceeded",
            )
        else:
            max_tokens = requested
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
            ),
            trace_headers=telemetry.inject_context(),
        )

    def _chat_prompt_ids(self, messages: list[dict]) -> list[int]:
        if any(TOKEN_IDS_KEY in m for m in messages):
            return exact_prompt_ids(self._tokenizer, messages)
        text = self._tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False
        )
        return self._tokenizer.encode(text, add_special_tokens=False)

    async def _chat_prompt(self, req: ChatCompletionRequest, request: Request):
        """Prompt token ids of a chat request, with the session's history in front when it
        names one; also returns the turn to append once the reply is done."""
        try:
            new_messages = [{"role": m.role, "content": m.text()} for m in req.messages]
        except ValueError as e:
            raise InvalidRequestError(str(e), param="messages") from None
        session_id = request.headers.get("x-session-id") or req.session_id
        if not session_id:
            return self._chat_prompt_ids(new_messages), None
        if self._sessions is None:
            raise InvalidRequestError("Sessions are disabled on this server.", param="session_id")
        record = await self._sessions.get(session_id)
        messages, _ = fit_history(
            record.messages,
            new_messages,
            count_tokens=lambda msgs: len(self._chat_prompt_ids(msgs)),
            max_new_tokens=req.requested_max_tokens() or self._config.limits.default_max_tokens,
            max_model_len=self._max_model_len,
            policy=self._sessions.config.overflow_policy,
        )
        turn = PendingTurn(session_id, record.version, new_messages, record.num_tokens)
        return self._chat_prompt_ids(messages), turn

    async def _commit_turn(self, call: "_Call", text: str) -> None:
        """Append the finished turn (user messages + reply) in one compare-and-set."""
        if call.turn is None:
            return
        reply = {"role": "assistant", "content": text}
        ids = reply_token_ids(call.output_ids, call.finish_reason, self._special_ids)
        if ids is not None:
            reply[TOKEN_IDS_KEY] = ids
        messages = call.turn.new_messages + [reply]
        await self._sessions.append(
            call.turn, messages, call.num_prompt_tokens + call.num_output_tokens
        )

    def _completion_prompt_ids(self, req: CompletionRequest) -> list[int]:
        if isinstance(req.prompt, list):
            return list(req.prompt)
        return self._tokenizer.encode(req.prompt)

    async def _next(self, stream, deadline: float) -> TokenDelta:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise asyncio.TimeoutError()
        # asyncio.timeout, not wait_for: no extra task per delta on this hot path.
        async with asyncio.timeout(remaining):
            return await stream.__anext__()

    def _record(self, call: _Call, status: int) -> None:
        tags = {"endpoint": call.endpoint}
        self._m.requests.inc(tags={"endpoint": call.endpoint, "status": str(status)})
        if status != 200:
            return
        end = time.monotonic()
        self._m.e2e.observe(end - call.started, tags=tags)
        self._m.prompt_tokens.inc(call.num_prompt_tokens, tags=tags)
        if call.num_output_tokens:
            self._m.output_tokens.inc(call.num_output_tokens, tags=tags)
        # Only a streamed request has a first token the client sees (a buffered one gets
        # its deltas from the router at the end).
        if call.first_token_at is not None and call.streamed:
            self._m.ttft.observe(call.first_token_at - call.started, tags=tags)
            if call.num_output_tokens > 1:
                self._m.tpot.observe(
                    (end - call.first_token_at) / (call.num_output_tokens - 1), tags=tags
                )
        logger.info(
            "request done: id=%s endpoint=%s prompt_tokens=%d output_tokens=%d finish=%s "
            "ttft_ms=%.1f e2e_ms=%.1f trace=%s",
            call.request_id,
            call.endpoint,
            call.num_prompt_tokens,
            call.num_output_tokens,
            call.finish_reason,
            1000 * ((call.first_token_at or end) - call.started),
            1000 * (end - call.started),
            call.trace_id,
        )

    # ---- generation -------------------------------------------------------------------

    async def _serve(self, endpoint: str, request: Request, schema) -> Response:
        with self._tracer.start_as_current_span(f"ingress.{endpoint}") as span:
            call = None
            try:
                self._router.reject_if_full()
                req = self._validate(schema, await self._read_json(request))
                turn = None
                if isinstance(req, ChatCompletionRequest):
                    prompt_ids, turn = await self._chat_prompt(req, request)
                else:
                    prompt_ids = self._completion_prompt_ids(req)
                gen_request = self._generation_request(req, prompt_ids)
                # A non-streaming client sees nothing before the end, so the router may
                # run it again if its worker dies mid-way (see Router._stream_with_retry).
                gen_request.buffered = not req.stream
                if turn is not None:
                    gen_request.session_id = turn.session_id
                    span.set_attribute("llm.session_id", turn.session_id)
                call = _Call(endpoint, gen_request.request_id, len(prompt_ids))
                call.turn = turn
                call.streamed = bool(req.stream)
                if turn is not None:
                    call.output_ids = []
                span.set_attribute("llm.request_id", call.request_id)
                span.set_attribute("llm.prompt_tokens", call.num_prompt_tokens)
                span.set_attribute("llm.stream", req.stream)
                deadline = call.started + self._config.limits.request_timeout_s
                stream = _LocalStream(self._router.generate(gen_request))
                try:
                    # Wait for the first delta before answering so that a rejection
                    # (429, 400 from the engine, 503) keeps its status code.
                    first = await self._next(stream, deadline)
                except BaseException:
                    stream.cancel()
                    raise
                call.on_delta(first)
            except Exception as e:  # noqa: BLE001 - every failure becomes an OpenAI error
                err = to_api_error(e)
                span.set_attribute("http.status_code", err.status_code)
                self._m.requests.inc(tags={"endpoint": endpoint, "status": str(err.status_code)})
                return error_response(err)
            if req.stream:
                return StreamingResponse(
                    self._stream_body(req, call, first, stream, deadline),
                    media_type="text/event-stream",
                    headers={"Cache-Control": "no-cache", "X-Request-Id": call.request_id},
                )
            return await self._complete_body(req, call, first, stream, deadline)

    async def _complete_body(self, req, call: _Call, first, stream, deadline) -> Response:
        parts = [first.text]
        try:
            delta = first
            while delta.finish_reason is None:
                delta = await self._next(stream, deadline)
                call.on_delta(delta)
                parts.append(delta.text)
            await self._commit_turn(call, "".join(parts))
        except BaseException as e:
            stream.cancel()
            if not isinstance(e, Exception):
                raise
            err = to_api_error(e)
            self._record(call, err.status_code)
            return error_response(err)
        self._record(call, 200)
        text = "".join(parts)
        if isinstance(req, ChatCompletionRequest):
            body = {
                "id": new_id("chatcmpl"),
                "object": "chat.completion",
                "created": now(),
                "model": req.model,
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": text},
                        "logprobs": None,
                        "finish_reason": call.finish_reason,
                    }
                ],
                "usage": call.usage(),
            }
        else:
            body = {
                "id": new_id("cmpl"),
                "object": "text_completion",
                "created": now(),
                "model": req.model,
                "choices": [
                    {
                        "index": 0,
                        "text": text,
                        "logprobs": None,
                        "finish_reason": call.finish_reason,
                    }
                ],
                "usage": call.usage(),
            }
        return JSONResponse(body, headers={"X-Request-Id": call.request_id})

    async def _stream_body(self, req, call: _Call, first, stream, deadline) -> AsyncIterator[bytes]:
        chat = isinstance(req, ChatCompletionRequest)
        chunk_id = new_id("chatcmpl" if chat else "cmpl")
        created = now()
        base = {
            "id": chunk_id,
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": created,
            "model": req.model,
        }

        def chunk(text: Optional[str], finish: Optional[str], role: bool = False) -> bytes:
            if chat:
                delta = {"role": "assistant", "content": text or ""} if role else (
                    {"content": text} if text else {}
                )
                choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            else:
                choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
            payload = {**base, "choices": [choice]}
            if req.include_usage_in_stream():
                payload["usage"] = None
            return _sse(payload)

        status = 200
        parts: list[str] = []
        try:
            if chat:
                yield chunk("", None, role=True)
            delta = first
            while True:
                parts.append(delta.text)
                if delta.finish_reason is not None:
                    # The turn is stored before the final chunk, so a client that saw
                    # finish_reason knows its turn is in the session (or gets the 409).
                    await self._commit_turn(call, "".join(parts))
                if delta.text or delta.finish_reason:
                    yield chunk(delta.text, delta.finish_reason)
                if delta.finish_reason is not None:
                    break
                delta = await self._next(stream, deadline)
                call.on_delta(delta)
            if req.include_usage_in_stream():
                yield _sse({**base, "choices": [], "usage": call.usage()})
        except Exception as e:  # noqa: BLE001 - the stream ends with an error event
            stream.cancel()
            err = to_api_error(e)
            status = err.status_code
            yield _sse(err.body())
        except BaseException:
            # The client went away (cancellation): stop the work behind this stream.
            stream.cancel()
            status = 499
            raise
        finally:
            self._record(call, status)
        yield SSE_DONE

    # ---- routes -----------------------------------------------------------------------


@serve.ingress(fastapi_app)
class IngressDeployment(Ingress):
    @fastapi_app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request) -> Response:
        return await self._serve("chat", request, ChatCompletionRequest)

    @fastapi_app.post("/v1/completions")
    async def completions(self, request: Request) -> Response:
        return await self._serve("completions", request, CompletionRequest)

    @fastapi_app.get("/v1/models")
    async def models(self) -> dict:
        return {
            "object": "list",
            "data": [
                {
                    "id": self._config.model.id,
                    "object": "model",
                    "created": self._created,
                    "owned_by": "llm-serving",
                    "max_model_len": self._max_model_len,
                }
            ],
        }

    @fastapi_app.get("/v1/models/{model_id}")
    async def model(self, model_id: str) -> Response:
        if model_id != self._config.model.id:
            return error_response(
                NotFoundError(f"The model '{model_id}' does not exist.", code="model_not_found")
            )
        return JSONResponse((await self.models())["data"][0])

    def _require_sessions(self) -> SessionClient:
        if self._sessions is None:
            raise NotFoundError("Sessions are disabled on this server (dataplane.enabled).")
        return self._sessions

    @fastapi_app.post("/v1/sessions")
    async def create_session(self, request: Request) -> Response:
        try:
            sessions = self._require_sessions()
            ttl_s = None
            if int(request.headers.get("content-length") or 0) > 0:
                body = await self._read_json(request)
                ttl_s = body.get("ttl_s")
                if ttl_s is not None and (not isinstance(ttl_s, int) or not 1 <= ttl_s <= 30 * 86_400):
                    raise InvalidRequestError("ttl_s must be an integer in [1, 2592000].", param="ttl_s")
            record = await sessions.create(ttl_s)
        except Exception as e:  # noqa: BLE001
            return error_response(to_api_error(e))
        return JSONResponse(session_json(record), status_code=201)

    @fastapi_app.get("/v1/sessions/{session_id}")
    async def get_session(self, session_id: str) -> Response:
        try:
            record = await self._require_sessions().get(session_id)
        except Exception as e:  # noqa: BLE001
            return error_response(to_api_error(e))
        return JSONResponse(session_json(record))

    @fastapi_app.delete("/v1/sessions/{session_id}")
    async def delete_session(self, session_id: str) -> Response:
        try:
            await self._require_sessions().delete(session_id)
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
            try:
                status = await asyncio.wait_for(self._dataplane.status.remote(), timeout=5.0)
                body["dataplane"] = "degraded" if status.get("degraded") else "ok"
            except Exception as e:  # noqa: BLE001
                logger.info("data plane status unavailable: %s", type(e).__name__)
                body["dataplane"] = "unavailable"
        return JSONResponse(body)

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
