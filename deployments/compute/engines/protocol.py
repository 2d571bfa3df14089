"""The engine protocol: the one interface every ComputeWorker engine implements.

The worker deployment, the router and the ingress only ever see the types in this
module, so an engine (``torch``, ``vllm``) can be swapped by configuration alone.

Contract of :meth:`Engine.generate`:

* it is an async iterator of :class:`TokenDelta`;
* every delta carries the *new* text and token ids since the previous delta (never the
  cumulative text); several tokens may be coalesced into one delta when the consumer is
  slower than the engine;
* exactly one delta, the last, has ``finish_reason`` set (``"stop"`` or ``"length"``),
  after which the iterator ends;
* an error ends the iterator by raising an :class:`EngineError` subclass; a request the
  engine refuses up front (too long, bad parameters) raises :class:`RequestRejected`
  before the first delta;
* closing the iterator early (``aclose()`` or cancelling the task that iterates it) aborts
  the request inside the engine: its slot is free again within one engine step.

A consumer that paces its reads (the ComputeWorker waits between them so that tokens
coalesce) asks :meth:`Engine.end_signal` whether the last delta is ready, and stops
waiting then instead of holding a finished request's end for the rest of its wait.
"""

from __future__ import annotations

import abc
import asyncio
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Literal, Optional

FinishReason = Literal["stop", "length"]

# The most alternatives per token an engine returns (OpenAI's top_logprobs limit, and
# vLLM's default max_logprobs).
MAX_LOGPROBS = 20

# Of one output token: its log-probability, and the ``k`` most likely tokens at its
# position as (token id, log-probability), most likely first. Log-probabilities are of the
# model's raw distribution (log-softmax of the logits, before temperature or top-p), as
# vLLM's default ``logprobs_mode`` gives them.
TokenLogprobs = tuple[float, list[tuple[int, float]]]

# Of one prompt token (vLLM's prompt logprobs): its log-probability given the tokens
# before it, its rank in that distribution (1: the most likely), and the ``k`` most likely
# tokens there as (token id, log-probability). The first prompt token has none (None).
PromptLogprob = tuple[float, int, list[tuple[int, float]]]


@dataclass(slots=True)
class SamplingParams:
    """How to pick tokens. ``temperature == 0`` means greedy (exact argmax)."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    seed: Optional[int] = None
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    # Return each output token's log-probability and this many alternatives
    # (TokenDelta.logprobs); None: none.
    logprobs: Optional[int] = None
    # Each prompt token's log-probability, rank and this many alternatives
    # (TokenDelta.prompt_logprobs, in the first delta); None: none. The whole prompt is
    # prefilled then (no cached prefix: it has no logits), as vLLM skips its prefix cache.
    prompt_logprobs: Optional[int] = None
    # What vLLM's SamplingParams mean by the same names. Applied in vLLM's order: logit
    # bias and min_tokens, then the penalties, to the logits (greedy picks from those);
    # then temperature, min_p, top_k and top_p to the distribution sampled from.
    top_k: int = 0  # the k most likely tokens only; 0: all
    min_p: float = 0.0  # drop tokens less likely than min_p times the most likely one
    presence_penalty: float = 0.0  # subtracted once from tokens already in the output
    frequency_penalty: float = 0.0  # subtracted per occurrence in the output
    repetition_penalty: float = 1.0  # divides positive (multiplies negative) logits of tokens in prompt or output
    logit_bias: Optional[dict[int, float]] = None  # added to those tokens' logits
    min_tokens: int = 0  # no end of sequence (EOS, stop string) before this many tokens
    # Tokens that end the reply like EOS (finish "stop", the token counted as output, its
    # text left out unless include_stop_str_in_output, as vLLM's stop_token_ids).
    stop_token_ids: list[int] = field(default_factory=list)
    # Hold the reply to a grammar (engines/structured.py): ("json", schema text),
    # ("json_object", None), ("regex", pattern) or ("choice", [strings]).
    structured_output: Optional[tuple[str, Any]] = None
    # False: special tokens' text stays in the reply (a tool-call parser whose format is
    # made of them needs it); the token that ends the reply stays out either way.
    skip_special_tokens: bool = True
    # vLLM's: the stop string (or stop token's text) that ended the reply is part of it.
    include_stop_str_in_output: bool = False
    # vLLM's: only these tokens may be picked (the others' logits ruled out); None: any.
    allowed_token_ids: Optional[list[int]] = None
    # vLLM's: words the reply may not contain. Each, with and without a leading space, is
    # a token sequence (bad_words.bad_words_token_ids) whose last token is ruled out
    # wherever the reply's last tokens are the rest of it.
    bad_words: Optional[list[str]] = None


@dataclass(slots=True)
class GenerationRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    # W3C trace context (``traceparent``...) of the caller's span, so the worker's spans
    # join the request's trace across Serve hops.
    trace_headers: dict[str, str] = field(default_factory=dict)
    # Whose request: KV blocks are keyed per tenant, so tenants never share cache.
    tenant: str = "default"
    # Under ``engine.scheduling_policy: priority``: lower starts sooner (vLLM's meaning).
    priority: int = 0
    # vLLM's ``cache_salt``: cached KV is reused only by requests with the same salt (and
    # tenant); it is in every block hash (``kv.block_hashes``). Secret: never logged.
    cache_salt: Optional[str] = None
    # The LoRA adapter (its configured name, ``model.lora_modules``) to run the request
    # with; None: the base model. Also in every block hash: an adapter's KV is its own.
    lora: Optional[str] = None
    session_id: Optional[str] = None
    # The stored record whose DELETE erases the KV blocks this request computes (the
    # data plane lists them under it): a stored response's id; None: the session's
    # (``session_id``), or nobody's for a stateless request (its blocks age out).
    kv_owner: Optional[str] = None
    # The prompt starts with a session's stored history: the previous turn's blocks were
    # exported moments ago (the router always looks those up, see kv_lookup_skip).
    session_continues: bool = False
    # The client gets nothing before the whole reply (a non-streaming request): the router
    # holds the deltas back and may run the request again even after a worker that died
    # had produced tokens.
    buffered: bool = False
    # KV reuse: the data plane's lookup of this prompt's prefix, started by the router as
    # the request arrived (a Ray ObjectRef of ``lookup_prefix``'s PrefixHit), so that it
    # runs while the request travels to its worker; ``kv_lookup_key`` is the last block
    # hash it looked up, which the worker checks against its own before using it (a
    # match means the same blocks up to there: each hash chains its parent's).
    kv_lookup: Optional[Any] = None
    kv_lookup_key: Optional[str] = None
    # How many leading blocks that lookup covered, when fewer than the prompt has (the
    # lookup of a session's previous turn, started before this prompt was built; the
    # key is then the hash of block ``kv_lookup_blocks - 1``). None: all of them.
    kv_lookup_blocks: Optional[int] = None
    # KV reuse: the router's index of stored chains has none that starts with this
    # prompt's first block, so a data-plane lookup would miss for certain; the engine
    # skips it (its own L1 still counts). deployments/dataplane/root_index.py.
    kv_lookup_skip: bool = False

    @property
    def blocks_owner(self) -> Optional[str]:
        """The record that lists this request's computed blocks (see ``kv_owner``)."""
        return self.kv_owner or self.session_id


