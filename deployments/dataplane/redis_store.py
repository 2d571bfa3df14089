"""L3: async Redis access for KV blocks and sessions (``redis.asyncio``).

Every connection failure or timeout surfaces as :class:`RedisUnavailable`, the one
exception the data plane catches to degrade to memory-only. Other Redis errors (a bad
script, a wrong type) are bugs and propagate.

Session records are one hash per session::

    tenant, messages (JSON array), num_messages, num_tokens, version, created, expires, ttl_s,
    last_turn (the id of the turn that made ``version``; absent before the first append)

and every change is a single Lua script, so a record is never half-written and an append
is one atomic compare-and-set on ``version``. An append names its turn: made again with
the same turn id after it landed (a retry whose first answer was lost), it reports that
success instead of a conflict, so a retry can neither duplicate a turn nor fail one.
"""

from __future__ import annotations

import functools
import json
import os
import time
from dataclasses import dataclass
from typing import Optional, Sequence

import redis.asyncio as aioredis
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.asyncio.retry import Retry

from app.config import RedisConfig
from app.errors import APIError, ServiceUnavailableError
from deployments.dataplane import keys
from deployments.dataplane.resp import RawBlockClient
from deployments.dataplane.types import SessionRecord

# A payload outlives its index entry by this much, so an index entry that a reader sees
# always has its payload (the index expires first).
PAYLOAD_TTL_MARGIN_S = 60


class RedisUnavailable(Exception):
    """Redis could not be reached, or did not answer in time."""


class RedisRefused(ServiceUnavailableError):
    """A running Redis refused a write and took nothing: over its ``maxmemory`` with
    ``noeviction`` (OOM), after a failed AOF or RDB write (MISCONF), as a read-only
    replica (READONLY), or short of in-sync replicas (NOREPLICAS). Reads still work. A
    503 to clients, without Redis's words (``reply``, kept for this process's log)."""

    reply: str = ""

    @classmethod
    def of(cls, error: Optional[ResponseError] = None) -> "RedisRefused":
        """The refusal Redis answered with ``error``; None: one known before any write
        was tried (a session read while its server refuses writes, ``SessionRecord``)."""
        refused = cls(
            "The session store is not accepting writes right now (it is full or "
            "read-only); nothing was saved. Retry later.",
            code="store_refusing_writes",
            headers={"Retry-After": str(REFUSED_RETRY_AFTER_S)},
        )
        refused.reply = "" if error is None else _as_said(error)[:300]
        return refused


class UnreadableSessionRecord(APIError):
    """A session key in Redis whose content is not a record this server wrote (edited by
    hand, written by another program, damaged): a 500 that says so, never a guess at its
    messages. It is left as it is for an operator; a DELETE of the session erases it."""

    @classmethod
    def of(cls, session_id: str, why: str) -> "UnreadableSessionRecord":
        return cls(
            f"Session {session_id[:80]!r} has a stored record that cannot be read ({why}); "
            "it was left as it is. Delete the session to start over.",
            param="session_id",
            code="session_record_unreadable",
        )


# What a client is told to wait after a refusal: an operator frees memory, or a failover
# ends, in minutes rather than milliseconds.
REFUSED_RETRY_AFTER_S = 5

# The error codes of a refused write (redis-py strips the code from the message and keeps
# it as ``status_code``; the raw client, resp.py, leaves it at the message's start).
REFUSAL_CODES = frozenset({"OOM", "MISCONF", "READONLY", "NOREPLICAS"})

# The error codes of a server that is there but serves nobody now: a script past its time
# limit (BUSY, until SCRIPT KILL), a replica cut off from its primary (MASTERDOWN), a
# cluster without quorum (CLUSTERDOWN, TRYAGAIN). Handled as unreachable: degraded until
# it answers. (LOADING, replaying the AOF, is redis-py's BusyLoadingError already.)
UNAVAILABLE_CODES = frozenset({"BUSY", "MASTERDOWN", "CLUSTERDOWN", "TRYAGAIN"})


def _error_code(error: BaseException) -> Optional[str]:
    if not isinstance(error, ResponseError):
        return None
    return getattr(error, "status_code", None) or str(error).split(" ", 1)[0]


def _as_said(error: ResponseError) -> str:
    """The error reply as the server sent it: its code, then the message."""
    said, code = str(error), _error_code(error) or ""
    return said if said.startswith(code) else f"{code} {said}"


