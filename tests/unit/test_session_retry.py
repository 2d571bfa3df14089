"""SessionClient over a data plane whose replica dies under a call (a scripted stand-in
for the DataPlane handle: pure logic, no Ray cluster). Dead-replica errors are Ray's own
exception types."""

from __future__ import annotations

import asyncio
import dataclasses
import sys

import pytest
import ray.exceptions as rex

from app import sessions
from app.config import SessionConfig
from app.errors import ConflictError, NotFoundError, ServiceUnavailableError
from app.sessions import PendingTurn, SessionClient, replica_died
from deployments.dataplane.types import SessionRecord

SID = "sess_" + "a" * 32


# A step whose call never answers (a call lost on its way).
HANG = object()


class _Response:
    """A call's answer, to await (as a DeploymentResponse) or to cancel."""

    def __init__(self, coro, method: "_Method"):
        self._coro, self._method = coro, method

    def __await__(self):
        return self._coro.__await__()

    def cancel(self):
        self._method.cancelled += 1


class _Method:
    def __init__(self, script):
        self.script = list(script)  # per call: a value, an exception, HANG, or a callable
        self.calls = self.cancelled = 0

    def remote(self, *args, **kwargs):
        self.calls += 1
        step = self.script.pop(0) if len(self.script) > 1 else self.script[0]

        async def run():
            if isinstance(step, BaseException):
                raise step
            value = step(*args, **kwargs) if callable(step) else step
            if value is HANG:
                await asyncio.get_running_loop().create_future()
            return value

        return _Response(run(), self)


class _Recording:
    """A scripted outcome (an exception to raise, or HANG) that also notes the turn id
    the call carried."""

    def __init__(self, outcome, seen: list):
        self.outcome, self.seen = outcome, seen

    def __call__(self, *args, **kwargs):
        self.seen.append(kwargs["turn_id"])
        if isinstance(self.outcome, BaseException):
            raise self.outcome
        return self.outcome


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


def test_an_append_made_again_names_the_same_turn():
    # The data plane answers a repeat of a landed turn with its success only if the
    # repeat carries the first attempt's turn id: every attempt must send the same one.
    seen = []

    def applied(*args, **kwargs):
        seen.append(kwargs["turn_id"])
        return record(3, [*MSGS])

    dp = FakeDataPlane(append_turn=[_Recording(rex.ActorDiedError(), seen), applied])
    assert asyncio.run(client(dp).append(TURN, MSGS, 10)).version == 3
    assert len(seen) == 2 and seen[0] == seen[1] == TURN.turn_id
    other = PendingTurn(session_id=SID, expected_version=2, new_messages=MSGS[:1])
    assert other.turn_id != TURN.turn_id  # each turn has its own


def test_an_append_conflict_is_the_clients_409_and_nothing_is_guessed():
    # The data plane already answered a repeat of this very turn with its success, so a
    # conflict is another turn's: passed on, even after a retry, without reading the
    # session to guess.
    for script in ([ConflictError("version 3")], [rex.ActorDiedError(), ConflictError("version 3")]):
        dp = FakeDataPlane(append_turn=script, get_session=[record(3, MSGS)])
        with pytest.raises(ConflictError):
            asyncio.run(client(dp).append(TURN, MSGS, 10))
        assert dp.get_session.calls == 0


def _busy() -> ServiceUnavailableError:
    return ServiceUnavailableError("cannot be changed on this server now", headers={"Retry-After": "1"})


def test_an_append_the_data_plane_cannot_take_now_is_made_again_with_the_same_turn(monkeypatch):
    # The reply is generated already: a 503 of the data plane's (the session's owner
    # briefly full during an outage) is waited out, a few times with a growing pause.
    pauses = []
    real_sleep = asyncio.sleep

    async def sleep(s):
        # Only the client's own pauses: the patch is asyncio's, and whatever else runs
        # in this process (another test's leftover loop) sleeps through it too.
        if sys._getframe(1).f_code is SessionClient._call.__code__:
            pauses.append(s)
        await real_sleep(0)

    monkeypatch.setattr(sessions.asyncio, "sleep", sleep)
    seen = []
    dp = FakeDataPlane(append_turn=[_Recording(_busy(), seen), _Recording(_busy(), seen), _Recording(record(3, [*MSGS]), seen)])
    assert asyncio.run(client(dp).append(TURN, MSGS, 10)).version == 3
    assert seen == [TURN.turn_id] * 3
    assert pauses == [sessions.BUSY_BACKOFF_S, 2 * sessions.BUSY_BACKOFF_S]

    # Not for ever: the request then fails with the data plane's 503.
    dp = FakeDataPlane(append_turn=[_busy()])
    with pytest.raises(ServiceUnavailableError):
        asyncio.run(client(dp).append(TURN, MSGS, 10))
    assert dp.append_turn.calls == sessions.APPEND_BUSY_RETRIES + 1


