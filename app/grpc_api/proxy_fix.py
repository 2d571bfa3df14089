"""What Serve's gRPC proxy runs of ours: the servicer function that adds the LLM service
to its server (``grpc_options.grpc_servicer_functions``), and a fix for Ray Serve 2.60's
proxy that it installs first.

The bug: when a client cancels a stream while the proxy waits to write a chunk to it (the
client reads slower than the replica produces, so the stream's HTTP/2 window is full),
gRPC cancels the proxy's task inside its write, outside every generator. The generators
are then closed one by one as they are dropped, and the one that holds the call to the
replica (``gRPCProxy.send_request_to_replica``) takes the ``GeneratorExit`` at its
``yield`` into ``except BaseException``: it logs "Request failed due to unexpected
error" and never cancels that call. The replica's generation runs on to ``max_tokens``
for nobody. (A cancel that lands while the proxy waits for the next chunk does cancel:
``ProxyResponseGenerator`` cancels the call on ``CancelledError``.) Upstream:
ray-project/ray#42665 (closed unmerged). ``tests/integration/test_grpc_api.py`` makes the
case every time with a client whose window is 1 KiB.

The fix wraps the proxy's own function: when the wrapper is closed in the middle of a
stream it cancels the replica call (``llm_grpc_proxy_cancels_total``), then throws
``CancelledError`` into Ray's generator, so that Ray ends it as the cancel it is (status
``CANCELLED``, its span finished, no error line), and closes it. It is installed only on
the Ray versions it was written against and read for, and only where the function still
has what it relies on; elsewhere the proxy runs unchanged, with a warning.
"""

from __future__ import annotations

import asyncio
import functools
import logging

from app.grpc_api import llm_pb2_grpc

# Under Serve's logger, so that its lines go to the proxy's own log (logs/serve/proxy_*.log).
logger = logging.getLogger("ray.serve.llm_grpc_proxy_fix")

# The Ray releases whose gRPCProxy.send_request_to_replica this was written against.
FIXED_RAY_VERSIONS = ("2.60.",)
# The local of Ray's generator that holds the ProxyResponseGenerator of the replica call
# (its ``_response`` is the call), beside ``status``, set once the stream has ended.
_CALL_LOCAL = "response_generator"

_state = {"installed": False, "cancels": None}


def add_servicer(servicer, server) -> None:
    """``grpc_options.grpc_servicer_functions`` entry: install the fix, then add the
    service (what ``llm_pb2_grpc.add_LLMServicer_to_server`` does alone)."""
    install()
    llm_pb2_grpc.add_LLMServicer_to_server(servicer, server)


def install() -> bool:
    """Wrap ``gRPCProxy.send_request_to_replica`` (once per process). False, with a
    warning, where this Ray is not one the fix was written for."""
    if _state["installed"]:
        return True
    import ray
    from ray.serve._private import proxy
    from ray.serve._private.tracing_utils import tracing_decorator_factory

    traced = proxy.gRPCProxy.send_request_to_replica
    original = getattr(traced, "__wrapped__", None)
    if not ray.__version__.startswith(FIXED_RAY_VERSIONS) or original is None \
            or not {_CALL_LOCAL, "status"} <= set(original.__code__.co_varnames):
        logger.warning(
            "Ray %s: not fixing its gRPC proxy (written for %s); a stream cancelled while "
            "the proxy writes to it may run on to max_tokens", ray.__version__,
            ", ".join(v + "x" for v in FIXED_RAY_VERSIONS))
        return False
    # Ray's own span, as its decorator puts it around the original.
    proxy.gRPCProxy.send_request_to_replica = tracing_decorator_factory(
        trace_name="proxy_grpc_request")(cancel_on_close(original))
    _state["installed"] = True
    logger.info("Ray %s: its gRPC proxy now cancels the replica call of a stream closed "
                "mid-write (app/grpc_api/proxy_fix.py)", ray.__version__)
    return True


def cancel_on_close(send):
    """``send`` (Ray's unwrapped ``send_request_to_replica``) with the replica call
    cancelled when the stream is closed before its end."""

    @functools.wraps(send)
    async def send_request_to_replica(self, *args, **kwargs):
        inner = send(self, *args, **kwargs)
        try:
            async for message in inner:
                yield message
        except GeneratorExit:
            await _cancel(inner)
            raise

    return send_request_to_replica


async def _cancel(inner) -> None:
    """Cancel the replica call ``inner`` holds (if it is mid-stream), let Ray's generator
    end on ``CancelledError``, and close it."""
    frame = inner.ag_frame
    if frame is None:  # finished: nothing is running
        return
    local = frame.f_locals
    response = getattr(local.get(_CALL_LOCAL), "_response", None)
    # Ray's generator sets ``status`` once the stream has ended (or failed).
    if response is not None and local.get("status") is None and not response.cancelled():
        response.cancel()
        _count_cancel()
        logger.info("cancelled the replica call of a gRPC stream closed mid-write")
    try:
        # Ray's generator takes it as a client that went away: status CANCELLED, its span
        # and tracing finished; it then yields that status, which goes nowhere.
        await inner.athrow(asyncio.CancelledError())
    except (StopAsyncIteration, asyncio.CancelledError):
        return
    except Exception:  # noqa: BLE001 - a clean-up: the call is cancelled already
        logger.debug("Ray's gRPC generator failed while closing", exc_info=True)
        return
    await inner.aclose()


def _count_cancel() -> None:
    if _state["cancels"] is None:
        try:
            from ray.util.metrics import Counter

            _state["cancels"] = Counter(
                "llm_grpc_proxy_cancels",
                description="gRPC streams closed while Serve's proxy wrote to them whose replica "
                            "call the proxy fix cancelled (app/grpc_api/proxy_fix.py)")
        except Exception:  # noqa: BLE001 - outside a Ray worker (unit tests)
            _state["cancels"] = False
    if _state["cancels"]:
        _state["cancels"].inc()