def refusal_code(error: BaseException) -> Optional[str]:
    """The code of an error reply by which Redis refused a write, else None."""
    code = _error_code(error)
    return code if code in REFUSAL_CODES else None


def unavailable_reply(error: BaseException) -> Optional[RedisUnavailable]:
    """The RedisUnavailable that an error reply of ``UNAVAILABLE_CODES`` stands for, else None."""
    return RedisUnavailable(_as_said(error)) if _error_code(error) in UNAVAILABLE_CODES else None


def _meaning(error: ResponseError) -> Exception:
    """What an error reply is here: RedisUnavailable (``UNAVAILABLE_CODES``), RedisRefused
    (``REFUSAL_CODES``), else the reply itself."""
    if (down := unavailable_reply(error)) is not None:
        return down
    return error if refusal_code(error) is None else RedisRefused.of(error)


_CONNECTION_ERRORS = (RedisConnectionError, RedisTimeoutError, OSError)


def _unavailable(fn):
    """Map connection failures to RedisUnavailable, after one retry on fresh connections,
    and a refused write to RedisRefused (not retried: the server is there and said no).

    After a Redis restart every pooled connection is dead, and redis-py's own retry only
    re-dials the one it is using, so a call can still fail on the next stale one. On a
    connection error we drop the idle pooled connections and try once more. Retrying is
    safe for every call here: writes are idempotent (SET, DEL, SADD) or compare-and-set
    (an append that did land the first time reports itself applied, never a duplicate).
    """

    @functools.wraps(fn)
    async def wrapper(self, *args, **kwargs):
        # (A wrapped call nested in another raises RedisUnavailable, which the outer
        # one passes through without retrying again.)
        try:
            try:
                return await fn(self, *args, **kwargs)
            except _CONNECTION_ERRORS:
                for c in self._clients():
                    await c.connection_pool.disconnect(inuse_connections=False)
                return await fn(self, *args, **kwargs)
        except _CONNECTION_ERRORS as e:
            # BusyLoadingError (Redis replaying its AOF) is a ConnectionError too.
            raise RedisUnavailable(f"{type(e).__name__}: {e}") from e
        except ResponseError as e:
            if (meant := _meaning(e)) is e:
                raise
            raise meant from e

    return wrapper


@dataclass(frozen=True, slots=True)
class AppendResult:
    status: str  # "ok" | "conflict" | "missing" | "too_many_messages"
    version: int = 0  # the new version ("ok") or the current one ("conflict")
    # "ok" because this turn id had already been applied (nothing written this time).
    replayed: bool = False


_APPEND = """
-- KEYS[1] session; ARGV: expected_version, new messages (JSON array), num new messages,
-- added tokens, now, max_messages, turn id ('' for none)
if redis.call('EXISTS', KEYS[1]) == 0 or redis.call('HEXISTS', KEYS[1], 'deleted') == 1 then
  return {-1, 0}
end
local v = tonumber(redis.call('HGET', KEYS[1], 'version'))
if v ~= tonumber(ARGV[1]) then
  -- This very turn, already applied (its first answer was lost): its success again.
  if ARGV[7] ~= '' and v == tonumber(ARGV[1]) + 1
     and redis.call('HGET', KEYS[1], 'last_turn') == ARGV[7] then return {v, 1} end
  return {-2, v}
end
local n = tonumber(redis.call('HGET', KEYS[1], 'num_messages')) + tonumber(ARGV[3])
if n > tonumber(ARGV[6]) then return {-3, n} end
local old = redis.call('HGET', KEYS[1], 'messages')
local new = ARGV[2]
local merged
-- Splice the two JSON arrays as text: decoding and re-encoding with cjson would turn
-- an empty list into {} and rewrite numbers.
if tonumber(ARGV[3]) == 0 then merged = old
elseif old == '[]' then merged = new
else merged = string.sub(old, 1, -2) .. ',' .. string.sub(new, 2) end
local ttl = tonumber(redis.call('HGET', KEYS[1], 'ttl_s'))
local tokens = tonumber(redis.call('HGET', KEYS[1], 'num_tokens')) + tonumber(ARGV[4])
redis.call('HSET', KEYS[1], 'messages', merged, 'num_messages', n, 'num_tokens', tokens,
           'version', v + 1, 'expires', tonumber(ARGV[5]) + ttl, 'last_turn', ARGV[7])
redis.call('EXPIRE', KEYS[1], ttl)
return {v + 1, 0}
"""