@dataclass(slots=True)
class TokenDelta:
    """New output since the previous delta of the same request."""

    text: str
    token_ids: list[int]
    finish_reason: Optional[FinishReason] = None
    num_prompt_tokens: int = 0
    # Cumulative number of output tokens generated so far (including this delta).
    num_output_tokens: int = 0
    # One entry per id in token_ids when the request asked for logprobs, else None.
    logprobs: Optional[list[TokenLogprobs]] = None
    # One entry per prompt token (None for the first) in the first delta when the request
    # asked for prompt logprobs, else None.
    prompt_logprobs: Optional[list[Optional[PromptLogprob]]] = None
    # Prompt tokens whose KV came from a cache instead of a prefill (the engine's own
    # prefix cache, or the data plane's L2/L3); known from the first delta on.
    num_cached_tokens: int = 0


@dataclass(slots=True)
class EngineStats:
    num_running: int
    num_waiting: int
    # Fraction of the engine's KV capacity in use, in [0, 1].
    kv_usage: float = 0.0
    num_steps: int = 0
    num_generated_tokens: int = 0


@dataclass(frozen=True, slots=True)
class EngineCapabilities:
    """Optional abilities, with safe defaults: the caller checks before relying on one."""

    # The engine batches at iteration level itself; the router still may group arrivals.
    continuous_batching: bool = False
    # Whether the router should hold requests to form batches in front of this engine.
    # An engine that batches continuously on its own (vLLM) says False.
    wants_router_batching: bool = True
    # The engine saves the KV of finished prefixes to the data plane and loads stored
    # prefixes back instead of prefilling them (through a KV connector).
    supports_kv_export: bool = False


class EngineError(RuntimeError):
    """The engine failed while serving a request; maps to HTTP 500/503."""


class EngineDeadError(EngineError):
    """The engine can serve nothing more; the replica must be replaced (HTTP 503)."""


class RequestRejected(ValueError):
    """The engine refuses this request before generating (HTTP 400). ``param`` names the
    offending field when there is one."""

    def __init__(self, message: str, param: Optional[str] = None):
        super().__init__(message)
        self.param = param


from deployments.compute.engines.scheduler import SequenceTooLong, check_fits  # noqa: E402


