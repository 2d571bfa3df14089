"""Server-side conversation context for the ingress: the sessions API and the glue that puts
a session's history in front of a chat request and appends the finished turn.

The DataPlane deployment owns the records (Redis-backed, compare-and-set on a version);
this module only validates ids, applies the context-overflow policy and calls it. A turn is
appended only after the reply finished, with the version read when the request started,
so two racing turns never interleave: the second append gets 409.
"""

from __future__ import annotations

import asyncio
import copy
import json
import logging
import re
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Optional

from app.auth import DEFAULT_TENANT
from app.config import SessionConfig
from app.errors import (
    ConflictError,
    InvalidRequestError,
    NotFoundError,
    ServiceUnavailableError,
    _causes,
    replica_death_types,
)
from app.responses import check_response_id
from app.serve_context import cancel_call
from deployments.dataplane.redis_store import RedisRefused
from deployments.dataplane.routing import DirectCalls

logger = logging.getLogger("ray.serve")

# A DataPlane replica that dies under a session call (or is unreachable) costs the call,
# not the request: the handle drops a dead replica from its candidates at once, so the
# same call made again goes to the key's next owner on the hash ring, which reads the
# session from Redis. Retried with a short backoff for at most this long.
DEATH_RETRY_BUDGET_S = 10.0
# An attempt with no answer in ``sessions.call_timeout_s`` is made again this many times
# (then 503): a call must never hold a request until its deadline.
TIMEOUT_RETRIES = 1
# A turn's append comes after its reply was generated: a 503 the data plane answers it
# with (the session's owner briefly full while Redis is down, DataPlane._claim_backup;
# or the session on its way between replicas) is made again after BUSY_BACKOFF_S *
# 2**k, this many times, before the request fails with it. The turn id makes it safe.
APPEND_BUSY_RETRIES = 3
BUSY_BACKOFF_S = 0.25

SESSION_ID_RE = re.compile(r"^sess_[0-9a-f]{32}$")

# An assistant reply in a session keeps the token ids the model generated, under this key
# (never shown by the API). The next turn's prompt splices them back in place of the
# reply's text, so its prefix is token-for-token what the engine processed last turn and
# every KV block of it (prompt and reply) is found again. Re-tokenising the reply text
# would not give the same ids (a model need not generate the tokenizer's own split) and
# would turn the reply, and everything after it, into a cache miss.
TOKEN_IDS_KEY = "_token_ids"
_SENTINEL = "\u27e6{nonce}:{index}\u27e7"
_NONCE = uuid.uuid4().hex[:12]


def reply_token_ids(output_ids: Optional[list[int]], finish_reason: Optional[str], special_ids) -> Optional[list[int]]:
    """The ids to keep with a reply whose text is what the client got: all generated ids,
    less a final special token (the end-of-turn the template writes after the reply
    anyway). None when they do not match the text: a stop string cut the text short."""
    if not output_ids:
        return None
    if finish_reason == "stop":
        if output_ids[-1] not in special_ids:
            return None  # ended by a stop string: the ids run past the text
        return output_ids[:-1]
    return list(output_ids)


def exact_prompt_ids(
    tokenizer, messages: list[dict], tools: Optional[list[dict]] = None, template_kwargs: Optional[dict] = None
) -> list[int]:
    """Chat-template prompt ids with the stored ids of replies spliced in. The template is
    rendered with a sentinel in place of each such reply; the text between sentinels is
    tokenised piece by piece. Pieces start and end at the template's special tokens and
    message boundaries, so a conversation's prompt ids only ever grow by appending: turn
    k+1 starts with turn k's prompt ids and reply ids exactly. A template that does not
    keep the sentinels intact falls back to tokenising the whole text."""
    rendered, spliced = [], []
    for m in messages:
        ids = m.get(TOKEN_IDS_KEY)
        if ids is None:
            rendered.append({k: v for k, v in m.items() if k != TOKEN_IDS_KEY})
            continue
        rendered.append({"role": m["role"], "content": _SENTINEL.format(nonce=_NONCE, index=len(spliced))})
        spliced.append(ids)
    extra = template_kwargs or {}
    text = tokenizer.apply_chat_template(rendered, tools=tools, add_generation_prompt=True, tokenize=False, **extra)
    pieces = re.split("\u27e6" + _NONCE + r":(\d+)\u27e7", text)
    # re.split with a group: [text, index, text, index, ..., text]
    indices = [int(i) for i in pieces[1::2]]
    if indices != list(range(len(spliced))):
        plain = [{k: v for k, v in m.items() if k != TOKEN_IDS_KEY} for m in messages]
        text = tokenizer.apply_chat_template(plain, tools=tools, add_generation_prompt=True, tokenize=False, **extra)
        return tokenizer.encode(text, add_special_tokens=False)
    out: list[int] = []
    for i, piece in enumerate(pieces[0::2]):
        if piece:
            out += tokenizer.encode(piece, add_special_tokens=False)
        if i < len(spliced):
            out += spliced[i]
    return out