_GET_AND_TOUCH = """
-- KEYS[1] session; ARGV[1] now. Returns the fields after refreshing the expiry.
if redis.call('EXISTS', KEYS[1]) == 0 or redis.call('HEXISTS', KEYS[1], 'deleted') == 1 then
  return {}
end
local ttl = tonumber(redis.call('HGET', KEYS[1], 'ttl_s'))
redis.call('HSET', KEYS[1], 'expires', tonumber(ARGV[1]) + ttl)
redis.call('EXPIRE', KEYS[1], ttl)
return redis.call('HGETALL', KEYS[1])
"""

_CREATE = """
-- KEYS[1] session; ARGV[1] ttl_s, then field/value pairs. 0 if the id is taken (a
-- deleted session's tombstone included: ids are never used twice).
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
redis.call('HSET', KEYS[1], unpack(ARGV, 2))
redis.call('EXPIRE', KEYS[1], tonumber(ARGV[1]))
return 1
"""

_PUT_IF_NEWER = """
-- KEYS[1] session; ARGV[1] version, ARGV[2] ttl_s, then field/value pairs.
-- Writes the record unless Redis holds the same or a newer version (resync after an
-- outage must never roll back a turn acknowledged by Redis) or the session's tombstone
-- (a stale copy on another replica must not bring a deleted session back).
if redis.call('HEXISTS', KEYS[1], 'deleted') == 1 then return 0 end
local cur = redis.call('HGET', KEYS[1], 'version')
if cur and tonumber(cur) >= tonumber(ARGV[1]) then return 0 end
redis.call('DEL', KEYS[1])
redis.call('HSET', KEYS[1], unpack(ARGV, 3))
redis.call('EXPIRE', KEYS[1], tonumber(ARGV[2]))
return 1
"""

_DELETE = """
-- KEYS[1] session; ARGV[1] seconds to keep a tombstone where there is no record (0: none).
-- Replaces the record by a tombstone (the one field 'deleted') that lives as long as the
-- record would have: a replica that kept a copy through a Redis outage (DataPlane.back_up)
-- writes it back later with _PUT_IF_NEWER, which the tombstone refuses. 1 if a session
-- was there.
-- A key of another type (not a record this server wrote) is deleted as a record.
local kind = redis.call('TYPE', KEYS[1])['ok']
if kind == 'hash' and redis.call('HEXISTS', KEYS[1], 'deleted') == 1 then return 0 end
local keep = tonumber(ARGV[1])
local live = kind ~= 'none'
if kind == 'hash' then keep = tonumber(redis.call('HGET', KEYS[1], 'ttl_s')) or keep end
redis.call('DEL', KEYS[1])
if keep > 0 then
  redis.call('HSET', KEYS[1], 'deleted', '1')
  redis.call('EXPIRE', KEYS[1], keep)
end
if live then return 1 end
return 0
"""


_LINK_BLOCKS = """
-- KEYS[1] session, KEYS[2] its block list; ARGV[1] the list's ttl_s, then members.
-- 0 and nothing added if the session was deleted (its tombstone): a turn's blocks
-- exported after its session's DELETE must not be listed under it again.
if redis.call('HEXISTS', KEYS[1], 'deleted') == 1 then return 0 end
for i = 2, #ARGV, 1000 do
  redis.call('SADD', KEYS[2], unpack(ARGV, i, math.min(i + 999, #ARGV)))
end
redis.call('EXPIRE', KEYS[2], tonumber(ARGV[1]))
return 1
"""


def _dumps(messages: Sequence[dict]) -> str:
    return json.dumps(list(messages), separators=(",", ":"), ensure_ascii=False)


def _record_fields(rec: SessionRecord) -> dict[str, str]:
    return {
        "tenant": rec.tenant,
        "messages": _dumps(rec.messages),
        "num_messages": str(len(rec.messages)),
        "num_tokens": str(rec.num_tokens),
        "version": str(rec.version),
        "created": repr(rec.created),
        "expires": repr(rec.expires_at),
        "ttl_s": str(rec.ttl_s),
        "last_turn": rec.last_turn_id,
    }


