"""The Redis key schema, in one place. Every key carries the tenant, so one tenant's data
can never be named by another's request; tenant and ids are percent-quoted so a ``:`` in
them cannot forge another key. No braces: each key hashes to its own Redis Cluster slot
(every script here touches one key, so no hash tags are needed).

    llm:<tenant>:sess:<id>          hash   session record (see redis_store); once deleted,
                                           a tombstone (the one field ``deleted``)
    llm:<tenant>:sess:<id>:blocks   set    "<shard_key>|<block hash>" of the session's blocks
    llm:<tenant>:kv:<hash>          string encoded KV block (payload)
    llm:<tenant>:kvi:<hash>         string index entry: payload length; present ⇒ payload is
                                           present (written after it, expires before it)
    llm:<tenant>:kvroots            zset   root (first block hash) of every stored chain,
                                           scored by the wall time of its last store or hit
                                           (root_index.py)
    llm:<tenant>:rate               hash   the tenant's rate-limit buckets (app/rate_limits.py):
                                           field per limit ("requests", "tokens"), its
                                           theoretical arrival time in ms; expires once full
    llm:!probe:<replica>            string a data-plane replica's write probe (no tenant
                                           data; lives a second): is a server that
                                           refused writes taking them again? (A quoted
                                           tenant never holds "!", so no tenant's key.)
"""

from __future__ import annotations

import re
from urllib.parse import quote, unquote

PREFIX = "llm"

# What quote(part, safe="-_.") leaves as it is (ASCII letters and digits, and "_.-~"):
# a part made of these alone (block hashes are hex, tenants and ids usually are) is its
# own quoted form, found without quote's encode and scan; a data-plane call names its
# 64-128 blocks' keys several times over.
_UNQUOTED = re.compile(r"[A-Za-z0-9_.~-]+").fullmatch


def _q(part: str) -> str:
    if not part:
        raise ValueError("tenant and ids must be non-empty")
    if _UNQUOTED(part):
        return part
    return quote(part, safe="-_.")


def session_key(tenant: str, session_id: str) -> str:
    return f"{PREFIX}:{_q(tenant)}:sess:{_q(session_id)}"


def session_blocks_key(tenant: str, session_id: str) -> str:
    return f"{session_key(tenant, session_id)}:blocks"


def rate_key(tenant: str) -> str:
    return f"{PREFIX}:{_q(tenant)}:rate"


def block_key(tenant: str, block_hash: str) -> str:
    return f"{PREFIX}:{_q(tenant)}:kv:{_q(block_hash)}"


def block_index_key(tenant: str, block_hash: str) -> str:
    return f"{PREFIX}:{_q(tenant)}:kvi:{_q(block_hash)}"


def split_block_key(key: str) -> tuple[str, str]:
    """(tenant, hash) of a ``block_key``."""
    prefix, tenant, kind, block_hash = key.split(":", 3)
    if prefix != PREFIX or kind != "kv":
        raise ValueError(f"not a block key: {key!r}")
    return unquote(tenant), unquote(block_hash)


def session_block_member(shard_key: str, block_hash: str) -> str:
    return f"{shard_key}|{block_hash}"


def split_session_block_member(member: str) -> tuple[str, str]:
    shard_key, _, block_hash = member.rpartition("|")
    return (shard_key or block_hash), block_hash


def kv_roots_key(tenant: str) -> str:
    return f"{PREFIX}:{_q(tenant)}:kvroots"


def probe_key(replica: str) -> str:
    return f"{PREFIX}:!probe:{_q(replica)}"
