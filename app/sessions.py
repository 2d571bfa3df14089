"""Server-side conversation context for the ingress: the sessions API and the glue that puts
a session's history in front of a chat request and appends the finished turn.

The DataPlane deployment owns the records (Redis-backed, compare-and-set on a version);
this module only validates ids, applies the context-overflow policy and calls it. A turn is
appended only after the reply finished, with the version read when the request started,
so two racing turns never interleave: the second append gets 409.
"""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass
from typing import Callable, Optional

from app.config import SessionConfig
from app.errors import InvalidRequestError, NotFoundError

SESSION_ID_RE = re.compile(r"^sess_[0-9a-f]{32}$")
DEFAULT_TENANT = "default"


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
    overflow policy. ``error``: 400 saying how many tokens are over. ``truncate_oldest``:
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


class SessionClient:
    """The ingress side of the sessions API over the DataPlane handle."""

    def __init__(self, dataplane, config: SessionConfig, tenant: str = DEFAULT_TENANT):
        self._dp = dataplane
        self.config = config
        self.tenant = tenant

    async def create(self, ttl_s: Optional[int] = None):
        ttl = ttl_s or self.config.cache_ttl_s
        # The id is made here so that the call can be routed to the id's shard.
        session_id = f"sess_{uuid.uuid4().hex}"
        return await self._dp.create_session.remote(
            self.tenant, session_id=session_id, ttl_s=ttl, shard_key=session_id
        )

    async def get(self, session_id: str):
        check_session_id(session_id)
        record = await self._dp.get_session.remote(self.tenant, session_id, shard_key=session_id)
        if record is None:
            # Same answer for absent, expired and another tenant's: no existence leak.
            raise NotFoundError(f"No session '{session_id}'.", param="session_id", code="session_not_found")
        return record

    async def append(self, turn: PendingTurn, messages: list[dict], context_tokens: int):
        """Append ``messages``; ``context_tokens`` is the conversation's size in tokens
        after this turn (prompt + reply)."""
        return await self._dp.append_turn.remote(
            self.tenant,
            turn.session_id,
            turn.expected_version,
            messages,
            context_tokens - turn.base_num_tokens,
            shard_key=turn.session_id,
        )

    async def delete(self, session_id: str) -> bool:
        check_session_id(session_id)
        deleted = await self._dp.delete_session.remote(self.tenant, session_id, shard_key=session_id)
        if not deleted:
            raise NotFoundError(f"No session '{session_id}'.", param="session_id", code="session_not_found")
        return True


def session_json(record) -> dict:
    return {
        "id": record.id,
        "object": "session",
        "created": int(record.created),
        "expires_at": int(record.expires_at),
        "version": record.version,
        "num_tokens": record.num_tokens,
        "messages": record.messages,
    }