def _record_from(session_id: str, fields: dict) -> SessionRecord:
    """The record in a session hash's ``fields``; UnreadableSessionRecord naming the
    first field that is missing or not what this server writes there."""
    name = ""

    def s(field: str, default: Optional[str] = None) -> str:
        nonlocal name
        name = field
        v = fields.get(field.encode(), fields.get(field, default))
        if v is None:
            raise KeyError(field)
        return v.decode() if isinstance(v, bytes) else v

    try:
        messages = json.loads(s("messages"))
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            raise ValueError("not a list of messages")
        return SessionRecord(
            id=session_id,
            tenant=s("tenant"),
            messages=messages,
            num_tokens=int(s("num_tokens")),
            version=int(s("version")),
            created=float(s("created")),
            expires_at=float(s("expires")),
            ttl_s=int(s("ttl_s")),
            last_turn_id=s("last_turn", ""),  # absent in records written before turn ids
        )
    except KeyError:
        raise UnreadableSessionRecord.of(session_id, f"no field {name!r}") from None
    except (ValueError, UnicodeDecodeError):
        raise UnreadableSessionRecord.of(session_id, f"field {name!r} is not what this server writes") from None


def _client(cfg: RedisConfig, environ) -> aioredis.Redis:
    password = environ.get(cfg.password_env) if cfg.password_env else None
    # rediss:// in the URL turns TLS on (redis-py reads it from the scheme); the CA and
    # client certificate come from the config (RedisConfig.tls_kwargs).
    return aioredis.Redis.from_url(
        cfg.url,
        **cfg.tls_kwargs(),
        password=password or None,
        max_connections=cfg.pool_size,
        socket_timeout=cfg.socket_timeout_s,
        socket_connect_timeout=cfg.connect_timeout_s,
        # One immediate retry re-dials a pooled connection that a Redis restart broke;
        # more would only delay noticing an outage (we degrade instead). The asyncio
        # Retry: redis-py converts a sync one, with a UserWarning per client.
        retry=Retry(NoBackoff(), 1),
        retry_on_timeout=False,
    )


async def _mget_blocks(
    raw: Optional[RawBlockClient], client: aioredis.Redis, tenant: str, hashes: Sequence[str], on_value=None
):
    """``RedisStore.get_blocks_packed`` over ``raw`` (None: redis-py's ``client``)."""
    import numpy as np

    if not hashes:
        return np.empty(0, np.uint8), []
    names = [keys.block_key(tenant, h) for h in hashes]
    if raw is not None:
        data, lengths = await raw.mget_packed(names, on_value=on_value)
    else:
        values = await client.mget(names)
        present = [v for v in values if v is not None]
        data = np.frombuffer(b"".join(present), dtype=np.uint8)
        lengths = [None if v is None else len(v) for v in values]
    view = memoryview(data).toreadonly()
    out, offset = [], 0
    for i, n in enumerate(lengths):
        if n is None:
            out.append(None)
            continue
        out.append(view[offset : offset + n])
        if raw is None and on_value is not None:
            on_value(i, out[-1])
        offset += n
    return data, out


class BlockReader:
    """Reads of KV block payloads from the blocks' Redis (``DataPlaneConfig.kv_redis``,
    else ``redis``), for a compute worker that reads the L3 blocks of a prefix itself:
    one transfer, Redis to the worker, instead of Redis to a data-plane replica, a copy
    into its object store, then the worker (``DataPlaneKVConnector``). The same clients
    and errors as :class:`RedisStore`: a connection failure is ``RedisUnavailable``."""

    def __init__(self, client: aioredis.Redis, buffer=None):
        """``buffer``: where the reply buffers of the raw client come from (nbytes ->
        uint8 array; default malloc), see ``RawBlockClient.buffer``."""
        self._kv = client
        self._raw = RawBlockClient.from_redis(client)
        if self._raw is not None and buffer is not None:
            self._raw.buffer = buffer

    @classmethod
    def from_config(cls, cfg: RedisConfig, environ=os.environ, buffer=None) -> "BlockReader":
        return cls(_client(cfg, environ), buffer=buffer)

    def _clients(self) -> list[aioredis.Redis]:
        return [self._kv]

    @_unavailable
    async def get_blocks_packed(self, tenant: str, hashes: Sequence[str], *, on_value=None):
        """As :meth:`RedisStore.get_blocks_packed`."""
        return await _mget_blocks(self._raw, self._kv, tenant, hashes, on_value)

    async def close(self) -> None:
        if self._raw is not None:
            self._raw.close()
        await self._kv.aclose()


