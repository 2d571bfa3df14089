"""Typed records the data plane hands across its boundary."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field


def new_session_id() -> str:
    """A fresh session id. Callers create it and pass it both as ``session_id`` and as
    ``shard_key`` of ``DataPlane.create_session``, so every later call on the session is
    routed to the same replica (which matters while Redis is down)."""
    return uuid.uuid4().hex


@dataclass(slots=True)
class SessionRecord:
    id: str
    tenant: str
    messages: list[dict] = field(default_factory=list)
    num_tokens: int = 0
    # Starts at 0 on create; each successful append adds one.
    version: int = 0
    created: float = 0.0
    # Unix time after which the session is gone unless used again (each use refreshes).
    expires_at: float = 0.0
    ttl_s: int = 0
    # The id of the turn that made ``version`` (empty before the first append): an append
    # made again with the same id after it landed is that turn's success, not a conflict.
    last_turn_id: str = ""
    # Not stored: set on a record read while its Redis refuses writes (full, read-only).
    # A turn on it would be refused at its append, after its reply was generated; the
    # ingress answers the 503 before any compute instead (app.sessions.check_writable).
    writes_refused: bool = False

    def expired(self, now: float) -> bool:
        return now >= self.expires_at


@dataclass(slots=True)
class InRedis:
    """The source of a ``DataPlane.get_block_refs`` segment whose blocks are only in Redis
    (L3), for a caller that reads L3 itself (``direct_l3``): their ``hashes``, which the
    segment's indices pick from. The caller reads them (``redis_store.BlockReader``),
    checks each, and asks the data plane to ``promote`` them into L2."""

    hashes: list[str]
