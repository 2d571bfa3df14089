"""Per-tenant rate limits: requests and tokens per minute (``security.rate_limits``).

Each limit is a token bucket of one minute's worth that refills continuously (GCRA: the
bucket is one number, its "theoretical arrival time"), kept in the data plane's Redis,
so every ingress replica counts against the same buckets. A tenant's buckets are the
fields of one hash, ``llm:<tenant>:rate``, and a check is one Lua script on Redis's own
clock: it charges every limited dimension or none, so a request refused for its tokens
does not use up a request, and replicas with skewed clocks agree.

A request is charged 1 request and ``prompt + n × max_tokens`` tokens when it starts (its
prompt is known then, its output is not: OpenAI charges the same way); when it ends, the
tokens it did not generate are given back. A refusal is a 429 ``rate_limit_exceeded``
with ``Retry-After`` (when enough has refilled for it) and OpenAI's ``x-ratelimit-*``
headers, which an admitted request carries too. A request that asks for more tokens than
a whole minute's bucket can never pass: its 429 says so and carries no ``Retry-After``.

Redis unreachable, or refusing writes (full, read-only): requests pass unchecked (a limit must not take the service down with
its store), counted in ``llm_rate_limit_unchecked_total`` with a log line a minute at
most.
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass, field
from typing import Optional

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from app import telemetry
from app.config import RateLimitsConfig, RedisConfig, TenantRateLimits
from app.errors import RateLimitError
from deployments.dataplane.keys import rate_key
from deployments.dataplane.redis_store import _client, refusal_code, unavailable_reply

logger = logging.getLogger("ray.serve")

PERIOD_MS = 60_000
UNCHECKED_LOG_INTERVAL_S = 60.0
REFUSAL_LOG_INTERVAL_S = 10.0
DIMENSIONS = ("requests", "tokens")

# KEYS[1]: the tenant's hash. ARGV: the period (ms), then (field, limit, cost) per limited
# dimension. Returns {admitted (0/1), wait ms (0 when admitted; -1: the cost exceeds a
# whole bucket), then remaining and reset ms per dimension}. Integers only: Redis
# truncates Lua numbers to integers in replies.
_CHARGE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + tonumber(t[2]) / 1000
local period = tonumber(ARGV[1])
local n = (#ARGV - 1) / 3
local tats, wait, out = {}, 0, {}
for i = 0, n - 1 do
  local field, limit, cost = ARGV[2 + 3 * i], tonumber(ARGV[3 + 3 * i]), tonumber(ARGV[4 + 3 * i])
  local interval = period / limit
  local tat = tonumber(redis.call('HGET', KEYS[1], field)) or now
  if tat < now then tat = now end
  local new_tat = tat + cost * interval
  if cost > limit then
    wait = -1
  elseif wait >= 0 and new_tat - now > period then
    wait = math.max(wait, new_tat - now - period)
  end
  tats[i + 1] = {field, tat, new_tat, interval}
end
local admitted = wait == 0
local longest = 0
for i = 1, n do
  local field, tat, new_tat, interval = unpack(tats[i])
  local used = admitted and new_tat or tat
  if admitted then redis.call('HSET', KEYS[1], field, tostring(new_tat)) end
  out[#out + 1] = math.max(0, math.floor((period - (used - now)) / interval))
  out[#out + 1] = math.ceil(used - now)
  longest = math.max(longest, used - now)
end
if admitted then redis.call('PEXPIRE', KEYS[1], math.ceil(longest) + 1000) end
local result = {admitted and 1 or 0, wait < 0 and -1 or math.ceil(wait)}
for _, v in ipairs(out) do result[#result + 1] = v end
return result
"""

# KEYS[1]: the tenant's hash. ARGV: the period (ms), the field, its limit, the amount to
# give back. The bucket never holds more than it can (a time before now is now).
_REFUND = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + tonumber(t[2]) / 1000
local tat = tonumber(redis.call('HGET', KEYS[1], ARGV[2]))
if not tat then return 0 end
local back = tonumber(ARGV[4]) * tonumber(ARGV[1]) / tonumber(ARGV[3])
redis.call('HSET', KEYS[1], ARGV[2], tostring(math.max(now, tat - back)))
return 1
"""


def _not_serving(error: ResponseError) -> bool:
    """A reply by which a running Redis refuses writes (full, read-only, a failed AOF) or
    serves nobody now (a busy script, a replica cut off): as unreachable here."""
    return refusal_code(error) is not None or unavailable_reply(error) is not None


def duration(ms: int) -> str:
    """A wait as OpenAI's ``x-ratelimit-reset-*`` headers write it: ``120ms``, ``1.5s``,
    ``6m0s``."""
    if ms < 1000:
        return f"{max(ms, 0)}ms"
    minutes, seconds = divmod(ms / 1000, 60)
    if minutes:
        return f"{int(minutes)}m{seconds:.0f}s"
    return f"{seconds:.3g}s"


@dataclass
class Grant:
    """An admitted request's charge: what to give back at its end, and its headers."""

    tenant: str
    tokens: int = 0  # charged to the token bucket (0: no token limit)
    headers: dict[str, str] = field(default_factory=dict)


def _remaining(limits: dict[str, int], reply: list[int]) -> dict[str, tuple[int, int]]:
    """``{dimension: (remaining, reset ms)}`` of the charge script's reply."""
    return {d: (reply[2 + 2 * i], reply[3 + 2 * i]) for i, d in enumerate(limits)}