class RedisStore:
    """KV blocks and session records in Redis. Construct with :meth:`from_config`."""

    def __init__(
        self,
        client: aioredis.Redis,
        *,
        kv_ttl_s: int,
        clock=time.time,
        raw_blocks: bool = True,
        kv_client: Optional[aioredis.Redis] = None,
    ):
        # Sessions (and each session's list of its blocks) on ``client``, the durable
        # server; KV blocks (payloads and index entries) on ``kv_client`` if given, a
        # cache server (``DataPlaneConfig.kv_redis``), else on the same one.
        self._r = client
        self._kv = kv_client or client
        # KV block payloads go through a copy-free RESP client where it can serve (plain
        # TCP); sessions, scripts and everything small stay on redis-py.
        self._raw = RawBlockClient.from_redis(self._kv) if raw_blocks else None
        self._kv_ttl_s = kv_ttl_s
        self._clock = clock
        self._append = client.register_script(_APPEND)
        self._get_touch = client.register_script(_GET_AND_TOUCH)
        self._put_if_newer = client.register_script(_PUT_IF_NEWER)
        self._create = client.register_script(_CREATE)
        self._delete = client.register_script(_DELETE)
        self._link_blocks = client.register_script(_LINK_BLOCKS)

    @classmethod
    def from_config(
        cls,
        cfg: RedisConfig,
        *,
        kv_ttl_s: int,
        kv_cfg: Optional[RedisConfig] = None,
        environ=os.environ,
    ) -> "RedisStore":
        """The store over ``cfg``'s server, with KV blocks on ``kv_cfg``'s if given."""
        kv_client = _client(kv_cfg, environ) if kv_cfg is not None else None
        return cls(_client(cfg, environ), kv_ttl_s=kv_ttl_s, kv_client=kv_client)

    @property
    def client(self) -> aioredis.Redis:
        """The sessions' (durable) server."""
        return self._r

    @property
    def kv_client(self) -> aioredis.Redis:
        """The KV blocks' server (``client`` unless a separate one was configured)."""
        return self._kv

    def _clients(self) -> list[aioredis.Redis]:
        return [self._r] if self._kv is self._r else [self._r, self._kv]

    async def close(self) -> None:
        if self._raw is not None:
            self._raw.close()
        for c in self._clients():
            await c.aclose()

    @property
    def shared(self) -> bool:
        """Sessions and KV blocks on one server (no ``kv_redis``)."""
        return self._kv is self._r

    async def ping(self, server: Optional[str] = None) -> bool:
        """The server answers: ``"sessions"`` (the durable one), ``"kv"`` (the blocks'
        one; the same when shared) or, by default, both. Only the asked server's idle
        connections are dropped and dialled again on a failure (a degraded replica pings
        the down server every few hundred ms; the other's pool is left alone)."""
        clients = {"sessions": [self._r], "kv": [self._kv]}.get(server or "", self._clients())
        for c in clients:
            try:
                try:
                    await c.ping()
                except _CONNECTION_ERRORS:
                    await c.connection_pool.disconnect(inuse_connections=False)
                    await c.ping()
            except _CONNECTION_ERRORS as e:
                raise RedisUnavailable(f"{type(e).__name__}: {e}") from e
            except ResponseError as e:  # a PING is never refused: unavailable or as it is
                if (meant := _meaning(e)) is e:
                    raise
                raise meant from e
        return True

    @_unavailable
    async def probe_write(self, server: str, key: str) -> None:
        """A small write that ``server`` (``"sessions"`` or ``"kv"``) takes unless it
        refuses writes (then RedisRefused): ``key`` set for a second."""
        await {"sessions": self._r, "kv": self._kv}[server].set(key, b"1", px=1000)

    # -- KV blocks -----------------------------------------------------------------

    @_unavailable
    async def put_block(self, tenant: str, block_hash: str, data: bytes, ttl_s: Optional[int] = None) -> None:
        await self.put_blocks(tenant, [block_hash], [data], ttl_s)

    @_unavailable
    async def put_blocks(
        self,
        tenant: str,
        hashes: Sequence[str],
        blocks: Sequence[bytes | memoryview],
        ttl_s: Optional[int] = None,
    ) -> None:
        ttl = ttl_s or self._kv_ttl_s
        if len(hashes) != len(blocks):
            raise ValueError(f"{len(hashes)} hashes but {len(blocks)} blocks")
        # Payload FIRST, then the index entry that marks it present: a reader that sees
        # the index (lookup/has_blocks) must find the payload. Both clients send the
        # commands in order on one connection, so the order holds.
        if self._raw is not None:
            commands = []
            for h, data in zip(hashes, blocks):
                commands.append(("SET", keys.block_key(tenant, h), data, "EX", ttl + PAYLOAD_TTL_MARGIN_S))
                commands.append(("SET", keys.block_index_key(tenant, h), len(data), "EX", ttl))
            for reply in await self._raw.pipeline(commands):
                if isinstance(reply, Exception):
                    raise reply
            return
        pipe = self._kv.pipeline(transaction=False)
        for h, data in zip(hashes, blocks):
            pipe.set(keys.block_key(tenant, h), data, ex=ttl + PAYLOAD_TTL_MARGIN_S)
            pipe.set(keys.block_index_key(tenant, h), len(data), ex=ttl)
        await pipe.execute()

    @_unavailable
    async def get_block(self, tenant: str, block_hash: str) -> Optional[bytes]:
        return await self._kv.get(keys.block_key(tenant, block_hash))

    @_unavailable
    async def get_blocks(self, tenant: str, hashes: Sequence[str]) -> list[Optional[bytes]]:
        if not hashes:
            return []
        return await self._kv.mget([keys.block_key(tenant, h) for h in hashes])

    @_unavailable
    async def get_blocks_packed(self, tenant: str, hashes: Sequence[str], *, on_value=None):
        """One MGET: ``(uint8 array of the present payloads back to back, read-only
        memoryview of each payload or None where absent)``. With the raw client the
        payloads are read from the socket straight into the array. ``on_value(i,
        payload)`` is called for each present one as it arrives (``blocks.BlockChecks``:
        the check of each block while it is in the CPU's cache); an exception from it
        is raised after the whole reply was read."""
        return await _mget_blocks(self._raw, self._kv, tenant, hashes, on_value)

    @_unavailable
    async def block_sizes(self, tenant: str, hashes: Sequence[str]) -> list[Optional[int]]:
        """Payload length of each block whose index entry is present, else None."""
        if not hashes:
            return []
        values = await self._kv.mget([keys.block_index_key(tenant, h) for h in hashes])
        return [None if v is None else int(v) for v in values]

    async def has_blocks(self, tenant: str, hashes: Sequence[str]) -> list[bool]:
        return [size is not None for size in await self.block_sizes(tenant, hashes)]

    @_unavailable
    async def delete_blocks(self, tenant: str, hashes: Sequence[str]) -> int:
        if not hashes:
            return 0
        # Index first: a reader must not find an index entry whose payload is gone.
        pipe = self._kv.pipeline(transaction=False)
        pipe.delete(*[keys.block_index_key(tenant, h) for h in hashes])
        pipe.delete(*[keys.block_key(tenant, h) for h in hashes])
        _, n = await pipe.execute()
        return int(n)

    async def delete(self, tenant: str, block_hash: str) -> int:
        return await self.delete_blocks(tenant, [block_hash])

    @_unavailable
    async def add_kv_roots(self, tenant: str, roots: Sequence[str], now: Optional[float] = None) -> None:
        """Publish chain roots (root_index.py): each scored ``now`` (wall time), entries
        older than the L3 TTL dropped, the set itself expiring with the last of them."""
        if not roots:
            return
        now = self._clock() if now is None else now
        key = keys.kv_roots_key(tenant)
        pipe = self._kv.pipeline(transaction=False)
        pipe.zadd(key, {r: now for r in roots})
        pipe.zremrangebyscore(key, "-inf", f"({now - self._kv_ttl_s!r}")
        pipe.expire(key, self._kv_ttl_s + PAYLOAD_TTL_MARGIN_S)
        await pipe.execute()

    @_unavailable
    async def add_session_blocks(
        self, tenant: str, session_id: str, members: Sequence[str], ttl_s: int
    ) -> bool:
        """List blocks under their session (what its delete erases). False, and nothing
        listed, if the session was deleted (its tombstone)."""
        if not members:
            return True
        ttl = max(ttl_s, self._kv_ttl_s) + PAYLOAD_TTL_MARGIN_S
        return bool(
            await self._link_blocks(
                keys=[keys.session_key(tenant, session_id), keys.session_blocks_key(tenant, session_id)],
                args=[ttl, *members],
            )
        )

    @_unavailable
    async def session_block_members(self, tenant: str, session_id: str) -> list[str]:
        members = await self._r.smembers(keys.session_blocks_key(tenant, session_id))
        return sorted(m.decode() if isinstance(m, bytes) else m for m in members)

    @_unavailable
    async def delete_member_blocks(self, tenant: str, members: Sequence[str]) -> None:
        """Delete the blocks of session block-list members (the KV server only)."""
        hashes = [keys.split_session_block_member(m)[1] for m in members]
        for start in range(0, len(hashes), 512):
            await self.delete_blocks(tenant, hashes[start : start + 512])

    @_unavailable
    async def forget_session_blocks(self, tenant: str, session_id: str) -> None:
        """Delete the session's list of its blocks (the sessions server only)."""
        await self._r.delete(keys.session_blocks_key(tenant, session_id))

    # -- sessions ------------------------------------------------------------------

    @_unavailable
    async def create_session(self, rec: SessionRecord) -> bool:
        """Store a new session; False (nothing written) if the id is already taken."""
        flat = [x for kv in _record_fields(rec).items() for x in kv]
        created = await self._create(
            keys=[keys.session_key(rec.tenant, rec.id)], args=[rec.ttl_s, *flat]
        )
        return bool(created)

    @_unavailable
    async def get_session(self, tenant: str, session_id: str, *, touch: bool = True) -> Optional[SessionRecord]:
        """The session, its expiry refreshed (``touch``: a write, which a server that
        refuses writes refuses); None if absent or expired."""
        key = keys.session_key(tenant, session_id)
        try:
            if touch:
                flat = await self._get_touch(keys=[key], args=[self._clock()])
                fields = dict(zip(flat[::2], flat[1::2]))
            else:
                fields = await self._r.hgetall(key)
        except ResponseError as e:
            if _error_code(e) != "WRONGTYPE":
                raise
            raise UnreadableSessionRecord.of(session_id, "the key holds another type than a hash") from None
        if not fields or b"deleted" in fields or "deleted" in fields:  # a tombstone
            return None
        rec = _record_from(session_id, fields)
        return rec if rec.tenant == tenant else None

    @_unavailable
    async def append(
        self,
        tenant: str,
        session_id: str,
        expected_version: int,
        new_messages: Sequence[dict],
        num_tokens: int,
        *,
        max_messages: int = 1 << 30,
        turn_id: str = "",
    ) -> AppendResult:
        """Atomically append if the stored version equals ``expected_version``.
        ``num_tokens``: the tokens the new messages add to the session's count. With a
        ``turn_id``, an append that already landed under that id answers ``ok`` again
        (``replayed``) instead of ``conflict``."""
        code, extra = await self._append(
            keys=[keys.session_key(tenant, session_id)],
            args=[
                int(expected_version),
                _dumps(new_messages),
                len(new_messages),
                int(num_tokens),
                self._clock(),
                max_messages,
                turn_id,
            ],
        )
        code, extra = int(code), int(extra)
        if code == -1:
            return AppendResult("missing")
        if code == -2:
            return AppendResult("conflict", version=extra)
        if code == -3:
            return AppendResult("too_many_messages", version=extra)
        return AppendResult("ok", version=code, replayed=bool(extra))

    @_unavailable
    async def put_session_if_newer(self, rec: SessionRecord) -> bool:
        fields = _record_fields(rec)
        flat = [x for kv in fields.items() for x in kv]
        ttl = max(1, int(rec.expires_at - self._clock()))
        written = await self._put_if_newer(
            keys=[keys.session_key(rec.tenant, rec.id)], args=[rec.version, ttl, *flat]
        )
        return bool(written)

    @_unavailable
    async def delete_session(self, tenant: str, session_id: str, *, tombstone_s: int = 0) -> bool:
        """Delete the session's record, leaving a tombstone for as long as the record
        would have lived (its ``ttl_s``); where there is no record, a tombstone of
        ``tombstone_s`` seconds if that is > 0 (a session that only a replica's memory
        held, deleted during an outage). True if a record was there."""
        return bool(await self._delete(keys=[keys.session_key(tenant, session_id)], args=[int(tombstone_s)]))
