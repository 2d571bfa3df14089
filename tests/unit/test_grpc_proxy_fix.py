"""The fix for Ray Serve 2.60's gRPC proxy (app/grpc_api/proxy_fix.py), on Ray's own
``send_request_to_replica`` and ``ProxyResponseGenerator``, with a replica call that is a
double: a stream closed mid-write cancels the call; one closed at its end does not. The
real proxy and a real client are in tests/integration/test_grpc_api.py."""

from __future__ import annotations

import asyncio
import logging

import pytest
from ray.serve._private import proxy
from ray.serve.handle import DeploymentResponseGenerator

from app.grpc_api import proxy_fix


class ReplicaCall(DeploymentResponseGenerator):
    """A streaming replica call of ``chunks`` chunks (Serve's type, so that Ray's
    ProxyResponseGenerator streams it); built without Serve's constructor."""

    def __new__(cls, chunks: int):
        call = object.__new__(cls)
        call.left, call.cancels = chunks, 0
        return call

    def __init__(self, chunks: int):
        pass

    async def __anext__(self):
        if self.cancels:
            raise asyncio.CancelledError()
        if not self.left:
            raise StopAsyncIteration
        self.left -= 1
        await asyncio.sleep(0)
        return Context(), b"chunk"

    def cancel(self):
        self.cancels += 1

    def cancelled(self) -> bool:
        return self.cancels > 0


class Context:
    def _set_on_grpc_context(self, context):
        pass


class Request:
    context = None

    def serialized_replica_arg(self):
        return b""


class Proxy:
    """What Ray's function reads of its gRPCProxy."""

    request_timeout_s = None

    def __init__(self, call: ReplicaCall):
        self.call, self.finished = call, []
        self.remote = lambda arg: call

    def _setup_grpc_tracing(self, request_id, handle, proxy_request):
        pass

    def _finalize_grpc_tracing(self, proxy_request, status, exc):
        self.finished.append(status.code.name)


def send(call: ReplicaCall):
    """The proxy's generator for one call, as the fix wraps it."""
    fake = Proxy(call)
    original = proxy.gRPCProxy.send_request_to_replica.__wrapped__
    gen = proxy_fix.cancel_on_close(original)(
        fake, request_id="r", internal_request_id="i", handle=fake, proxy_request=Request())
    return gen, fake


async def test_a_stream_closed_mid_write_cancels_its_replica_call_and_ends_as_cancelled():
    call = ReplicaCall(chunks=50)
    gen, fake = send(call)
    assert await gen.__anext__() == b"chunk"
    await gen.aclose()  # the client went away while the chunk was being written
    assert call.cancels == 1
    assert fake.finished == ["CANCELLED"]  # Ray's own ending for a client that left


async def test_a_stream_read_to_its_end_cancels_nothing():
    call = ReplicaCall(chunks=3)
    gen, fake = send(call)
    got = [m async for m in gen]
    assert got[:3] == [b"chunk"] * 3 and got[3].code.name == "OK"
    assert call.cancels == 0 and fake.finished == ["OK"]


async def test_a_stream_closed_after_its_last_chunk_cancels_nothing():
    call = ReplicaCall(chunks=2)
    gen, fake = send(call)
    assert [await gen.__anext__() for _ in range(3)][2].code.name == "OK"  # the status
    await gen.aclose()
    assert call.cancels == 0 and fake.finished == ["OK"]


@pytest.fixture
def unfixed(monkeypatch):
    monkeypatch.setattr(proxy.gRPCProxy, "send_request_to_replica", proxy.gRPCProxy.send_request_to_replica)
    monkeypatch.setitem(proxy_fix._state, "installed", False)


def test_install_wraps_this_rays_proxy_once(unfixed):
    ray_own = proxy.gRPCProxy.send_request_to_replica
    assert proxy_fix.install()
    fixed = proxy.gRPCProxy.send_request_to_replica
    assert fixed is not ray_own and fixed.__wrapped__.__wrapped__ is ray_own.__wrapped__
    assert proxy_fix.install() and proxy.gRPCProxy.send_request_to_replica is fixed


def test_install_leaves_a_proxy_it_was_not_written_for(unfixed, monkeypatch, caplog):
    async def other(self, request_id, handle, proxy_request):
        yield b""

    def traced(*args, **kwargs):
        return other(*args, **kwargs)

    traced.__wrapped__ = other
    monkeypatch.setattr(proxy.gRPCProxy, "send_request_to_replica", traced)
    with caplog.at_level(logging.WARNING, logger=proxy_fix.logger.name):
        assert not proxy_fix.install()
    assert proxy.gRPCProxy.send_request_to_replica is traced
    assert "not fixing its gRPC proxy" in caplog.text


def test_install_leaves_another_ray_version(unfixed, monkeypatch):
    import ray

    ray_own = proxy.gRPCProxy.send_request_to_replica
    monkeypatch.setattr(ray, "__version__", "2.61.0")
    assert not proxy_fix.install()
    assert proxy.gRPCProxy.send_request_to_replica is ray_own