def check_writable(record) -> None:
    """A 503 for a turn on ``record`` when it was read while its store refuses writes
    (``SessionRecord.writes_refused``): its append would be refused, after its reply was
    generated; so the turn is refused before any compute, with the same answer."""
    if record.writes_refused:
        raise RedisRefused.of()


MAX_SESSION_TTL_S = 30 * 86_400


def session_create_ttl(body: dict) -> Optional[int]:
    """The ``ttl_s`` of a ``POST /v1/sessions`` body (None: the configured default), or a
    400 naming what is wrong. The body takes ``ttl_s`` alone: any other field is refused,
    since quietly dropping it (a ``messages`` meant as the session's start, a misspelt
    ``ttl``) would give the client a session other than the one it asked for. ``ttl_s``
    must be a JSON integer: ``true`` is refused (Python's ``bool`` is an ``int``, and
    ``true`` made a session that expired after one second), and so is ``60.0``."""
    unknown = sorted(k for k in body if k != "ttl_s")
    if unknown:
        hint = (
            " A session starts empty: send its first messages (a system message too) in its "
            "first chat turn." if "messages" in unknown else ""
        )
        raise InvalidRequestError(
            f"Unknown field '{unknown[0][:80]}': a session takes only 'ttl_s'.{hint}",
            param=unknown[0][:80],
        )
    ttl_s = body.get("ttl_s")
    if ttl_s is not None and (type(ttl_s) is not int or not 1 <= ttl_s <= MAX_SESSION_TTL_S):
        raise InvalidRequestError(
            f"ttl_s must be an integer in [1, {MAX_SESSION_TTL_S}], got {json.dumps(ttl_s)[:40]}.", param="ttl_s"
        )
    return ttl_s


def check_session_id(session_id: str) -> str:
    if not SESSION_ID_RE.match(session_id or ""):
        raise InvalidRequestError(
            f"Malformed session id {session_id[:80]!r}: expected 'sess_' and 32 hex digits.",
            param="session_id",
        )
    return session_id


@dataclass(slots=True)
class PendingTurn:
    """What to append to a session once the reply has finished."""

    session_id: str
    expected_version: int
    new_messages: list[dict]
    # The session's token count when the request started (the store adds deltas).
    base_num_tokens: int = 0
    # Names this turn to the data plane, so the append is safe to repeat: made again after
    # it landed, it answers that success rather than a 409 (see DataPlane.append_turn).
    turn_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    # Whose session (the request's API key's tenant).
    tenant: str = DEFAULT_TENANT


def fit_history(
    history: list[dict],
    new_messages: list[dict],
    *,
    count_tokens: Callable[[list[dict]], int],
    max_new_tokens: int,
    max_model_len: int,
    policy: str,
) -> tuple[list[dict], int]:
    """The messages to send (history + new) and their prompt token count, under the
    overflow policy. The last call of ``count_tokens`` is always for the messages
    returned (callers rely on it to reuse what it built). ``error``: 400 saying how many tokens are over. ``truncate_oldest``:
    drop the oldest non-system history messages until it fits."""
    messages = history + new_messages
    num_tokens = count_tokens(messages)
    over = num_tokens + max_new_tokens - max_model_len
    if over <= 0:
        return messages, num_tokens
    if policy == "error":
        raise InvalidRequestError(
            f"The session history plus this request need {num_tokens + max_new_tokens} "
            f"tokens ({num_tokens} prompt, {max_new_tokens} for the completion), "
            f"{over} over the model's context of {max_model_len}.",
            param="messages",
            code="context_length_exceeded",
        )
    kept = list(history)
    while over > 0:
        victim = next((i for i, m in enumerate(kept) if m.get("role") != "system"), None)
        if victim is None:
            break
        del kept[victim]
        messages = kept + new_messages
        num_tokens = count_tokens(messages)
        over = num_tokens + max_new_tokens - max_model_len
    return messages, num_tokens