def validate_request(
    request: GenerationRequest, *, vocab_size: int, max_model_len: int, active_ids
) -> None:
    """The checks every engine makes before accepting a request: RequestRejected (400)
    naming the parameter, never a failure later in the engine loop."""
    params = request.sampling
    num_prompt = len(request.prompt_token_ids)
    if num_prompt == 0:
        raise RequestRejected("prompt is empty", param="prompt")
    if params.max_tokens < 1:
        raise RequestRejected(f"max_tokens must be >= 1, got {params.max_tokens}", param="max_tokens")
    if params.temperature < 0:
        raise RequestRejected(f"temperature must be >= 0, got {params.temperature}", param="temperature")
    if not 0 < params.top_p <= 1:
        raise RequestRejected(f"top_p must be in (0, 1], got {params.top_p}", param="top_p")
    if params.logprobs is not None and not 0 <= params.logprobs <= MAX_LOGPROBS:
        raise RequestRejected(
            f"logprobs must be in [0, {MAX_LOGPROBS}], got {params.logprobs}", param="logprobs"
        )
    if params.prompt_logprobs is not None and not 0 <= params.prompt_logprobs <= MAX_LOGPROBS:
        raise RequestRejected(
            f"prompt_logprobs must be in [0, {MAX_LOGPROBS}], got {params.prompt_logprobs}",
            param="prompt_logprobs",
        )
    if params.top_k < 0:
        raise RequestRejected(f"top_k must be >= 0 (0: no limit), got {params.top_k}", param="top_k")
    if not 0 <= params.min_p <= 1:
        raise RequestRejected(f"min_p must be in [0, 1], got {params.min_p}", param="min_p")
    if params.repetition_penalty <= 0:
        raise RequestRejected(
            f"repetition_penalty must be > 0, got {params.repetition_penalty}", param="repetition_penalty"
        )
    if params.min_tokens < 0 or params.min_tokens > params.max_tokens:
        raise RequestRejected(
            f"min_tokens must be in [0, max_tokens = {params.max_tokens}], got {params.min_tokens}",
            param="min_tokens",
        )
    if params.structured_output is not None and params.min_tokens:
        # The grammar may allow nothing but the end of sequence that min_tokens rules out.
        raise RequestRejected("min_tokens cannot be combined with structured output", param="min_tokens")
    if params.stop_token_ids and not all(0 <= t < vocab_size for t in params.stop_token_ids):
        raise RequestRejected(f"stop_token_ids must be in [0, {vocab_size})", param="stop_token_ids")
    if params.logit_bias and not all(0 <= t < vocab_size for t in params.logit_bias):
        raise RequestRejected(f"logit_bias token ids must be in [0, {vocab_size})", param="logit_bias")
    if params.allowed_token_ids is not None and not (
        params.allowed_token_ids and all(0 <= t < vocab_size for t in params.allowed_token_ids)
    ):
        raise RequestRejected(
            f"allowed_token_ids must be a non-empty list of ids in [0, {vocab_size})", param="allowed_token_ids"
        )
    if min(request.prompt_token_ids) < 0 or max(request.prompt_token_ids) >= vocab_size:
        raise RequestRejected(f"prompt token ids must be in [0, {vocab_size})", param="prompt")
    try:
        check_fits(num_prompt, params.max_tokens, max_model_len)
    except SequenceTooLong as e:
        raise RequestRejected(
            str(e), param="max_tokens" if num_prompt < max_model_len else "prompt"
        ) from None
    if request.request_id in active_ids:
        raise RequestRejected(f"duplicate request_id {request.request_id!r}", param="request_id")


class Engine(abc.ABC):
    """Base class of engines. Implementations must be safe to call from one asyncio loop."""

    capabilities: EngineCapabilities = EngineCapabilities()

    @abc.abstractmethod
    async def start(self) -> None:
        """Load weights and get ready; returns once the engine can serve."""

    @abc.abstractmethod
    def generate(self, request: GenerationRequest) -> AsyncIterator[TokenDelta]:
        """Stream the output of one request (see the module docstring for the contract)."""

    @abc.abstractmethod
    async def check_health(self) -> None:
        """Raise :class:`EngineDeadError` if the engine can no longer serve."""

    @abc.abstractmethod
    def stats(self) -> EngineStats:
        """Cheap, non-blocking snapshot of the engine's load."""

    @abc.abstractmethod
    async def shutdown(self) -> None:
        """Stop serving and release resources; in-flight requests end with an error."""

    def forget_measurements(self) -> None:
        """Drop what the engine measured of its own speed so far; the worker calls it
        after its warm-up generation, which is no guide to the speed of serving. Engines
        that measure nothing need not override it."""

    def end_signal(self, request_id: str) -> Optional[asyncio.Future]:
        """A future of the request ``request_id`` that ``generate`` is streaming, done
        (result None) once its stream's last delta (the finishing one, or its error) is
        ready to read, before the consumer reads it; None once that stream is closed, or
        when the engine cannot tell (the consumer then waits out its pacing as before).
        Made, completed and read on the loop that iterates ``generate``; a consumer only
        watches it (never cancels it)."""
        return None
