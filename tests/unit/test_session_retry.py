"""SessionClient over a data plane whose replica dies under a call (a scripted stand-in
for the DataPlane handle: pure logic, no Ray cluster). Dead-replica errors are Ray's own
exception types."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
import ray.exceptions as rex

from app import sessions
from app.config import SessionConfig
from app.errors import ConflictError, NotFoundError
from app.sessions import PendingTurn, SessionClient, replica_died
from deployments.dataplane.types import SessionRecord

SID = "sess_" + "a" * 32


class _Method:
    def __init__(self, script):
        self.script = list(script)  # per call: a value, an exception, or a callable
        self.calls = 0

    def remote(self, *args, **kwargs):
        self.calls += 1
        step = self.script.pop(0) if len(self.script) > 1 else self.script[0]

        async def run():
            if isinstance(step, BaseException):
                raise step
            return step(*args, **kwargs) if callable(step) else step

        return run()


class FakeDataPlane:
    def __init__(self, **methods):
        for name, script in methods.items():
            setattr(self, name, _Method(script))


def record(version: int, messages: list[dict]) -> SessionRecord:
    return SessionRecord(id=SID, tenant="default", created=0.0, expires_at=1.0, ttl_s=60, version=version, messages=messages)


@pytest.fixture(autouse=True)
def fast_backoff(monkeypatch):
    real_sleep = asyncio.sleep
    monkeypatch.setattr(sessions.asyncio, "sleep", lambda s: real_sleep(0))


def client(dp) -> SessionClient:
    return SessionClient(dp, SessionConfig())


def test_replica_died_sees_through_wrappers():
    wrapped = RuntimeError("outer")
    wrapped.__cause__ = rex.ActorDiedError()
    assert replica_died(wrapped)
    assert not replica_died(ConflictError("x"))
    assert not replica_died(ValueError("x"))


def test_get_is_made_again_after_a_death():
    rec = record(3, [])
    dp = FakeDataPlane(get_session=[rex.ActorDiedError(), rec])
    assert asyncio.run(client(dp).get(SID)) is rec
    assert dp.get_session.calls == 2


def test_other_errors_are_not_retried():
    dp = FakeDataPlane(get_session=[ValueError("boom"), record(0, [])])
    with pytest.raises(ValueError):
        asyncio.run(client(dp).get(SID))
    assert dp.get_session.calls == 1


def test_gives_up_after_the_budget(monkeypatch):
    monkeypatch.setattr(sessions, "DEATH_RETRY_BUDGET_S", 0.0)
    dp = FakeDataPlane(get_session=[rex.ActorDiedError()])
    with pytest.raises(rex.ActorDiedError):
        asyncio.run(client(dp).get(SID))


MSGS = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
TURN = PendingTurn(session_id=SID, expected_version=2, new_messages=MSGS[:1])


def test_append_applied_before_the_death_is_a_success():
    # Attempt 1 reached Redis, then its replica died; attempt 2 finds the version moved.
    applied = record(3, [{"role": "user", "content": "old"}, *MSGS])
    dp = FakeDataPlane(
        append_turn=[rex.ActorDiedError(), ConflictError("version 3, expected 2")],
        get_session=[applied],
    )
    assert asyncio.run(client(dp).append(TURN, MSGS, 10)) is applied


def test_append_conflict_without_a_retry_stays_409():
    # Same messages at the end, but nothing died: another request raced this turn.
    dp = FakeDataPlane(append_turn=[ConflictError("version 3")], get_session=[record(3, MSGS)])
    with pytest.raises(ConflictError):
        asyncio.run(client(dp).append(TURN, MSGS, 10))
    assert dp.get_session.calls == 0


def test_append_conflict_after_a_retry_with_other_messages_stays_409():
    dp = FakeDataPlane(
        append_turn=[rex.ActorDiedError(), ConflictError("version 3")],
        get_session=[record(3, [{"role": "user", "content": "someone else"}])],
    )
    with pytest.raises(ConflictError):
        asyncio.run(client(dp).append(TURN, MSGS, 10))


def test_create_whose_first_attempt_applied_returns_the_session():
    def fresh(tenant, session_id, **_):
        return dataclasses.replace(record(0, []), id=session_id)

    dp = FakeDataPlane(
        create_session=[rex.ActorUnavailableError("gone", None), ConflictError("exists")],
        get_session=[fresh],
    )
    rec = asyncio.run(client(dp).create())
    assert rec.version == 0 and rec.id.startswith("sess_")


def test_delete_whose_first_attempt_applied_is_a_success():
    dp = FakeDataPlane(delete_session=[rex.ActorDiedError(), False])
    assert asyncio.run(client(dp).delete(SID)) is True
    dp = FakeDataPlane(delete_session=[False])
    with pytest.raises(NotFoundError):
        asyncio.run(client(dp).delete(SID))