class RecordCache:
    """The session records an ingress read or wrote last, newest last, at most
    ``max_tokens`` tokens of history in all (a record counts its ``num_tokens``, at least
    1). A record is a snapshot at its version: the store's copy at the same version is the
    same, because every change of a session's history is a compare-and-set that moves the
    version on, and ids are never reused. Kept per (tenant, session id): a tenant never
    gets another's record, whatever id it sends."""

    def __init__(self, max_tokens: int):
        self.max_tokens = max_tokens
        self._records: OrderedDict[tuple[str, str], object] = OrderedDict()
        self._tokens = 0

    def __len__(self) -> int:
        return len(self._records)

    @property
    def num_tokens(self) -> int:
        return self._tokens

    @staticmethod
    def _size(record) -> int:
        return max(1, int(record.num_tokens))

    def get(self, tenant: str, session_id: str):
        record = self._records.get((tenant, session_id))
        if record is not None:
            self._records.move_to_end((tenant, session_id))
        return record

    def put(self, record) -> None:
        """Keep ``record`` in place of the one kept: the store's last answer wins, also one
        at a lower version (a store that lost data), which a check then sees as it is."""
        self.drop(record.tenant, record.id)
        size = self._size(record)
        if size > self.max_tokens:
            return
        self._records[(record.tenant, record.id)] = record
        self._tokens += size
        while self._tokens > self.max_tokens:
            _, oldest = self._records.popitem(last=False)
            self._tokens -= self._size(oldest)

    def drop(self, tenant: str, session_id: str) -> None:
        record = self._records.pop((tenant, session_id), None)
        if record is not None:
            self._tokens -= self._size(record)


def replica_died(exc: BaseException) -> bool:
    """Whether ``exc`` (or a cause Ray wrapped it in) says the replica that took the call
    died or could not be reached, so the call may be made again on another one."""
    types = replica_death_types()
    return any(isinstance(cause, types) for cause in _causes(exc))


