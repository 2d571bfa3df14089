"""Serve's context for our code: handle calls that run side by side within one request
(:func:`spawn`), the stop of a replica (:class:`DrainsOnStop`), and whether another
replica's actor still lives (:func:`named_actor_alive`).

A handle call made while a replica serves a request carries that request's internal id
(``RequestMetadata.internal_request_id``), and Serve's router hands each replica it picks
to the waiting call with that id (Ray 2.60, ``RequestRouter._fulfill_next_pending_request``).
So two calls to one deployment in flight at once from one request are mistaken for each
other: one of them is left waiting, here for ~10 s (a session read racing the KV lookup
of the same request, both to the data plane). Ray's own broadcast gives each call a new
id for the same reason (``Router.broadcast``). :func:`spawn` runs a coroutine as a task
whose calls get an id of their own; the request's ``request_id`` (its log lines) stays.
"""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import logging
from typing import Coroutine, Optional

logger = logging.getLogger("ray.serve")


def own_call_context() -> contextvars.Context:
    """A copy of the current context with a new Serve internal request id (the current
    context unchanged outside a Serve request, or without Serve)."""
    ctx = contextvars.copy_context()
    try:
        from ray.serve import context as serve_context
        from ray.serve._private.utils import generate_request_id

        current = serve_context._get_serve_request_context()
        if current._internal_request_id:
            fresh = dataclasses.replace(current, _internal_request_id=generate_request_id())
            ctx.run(serve_context._serve_request_context.set, fresh)
    except Exception as e:  # noqa: BLE001 - a Ray without these names: calls as they were
        logger.debug("no separate Serve request id for a concurrent call: %r", e)
    return ctx


def spawn(coro: Coroutine) -> asyncio.Task:
    """``coro`` as a task whose Serve handle calls carry an internal id of their own."""
    return asyncio.get_running_loop().create_task(coro, context=own_call_context())


def cancel_call(response) -> None:
    """Cancel a call that was given up (best effort): a Serve handle call (one not yet
    sent leaves its router's queue; one running finishes, its answer unread), or one sent
    straight to a replica's actor (an ObjectRef, ``routing.send_direct``: ``ray.cancel``,
    which cancels the replica's coroutine). ``response`` may be None (never made) or
    anything without ``cancel``."""
    cancel = getattr(response, "cancel", None)
    if cancel is None and type(response).__name__ == "ObjectRef":
        # A call sent straight to a replica's actor (routing.send_direct).
        import ray

        cancel = lambda: ray.cancel(response)  # noqa: E731
    if cancel is not None:
        try:
            cancel()
        except Exception as e:  # noqa: BLE001 - only a clean-up
            logger.debug("cancelling a given-up Serve call failed: %r", e)


def in_serve_replica() -> bool:
    """True inside a Serve replica (with Ray 2.60's replica context)."""
    try:
        from ray import serve

        return serve.get_replica_context() is not None
    except Exception:  # noqa: BLE001 - no Ray, or not in a replica
        return False


class DrainsOnStop:
    """``__del__`` for a deployment class whose work on stopping is ``async def drain()``
    (which sets ``self._drain_started``). Serve calls ``__del__`` when it stops the
    replica, after the calls in flight finished, and awaits what it returns (Ray 2.60's
    destructor call awaits a coroutine that ``__del__`` returns): here ``drain()``. A plain
    method rather than ``async def``, because Python's garbage collector calls
    ``__del__`` too, on every instance made outside Serve (tests, tools), where an
    ``async def`` would leave a never-awaited coroutine each time; there, and once the
    drain has begun, it returns None."""

    def __del__(self) -> Optional[Coroutine]:
        if getattr(self, "_drain_started", True) or not in_serve_replica():
            return None
        return self.drain()


def named_actor_alive(name: str, namespace: str = "serve") -> bool:
    """Whether Ray still knows a live actor of that name (blocking: one GCS call). A
    dead actor that will not be restarted has its name released; unsure (a GCS error)
    counts as alive."""
    import ray

    try:
        ray.get_actor(name, namespace=namespace)
    except ValueError:
        return False
    except Exception as e:  # noqa: BLE001 - unsure: alive
        logger.debug("looking up actor %s failed: %r", name, e)
    return True