def _headers(limits: dict[str, int], left: dict[str, tuple[int, int]]) -> dict[str, str]:
    headers = {}
    for dimension, limit in limits.items():
        remaining, reset_ms = left[dimension]
        headers[f"x-ratelimit-limit-{dimension}"] = str(limit)
        headers[f"x-ratelimit-remaining-{dimension}"] = str(remaining)
        headers[f"x-ratelimit-reset-{dimension}"] = duration(reset_ms)
    return headers


class RateLimiter:
    def __init__(self, config: RateLimitsConfig, redis: RedisConfig, environ=os.environ):
        self._config = config
        self._tracer = telemetry.tracer(__name__)
        self._client = _client(redis, environ)
        self._charge = self._client.register_script(_CHARGE)
        self._refund = self._client.register_script(_REFUND)
        self._unchecked_log = telemetry.Every(UNCHECKED_LOG_INTERVAL_S)
        self._refusal_log = telemetry.Every(REFUSAL_LOG_INTERVAL_S)
        self._refusals = 0
        from ray.util.metrics import Counter

        self._limited = Counter(
            "llm_rate_limited", "Requests refused by a tenant's rate limit, by the limit "
            "that refused them (requests, tokens, too_large: more tokens than a minute's worth).",
            tag_keys=("tenant", "limit"),
        )
        self._unchecked = Counter(
            "llm_rate_limit_unchecked",
            "Requests admitted without a rate-limit check because Redis did not answer.",
        )

    @staticmethod
    def _limits(limits: TenantRateLimits) -> dict[str, int]:
        return {d: getattr(limits, f"{d}_per_minute") for d in DIMENSIONS
                if getattr(limits, f"{d}_per_minute") is not None}

    async def acquire(self, tenant: str, tokens: int) -> Optional[Grant]:
        """Charge one request of ``tokens`` tokens to ``tenant``; None when it has no
        limit (or Redis did not answer), else its Grant. Raises RateLimitError (429)."""
        limits = self._limits(self._config.of(tenant))
        if not limits:
            return None
        with self._tracer.start_as_current_span("ingress.rate_limit") as span:
            span.set_attribute("llm.tenant", tenant)
            span.set_attribute("llm.rate_limit.tokens", tokens)
            grant = await self._acquire(tenant, tokens, limits, span)
            span.set_attribute("llm.rate_limit.result", "admitted" if grant is not None else "unchecked")
            return grant

    async def _acquire(self, tenant: str, tokens: int, limits: dict[str, int], span) -> Optional[Grant]:
        costs = {"requests": 1, "tokens": tokens}
        args: list = [PERIOD_MS]
        for dimension, limit in limits.items():
            args += [dimension, limit, costs[dimension]]
        try:
            reply = [int(v) for v in await self._charge(keys=[rate_key(tenant)], args=args)]
        except (RedisConnectionError, RedisTimeoutError, OSError, ResponseError) as e:
            if isinstance(e, ResponseError) and not _not_serving(e):
                raise  # a bug here (the script), not Redis's state
            self._unchecked.inc()
            if self._unchecked_log.due():
                logger.warning("rate limits unchecked: Redis did not answer (%s); requests pass "
                               "until it does (llm_rate_limit_unchecked_total counts them)", e)
            return None
        left = _remaining(limits, reply)
        headers = _headers(limits, left)
        for dimension, (remaining, _) in left.items():
            span.set_attribute(f"llm.rate_limit.remaining_{dimension}", remaining)
        if reply[0] == 1:
            return Grant(tenant, tokens if "tokens" in limits else 0, headers)
        span.set_attribute("llm.rate_limit.result", "refused")
        raise self._refusal(tenant, limits, costs, reply[1], left, headers)

    def _refusal(self, tenant, limits, costs, wait_ms: int, left, headers) -> RateLimitError:
        # Which limit refused: the first with too little left for its cost.
        dimension = "too_large" if wait_ms < 0 else next(
            (d for d in limits if left[d][0] < costs[d]), "requests")
        self._limited.inc(tags={"tenant": tenant, "limit": dimension})
        self._refusals += 1
        if self._refusal_log.due():  # a flood of refusals is one line per interval
            logger.info("429 rate limit: %d request(s) refused since the last such line; the latest "
                        "tenant %s on %s", self._refusals, tenant, dimension)
            self._refusals = 0
        if wait_ms < 0:
            return RateLimitError(
                f"Request too large for tenant {tenant!r}'s tokens per minute: limit "
                f"{limits['tokens']}, requested {costs['tokens']} (the prompt plus n × max_tokens). "
                "Lower max_tokens or shorten the prompt.",
                code="rate_limit_exceeded", headers=headers,
            )
        retry_s = max(1, math.ceil(wait_ms / 1000))
        return RateLimitError(
            f"Rate limit reached for tenant {tenant!r} on {dimension} per minute: limit "
            f"{limits[dimension]}, requested {costs[dimension]}. Try again in {duration(wait_ms)}.",
            code="rate_limit_exceeded", headers={**headers, "Retry-After": str(retry_s)},
        )

    async def refund(self, grant: Grant, unused_tokens: int) -> None:
        """Give back ``unused_tokens`` of ``grant``'s charge (best effort)."""
        unused = min(unused_tokens, grant.tokens)
        limit = self._config.of(grant.tenant).tokens_per_minute
        if unused <= 0 or limit is None:
            return
        try:
            await self._refund(keys=[rate_key(grant.tenant)], args=[PERIOD_MS, "tokens", limit, unused])
        except (RedisConnectionError, RedisTimeoutError, OSError, ResponseError) as e:
            if isinstance(e, ResponseError) and not _not_serving(e):
                raise  # the bucket refills by itself; a lost refund only charges the full budget

    async def close(self) -> None:
        await self._client.aclose()