class SessionClient:
    """The ingress side of the sessions API over the DataPlane handle.

    Every call survives the death of the data-plane replica that takes it (see
    ``DEATH_RETRY_BUDGET_S``), and an attempt that gets no answer within
    ``config.call_timeout_s`` is given up (cancelled) and made again, once: a call lost
    on its way (a dying replica, a handle's routing) costs seconds, not the request's
    whole deadline. A call made again may find its first attempt applied (the
    replica died after Redis took the write, before it answered), whether this client made
    it again or Ray Serve's router did (it re-sends a call whose replica died before the
    call's acceptance reached it, which can be after the call ran). So each write is safe
    to repeat: an append names its turn and the data plane answers a repeat with that
    turn's success; a create finds its own fresh id taken, which is its success; a delete
    made again by this client that finds nothing is its success too.
    """

    def __init__(self, dataplane, config: SessionConfig, tenant: str = DEFAULT_TENANT, *, direct_calls: bool = False):
        self._dp = dataplane
        self.config = config
        self.tenant = tenant
        # A call's first attempt goes straight to the replica that owns the session
        # (``routing.send_direct``, ``dataplane.direct_calls``) once this process's Serve
        # router has seen the replicas; counted: sent so, and those whose replica died
        # under them (made again through Serve). Shared with for_tenant()'s siblings.
        self._direct = DirectCalls(dataplane, direct_calls, "sessions")
        self.direct_calls = {"calls": 0, "fallbacks": 0}
        # What this client (and its for_tenant() siblings) read or wrote last (see cached()).
        self._records = RecordCache(config.ingress_cache_tokens)
        self._siblings: dict[str, SessionClient] = {}
        self._m_retries = self._m_direct = None
        try:
            import ray

            if ray.is_initialized():
                from ray.util import metrics

                self._m_retries = metrics.Counter(
                    "llm_session_dataplane_retries",
                    "Session calls made again: the data-plane replica died under them "
                    "(reason=replica_died), no answer came in sessions.call_timeout_s "
                    "(reason=timeout), or a turn's append got a 503 (reason=busy).",
                    tag_keys=("op", "reason"),
                )
                self._m_direct = metrics.Counter(
                    "llm_session_dataplane_direct_calls",
                    "Session calls sent straight to the data-plane replica that owns the "
                    "session (dataplane.direct_calls; outcome=sent), and those whose replica "
                    "died or could not be reached under them (outcome=fallback: made again "
                    "through Serve's router).",
                    tag_keys=("op", "outcome"),
                )
        except Exception:  # noqa: BLE001 - metrics are optional outside a Ray worker
            self._m_retries = self._m_direct = None

    async def _call(self, op: str, sid: str, /, *args, retried: list | None = None, busy_retries: int = 0, **kwargs):
        """``self._dp.<op>.remote(*args, **kwargs)``, made again while the replica taking
        it dies, ``TIMEOUT_RETRIES`` times after an attempt that got no answer within
        ``config.call_timeout_s`` (then 503), and ``busy_retries`` times after a 503 of
        the data plane's. ``retried``, if given, gets True appended when this client made
        the call again (also when the call then fails)."""
        deadline = time.monotonic() + DEATH_RETRY_BUDGET_S
        attempt = timeouts = busy = 0
        while True:
            pause = None
            bound = asyncio.timeout(self.config.call_timeout_s)
            response = None
            direct = False
            try:
                async with bound:
                    # The first attempt straight to the owner replica where known; a
                    # repeat through Serve's router, which finds a live replica itself.
                    response, direct = self._direct.call(op, args, kwargs, straight=attempt == 0)
                    if direct:
                        self._count_direct(op, "sent")
                    return await response
            except Exception as e:
                if direct and replica_died(e):
                    self._count_direct(op, "fallback")
                if isinstance(e, TimeoutError) and bound.expired():
                    cancel_call(response)
                    timeouts += 1
                    if timeouts > TIMEOUT_RETRIES:
                        self._on_give_up(op, sid, timeouts)
                        raise ServiceUnavailableError(
                            "The session store did not answer in time; retry shortly.",
                            headers={"Retry-After": "1"},
                        ) from None
                    reason = "timeout"
                elif replica_died(e) and time.monotonic() < deadline:
                    reason = "replica_died"
                elif isinstance(e, ServiceUnavailableError) and busy < busy_retries:
                    reason = "busy"
                    pause = BUSY_BACKOFF_S * 2**busy
                    busy += 1
                else:
                    raise
                attempt += 1
                if retried is not None:
                    retried.append(True)
                self._on_retry(op, sid, e, attempt, reason)
            if pause is None:
                pause = min(0.05 * 2**attempt, 1.0, max(0.0, deadline - time.monotonic()))
            await asyncio.sleep(pause)

    def _count_direct(self, op: str, outcome: str) -> None:
        self.direct_calls["calls" if outcome == "sent" else "fallbacks"] += 1
        if self._m_direct is not None:
            self._m_direct.inc(tags={"op": op, "outcome": outcome})

    def _on_retry(self, op: str, session_id: str, error: BaseException, attempt: int, reason: str) -> None:
        from opentelemetry import trace

        if reason == "timeout":
            logger.warning(
                "session %s: no answer from the data plane to %s within %.1fs "
                "(sessions.call_timeout_s); cancelled, trying again (attempt %d)",
                session_id,
                op,
                self.config.call_timeout_s,
                attempt + 1,
            )
        elif reason == "busy":
            logger.info(
                "session %s: the data plane cannot take %s now (%s); trying again (attempt %d)",
                session_id,
                op,
                error,
                attempt + 1,
            )
        else:
            logger.warning(
                "session %s: the data-plane replica died under %s (%s); trying again (attempt %d)",
                session_id,
                op,
                type(error).__name__,
                attempt + 1,
            )
        trace.get_current_span().add_event(
            "session.dataplane_retry",
            {"op": op, "reason": reason, "error": type(error).__name__, "attempt": attempt},
        )
        if self._m_retries is not None:
            self._m_retries.inc(tags={"op": op, "reason": reason})

    def _on_give_up(self, op: str, session_id: str, attempts: int) -> None:
        logger.error(
            "session %s: no answer from the data plane to %s in %d attempts of %.1fs; answering 503",
            session_id,
            op,
            attempts,
            self.config.call_timeout_s,
        )

    def for_tenant(self, tenant: str) -> "SessionClient":
        """The client of ``tenant``'s sessions: the same handle, settings, metrics and
        record cache (kept per tenant and id), every call made as ``tenant``."""
        if tenant == self.tenant:
            return self
        sibling = self._siblings.get(tenant)
        if sibling is None:  # one per tenant that sent a request (tenants come from the keys)
            sibling = self._siblings[tenant] = copy.copy(self)
            sibling.tenant = tenant
        return sibling

    def cached(self, session_id: str):
        """The last record of this session this client read or wrote, if it still holds
        it; it may be behind the store's (another ingress replica appended a turn since),
        so a caller checks it against a read before acting on it."""
        return self._records.get(self.tenant, session_id)

    async def create(self, ttl_s: Optional[int] = None):
        record = await self._create(ttl_s)
        self._records.put(record)
        return record

    async def _create(self, ttl_s: Optional[int]):
        ttl = ttl_s or self.config.cache_ttl_s
        # The id is made here so that the call can be routed to the id's shard.
        session_id = f"sess_{uuid.uuid4().hex}"
        try:
            return await self._call(
                "create_session",
                session_id,
                self.tenant,
                session_id=session_id,
                ttl_s=ttl,
                shard_key=session_id,
            )
        except ConflictError:
            # The id is fresh (122 random bits): only an earlier attempt of this very call
            # can have taken it, made again by us or by the router.
            record = await self._call("get_session", session_id, self.tenant, session_id, shard_key=session_id)
            if record is None or record.version != 0:
                raise
            return record

    async def get(self, session_id: str):
        check_session_id(session_id)
        return await self._get(session_id, "session")

    async def _get(self, record_id: str, kind: str):
        record = await self._call("get_session", record_id, self.tenant, record_id, shard_key=record_id)
        if record is None or (kind == "response" and record.version == 0):
            # (A response's record holds its conversation from its one append on: one
            # still empty is a store that did not finish, not a response.)
            self._records.drop(self.tenant, record_id)
            # Same answer for absent, expired and another tenant's: no existence leak.
            raise NotFoundError(f"No {kind} '{record_id}'.", param=f"{kind}_id", code=f"{kind}_not_found")
        if kind == "session":  # (no prompt is built from a held response record)
            self._records.put(record)
        return record

    async def get_response(self, response_id: str):
        """A stored response's record (app/responses.py): 404 as a session's."""
        check_response_id(response_id, "response_id")
        return await self._get(response_id, "response")

    async def store_response(self, response_id: str, messages: list[dict], num_tokens: int, ttl_s: int):
        """Store a response (app/responses.py) as a record of its own: created, then its
        conversation appended at version 0. Both calls are safe to repeat, as a
        session's create and append are (the id is fresh; the append names its turn)."""
        try:
            await self._call(
                "create_session", response_id, self.tenant, session_id=response_id, ttl_s=ttl_s, shard_key=response_id
            )
        except ConflictError:
            pass  # a fresh id: only an earlier attempt of this very call took it
        turn = PendingTurn(response_id, 0, messages, tenant=self.tenant)
        return await self.append(turn, messages, num_tokens, keep=False)

    async def append(self, turn: PendingTurn, messages: list[dict], context_tokens: int, keep: bool = True):
        """Append ``messages``; ``context_tokens`` is the conversation's size in tokens
        after this turn (prompt + reply). ``keep``: hold the record for ``cached``."""
        sid = turn.session_id
        # A 409 here is a turn that raced this one: after a repeat of this very append the
        # data plane answers its success (same turn id), never a conflict.
        try:
            record = await self._call(
                "append_turn",
                sid,
                self.tenant,
                sid,
                turn.expected_version,
                messages,
                context_tokens - turn.base_num_tokens,
                turn_id=turn.turn_id,
                shard_key=sid,
                busy_retries=APPEND_BUSY_RETRIES,
            )
        except BaseException:
            self._records.drop(self.tenant, sid)
            raise
        if keep:
            self._records.put(record)
        return record

    async def delete(self, session_id: str) -> bool:
        check_session_id(session_id)
        return await self._delete(session_id, "session")

    async def delete_response(self, response_id: str) -> bool:
        check_response_id(response_id, "response_id")
        return await self._delete(response_id, "response")

    async def _delete(self, record_id: str, kind: str) -> bool:
        self._records.drop(self.tenant, record_id)
        retried: list = []
        deleted = await self._call(
            "delete_session", record_id, self.tenant, record_id, shard_key=record_id, retried=retried
        )
        # After a retry, "nothing to delete" is our first attempt's work.
        if not deleted and not retried:
            raise NotFoundError(f"No {kind} '{record_id}'.", param=f"{kind}_id", code=f"{kind}_not_found")
        return True


def session_json(record) -> dict:
    return {
        "id": record.id,
        "object": "session",
        "created": int(record.created),
        "expires_at": int(record.expires_at),
        "version": record.version,
        "num_tokens": record.num_tokens,
        "messages": [{k: v for k, v in m.items() if k != TOKEN_IDS_KEY} for m in record.messages],
    }
