"""The ingress's record of recent sessions (RecordCache, SessionClient.cached): what it
keeps, for how long, and that every way a session changes through this client updates or
drops it. A scripted stand-in for the DataPlane handle; no Ray cluster."""

from __future__ import annotations

import asyncio

import pytest

from app.config import SessionConfig
from app.errors import ConflictError, NotFoundError
from app.sessions import PendingTurn, RecordCache, SessionClient
from deployments.dataplane.types import SessionRecord


T = "default"


def rec(sid: str, version: int, num_tokens: int, tenant: str = T) -> SessionRecord:
    return SessionRecord(id=sid, tenant=tenant, num_tokens=num_tokens, version=version)


def sid(i: int) -> str:
    return "sess_" + f"{i:032x}"


def test_bounded_by_tokens_oldest_used_goes_first():
    cache = RecordCache(max_tokens=100)
    for i in range(3):
        cache.put(rec(sid(i), 1, 40))
    # 120 tokens > 100: the first one went.
    assert cache.get(T, sid(0)) is None and len(cache) == 2 and cache.num_tokens == 80
    cache.get(T, sid(1))  # used: now the newest
    cache.put(rec(sid(3), 1, 40))
    assert cache.get(T, sid(2)) is None and cache.get(T, sid(1)) is not None
    # One record over the whole budget is not kept (and evicts nothing).
    cache.put(rec(sid(4), 1, 101))
    assert cache.get(T, sid(4)) is None and len(cache) == 2
    # Zero tokens counts as one, so a budget of 0 keeps nothing.
    off = RecordCache(max_tokens=0)
    off.put(rec(sid(5), 0, 0))
    assert off.get(T, sid(5)) is None


def test_the_last_record_put_wins_and_tokens_are_counted_once():
    cache = RecordCache(max_tokens=1000)
    cache.put(rec(sid(1), 5, 10))
    cache.put(rec(sid(1), 4, 9))  # the store's answer, even behind: a check compares it
    assert cache.get(T, sid(1)).version == 4 and cache.num_tokens == 9
    cache.put(rec(sid(1), 6, 12))
    assert cache.get(T, sid(1)).version == 6 and cache.num_tokens == 12
    cache.drop(T, sid(1))
    assert cache.get(T, sid(1)) is None and cache.num_tokens == 0


class _DataPlane:
    """Answers each method from a dict of callables (or raises what they return)."""

    def __init__(self, **methods):
        for name, fn in methods.items():
            setattr(self, name, _Method(fn))


class _Method:
    def __init__(self, fn):
        self.fn = fn

    def remote(self, *args, **kwargs):
        async def run():
            out = self.fn(*args, **kwargs)
            if isinstance(out, BaseException):
                raise out
            return out

        return run()


S = sid(7)


def test_the_client_keeps_what_it_read_created_and_appended_and_drops_the_rest():
    state = {"version": 0, "missing": False}

    def get_session(tenant, session_id, *_, **__):
        return None if state["missing"] else rec(session_id, state["version"], 10)

    def append_turn(tenant, session_id, expected, messages, num_tokens, **_):
        if expected != state["version"]:
            return ConflictError("moved on")
        state["version"] += 1
        return rec(session_id, state["version"], 10 + num_tokens)

    dp = _DataPlane(
        create_session=lambda *a, session_id, **k: rec(session_id, 0, 0),
        get_session=get_session,
        append_turn=append_turn,
        delete_session=lambda *a, **k: True,
    )
    client = SessionClient(dp, SessionConfig())

    async def main():
        created = await client.create()
        assert client.cached(created.id) is created
        assert client.cached(S) is None
        await client.get(S)
        assert client.cached(S).version == 0
        appended = await client.append(PendingTurn(S, 0, []), [{"role": "user", "content": "x"}], 15)
        assert appended.version == 1 and client.cached(S) is appended
        # A conflict means the store moved on: what this client held is dropped.
        with pytest.raises(ConflictError):
            await client.append(PendingTurn(S, 0, []), [], 15)
        assert client.cached(S) is None
        await client.get(S)
        state["missing"] = True  # expired or deleted elsewhere
        with pytest.raises(NotFoundError):
            await client.get(S)
        assert client.cached(S) is None
        state["missing"] = False
        await client.get(S)
        await client.delete(S)
        assert client.cached(S) is None

    asyncio.run(main())


def test_a_zero_budget_keeps_nothing():
    dp = _DataPlane(get_session=lambda tenant, session_id, *a, **k: rec(session_id, 3, 10))
    client = SessionClient(dp, SessionConfig(ingress_cache_tokens=0))
    asyncio.run(client.get(S))
    assert client.cached(S) is None


def test_each_tenant_has_its_own_records_and_calls():
    """``for_tenant``: siblings share one cache, keyed by tenant and id, and each makes
    its calls as its own tenant. One tenant sending another's session id gets the
    store's answer for itself (none), never the other's record, and leaves it cached."""
    calls = []

    def get_session(tenant, session_id, *_, **__):
        calls.append(("get", tenant))
        return rec(session_id, 2, 10, tenant) if tenant == "a" else None

    def append_turn(tenant, session_id, expected, messages, num_tokens, **_):
        calls.append(("append", tenant))
        return rec(session_id, expected + 1, 10 + num_tokens, tenant)

    client = SessionClient(_DataPlane(get_session=get_session, append_turn=append_turn), SessionConfig())
    a, b = client.for_tenant("a"), client.for_tenant("b")
    assert client.for_tenant("a") is a and client.for_tenant(T) is client and (a.tenant, b.tenant) == ("a", "b")

    async def main():
        held = await a.get(S)
        assert a.cached(S) is held and b.cached(S) is None and client.cached(S) is None
        with pytest.raises(NotFoundError):
            await b.get(S)
        assert a.cached(S) is held  # b's 404 dropped only b's (absent) record
        appended = await a.append(PendingTurn(S, 2, [], tenant="a"), [], 5)
        assert a.cached(S) is appended and b.cached(S) is None

    asyncio.run(main())
    assert calls == [("get", "a"), ("get", "b"), ("append", "a")]