def test_a_read_the_data_plane_cannot_answer_now_is_the_clients_503_at_once():
    # Nothing generated yet: the client retries (Retry-After) rather than the request
    # holding a slot.
    dp = FakeDataPlane(get_session=[_busy(), record(0, [])])
    with pytest.raises(ServiceUnavailableError):
        asyncio.run(client(dp).get(SID))
    assert dp.get_session.calls == 1


def test_create_whose_first_attempt_applied_returns_the_session():
    def fresh(tenant, session_id, **_):
        return dataclasses.replace(record(0, []), id=session_id)

    dp = FakeDataPlane(
        create_session=[rex.ActorUnavailableError("gone", None), ConflictError("exists")],
        get_session=[fresh],
    )
    rec = asyncio.run(client(dp).create())
    assert rec.version == 0 and rec.id.startswith("sess_")
    # Serve's router may have made it again itself (no error reached us): the same.
    dp = FakeDataPlane(create_session=[ConflictError("exists")], get_session=[fresh])
    assert asyncio.run(client(dp).create()).version == 0
    # But a taken id holding turns is not ours: the 409 stands.
    dp = FakeDataPlane(create_session=[ConflictError("exists")], get_session=[record(1, MSGS)])
    with pytest.raises(ConflictError):
        asyncio.run(client(dp).create())


def test_delete_whose_first_attempt_applied_is_a_success():
    dp = FakeDataPlane(delete_session=[rex.ActorDiedError(), False])
    assert asyncio.run(client(dp).delete(SID)) is True
    dp = FakeDataPlane(delete_session=[False])
    with pytest.raises(NotFoundError):
        asyncio.run(client(dp).delete(SID))


def timing_out_client(dp, call_timeout_s: float = 0.05) -> SessionClient:
    return SessionClient(dp, SessionConfig(call_timeout_s=call_timeout_s))


def test_a_read_with_no_answer_is_cancelled_and_made_again():
    rec = record(3, [])
    dp = FakeDataPlane(get_session=[HANG, rec])
    assert asyncio.run(timing_out_client(dp).get(SID)) is rec
    assert dp.get_session.calls == 2 and dp.get_session.cancelled == 1


def test_an_append_with_no_answer_is_made_again_as_the_same_turn():
    seen: list = []

    def applied(*args, **kwargs):
        seen.append(kwargs["turn_id"])
        return record(3, [*MSGS])

    dp = FakeDataPlane(append_turn=[_Recording(HANG, seen), applied])
    assert asyncio.run(timing_out_client(dp).append(TURN, MSGS, 10)).version == 3
    assert seen == [TURN.turn_id, TURN.turn_id]


def test_a_call_that_never_answers_is_a_503_after_one_more_try_not_a_hang():
    dp = FakeDataPlane(get_session=[HANG])

    async def main():
        # Bounded well below any request deadline: two attempts of call_timeout_s.
        return await asyncio.wait_for(timing_out_client(dp).get(SID), 5)

    with pytest.raises(ServiceUnavailableError) as info:
        asyncio.run(main())
    assert info.value.headers.get("Retry-After") == "1"
    assert dp.get_session.calls == 1 + sessions.TIMEOUT_RETRIES
    assert dp.get_session.cancelled == dp.get_session.calls


def test_a_timeout_raised_by_the_data_plane_is_its_answer_not_a_lost_call():
    # Ray re-raises a remote TimeoutError as an instance of TimeoutError: the client's own
    # bound did not expire, so it is an answer, passed on and not made again.
    dp = FakeDataPlane(get_session=[TimeoutError("inside the data plane"), record(0, [])])
    with pytest.raises(TimeoutError):
        asyncio.run(timing_out_client(dp, call_timeout_s=5).get(SID))
    assert dp.get_session.calls == 1


RID = "resp_" + "b" * 32


def test_a_response_store_whose_create_landed_before_a_death_still_appends_it():
    """A create made again after its first attempt landed finds the fresh id taken (its
    own work): the store goes on to the append, at version 0. Response records are not
    held for ``cached`` (no prompt is built from a held one)."""
    seen = []

    def appended(*args, **kwargs):
        seen.append((args[2], kwargs["turn_id"]))
        return dataclasses.replace(record(1, [*MSGS]), id=RID)

    dp = FakeDataPlane(create_session=[rex.ActorDiedError(), ConflictError("taken")], append_turn=[appended])
    c = client(dp)
    assert asyncio.run(c.store_response(RID, MSGS, 10, 60)).version == 1
    assert dp.create_session.calls == 2 and [v for v, _ in seen] == [0]
    assert c.cached(RID) is None


def test_a_response_record_is_read_only_once_it_holds_its_conversation():
    empty = dataclasses.replace(record(0, []), id=RID)  # created, its append never made
    full = dataclasses.replace(record(1, [*MSGS]), id=RID)
    c = client(FakeDataPlane(get_session=[empty, full, None]))
    with pytest.raises(NotFoundError) as e:
        asyncio.run(c.get_response(RID))
    assert e.value.code == "response_not_found" and e.value.param == "response_id"
    assert asyncio.run(c.get_response(RID)) is full and c.cached(RID) is None
    with pytest.raises(NotFoundError):
        asyncio.run(c.get_response(RID))
    from app.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError):
        asyncio.run(c.get_response(SID))  # a session's id is no response's


class _ServeLikeDataPlane(FakeDataPlane):
    app_name = "app"
    deployment_name = "DataPlane"


def _owner_replica(monkeypatch, script):
    """The owner replica's actor (``routing.owner_actor``'s answer) as a stand-in whose
    ``handle_request`` answers from ``script`` as a scripted method does; returns the
    (metadata, args, kwargs) of each call it got, and the scripted method."""
    import pickle
    from types import SimpleNamespace

    from deployments.dataplane import routing

    got, method = [], _Method(script)

    def remote(metadata, *args, **kwargs):
        got.append((pickle.loads(metadata), args, kwargs))
        return method.remote(*args, **kwargs)

    actor = SimpleNamespace(handle_request=SimpleNamespace(remote=remote))
    monkeypatch.setattr(routing, "owner_actor", lambda app, deployment, key: actor)
    return got, method


def test_a_session_call_goes_straight_to_the_replica_that_owns_the_session(monkeypatch):
    rec = record(3, [])
    got, _ = _owner_replica(monkeypatch, [rec])
    dp = _ServeLikeDataPlane(get_session=[record(9, [])])
    c = SessionClient(dp, SessionConfig(), direct_calls=True)
    assert asyncio.run(c.get(SID)) is rec
    assert dp.get_session.calls == 0
    metadata, args, kwargs = got[0]
    assert (metadata.call_method, metadata.app_name, args, kwargs) == (
        "get_session", "app", ("default", SID), {"shard_key": SID}
    )
    assert c.direct_calls == {"calls": 1, "fallbacks": 0}


def test_a_session_call_whose_replica_died_under_it_is_made_again_through_serve(monkeypatch):
    rec = record(3, [])
    got, _ = _owner_replica(monkeypatch, [rex.ActorDiedError()])
    dp = _ServeLikeDataPlane(get_session=[rec])
    c = SessionClient(dp, SessionConfig(), direct_calls=True)
    assert asyncio.run(c.get(SID)) is rec
    assert len(got) == 1 and dp.get_session.calls == 1
    assert c.direct_calls == {"calls": 1, "fallbacks": 1}


def test_a_direct_session_call_with_no_answer_is_cancelled_and_made_again_through_serve(monkeypatch):
    rec = record(3, [])
    _, direct = _owner_replica(monkeypatch, [HANG])
    dp = _ServeLikeDataPlane(get_session=[rec])
    c = SessionClient(dp, SessionConfig(call_timeout_s=0.05), direct_calls=True)
    assert asyncio.run(c.get(SID)) is rec
    assert (direct.calls, direct.cancelled, dp.get_session.calls) == (1, 1, 1)
    assert c.direct_calls == {"calls": 1, "fallbacks": 0}


def test_a_direct_session_calls_own_error_is_the_answer(monkeypatch):
    _owner_replica(monkeypatch, [ValueError("boom")])
    dp = _ServeLikeDataPlane(get_session=[record(3, [])])
    with pytest.raises(ValueError):
        asyncio.run(SessionClient(dp, SessionConfig(), direct_calls=True).get(SID))
    assert dp.get_session.calls == 0


def test_with_direct_calls_off_or_no_owner_known_session_calls_go_through_serve(monkeypatch):
    from deployments.dataplane import routing

    rec = record(3, [])
    got, _ = _owner_replica(monkeypatch, [record(9, [])])
    dp = _ServeLikeDataPlane(get_session=[rec])
    assert asyncio.run(SessionClient(dp, SessionConfig()).get(SID)) is rec
    monkeypatch.setattr(routing, "owner_actor", lambda app, deployment, key: None)
    on = SessionClient(dp, SessionConfig(), direct_calls=True)
    assert asyncio.run(on.get(SID)) is rec
    assert got == [] and dp.get_session.calls == 2 and on.direct_calls == {"calls": 0, "fallbacks": 0}


def test_a_handle_that_is_not_serves_turns_direct_calls_off(monkeypatch):
    _owner_replica(monkeypatch, [record(9, [])])
    rec = record(3, [])
    dp = FakeDataPlane(get_session=[rec])  # no app_name: not a Serve handle
    c = SessionClient(dp, SessionConfig(), direct_calls=True)
    assert asyncio.run(c.get(SID)) is rec
    assert c._direct.enabled is False and dp.get_session.calls == 1


def test_a_given_up_direct_call_is_cancelled_through_ray(monkeypatch):
    import ray

    from app.serve_context import cancel_call

    class ObjectRef:  # what a call sent straight to an actor returns (no cancel of its own)
        pass

    cancelled = []
    monkeypatch.setattr(ray, "cancel", cancelled.append)
    ref = ObjectRef()
    cancel_call(ref)
    assert cancelled == [ref]
